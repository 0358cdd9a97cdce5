"""The eviction trace simulation (no model): deterministic, and policies only differ under pressure."""

from __future__ import annotations

from prefixcache.bench.trace import run_trace_benchmark

POLICIES = ("lru", "lfu", "ttl", "cost")


def by_key(rows):
    return {(r["trace"], r["seed"], r["policy"]): r for r in rows}


def test_trace_is_deterministic_and_lru_is_the_baseline():
    a = by_key(run_trace_benchmark(POLICIES, seeds=(0,), num_requests=300, num_blocks=256))
    b = by_key(run_trace_benchmark(POLICIES, seeds=(0,), num_requests=300, num_blocks=256))
    assert set(a) == {(t, 0, p) for t in ("skewed", "uniform") for p in POLICIES}
    assert {k: r["prefill_tokens_saved"] for k, r in a.items()} == {k: r["prefill_tokens_saved"] for k, r in b.items()}
    for (trace, _, policy), r in a.items():
        assert 0.0 <= r["hit_rate"] <= 1.0
        assert r["num_evictions"] > 0, "256 blocks must be below the working set"
        if policy == "lru":
            assert r["saved_vs_lru"] == 0.0


def test_without_memory_pressure_every_policy_saves_the_same():
    rows = by_key(run_trace_benchmark(POLICIES, seeds=(1,), num_requests=200, num_blocks=100_000))
    for trace in ("skewed", "uniform"):
        saved = {rows[(trace, 1, p)]["prefill_tokens_saved"] for p in POLICIES}
        assert len(saved) == 1 and saved.pop() > 0
        assert all(rows[(trace, 1, p)]["num_evictions"] == 0 for p in POLICIES)


def test_belady_reference_beats_the_real_policies_on_the_toy_trace():
    rows = by_key(run_trace_benchmark(("lru", "cost", "belady"), seeds=(0,), num_requests=300, num_blocks=256))
    for trace in ("skewed", "uniform"):
        saved = {p: rows[(trace, 0, p)]["prefill_tokens_saved"] for p in ("lru", "cost", "belady")}
        assert saved["belady"] >= max(saved["lru"], saved["cost"]), saved
        assert rows[(trace, 0, "belady")]["num_evictions"] > 0
