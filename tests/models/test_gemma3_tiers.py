"""KV tiers for Gemma 3 (one full and two sliding-window KV-cache groups) through the engine, on a
tiny random checkpoint: a restart through the disk tier, a replica through Redis, and a pool hit
continued by the tier, each with the tier hit the hybrid rule gives (hand-computed), the sliding
groups loading only their window, and the tokens of a cache-off run.

The model: 6 layers, local local global local local global, window 8, blocks of 4 tokens, so the
engine makes one full group {2, 5} and two sliding groups {0, 1}, {3, 4} of two layers each; a
pool block, and so a tier entry, holds two layers' K/V.
"""

from __future__ import annotations


import pytest
import torch
from model_testlib import GEMMA3_BLOCK_SIZE as B
from model_testlib import greedy, load_engine_gemma3, make_gemma3_engine, token_ids

from prefixcache.engine.llm_engine import LLMEngine

PROMPT = token_ids(41, seed=11)  # 10 blocks + 1
# A hit at 40 tokens: the full group loads blocks 0-9, each sliding group the blocks covering
# [40 - 8 + 1, 40) = 33..39, blocks 8-9.
FULL_BLOCKS = list(range(10))
WINDOW_BLOCKS = [8, 9]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Our loaded tiny Gemma 3 (model_testlib's engine-test checkpoint, test_gemma3_engine.py's) with
    the default model's tokenizer files beside the weights."""
    return load_engine_gemma3(tmp_path_factory.mktemp("tiny-gemma3-tiers"))


def make_engine(loaded, **options) -> LLMEngine:
    """:func:`make_gemma3_engine` with a fixed hash seed: a restarted engine finds the entries stored."""
    options.setdefault("hash_seed", 1234)
    return make_gemma3_engine(loaded, **options)


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
        engine.add_request(prompt, greedy(6))
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


def test_lookup_and_retention_compute_one_digest_chain_for_the_three_groups(loaded, cold_ids, tmp_path, monkeypatch):
    """The three KV-cache groups' entry keys share the request's prefix digests (a sha256 chain over
    the prompt): the restarted engine's tier lookup (group 0's chain, then each sliding group's
    window) computes one chain of 10 digests, and so does retaining the prompt; the hit is the 40
    tokens of test_restart_loads_every_groups_part_from_the_disk_tier, its keys those stored."""
    from prefixcache.cache.tiers import stack as stack_module

    first = make_engine(loaded, kv_disk_dir=str(tmp_path))
    assert run(first, PROMPT).num_cached_tokens == 0
    first.kv_tiers.flush()
    first.close()
    engine = make_engine(loaded, kv_disk_dir=str(tmp_path), max_retained_disk_fraction=0.5)
    chains: dict[str, list[int]] = {"lookup": [], "retain": []}
    phase = []
    compute = stack_module.prefix_digests

    def counting(root_key, tokens, block_size, extra_key, num_blocks):
        if phase:
            chains[phase[-1]].append(num_blocks)
        return compute(root_key, tokens, block_size, extra_key, num_blocks)

    def during(name, method):
        def wrapped(*args, **kwargs):
            phase.append(name)
            try:
                return method(*args, **kwargs)
            finally:
                phase.pop()
        return wrapped

    monkeypatch.setattr(stack_module, "prefix_digests", counting)
    manager = engine.kv_cache_manager
    manager._load_hybrid_from_tiers = during("lookup", manager._load_hybrid_from_tiers)
    engine._retain = during("retain", engine._retain)
    engine.add_request(PROMPT, greedy(6), retain_s=3600)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    assert out.token_ids == cold_ids and out.num_cached_tokens == 40 and out.num_retained_tokens == 40
    assert chains == {"lookup": [10], "retain": [10]}
    engine.kv_tiers.flush()
    assert engine.get_metrics().kv_tiers["disk"]["retained_entries"] == 10 + 2 * len(WINDOW_BLOCKS)


def retained_restart(loaded, tmp_path, retain_s):
    """PROMPT (with ``retain_s`` or not), then three other 41-token prompts that overflow the disk
    tier's size cap (about 60 entries; 3 x 33 are written), then a restarted engine's PROMPT:
    returns (the first output, the restarted output, the retained entries after the first)."""
    bpb = make_engine(loaded).kv_cache_bytes_per_block
    options = dict(kv_disk_dir=str(tmp_path), kv_disk_bytes=60 * (bpb + 1024), max_retained_disk_fraction=0.5)
    first = make_engine(loaded, **options)
    first.add_request(PROMPT, greedy(6), retain_s=retain_s)
    out = None
    while first.has_unfinished_requests():
        out = next((o for o in first.step() if o.finished), out)
    first.kv_tiers.flush()
    retained = first.get_metrics().kv_tiers["disk"]["retained_entries"]
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        run(first, torch.randint(3, 256, (41,), generator=gen).tolist())
        first.kv_tiers.flush()
    first.close()
    return out, run(make_engine(loaded, **options), PROMPT), retained


def test_retention_keeps_every_groups_part_through_the_size_cap(loaded, cold_ids, tmp_path):
    """retain_s marks group 0's 10 full prompt blocks and each sliding group's window before them
    (blocks 8-9): 14 entries; after other prompts overflow the tier, a restart still hits 40."""
    out, restarted, retained = retained_restart(loaded, tmp_path / "kept", retain_s=3600)
    assert out.num_retained_tokens == 40 and retained == 10 + 2 * len(WINDOW_BLOCKS)
    assert restarted.token_ids == cold_ids and restarted.num_cached_tokens == 40


def test_without_retention_the_same_overflow_loses_the_prompt(loaded, cold_ids, tmp_path):
    out, restarted, retained = retained_restart(loaded, tmp_path / "lost", retain_s=None)
    assert out.num_retained_tokens is None and retained == 0
    assert restarted.token_ids == cold_ids and restarted.num_cached_tokens < 40
