"""Cache breakpoints on the offline API (``LLM.generate(..., cache_control=...)``) with the real
model: a pinned prefix survives a flood of one-off prompts through a pool too small for both, and
its pin ends one step after its ttl (C27; the pins' clock is injected as C21's tests inject the
pool's)."""

from __future__ import annotations

import itertools

from prefixcache.cache.pins import CacheBreakpoint, PinResult
from prefixcache.sampling_params import SamplingParams

B = 16
PREFIX = list(range(1000, 1000 + 5 * B))  # 5 full blocks
GREEDY = SamplingParams(max_tokens=1, temperature=0)
_FLOODS = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def flood(llm, rounds=3):
    """One-off prompts of 18 blocks + 1 token: each needs 19 of the pool's 24 blocks."""
    for _ in range(rounds):
        start = 2000 + next(_FLOODS) * 400  # every prompt new: nothing to hit
        prompt = list(range(start, start + 18 * B + 1))
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_pinned_prefix_survives_a_flood_and_ends_one_step_after_its_ttl(make_llm):
    llm = make_llm(block_size=B, num_blocks=24, enable_partial_block_reuse=False, max_pinned_fraction=0.5)
    clock = Clock()
    kv = llm.engine.kv_cache_manager
    kv.pins.clock = clock
    bp = CacheBreakpoint(len(PREFIX), 300.0)
    first = llm.generate(PREFIX + [7], GREEDY, use_tqdm=False, cache_control=bp)[0]
    assert first.pinned == (PinResult(bp, 5 * B),) and first.num_cached_tokens == 0
    assert len(kv.pins) == 5 and [kv.block_pool.blocks[i].ref_cnt for i in sorted(kv.pins.pins)] == [1] * 5
    flood(llm)
    again = llm.generate(PREFIX + [8], GREEDY, use_tqdm=False)[0]  # a hit, no breakpoint: refreshes the pin
    assert again.num_cached_tokens == 5 * B and again.pinned == ()
    clock.now = 300.0  # idle exactly the ttl: still pinned after the next step's sweep
    flood(llm, rounds=1)
    assert len(kv.pins) == 5
    clock.now = 300.001  # idle longer: the next step releases it, and the flood evicts it
    flood(llm)
    assert len(kv.pins) == 0 and kv.pins.num_released == 5
    assert llm.generate(PREFIX + [9], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_without_a_breakpoint_the_flood_evicts_the_prefix(make_llm):
    llm = make_llm(block_size=B, num_blocks=24, enable_partial_block_reuse=False)
    first = llm.generate(PREFIX + [7], GREEDY, use_tqdm=False)[0]
    flood(llm)
    again = llm.generate(PREFIX + [7], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.token_ids == first.token_ids
    assert len(llm.engine.kv_cache_manager.pins) == 0


def test_a_pinned_hit_equals_cold(make_llm):
    llm = make_llm(block_size=B, num_blocks=24, enable_partial_block_reuse=False)
    cold = make_llm(block_size=B, num_blocks=24, enable_prefix_caching=False)
    llm.generate(PREFIX + [7], GREEDY, use_tqdm=False, cache_control=CacheBreakpoint(len(PREFIX)))
    flood(llm)
    params = SamplingParams(max_tokens=6, temperature=0)
    warm = llm.generate(PREFIX + [11, 12], params, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 5 * B
    assert warm.token_ids == cold.generate(PREFIX + [11, 12], params, use_tqdm=False)[0].token_ids
