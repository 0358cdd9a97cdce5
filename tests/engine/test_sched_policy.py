"""Waiting-queue order (prefixcache/engine/sched_policy.py) without a model: exact admission orders
on hand-made queues (lpm in arrival order without memory pressure, reordered under it, back after the
pressure window), the starvation bounds across those switches, priority, and the match-length cache.

Requests are real (hashed, block size 4); the "model" is this test choosing each sampled token.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
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


def press(scheduler: Scheduler) -> None:
    """Memory pressure: caches a junk prefix (2 blocks), then takes every free block, which evicts
    it to make room, and frees them all (the pool is left free and uncached). lpm sees the evictions
    at its next step and reorders for ``scheduling_pressure_steps`` steps."""
    pool = scheduler.kv_cache_manager.block_pool
    before = pool.num_allocation_evictions
    prime(scheduler, list(range(80000, 80000 + 2 * B)))
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))
    assert pool.num_allocation_evictions == before + 2 and pool.num_cached_blocks == 0


def drain(scheduler: Scheduler) -> list[str]:
    """Steps until nothing is left; the first admissions in order. A request finishes as soon as it
    has its ``max_tokens``."""
    order = []
    while scheduler.has_unfinished_requests():
        order += [rid for rid in admitted(scheduler) if rid not in order]
        for r in list(scheduler.running.values()):
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                scheduler.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    return order


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


ARRIVAL_ORDER = ["x", "a1", "y", "a2", "b1", "z", "b2"]
LPM_ORDER = ["a1", "a2", "x", "y", "b1", "b2", "z"]  # 3 cached blocks, 2, then the misses by group


def hand_made_queue(scheduler: Scheduler, max_tokens: int = 16) -> dict[str, Request]:
    prime(scheduler, A)
    reqs = {
        "x": request("x", list(range(300, 308)), max_tokens),
        "a1": request("a1", A[:12] + [100, 101, 102, 103], max_tokens),  # hits 3 blocks of A
        "y": request("y", list(range(400, 408)), max_tokens),
        "a2": request("a2", A[:8] + list(range(200, 206)), max_tokens),  # hits 2 blocks
        "b1": request("b1", S + [600, 601, 602], max_tokens),  # S is not cached: b1 and b2 form a group
        "z": request("z", list(range(500, 508)), max_tokens),
        "b2": request("b2", S + [700, 701, 702], max_tokens),
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


def test_lpm_admits_in_arrival_order_while_nothing_is_evicted():
    """A pool holding everything: reordering can't save a block (every hit stays cached, and b2 hits
    b1's blocks in either order), so lpm admits exactly as fcfs does, with the same hits."""
    scheduler = make_scheduler(64, "lpm")
    reqs = hand_made_queue(scheduler)
    assert admitted(scheduler) == ARRIVAL_ORDER
    assert scheduler.policy.reordering is False
    assert scheduler.kv_cache_manager.block_pool.num_allocation_evictions == 0
    assert [reqs[r].num_cached_tokens for r in ("a1", "a2", "b1", "b2")] == [12, 8, 0, 8]


def test_lpm_admits_longest_cached_prefix_first_then_groups_under_pressure():
    scheduler = make_scheduler(64, "lpm")
    press(scheduler)
    reqs = hand_made_queue(scheduler)
    # a1 (3 cached blocks), a2 (2), then the uncached ones by group: x, y, {b1, b2}, z.
    assert admitted(scheduler) == LPM_ORDER
    assert scheduler.policy.reordering is True
    assert [reqs[r].num_cached_tokens for r in ("a1", "a2", "b1", "b2")] == [12, 8, 0, 8]


def test_lpm_without_prefix_caching_is_arrival_order():
    """Nothing is cached, so nothing cached is evicted, however full the pool: lpm never reorders."""
    scheduler = Scheduler(make_manager(8, B, enable_caching=False), SchedulerConfig(16, 64, scheduling_policy="lpm"))
    for i in range(4):
        scheduler.add_request(request(f"r{i}", list(range(100 * i, 100 * i + 10)), max_tokens=2))
    assert drain(scheduler) == ["r0", "r1", "r2", "r3"]  # 3 blocks each: at most 2 at a time in 8
    assert scheduler.kv_cache_manager.block_pool.num_allocation_evictions == 0
    assert scheduler.policy.reordering is False


@pytest.mark.parametrize("pressure_steps,expected", [
    (3, ARRIVAL_ORDER),  # steps 1-3 reorder (only hog chooses, then none is admitted); 4 on: arrival order
    (4, ["a1", "a2", "x", "y", "b1", "z", "b2"]),  # step 4 still reorders (budget 16: a1 4, a2 6, x 6 tokens)
])
def test_lpm_returns_to_arrival_order_once_the_pressure_window_passes(pressure_steps, expected):
    """Evictions seen at step 1, none after. A 48-token hog takes the whole 16-token budget in steps
    1-3 while the queue waits (each of those is a step of the window); from step
    1 + pressure_steps on, admissions are in arrival order."""
    scheduler = make_scheduler(64, "lpm", budget=16, scheduling_pressure_steps=pressure_steps)
    press(scheduler)
    scheduler.add_request(request("hog", list(range(3000, 3048)), max_tokens=1))
    assert admitted(scheduler) == ["hog"] and scheduler.policy.reordering  # step 1
    hand_made_queue(scheduler, max_tokens=1)
    modes = []
    order = []
    while scheduler.has_unfinished_requests():
        order += [rid for rid in admitted(scheduler) if rid not in order]
        modes.append(scheduler.policy.reordering)
        for r in list(scheduler.running.values()):
            if r.num_output_tokens >= 1:
                scheduler.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    assert order == expected
    assert modes[: pressure_steps] == [True] * (pressure_steps - 1) + [False]  # steps 2 .. 1 + pressure_steps
    assert not any(modes[pressure_steps:])
    assert scheduler.kv_cache_manager.block_pool.num_allocation_evictions == 2  # press's only


def test_lpm_counts_overtakes_of_the_requests_left_waiting():
    scheduler = make_scheduler(64, "lpm", max_num_seqs=3)
    press(scheduler)
    hand_made_queue(scheduler)
    assert admitted(scheduler) == ["a1", "a2", "x"]
    # a1 and a2 overtook x (admitted now); a2 (arrived 4th) overtook y (3rd), nobody else.
    assert [scheduler.policy.num_overtakes(r) for r in ("y", "b1", "z", "b2")] == [1, 0, 0, 0]


def test_lpm_keeps_a_cached_prefix_that_fcfs_evicts():
    """8 blocks, A's 4 cached and free. x (6 blocks, first in line) and a1 (A + 4 tokens) can't run
    together. FCFS admits x, whose allocation evicts A's tail; LPM under pressure admits a1 first,
    hitting all of A. Before any eviction lpm is FCFS: the first eviction of an episode is made in
    arrival order (the rule reacts to evictions, it does not predict them)."""
    results = {}
    for policy, pressed in (("fcfs", True), ("lpm", True), ("lpm", False)):
        scheduler = make_scheduler(8, policy, budget=64)
        if pressed:
            press(scheduler)
        prime(scheduler, A)
        scheduler.add_request(request("x", list(range(300, 322)), max_tokens=2))
        scheduler.add_request(request("a1", A + [100, 101, 102, 103], max_tokens=2))
        results[policy, pressed] = (drain(scheduler), scheduler.kv_cache_manager.stats.hits)
    assert results["fcfs", True] == (["x", "a1"], 8)  # x took A's two tail blocks (freed tail first)
    assert results["lpm", True] == (["a1", "x"], 16)
    assert results["lpm", False] == (["x", "a1"], 8)


@pytest.mark.parametrize("policy,pressed", [("fcfs", False), ("lpm", False), ("lpm", True)])
def test_priority_is_the_outer_key(policy, pressed):
    scheduler = make_scheduler(64, policy)
    if pressed:
        press(scheduler)
    prime(scheduler, A)
    scheduler.add_request(request("low", list(range(300, 308)), priority=5))
    scheduler.add_request(request("hit", A[:12] + [9, 9, 9], priority=1))
    scheduler.add_request(request("urgent", list(range(400, 408)), priority=-3))
    scheduler.add_request(request("mid", list(range(500, 508)), priority=1))
    assert admitted(scheduler) == ["urgent", "hit", "mid", "low"]
    assert scheduler.policy.reordering is pressed


@pytest.mark.parametrize("pressed,expected", [(False, ["miss", "hit"]), (True, ["hit", "miss"])])
def test_priority_orders_lpm_ties_by_match_under_pressure(pressed, expected):
    scheduler = make_scheduler(64, "lpm")
    if pressed:
        press(scheduler)
    prime(scheduler, A)
    scheduler.add_request(request("miss", list(range(300, 308)), priority=1))
    scheduler.add_request(request("hit", A[:12] + [9, 9, 9], priority=1))
    scheduler.add_request(request("urgent", list(range(400, 408)), priority=0))
    assert admitted(scheduler) == ["urgent", *expected]


def test_age_bound_puts_an_old_request_first():
    now = [100.0]
    scheduler = make_scheduler(64, "lpm", clock=lambda: now[0], scheduling_max_wait_s=5.0)
    press(scheduler)
    prime(scheduler, A)
    scheduler.add_request(request("old", list(range(300, 308)), arrival_s=90.0))  # waited 10 s > 5 s
    scheduler.add_request(request("young", list(range(400, 408)), arrival_s=99.0))
    scheduler.add_request(request("hit", A[:12] + [9, 9, 9], arrival_s=99.5))
    assert admitted(scheduler) == ["old", "hit", "young"]


def test_overtake_bound_is_hard():
    """max_overtakes=2: a one-off waits behind at most two later cache hits, then goes first; it
    does not fit beside them (seats), so it blocks the queue until it is admitted."""
    scheduler = make_scheduler(64, "lpm", max_num_seqs=1, scheduling_max_overtakes=2)
    press(scheduler)
    prime(scheduler, A)
    scheduler.add_request(request("one-off", list(range(300, 308)), max_tokens=1))
    for i in range(4):
        scheduler.add_request(request(f"hit{i}", A[:12] + [i, i, i], max_tokens=1))
    assert drain(scheduler) == ["hit0", "hit1", "one-off", "hit2", "hit3"]


def test_zero_overtakes_is_arrival_order():
    scheduler = make_scheduler(64, "lpm", scheduling_max_overtakes=0)
    press(scheduler)
    reqs = hand_made_queue(scheduler)
    assert admitted(scheduler) == list(reqs)


def test_match_length_is_refreshed_only_for_changed_hashes():
    scheduler = make_scheduler(64, "lpm", max_num_seqs=1)
    press(scheduler)
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


def test_no_match_lookups_while_not_reordering():
    """Without pressure lpm looks nothing up for ordering: the only lookups are the admissions'."""
    scheduler = make_scheduler(64, "lpm", max_num_seqs=2)
    hand_made_queue(scheduler, max_tokens=1)
    calls = []
    original = scheduler.kv_cache_manager.get_computed_blocks
    scheduler.kv_cache_manager.get_computed_blocks = lambda r: calls.append(r.request_id) or original(r)
    assert drain(scheduler) == ARRIVAL_ORDER
    assert sorted(calls) == sorted(ARRIVAL_ORDER) and not scheduler.policy.reordering


def test_bad_config_names_the_field():
    for options, field in (({"scheduling_policy": "sjf"}, "scheduling_policy"),
                           ({"scheduling_max_wait_s": 0}, "scheduling_max_wait_s"),
                           ({"scheduling_max_overtakes": -1}, "scheduling_max_overtakes"),
                           ({"scheduling_pressure_steps": 0}, "scheduling_pressure_steps")):
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


@settings(max_examples=80, deadline=None)
@given(steps=arrivals(), max_overtakes=st.integers(0, 4), max_num_seqs=st.integers(1, 4),
       num_blocks=st.integers(12, 40), pressure_steps=st.integers(1, 6))
def test_no_request_is_overtaken_more_than_the_bound(steps, max_overtakes, max_num_seqs, num_blocks,
                                                     pressure_steps):
    """Adversarial arrivals (families whose prefixes get cached, one-offs that never hit), a small
    pool with evictions and preemptions, so lpm switches between reordering (evictions within the
    last ``pressure_steps`` steps) and arrival order: every request finishes, no request sees more
    than ``max_overtakes`` later arrivals admitted before it, and a step that does not reorder admits
    new requests exactly in arrival order (the oldest never-admitted ones)."""
    scheduler = make_scheduler(num_blocks, "lpm", max_num_seqs=max_num_seqs, budget=24,
                               scheduling_max_overtakes=max_overtakes, scheduling_max_wait_s=1e9,
                               scheduling_pressure_steps=pressure_steps)
    arrival: dict[str, int] = {}
    first_admission: list[str] = []
    max_tokens: dict[str, int] = {}
    modes = set()
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
        never_admitted = sorted((rid for rid in scheduler.waiting if rid not in first_admission), key=arrival.get)
        new = [rid for rid in admitted(scheduler) if rid not in first_admission]
        if scheduler.waiting or new:
            modes.add(scheduler.policy.reordering)
            if not scheduler.policy.reordering:
                assert new == never_admitted[: len(new)], (t, new, never_admitted)
        first_admission += new
        for r in list(scheduler.running.values()):
            if r.num_output_tokens >= max_tokens[r.request_id]:
                scheduler.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    assert not scheduler.has_unfinished_requests() and len(first_admission) == n
    event(f"modes {sorted(modes)}")
    for i, rid in enumerate(first_admission):
        overtaken_by = [o for o in first_admission[:i] if arrival[o] > arrival[rid]]
        assert len(overtaken_by) <= max_overtakes, (rid, overtaken_by)


def test_serve_flags_set_the_policy_and_bounds():
    import argparse

    from prefixcache.config import EngineConfig
    from prefixcache.entrypoints.cli.serve import add_cli_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--scheduling-policy", "fcfs", "--scheduling-max-wait-s", "2.5",
                              "--scheduling-max-overtakes", "0", "--scheduling-pressure-steps", "8"])
    config = engine_config_from_args(args)
    assert (config.scheduling_policy, config.scheduling_max_wait_s, config.scheduling_max_overtakes,
            config.scheduling_pressure_steps) == ("fcfs", 2.5, 0, 8)
    assert (EngineConfig().scheduling_policy, EngineConfig().scheduling_pressure_steps) == ("lpm", 64)
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "sjf"])
