"""KV tiers for Gemma 3 (one full and two sliding-window KV-cache groups) through the engine, on a
tiny random checkpoint: a restart through the disk tier, a replica through Redis, and a pool hit
continued by the tier, each with the tier hit the hybrid rule gives (hand-computed), the sliding
groups loading only their window, and the tokens of a cache-off run.

The model: 6 layers, local local global local local global, window 8, blocks of 4 tokens, so the
engine makes one full group {2, 5} and two sliding groups {0, 1}, {3, 4} of two layers each; a
pool block, and so a tier entry, holds two layers' K/V.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from prefixcache.config import EngineConfig
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.errors import InvalidInputError
from prefixcache.models.fetch import default_model_dir
from prefixcache.models.loader import load_model
from prefixcache.sampling_params import SamplingParams

B = 4  # block_size
W = 8  # sliding_window: a query at p reads keys p - 7 .. p
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
PROMPT = torch.randint(3, 256, (41,), generator=torch.Generator().manual_seed(11)).tolist()  # 10 blocks + 1
# A hit at 40 tokens: the full group loads blocks 0-9, each sliding group the blocks covering
# [40 - 8 + 1, 40) = 33..39, blocks 8-9.
FULL_BLOCKS = list(range(10))
WINDOW_BLOCKS = [8, 9]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Our loaded tiny Gemma 3 (tests/models/test_gemma3_engine.py's checkpoint) with the default
    model's tokenizer files beside the weights."""
    out_dir = tmp_path_factory.mktemp("tiny-gemma3-tiers")
    config = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
        sliding_window=W, query_pre_attn_scalar=24, final_logit_softcapping=30.0, layer_types=LAYER_TYPES,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        architectures=["Gemma3ForCausalLM"], tie_word_embeddings=True, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager",
    )
    torch.manual_seed(1)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # Gemma's norm weights start at 0 (a factor 1): make them matter
        for name, param in ref.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    ref.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, out_dir / name)
    return load_model(str(out_dir))


def make_engine(loaded, **options) -> LLMEngine:
    options.setdefault("hash_seed", 1234)
    return LLMEngine(EngineConfig(model=str(loaded.model_dir), block_size=B, num_blocks=200, num_threads=1,
                                  **options), loaded=loaded)


def run(engine: LLMEngine, prompt: list[int], loads: list | None = None):
    """One greedy request to completion; ``loads`` collects ``(group id, block index)`` of every
    block a tier load writes."""
    if loads is not None:
        write_blocks = engine.runner.write_blocks

        def recording(ops):
            manager = engine.kv_cache_manager
            where = {b.block_id: (g, i) for rid, table in manager.req_to_blocks.items()
                     for g, t in enumerate([table, *manager.req_to_group_blocks.get(rid, [])])
                     for i, b in enumerate(t) if b is not None}
            loads.extend(where[op.block_id] for op in ops)
            write_blocks(ops)

        engine.runner.write_blocks = recording
    try:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        while engine.has_unfinished_requests():
            outs = [o for o in engine.step() if o.finished]
            if outs:
                assert outs[0].finish_reason == "length"
                return outs[0]
    finally:
        engine.runner.__dict__.pop("write_blocks", None)
    raise AssertionError("no output")


@pytest.fixture(scope="module")
def cold_ids(loaded):
    return run(make_engine(loaded, enable_prefix_caching=False), PROMPT).token_ids


def expected_loads() -> list[tuple[int, int]]:
    return sorted([(0, i) for i in FULL_BLOCKS] + [(g, i) for g in (1, 2) for i in WINDOW_BLOCKS])


def check_tier_hit(engine: LLMEngine, out, cold_ids, loads, tier: str, num_tier_tokens: int = 40) -> None:
    assert out.token_ids == cold_ids
    assert out.num_cached_tokens == 40
    metrics = engine.get_metrics()
    assert metrics.prefix_cache_tier_hits == num_tier_tokens
    assert metrics.kv_tiers[tier]["hits"] == num_tier_tokens
    assert metrics.prompt_tokens_computed == len(PROMPT) - 40
    assert sorted(loads) == expected_loads()  # the sliding groups: their window only


def test_restart_loads_every_groups_part_from_the_disk_tier(loaded, cold_ids, tmp_path):
    first = make_engine(loaded, kv_disk_dir=str(tmp_path))
    out = run(first, PROMPT)
    assert out.token_ids == cold_ids and out.num_cached_tokens == 0
    first.kv_tiers.flush()
    # Write-through: blocks 0-10 (block 10 fills while decoding) of each of the 3 groups.
    assert first.get_metrics().kv_tiers["disk"]["stores"] == 3 * 11
    first.close()

    restarted = make_engine(loaded, kv_disk_dir=str(tmp_path))  # empty pool, same directory
    loads = []
    out = run(restarted, PROMPT, loads)
    check_tier_hit(restarted, out, cold_ids, loads, "disk")
    assert restarted.get_metrics().kv_tiers["disk"]["bytes_loaded"] == 14 * restarted.kv_cache_bytes_per_block
    # The loaded blocks are cached pool blocks now: the same prompt hits the pool, loads nothing.
    loads.clear()
    again = run(restarted, PROMPT, loads)
    assert again.token_ids == cold_ids and again.num_cached_tokens == 40 and loads == []
    assert restarted.get_metrics().prefix_cache_tier_hits == 40
    # A prompt sharing 6 blocks: a hit at 24 needs the sliding groups' blocks 4-5, which the pool
    # lacks (only the window at 40 was loaded, nothing else was written): the tier serves them.
    short = PROMPT[:24] + [7, 8, 9, 10, 11]
    loads.clear()
    out = run(restarted, short, loads)
    assert out.token_ids == run(make_engine(loaded, enable_prefix_caching=False), short).token_ids
    assert out.num_cached_tokens == 24
    assert sorted(loads) == sorted([(0, i) for i in range(6)] + [(g, i) for g in (1, 2) for i in (4, 5)])


def test_a_replica_loads_the_prefix_from_redis(loaded, cold_ids, redis_server):
    writer = make_engine(loaded, kv_redis_url=redis_server.url)
    assert run(writer, PROMPT).num_cached_tokens == 0
    writer.kv_tiers.flush()
    replica = make_engine(loaded, kv_redis_url=redis_server.url)
    loads = []
    out = run(replica, PROMPT, loads)
    check_tier_hit(replica, out, cold_ids, loads, "redis")


def test_a_pool_hit_is_continued_by_the_tier_and_the_sliding_windows_move(loaded, cold_ids, tmp_path):
    """Blocks 6-9 of every group leave the pool: the pool serves 24 tokens (group 0's blocks 0-5,
    each sliding group's 4-5), the disk tier 16 more (group 0's 6-9, each sliding group's 8-9); the
    sliding groups' pool hits 4-5 are outside the window at 40 and are not taken."""
    engine = make_engine(loaded, kv_disk_dir=str(tmp_path))
    assert run(engine, PROMPT).num_cached_tokens == 0
    engine.kv_tiers.flush()
    pool = engine.kv_cache_manager.block_pool
    later = {tuple(PROMPT[i * B:(i + 1) * B]) for i in range(6, 10)}
    pool.uncache([b for b in pool.blocks if b.block_hash is not None and tuple(b.token_ids) in later], reason="test")
    loads = []
    out = run(engine, PROMPT, loads)
    assert out.token_ids == cold_ids and out.num_cached_tokens == 40
    assert engine.get_metrics().prefix_cache_tier_hits == 16
    assert sorted(loads) == sorted([(0, i) for i in range(6, 10)] + [(g, i) for g in (1, 2) for i in WINDOW_BLOCKS])


def test_retention_is_refused_for_a_hybrid_model_naming_the_field(loaded, tmp_path):
    engine = make_engine(loaded, kv_disk_dir=str(tmp_path), max_retained_disk_fraction=0.5)
    with pytest.raises(InvalidInputError, match="retain_s is not supported for sliding-window models"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=1), retain_s=60)
