"""The scheduler without a model: exact chunks, block tables, preemption order and seats.

Requests are real (hashed, block size 4); the "model" is this test choosing each sampled token.
"""

from __future__ import annotations

import dataclasses

from prefixcache.config import SchedulerConfig
from prefixcache.engine.scheduler import Scheduler
from prefixcache.request import Request, RequestStatus
from prefixcache.sampling_params import SamplingParams
from tests.cache.cache_test_utils import make_manager, make_request

B = 4


def make_scheduler(num_blocks: int, max_num_seqs: int = 8, max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(make_manager(num_blocks, B), SchedulerConfig(max_num_seqs, max_num_batched_tokens))


def step(scheduler: Scheduler, token: int = 7) -> list[tuple[str, int, int, list[int], bool]]:
    """Schedules and "runs" one step (every sampling sequence samples ``token``); returns the
    step's (request id, first position, number of tokens, block ids, samples?) per sequence."""
    out = scheduler.schedule()
    sampled = {s.request_id: token for s in out.seqs if s.sampling_params is not None}
    for s in out.seqs:
        sampled.update((fork_id, token) for fork_id, _ in s.forks)
    scheduler.update_from_output(out, sampled)
    return [(s.request_id, s.num_computed_tokens, len(s.token_ids), s.block_ids, s.sampling_params is not None)
            for s in out.seqs]


def test_chunked_prefill_exact_chunks_then_decode():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", list(range(20)), block_size=B))
    assert step(scheduler) == [("a", 0, 8, [0, 1], False)]
    assert step(scheduler) == [("a", 8, 8, [0, 1, 2, 3], False)]
    assert step(scheduler) == [("a", 16, 4, [0, 1, 2, 3, 4], True)]  # completes the prompt: samples
    assert step(scheduler) == [("a", 20, 1, [0, 1, 2, 3, 4, 5], True)]  # decode of the sampled token
    request = scheduler.requests["a"]
    assert request.output_token_ids == [7, 7] and request.num_computed_tokens == 21


def test_budget_is_shared_running_first_then_waiting():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", list(range(6)), block_size=B))
    scheduler.add_request(make_request("b", list(range(100, 110)), block_size=B))
    assert step(scheduler) == [("a", 0, 6, [0, 1], True), ("b", 0, 4, [2], False)]
    assert step(scheduler) == [("a", 6, 1, [0, 1], True), ("b", 4, 6, [2, 3, 4], True)]


def test_preemption_takes_the_newest_and_requeues_it_first():
    # 4 blocks: a (7 tokens, 2 blocks) and b (7 tokens, 2 blocks) fill the pool; a's 9th token needs
    # a third block, so b (the newest) is preempted, its blocks freed, back at the queue's head.
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("a", list(range(7)), block_size=B))
    scheduler.add_request(make_request("b", list(range(50, 57)), block_size=B))
    scheduler.add_request(make_request("c", list(range(90, 93)), block_size=B))
    assert step(scheduler) == [("a", 0, 7, [0, 1], True), ("b", 0, 7, [2, 3], True)]  # c: no room
    assert step(scheduler) == [("a", 7, 1, [0, 1], True), ("b", 7, 1, [2, 3], True)]
    out = scheduler.schedule()  # a's and b's 9th tokens each need a third block
    assert out.preempted_req_ids == ["b"] and [s.request_id for s in out.seqs] == ["a"]
    assert out.seqs[0].block_ids == [0, 1, 3]  # b's freed blocks, tail first: 3 then 2
    assert list(scheduler.waiting) == ["b", "c"] and list(scheduler.running) == ["a"]
    b = scheduler.requests["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions, scheduler.num_preemptions) == (
        RequestStatus.PREEMPTED, 0, 1, 1)
    assert b.all_token_ids == list(range(50, 57)) + [7, 7]  # recomputed later from prompt + output
    assert b.num_cached_tokens == 0  # the readmission's own-block reuse will not count as a hit


def test_parallel_sampling_seats():
    scheduler = make_scheduler(num_blocks=32, max_num_seqs=3)
    scheduler.add_request(make_request("a", list(range(5)), block_size=B))
    n3 = make_request("g", list(range(40, 45)), block_size=B)
    n3 = Request("g", n3.prompt_token_ids, SamplingParams(temperature=0, n=3), n3.block_hasher, n3.root_key)
    scheduler.add_request(n3)
    # 1 running + 3 seats > 3: g waits while a runs.
    assert [s[0] for s in step(scheduler)] == ["a"]
    scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)
    # Alone, g takes its 3 seats; its prompt step samples for 3 samples, forked sharing its blocks.
    # (a's freed blocks went to the free queue's tail: g gets blocks 2 and 3.)
    assert step(scheduler) == [("g", 0, 5, [2, 3], True)]
    assert list(scheduler.running) == ["g", "g#1", "g#2"]
    tables = [scheduler.kv_cache_manager.get_block_ids(rid) for rid in scheduler.running]
    assert tables == [[2, 3]] * 3
    # Each sample's first write into the shared partial block copies it (copy-on-write), but the last.
    assert [s[3] for s in step(scheduler)] == [[2, 4], [2, 5], [2, 3]]


def test_a_repeated_aligned_prompt_fits_the_pool_it_fitted_before():
    """One cached copy per prefix costs no memory past the step: a repeat of a 3-block prompt with
    max_tokens 4 runs in the 4 blocks it ran in alone, without preemption."""
    scheduler = make_scheduler(num_blocks=4)
    prompt = list(range(100, 112))  # 3 full blocks; + 4 tokens = exactly 4 blocks
    for rid in ("a", "b", "c"):
        request = make_request(rid, prompt, block_size=B, max_tokens=4)
        scheduler.add_request(request)
        while request.num_output_tokens < 4:
            step(scheduler)
        scheduler.finish_request(rid, RequestStatus.FINISHED_LENGTH)
        assert request.num_cached_tokens == (0 if rid == "a" else 8 + 3)  # 2 blocks + 3 copied
    assert scheduler.num_preemptions == 0
    assert scheduler.kv_cache_manager.num_cached_blocks == 3


def test_finish_and_abort_remove_in_place():
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=1)
    for rid, base in (("a", 0), ("b", 100), ("c", 200)):
        scheduler.add_request(make_request(rid, list(range(base, base + 5)), block_size=B))
    step(scheduler)  # a runs; b, c wait (one seat)
    assert scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED).status == RequestStatus.FINISHED_ABORTED
    assert list(scheduler.waiting) == ["c"] and list(scheduler.running) == ["a"]
    assert scheduler.finish_request("a", RequestStatus.FINISHED_LENGTH) is not None
    assert scheduler.finish_request("a", RequestStatus.FINISHED_LENGTH) is None  # unknown now
    assert scheduler.kv_cache_manager.num_free_blocks == 16
    assert scheduler.schedule().finished_req_ids == ["b", "a"]


def test_request_fork_shares_no_mutable_state():
    """Every field of a forked sample that holds a list, dict or set is its own object."""
    parent = make_request("p", list(range(9)), block_size=B)
    parent.append_output_token_ids(3)
    child = parent.fork("p#1", dataclasses.replace(parent.sampling_params, seed=5), 1)
    for f in dataclasses.fields(Request):
        value = getattr(parent, f.name)
        if isinstance(value, (list, dict, set, bytearray)):
            assert getattr(child, f.name) is not value, f"fork shares {f.name}"
            assert getattr(child, f.name) == (value if f.name != "fork_params" else [])
    child.append_output_token_ids(4)
    assert parent.output_token_ids == [3] and child.output_token_ids == [3, 4]
    assert (child.request_id, child.group_id, child.sample_index) == ("p#1", "p", 1)


def test_a_short_request_is_admitted_while_a_long_prompt_prefills():
    """Found by a new user: a 5-token request waited out a 7,000-token prompt's whole prefill (40 s on
    one thread), each chunk taking the whole step. Now running prefills leave the short request's
    tokens in the step (long_prefill_token_threshold), then its decodes' token; a long waiting request
    gets no such room."""
    def run(threshold: int, waiting_prompt: list[int]):
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=threshold)
        scheduler = Scheduler(make_manager(128, B), config)
        scheduler.add_request(make_request("long", list(range(1000, 1200)), block_size=B))
        assert step(scheduler) == [("long", 0, 64, list(range(16)), False)]
        scheduler.add_request(make_request("next", waiting_prompt, block_size=B))
        return step(scheduler), step(scheduler)

    second, third = run(256, [1, 2, 3, 4, 5])
    assert second == [("long", 64, 59, list(range(31)), False), ("next", 0, 5, [31, 32], True)]
    # and its decodes go on beside the long prefill (the chunk leaves them their token)
    assert third == [("long", 123, 63, list(range(31)) + list(range(33, 49)), False), ("next", 5, 1, [31, 32], True)]
    # threshold 0 (off): the short one waits for the long prompt's chunks
    second, _ = run(0, [1, 2, 3, 4, 5])
    assert second == [("long", 64, 64, list(range(32)), False)]
    # a long waiting prompt (> the reserve's limit, 31 tokens here: under half the step) gets no room
    second, _ = run(256, list(range(2000, 2040)))
    assert second == [("long", 64, 64, list(range(32)), False)]


def test_the_reserve_never_stalls_a_prefill_and_follows_priority():
    """Review cases of the reserve's first form: (1) with decodes filling the step, short requests it
    admitted got 0 tokens while more waited (the first's prompt done at step 6 of a burst of 6; 40 of a
    burst of 40); now every prefill keeps at least half the budget it finds. (2) A priority -1 short
    request behind a long priority-0 one got no reserve (the reserve walked arrival order)."""
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=16)
    scheduler = Scheduler(make_manager(4096, B), config)
    for i in range(13):
        scheduler.add_request(make_request(f"d{i}", [100 + i], block_size=B, max_tokens=1000))
    step(scheduler)
    for i in range(40):
        scheduler.add_request(make_request(f"s{i}", [2000 + 10 * i + k for k in range(5)], block_size=B, max_tokens=5))
    first = step(scheduler)
    assert [(rid, n) for rid, _, n, _, _ in first if rid.startswith("s")] == [("s0", 3)]  # 16 - 13 decodes
    second = step(scheduler)
    assert ("s0", 3, 2, [13, 14], True) in second  # its prompt's rest, sampled: no stall behind the reserve

    scheduler = Scheduler(make_manager(1024, B), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    scheduler.add_request(make_request("L", list(range(1000, 1700)), block_size=B))
    step(scheduler)
    scheduler.add_request(make_request("W", list(range(3000, 3500)), block_size=B))
    short = make_request("S", [1, 2, 3, 4, 5], block_size=B)
    short.priority = -1
    scheduler.add_request(short)
    assert [(rid, n) for rid, _, n, _, _ in step(scheduler)] == [("L", 59), ("S", 5)]
