"""Eviction policies and partial-block reuse end to end on the real model (outputs equal cold)."""

from __future__ import annotations

import random

import pytest

from prefixcache.sampling_params import SamplingParams
from tests.engine.test_prefix_caching import cold, rand_ids

GREEDY8 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_partial_block_reuse_137_token_prompt_and_c8(make_llm):
    rng = random.Random(137)
    system = rand_ids(rng, 137)  # 8 full blocks + 9 tokens
    s = rand_ids(rng, 24)  # C8: 1.5 blocks, then different continuations
    c8_a, c8_b = s + rand_ids(rng, 9), s + rand_ids(rng, 9)
    llm = make_llm()
    first = llm.generate(system, GREEDY8, use_tqdm=False)[0]  # 145 tokens: block 8 fills, is cached
    again = llm.generate(system, GREEDY8, use_tqdm=False)[0]
    # 8 full blocks (128) + 8 of block 8's 9 prompt tokens copied; the last prompt token is computed.
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 136)
    out_a = llm.generate(c8_a, GREEDY8, use_tqdm=False)[0]
    out_b = llm.generate(c8_b, GREEDY8, use_tqdm=False)[0]
    assert (out_a.num_cached_tokens, out_b.num_cached_tokens) == (0, 24)  # 1 block + 8 copied
    m = llm.get_metrics()
    # A partial-block copy is a hit (usage's cached_tokens counts it): 144 full-block + 16 copied.
    assert (m.prefix_cache_hits, m.prefix_cache_partial_hits) == (128 + 16 + 8 + 8, 8 + 8)
    assert m.prefix_cache_hits == sum(o.num_cached_tokens for o in (first, again, out_a, out_b))
    ref = cold(make_llm, [system, c8_a, c8_b], GREEDY8)
    assert [first.token_ids, again.token_ids, out_a.token_ids, out_b.token_ids] == [ref[0], ref[0], ref[1], ref[2]]


@pytest.mark.parametrize("policy", ["lfu", "ttl", "cost"])
def test_c3_evicted_blocks_gone_under_policy(make_llm, policy):
    rng = random.Random(3)
    a = rand_ids(rng, 3 * 4 + 1)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm = make_llm(block_size=4, num_blocks=8, eviction_policy=policy)
    first = llm.generate(a, params, use_tqdm=False)[0]
    llm.generate(rand_ids(rng, 26), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    pool = llm.engine.kv_cache_manager.block_pool
    assert llm.get_metrics().evictions_by_reason.get(policy if policy != "ttl" else "lru", 0) >= 3
    assert all(b.token_ids is None or list(b.token_ids) not in [a[i:i + 4] for i in range(0, 12, 4)]
               for b in pool.blocks)
    again = llm.generate(a, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.token_ids == first.token_ids == cold(make_llm, [a], params, block_size=4, num_blocks=8)[0]
