"""Waiting-queue order (prefixcache/engine/sched_policy.py) without a model: exact admission orders
on hand-made queues, the starvation bounds, priority, and the match-length cache.

Requests are real (hashed, block size 4); the "model" is this test choosing each sampled token.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.config import SCHEDULING_POLICIES, SchedulerConfig
from prefixcache.engine.sched_policy import SCHEDULING_POLICY_CLASSES
from prefixcache.engine.scheduler import Scheduler
from prefixcache.errors import InvalidInputError
from prefixcache.request import Request, RequestStatus
from tests.cache.cache_test_utils import make_manager, make_request

B = 4
A = list(range(1000, 1016))  # a 4-block prefix, cached by prime()
S = list(range(2000, 2008))  # a 2-block prefix shared by b1 and b2, not cached


def make_scheduler(num_blocks: int, policy: str, max_num_seqs: int = 16, budget: int = 256, clock=None,
                   **options) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, budget, scheduling_policy=policy, **options)
    return Scheduler(make_manager(num_blocks, B), config, **({"clock": clock} if clock else {}))


def prime(scheduler: Scheduler, tokens: list[int]) -> None:
    """Computes ``tokens`` (+ one) through the pool and frees them: their full blocks stay cached."""
    kv = scheduler.kv_cache_manager
    request = make_request("prime", tokens + [1], block_size=B)
    assert kv.admit(request, request.num_tokens) is not None
    kv.free(request)
    kv.end_step()


def request(rid: str, tokens: list[int], max_tokens: int = 16, priority: int = 0, arrival_s: float | None = None):
    r = make_request(rid, tokens, block_size=B, max_tokens=max_tokens)
    r.priority = priority
    if arrival_s is not None:
        r.arrival_s = arrival_s
    return r


def admitted(scheduler: Scheduler, token: int = 7) -> list[str]:
    """Runs one step; returns the ids admitted in it (first scheduled now), in admission order."""
    waiting = set(scheduler.waiting)
    out = scheduler.schedule()
    sampled = {s.request_id: token for s in out.seqs if s.sampling_params is not None}
    scheduler.update_from_output(out, sampled)
    return [s.request_id for s in out.seqs if s.request_id in waiting]


def hand_made_queue(scheduler: Scheduler) -> dict[str, Request]:
    prime(scheduler, A)
    reqs = {
        "x": request("x", list(range(300, 308))),
        "a1": request("a1", A[:12] + [100, 101, 102, 103]),  # hits 3 blocks of A
        "y": request("y", list(range(400, 408))),
        "a2": request("a2", A[:8] + list(range(200, 206))),  # hits 2 blocks
        "b1": request("b1", S + [600, 601, 602]),  # S is not cached: b1 and b2 form a group
        "z": request("z", list(range(500, 508))),
        "b2": request("b2", S + [700, 701, 702]),
    }
    for r in reqs.values():
        scheduler.add_request(r)
    return reqs


def test_policy_names_agree_with_config():
    assert tuple(SCHEDULING_POLICY_CLASSES) == SCHEDULING_POLICIES


def test_fcfs_admits_in_arrival_order():
    scheduler = make_scheduler(64, "fcfs")
    reqs = hand_made_queue(scheduler)
    assert admitted(scheduler) == ["x", "a1", "y", "a2", "b1", "z", "b2"]
    assert reqs["b2"].num_cached_tokens == 8  # b1's blocks, cached when allocated in this step


def test_lpm_admits_longest_cached_prefix_first_then_groups():
    scheduler = make_scheduler(64, "lpm")
    reqs = hand_made_queue(scheduler)
    # a1 (3 cached blocks), a2 (2), then the uncached ones by group: x, y, {b1, b2}, z.
    assert admitted(scheduler) == ["a1", "a2", "x", "y", "b1", "b2", "z"]
    assert [reqs[r].num_cached_tokens for r in ("a1", "a2", "b1", "b2")] == [12, 8, 0, 8]


def test_lpm_counts_overtakes_of_the_requests_left_waiting():
    scheduler = make_scheduler(64, "lpm", max_num_seqs=3)
    hand_made_queue(scheduler)
    assert admitted(scheduler) == ["a1", "a2", "x"]
    # a1 and a2 overtook x (admitted now); a2 (arrived 4th) overtook y (3rd), nobody else.
    assert [scheduler.policy.num_overtakes(r) for r in ("y", "b1", "z", "b2")] == [1, 0, 0, 0]


def test_lpm_keeps_a_cached_prefix_that_fcfs_evicts():
    """8 blocks, A's 4 cached and free. x (6 blocks, first in line) and a1 (A + 4 tokens) can't run
    together. FCFS admits x, whose allocation evicts A's tail; LPM admits a1 first, hitting all of A."""
    results = {}
    for policy in ("fcfs", "lpm"):
        scheduler = make_scheduler(8, policy, budget=64)
        prime(scheduler, A)
        scheduler.add_request(request("x", list(range(300, 322)), max_tokens=2))
        scheduler.add_request(request("a1", A + [100, 101, 102, 103], max_tokens=2))
        order = []
        while scheduler.has_unfinished_requests():
            order += admitted(scheduler)
            for r in list(scheduler.running.values()):
                if r.num_output_tokens >= 2:
                    scheduler.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
        results[policy] = (order, scheduler.kv_cache_manager.stats.hits)
    assert results["fcfs"] == (["x", "a1"], 8)  # x took A's two tail blocks (freed tail first)
    assert results["lpm"] == (["a1", "x"], 16)


def test_priority_is_the_outer_key():
    for policy in ("fcfs", "lpm"):
        scheduler = make_scheduler(64, policy)
        prime(scheduler, A)
        scheduler.add_request(request("low", list(range(300, 308)), priority=5))
        scheduler.add_request(request("hit", A[:12] + [9, 9, 9], priority=1))
        scheduler.add_request(request("urgent", list(range(400, 408)), priority=-3))
        scheduler.add_request(request("mid", list(range(500, 508)), priority=1))
        expected = {"fcfs": ["urgent", "hit", "mid", "low"], "lpm": ["urgent", "hit", "mid", "low"]}[policy]
        assert admitted(scheduler) == expected


def test_priority_orders_lpm_ties_by_match():
    scheduler = make_scheduler(64, "lpm")
    prime(scheduler, A)
    scheduler.add_request(request("miss", list(range(300, 308)), priority=1))
    scheduler.add_request(request("hit", A[:12] + [9, 9, 9], priority=1))
    assert admitted(scheduler) == ["hit", "miss"]


def test_age_bound_puts_an_old_request_first():
    now = [100.0]
    scheduler = make_scheduler(64, "lpm", clock=lambda: now[0], scheduling_max_wait_s=5.0)
    prime(scheduler, A)
    scheduler.add_request(request("old", list(range(300, 308)), arrival_s=90.0))  # waited 10 s > 5 s
    scheduler.add_request(request("young", list(range(400, 408)), arrival_s=99.0))
    scheduler.add_request(request("hit", A[:12] + [9, 9, 9], arrival_s=99.5))
    assert admitted(scheduler) == ["old", "hit", "young"]


def test_overtake_bound_is_hard():
    """max_overtakes=2: a one-off waits behind at most two later cache hits, then goes first; it
    does not fit beside them (seats), so it blocks the queue until it is admitted."""
    scheduler = make_scheduler(64, "lpm", max_num_seqs=1, scheduling_max_overtakes=2)
    prime(scheduler, A)
    scheduler.add_request(request("one-off", list(range(300, 308)), max_tokens=1))
    for i in range(4):
        scheduler.add_request(request(f"hit{i}", A[:12] + [i, i, i], max_tokens=1))
    order = []
    while scheduler.has_unfinished_requests():
        order += admitted(scheduler)
        for r in list(scheduler.running.values()):
            scheduler.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    assert order == ["hit0", "hit1", "one-off", "hit2", "hit3"]


def test_zero_overtakes_is_arrival_order():
    scheduler = make_scheduler(64, "lpm", scheduling_max_overtakes=0)
    reqs = hand_made_queue(scheduler)
    assert admitted(scheduler) == list(reqs)


def test_match_length_is_refreshed_only_for_changed_hashes():
    scheduler = make_scheduler(64, "lpm", max_num_seqs=1)
    prime(scheduler, A)
    scheduler.add_request(request("run", list(range(300, 312)), max_tokens=1))
    scheduler.add_request(request("a1", A[:12] + [9, 9, 9]))
    scheduler.add_request(request("other", list(range(700, 708))))
    policy = scheduler.policy
    assert admitted(scheduler) == ["a1"]  # 3 cached blocks first; the others wait for its one seat
    calls = []
    original = scheduler.kv_cache_manager.get_computed_blocks
    scheduler.kv_cache_manager.get_computed_blocks = lambda r: calls.append(r.request_id) or original(r)
    scheduler.finish_request("a1", RequestStatus.FINISHED_LENGTH)
    # a1's blocks (cached, then freed) change no hash of a waiting request: the only lookup is
    # run's own admission.
    assert admitted(scheduler) == ["run"] and calls == ["run"]
    prime(scheduler, list(range(700, 704)))  # caches other's first block
    calls.clear()
    assert admitted(scheduler) == [] and calls == ["other"]  # refreshed (run holds the seat)
    assert policy._entries["other"].match_blocks == 1


def test_bad_config_names_the_field():
    for options, field in (({"scheduling_policy": "sjf"}, "scheduling_policy"),
                           ({"scheduling_max_wait_s": 0}, "scheduling_max_wait_s"),
                           ({"scheduling_max_overtakes": -1}, "scheduling_max_overtakes")):
        with pytest.raises(InvalidInputError) as e:
            SchedulerConfig(**options).validate()
        assert e.value.field == field


# ---------------------------------------------------------------------------------------- starvation

FAMILIES = [list(range(5000 + 100 * f, 5000 + 100 * f + 12)) for f in range(3)]  # 3-block prefixes


@st.composite
def arrivals(draw):
    """Per step, the requests arriving: a family member (a cached-prefix candidate) or a one-off."""
    steps = draw(st.lists(st.lists(st.tuples(st.integers(-1, 2), st.integers(1, 9), st.integers(1, 3)),
                                   max_size=4), min_size=1, max_size=12))
    return steps


@settings(max_examples=60, deadline=None)
@given(steps=arrivals(), max_overtakes=st.integers(0, 4), max_num_seqs=st.integers(1, 4),
       num_blocks=st.integers(12, 40))
def test_no_request_is_overtaken_more_than_the_bound(steps, max_overtakes, max_num_seqs, num_blocks):
    """Adversarial arrivals (families whose prefixes get cached, one-offs that never hit), a small
    pool with preemptions: every request finishes, and no request sees more than
    ``max_overtakes`` later arrivals admitted before it."""
    scheduler = make_scheduler(num_blocks, "lpm", max_num_seqs=max_num_seqs, budget=24,
                               scheduling_max_overtakes=max_overtakes, scheduling_max_wait_s=1e9)
    arrival: dict[str, int] = {}
    first_admission: list[str] = []
    max_tokens: dict[str, int] = {}
    n = 0
    for t in range(400):
        for family, suffix, out in steps[t] if t < len(steps) else ():
            rid = f"r{n}"
            head = FAMILIES[family] if family >= 0 else list(range(90000 + 50 * n, 90000 + 50 * n + 12))
            scheduler.add_request(request(rid, head + [7000 + n] * suffix, max_tokens=out))
            arrival[rid], max_tokens[rid] = n, out
            n += 1
        if t >= len(steps) and not scheduler.has_unfinished_requests():
            break
        first_admission += [rid for rid in admitted(scheduler) if rid not in first_admission]
        for r in list(scheduler.running.values()):
            if r.num_output_tokens >= max_tokens[r.request_id]:
                scheduler.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    assert not scheduler.has_unfinished_requests() and len(first_admission) == n
    for i, rid in enumerate(first_admission):
        overtaken_by = [o for o in first_admission[:i] if arrival[o] > arrival[rid]]
        assert len(overtaken_by) <= max_overtakes, (rid, overtaken_by)


def test_serve_flags_set_the_policy_and_bounds():
    import argparse

    from prefixcache.config import EngineConfig
    from prefixcache.entrypoints.cli_args import add_cli_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--scheduling-policy", "fcfs", "--scheduling-max-wait-s", "2.5",
                              "--scheduling-max-overtakes", "0"])
    config = engine_config_from_args(args)
    assert (config.scheduling_policy, config.scheduling_max_wait_s, config.scheduling_max_overtakes) == ("fcfs", 2.5, 0)
    assert EngineConfig().scheduling_policy == "lpm"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "sjf"])
