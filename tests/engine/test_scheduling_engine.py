"""Scheduling policies and request priority through the real engine: the order changes which
request runs when, never what it generates (exact token ids), and ``priority`` comes first."""

from __future__ import annotations

import pytest

from prefixcache.errors import InvalidInputError
from prefixcache.sample_texts import QUESTIONS, SYSTEM_PROMPT
from prefixcache.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def record_admissions(llm) -> list[list[int]]:
    """Observes the scheduler's admissions (prompt token ids, in order) without changing them."""
    policy, order = llm.engine.scheduler.policy, []
    admit = policy.on_admit

    def on_admit(request, waiting):
        order.append(request.prompt_token_ids)
        admit(request, waiting)

    policy.on_admit = on_admit
    return order


def prompts(tokenizer) -> tuple[list[int], list[list[int]]]:
    """A primer, then a batch mixing requests that share the primer's prefix with unrelated ones."""
    shared = tokenizer(SYSTEM_PROMPT).input_ids
    unrelated = [tokenizer(f"Unrelated note {i}: the weather in town {i} was mild today.").input_ids
                 for i in range(3)]
    batch = []
    for i in range(3):
        batch += [unrelated[i], shared + tokenizer(" " + QUESTIONS[i]).input_ids]
    return shared + tokenizer(" " + QUESTIONS[5]).input_ids, batch


def run_batch(make_llm, policy: str, primer: list[int], batch: list[list[int]], pressure: bool):
    """Primes the cache, then generates ``batch`` (max_num_seqs 2, a 64-block pool of 16 tokens).

    With ``pressure``: junk1 (10 full blocks + 1 for the decode tokens) is computed before the
    primer, so the LRU free queue holds the never-used blocks, then junk1's, then the primer's;
    junk2 then takes the U free uncached blocks + 6 (5 more prompt blocks, 1 for decode), i.e. the
    never-used ones, junk1's uncached one and 7 of its cached ones, which are evicted to make room
    (the primer's are not touched). The batch's first step sees those evictions.

    Returns:
        (token ids per request, cached tokens per request, admission order as batch indices,
        evictions to make room before the batch)
    """
    llm = make_llm(scheduling_policy=policy, max_num_seqs=2, block_size=16, num_blocks=64)
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    if pressure:
        llm.generate([list(range(1000, 1000 + 10 * 16))], GREEDY, use_tqdm=False)
    llm.generate([primer], GREEDY, use_tqdm=False)
    if pressure:
        uncached = sum(b.block_hash is None for b in pool.evictor.get_all_free_blocks())
        llm.generate([list(range(5000, 5000 + (uncached + 5) * 16))], GREEDY, use_tqdm=False)
    evictions = pool.num_allocation_evictions
    order = record_admissions(llm)
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    return ([o.token_ids for o in outs], [o.num_cached_tokens for o in outs], [batch.index(p) for p in order],
            evictions)


def test_lpm_is_fcfs_without_pressure_and_generates_identical_tokens(make_llm, smollm2):
    """Everything fits (no eviction): lpm admits in arrival order, as fcfs; every request's tokens
    and cache hits are the same, and the tokens the same as alone."""
    primer, batch = prompts(smollm2.tokenizer)
    results = {policy: run_batch(make_llm, policy, primer, batch, pressure=False) for policy in ("fcfs", "lpm")}
    assert results["fcfs"] == results["lpm"]
    tokens, cached, order, evictions = results["lpm"]
    assert order == [0, 1, 2, 3, 4, 5] and evictions == 0
    # The shared prompt's 105 tokens (6 full blocks + 9 by partial-block reuse); the unrelated notes
    # after the first share its first 4 tokens ("Unrelated note").
    assert cached == [0, 105, 4, 105, 4, 105]
    alone = make_llm(enable_prefix_caching=False, num_blocks=64)
    assert [alone.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in batch] == tokens


def test_lpm_reorders_under_pressure_and_generates_identical_tokens(make_llm, smollm2):
    """The pool evicted (junk) blocks just before the batch: lpm admits the cache hits first, fcfs in
    arrival order; every request's tokens are the same, and the same as alone."""
    primer, batch = prompts(smollm2.tokenizer)
    results = {policy: run_batch(make_llm, policy, primer, batch, pressure=True) for policy in ("fcfs", "lpm")}
    assert results["fcfs"][2] == [0, 1, 2, 3, 4, 5]
    assert results["lpm"][2] == [1, 3, 5, 0, 2, 4]  # the three cache hits first
    assert results["fcfs"][3] == results["lpm"][3] == 7
    assert results["fcfs"][0] == results["lpm"][0]
    assert results["lpm"][1] == [0, 105, 4, 105, 4, 105]
    alone = make_llm(enable_prefix_caching=False, num_blocks=64)
    assert [alone.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in batch] == results["lpm"][0]


def test_priority_comes_first_offline(make_llm, smollm2):
    _, batch = prompts(smollm2.tokenizer)
    got = {}
    for policy in ("fcfs", "lpm"):
        llm = make_llm(scheduling_policy=policy, max_num_seqs=1, num_blocks=128)
        order = record_admissions(llm)
        outs = llm.generate(batch[:4], GREEDY, use_tqdm=False, priority=[3, -1, 0, -1])
        assert [batch.index(p) for p in order] == [1, 3, 2, 0]
        got[policy] = [o.token_ids for o in outs]
    assert got["fcfs"] == got["lpm"]


def test_bad_priority_names_the_field(make_llm):
    llm = make_llm(num_blocks=64)
    for priority in ("high", 1.5, True, 2**63, [0, 1]):
        with pytest.raises(InvalidInputError) as e:
            llm.generate(["Hello"], GREEDY, use_tqdm=False, priority=priority)
        assert e.value.field == "priority"
    assert not llm.engine.has_unfinished_requests()
