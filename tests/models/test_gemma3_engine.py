"""Gemma 3 through the engine with KV-cache groups, on a tiny random checkpoint (fast): cache on ==
cache off == transformers, hit lengths by the hybrid rule (hand-computed), local-layer KV bounded per
running sequence, batch invariance to the bit, LoRA refused, and the window in the cache key.

The model: 6 layers, local local global local local global, window 8, blocks of 4 tokens, so the
engine makes one full group {2, 5} and two sliding groups {0, 1}, {3, 4} of two layers each.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_testlib import GEMMA3_BLOCK_SIZE as B
from model_testlib import GEMMA3_PREFIX as PREFIX
from model_testlib import GEMMA3_TAILS as TAILS
from model_testlib import GEMMA3_WINDOW as W
from model_testlib import PagedDriver, greedy, save_engine_gemma3
from model_testlib import make_gemma3_engine as make_engine
from model_testlib import token_ids as ids

from prefixcache.cache.kv_cache_groups import group_block_hash
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.errors import InvalidInputError
from prefixcache.kernels import prefill_attention
from prefixcache.kernels.prefill_attention import form_supported, kernel_form
from prefixcache.layers.attention import metadata as attention_metadata
from prefixcache.layers.lora import LoRARequest
from prefixcache.models import gemma3
from prefixcache.models.loader import load_model
from prefixcache.request import Request


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, our loaded model) with the default model's tokenizer files beside the
    weights (the engine decodes what it generates; ids stay < 256)."""
    out_dir = tmp_path_factory.mktemp("tiny-gemma3-engine")
    ref = save_engine_gemma3(out_dir)
    return ref, load_model(str(out_dir))


def run(engine: LLMEngine, prompt: list[int], max_tokens: int = 6, on_step=None):
    """One request to completion; ``on_step(request_id)`` after every step while it runs."""
    rid = engine.add_request(prompt, greedy(max_tokens))
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.finished]
        if on_step is not None and rid in engine.kv_cache_manager.req_to_blocks:
            on_step(rid)
        if outs:
            return outs[0]
    raise AssertionError("no output")


def reference_greedy(ref, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_the_engine_runs_gemma3_with_one_full_and_two_sliding_groups(tiny):
    _, loaded = tiny
    engine = make_engine(loaded)
    groups = engine.kv_cache_groups
    assert [g.layer_ids for g in groups.groups] == [(2, 5), (0, 1), (3, 4)]
    assert [g.is_sliding for g in groups.groups] == [False, True, True]
    assert len(engine.runner.kv_caches) == groups.layers_per_group == 2


def test_cache_on_equals_cache_off_equals_transformers_with_the_hit_the_rule_gives(tiny):
    ref, loaded = tiny
    on, off = make_engine(loaded), make_engine(loaded, enable_prefix_caching=False)
    prompts = [PREFIX + tail for tail in TAILS]
    outs_on = [run(on, p) for p in prompts]
    outs_off = [run(off, p) for p in prompts]
    expected = [reference_greedy(ref, p, 6) for p in prompts]
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off] == expected
    # the second and third share the 40-token prefix: group 0 serves blocks 0-9, each sliding group
    # the blocks covering [40 - 8 + 1, 40) = 33..39, blocks 8-9 (still cached: nothing evicted)
    assert [o.num_cached_tokens for o in outs_on] == [0, 40, 40]
    assert [o.num_cached_tokens for o in outs_off] == [0, 0, 0]


def sliding_blocks_at(engine: LLMEngine, tokens: list[int], index: int) -> list:
    """The cached sliding-group blocks holding ``tokens``' block ``index`` (one per sliding group)."""
    pool = engine.kv_cache_manager.block_pool
    want = tokens[index * B:(index + 1) * B]
    return [b for b in pool.blocks if b.group_id != 0 and b.block_hash is not None and list(b.token_ids) == want]


def test_a_hit_shortens_exactly_as_the_rule_says_when_sliding_blocks_are_evicted(tiny):
    """The full chain stays; the sliding blocks a window needs go: the hit ends where every group
    still has what it needs (hand-computed), and the tokens are still cache-off's."""
    _, loaded = tiny
    engine, off = make_engine(loaded), make_engine(loaded, enable_prefix_caching=False)
    first = run(engine, PREFIX + TAILS[0])
    assert first.num_cached_tokens == 0
    pool = engine.kv_cache_manager.block_pool
    # block 9 (tokens 36-39) of sliding group 1 only: a hit at 40 needs it, one at 36 needs blocks 7-8
    (block9_g1,) = [b for b in sliding_blocks_at(engine, PREFIX, 9) if b.group_id == 1]
    pool.uncache([block9_g1], reason="test")
    second = run(engine, PREFIX + TAILS[1])
    assert second.num_cached_tokens == 36
    assert second.token_ids == run(off, PREFIX + TAILS[1]).token_ids
    # The second request cached block 9 again; now drop block 6 of group 2 and block 8 of group 1:
    # at 40 group 1 lacks block 8, at 36 (blocks 7-8) too, at 32 (blocks 6-7) group 2 lacks block 6,
    # at 28 (blocks 5-6) the same; at 24 both groups have blocks 4-5: a 24-token hit.
    (block8_g1,) = [b for b in sliding_blocks_at(engine, PREFIX, 8) if b.group_id == 1]
    (block6_g2,) = [b for b in sliding_blocks_at(engine, PREFIX, 6) if b.group_id == 2]
    pool.uncache([block8_g1, block6_g2], reason="test")
    assert all(len(sliding_blocks_at(engine, PREFIX, i)) == 2 for i in (4, 5))
    third = run(engine, PREFIX + TAILS[2])
    assert third.num_cached_tokens == 24
    assert third.token_ids == run(off, PREFIX + TAILS[2]).token_ids


def test_local_layer_kv_per_running_sequence_stays_within_window_plus_two_blocks(tiny):
    """Measured from the manager after every step: chunked prefill (5-token chunks) then decode."""
    _, loaded = tiny
    engine = make_engine(loaded, max_num_batched_tokens=5, long_prefill_token_threshold=0)
    kv = engine.kv_cache_manager
    seen = []

    def check(rid: str) -> None:
        full = kv.req_to_blocks[rid]
        for table in kv.req_to_group_blocks[rid]:
            held = sum(b is not None for b in table)
            assert held * B <= W + 2 * B, (len(full), held)
            seen.append(held)
        assert all(b is not None for b in full)  # the full group keeps the whole context

    out = run(engine, PREFIX + TAILS[0], max_tokens=30, on_step=check)
    assert len(out.token_ids) == 30 and len(seen) > 2 * 20
    assert max(seen) == 3  # window 8 + the block being filled: at most 3 blocks of 4
    assert len(kv.req_to_blocks) == 0 and kv.block_pool.get_num_free_blocks() == engine.num_blocks


def test_blocks_held_for_a_long_prompt_against_one_group(tiny):
    """After a 500-token prefill (block 4, window 8): the full group holds every block, each sliding
    group the two its next window reads; one group would hold 125 blocks of all 6 layers. The real
    model's 2,000-token count is test_gemma3_vs_transformers.py's (and docs/design/prefix-caching.md's)."""
    _, loaded = tiny
    engine = make_engine(loaded, num_blocks=1600, max_model_len=512)
    prompt = (PREFIX * 13)[:500]  # max_position_embeddings 512: 500 tokens, 125 blocks
    held = {}

    def record(rid: str) -> None:
        kv = engine.kv_cache_manager
        held.setdefault("tables", (len(kv.req_to_blocks[rid]),
                                   [sum(b is not None for b in t) for t in kv.req_to_group_blocks[rid]]))

    run(engine, prompt, max_tokens=2, on_step=record)
    full, sliding = held["tables"]
    # next token at 500 reads keys 493..500: blocks 123-124 (492-499) and the next one
    assert full == 125 and sliding == [2, 2]
    layers_per_block = engine.kv_cache_groups.layers_per_group
    grouped = (full + sum(sliding)) * layers_per_block  # layer-blocks held
    one_group = 125 * loaded.config.num_hidden_layers
    assert (grouped, one_group) == (258, 750)


def test_a_prompt_alone_and_in_a_batch_of_three_gives_the_same_logits_bits(tiny):
    _, loaded = tiny
    prompts = {"a": ids(23, seed=10), "b": ids(9, seed=11), "c": ids(41, seed=12)}

    def logits(batch: list[str]) -> dict[str, list[torch.Tensor]]:
        driver = PagedDriver(loaded, num_blocks=200, seed=3)
        for s in batch:
            driver.add(s, len(prompts[s]) + 4)
        out = {s: [x] for s, x in driver.step([(s, prompts[s]) for s in batch]).items()}
        for t in range(4):  # decodes, past the window
            for s, x in driver.step([(s, [7 + t]) for s in batch]).items():
                out[s].append(x)
        return out

    alone = logits(["a"])["a"]
    for batch in (["b", "a", "c"], ["c", "b", "a"]):
        together = logits(batch)["a"]
        assert all(torch.equal(x, y) for x, y in zip(alone, together)), batch


def test_batched_engine_tokens_equal_each_alone(tiny):
    _, loaded = tiny
    engine = make_engine(loaded, enable_prefix_caching=False)
    prompts = [PREFIX + TAILS[0], ids(11, seed=20), ids(27, seed=21)]
    alone = [run(engine, p, 8).token_ids for p in prompts]
    rids = [engine.add_request(p, greedy(8)) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [done[r] for r in rids] == alone


def test_lora_is_refused_naming_lora(tiny, tmp_path):
    _, loaded = tiny
    engine = make_engine(loaded)
    with pytest.raises(InvalidInputError, match="lora: Gemma3ForCausalLM does not support LoRA") as info:
        engine.add_request(PREFIX, greedy(2), lora=LoRARequest("adapter", str(tmp_path)))
    assert info.value.field == "lora"
    assert not engine.has_unfinished_requests()


def test_the_window_is_in_the_cache_key(tiny):
    """K/V of layers after the first local one depend on the window through earlier layers'
    attention: another window (or convention) must give another model key."""
    _, loaded = tiny
    engine = make_engine(loaded)
    model = loaded.model
    assert model.numerics_key == "sliding_window=8|keys=p-w+1..p|layers=L,L,G,L,L,G"
    assert model.quantization_key == ""  # no weight quantization: the window rides on its own key
    key = engine.input_processor.model_key
    original = model.config
    try:
        model.config = dataclasses.replace(original, sliding_window=9)
        assert engine.input_processor.model_key != key
    finally:
        model.config = original
    assert engine.input_processor.model_key == key
    assert group_block_hash(b"x" * 8, 0) == b"x" * 8  # group 0 keys are the chain's own


def test_configs_differing_only_in_the_window_hash_blocks_apart(tiny):
    """Two Gemma configs alike but for ``sliding_window`` (same weights' fingerprint): every block
    hash of the same tokens differs, through the model key's numerics part."""
    _, loaded = tiny
    engine = make_engine(loaded)
    model, original = loaded.model, loaded.model.config

    def block_hashes() -> list:
        probe = Request("p", PREFIX, greedy(1), engine.input_processor.block_hasher, engine.root_key())
        return probe.block_hashes

    window_8 = block_hashes()
    try:
        model.config = dataclasses.replace(original, sliding_window=9)
        window_9 = block_hashes()
        assert model.numerics_key == "sliding_window=9|keys=p-w+1..p|layers=L,L,G,L,L,G"
    finally:
        model.config = original
    assert len(window_8) == len(window_9) == 10
    assert all(a != b for a, b in zip(window_8, window_9))
    assert block_hashes() == window_8  # the key follows the config back


def test_metadata_is_built_once_per_group_and_step(tiny, monkeypatch):
    """One full group and two sliding groups: three metadata builds a step (a sliding group's
    window metadata alone, no full-context one beside it), in prefill and in decode steps."""
    _, loaded = tiny
    builds = []
    build = attention_metadata._build_metadata

    def counting_build(*args, **kwargs):
        builds.append(kwargs.get("window"))
        return build(*args, **kwargs)

    monkeypatch.setattr(attention_metadata, "_build_metadata", counting_build)
    engine = make_engine(loaded)
    engine.add_request(PREFIX[:10], greedy(3))
    per_step = []
    while engine.has_unfinished_requests():
        builds.clear()
        engine.step()
        per_step.append(list(builds))
    assert per_step == [[None, W, W]] * 3  # the prefill, then two decodes (the third token ends it)


def test_a_prompt_whose_one_chunk_needs_the_pool_three_times_runs_in_smaller_chunks(tiny):
    """160 tokens: 40 blocks per group, 120 in one chunk, in a pool of 60. The scheduler halves the
    chunk until it fits (sliding groups give their blocks back after each step); the tokens are a
    large pool's."""
    _, loaded = tiny
    prompt = (PREFIX * 4)[:160]
    small = run(make_engine(loaded, num_blocks=60), prompt, max_tokens=4)
    assert small.finish_reason == "length"
    assert small.token_ids == run(make_engine(loaded, enable_prefix_caching=False), prompt, max_tokens=4).token_ids


def test_a_pool_the_sliding_groups_would_fill_is_refused_at_start_and_a_small_one_names_its_share(tiny):
    """Each sliding group holds up to ceil(W / B) + 2 blocks for a running request: a pool of no more than their
    sum leaves a request's full-attention layers nothing, and used to start, then refuse every request saying
    "the pool has 1 block"."""
    _, loaded = tiny
    groups = make_engine(loaded).kv_cache_groups.groups
    held = sum(g.is_sliding for g in groups) * (-(-W // B) + 2)
    assert held == make_engine(loaded).kv_cache_groups.sliding_blocks_held(B) > 0
    with pytest.raises(InvalidInputError) as e:
        make_engine(loaded, num_blocks=held)
    assert e.value.field == "num_blocks" and e.value.message.startswith(
        f"num_blocks: a KV pool of {held} blocks leaves none for a request's full-attention layers: the model's "
        f"{sum(g.is_sliding for g in groups)} sliding-window KV-cache groups hold up to {held} blocks of {B} tokens")
    engine = make_engine(loaded, num_blocks=held + 2)  # 2 blocks (8 tokens) for the full-attention layers
    with pytest.raises(InvalidInputError) as e:
        engine.add_request(PREFIX[:6], greedy(4))
    assert e.value.field == "max_tokens" and e.value.message == (
        f"prompt + max_tokens (10 tokens) needs 3 KV blocks but the pool has 2 blocks for it ({held + 2}, less "
        f"{held} that the sliding-window layers hold); lower max_tokens or raise --num-blocks or --kv-cache-memory "
        "(num_blocks / kv_cache_memory_bytes offline)")


@pytest.mark.skipif(not form_supported("avx2"), reason="the paged kernel's window form needs AVX2")
def test_on_the_paged_kernel_cache_on_equals_cache_off_equals_transformers_to_the_bit_in_a_batch(tiny, monkeypatch):
    """Where torch's padded attention is not batch-invariant (MKL's AVX2 path, as on an AVX2-only CPU: the
    check is made to say so here), Gemma 3 runs our paged kernel's AVX2 form, the sliding layers with their
    window: greedy tokens equal transformers' and cache off's, a prompt's logits have the same bits alone and
    in a batch, and the cache key names the kernel, so K/V from torch's path is never served to it."""
    ref, loaded = tiny
    monkeypatch.setattr(gemma3, "torch_attention_batch_invariant", lambda: True)  # as on MKL's AVX-512 path
    assert not loaded.model.paged_attention
    torch_key = make_engine(loaded).input_processor.model_key
    monkeypatch.setattr(gemma3, "torch_attention_batch_invariant", lambda: False)
    model = loaded.model
    assert model.paged_attention and model.sliding_attention_form == "avx2" and not model.fuses_prompt_ops
    assert model.paged_attention_form == kernel_form(torch.float32) == "avx2"  # the tiny checkpoint is float32
    on, off = make_engine(loaded), make_engine(loaded, enable_prefix_caching=False)
    assert on.input_processor.model_key != torch_key
    windows = []
    real = prefill_attention.paged_prefill_attention
    monkeypatch.setattr("prefixcache.layers.attention.torch_attention.paged_prefill_attention",
                        lambda q, kv, rows, scale, form=None: windows.append(rows.window) or real(q, kv, rows, scale, form))
    prompts = [PREFIX + tail for tail in TAILS]
    outs_on = [run(on, p) for p in prompts]
    outs_off = [run(off, p) for p in prompts]
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off] == [reference_greedy(ref, p, 6)
                                                                                 for p in prompts]
    assert [o.num_cached_tokens for o in outs_on] == [0, 40, 40]
    assert set(windows) == {0, W} and windows.count(W) == 2 * windows.count(0)  # 4 sliding layers, 2 global
    test_a_prompt_alone_and_in_a_batch_of_three_gives_the_same_logits_bits(tiny)
