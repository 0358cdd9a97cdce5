"""The seed demo's report on the real model (issue 2's "done when" numbers)."""

from prefixcache.entrypoints.demo import run_demo


def test_demo_report(smollm2):
    r = run_demo(loaded=smollm2, num_threads=2)
    assert r["outputs_equal"] is True
    assert (r["num_requests"], r["hit_requests"]) == (10, 9)
    assert r["prefill_tokens_no_cache"] == r["prompt_tokens"]
    # The shared prefix (system message + user header) is computed once; 9 requests reuse its full blocks.
    shared_full_blocks = min(a["num_cached_tokens"] for a in r["answers"][1:]) // 16
    assert shared_full_blocks == 7
    assert r["prefill_tokens_cache"] == r["prompt_tokens"] - 9 * 7 * 16
    assert r["saved_fraction"] >= 0.70
    assert all(a["answer"].strip() for a in r["answers"])
