"""The queue workload's replay (prefixcache/bench/queue.py): exact accounting, determinism, and the
issue's targets on the default workload."""

from __future__ import annotations

import dataclasses

import pytest

from prefixcache.bench.queue import QueueConfig, generate_queue_trace, run_queue_benchmark, simulate_queue

SMALL = dataclasses.replace(QueueConfig(), num_requests=120, num_families=6, family_prefix_len=128,
                            oneoff_len=(40, 200), rate_rps=40.0, num_blocks=4096)


def test_no_pressure_accounting_is_exact_and_deterministic():
    trace = generate_queue_trace(SMALL)
    assert trace == generate_queue_trace(SMALL)
    for policy in ("fcfs", "lpm"):
        r = simulate_queue(trace, policy, SMALL)
        assert r.num_preemptions == 0
        # every prompt token is either a hit or computed once
        assert r.prefill_tokens_computed == r.prompt_tokens - r.hit_tokens
        assert r.prompt_tokens == sum(len(t.prompt_token_ids) for t in trace)
        again = simulate_queue(trace, policy, SMALL)
        assert dataclasses.replace(again, schedule_wall_us_per_step=0) == dataclasses.replace(
            r, schedule_wall_us_per_step=0)
    assert simulate_queue(trace, "fcfs", SMALL).max_overtakes == 0


@pytest.mark.slow
def test_default_queue_workload_meets_the_issue_targets():
    result = run_queue_benchmark()
    assert all(g["met"] for g in result["goals"]), result["goals"]
    assert result["policies"]["lpm"]["max_overtakes"] <= 64
