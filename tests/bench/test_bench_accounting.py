"""Ideal accounting and the "worth enabling" verdict on hand-made numbers (no model)."""

from __future__ import annotations

import pytest

from prefixcache.bench.accounting import common_prefix_len, ideal_accounting
from prefixcache.bench.worth import INCONCLUSIVE, MARGINAL, NOT_WORTH, WORTH, WorthInputs, estimate_worth

# block size 4; A and B share two full blocks, C (8 tokens, a multiple of 4) may take only its first
# block from the cache, D shares nothing.
A = list(range(1, 11))  # 10 tokens: c = 2, tail 2
B = list(range(1, 9)) + [20, 21, 22]  # 11 tokens: c = 2, tail 3
C = list(range(1, 9))  # 8 tokens: c = 1, tail 4
D = [9, 9, 9]  # 3 tokens: c = 0, tail 3
SYNTHETIC = [A, B, C, D]


def test_ideal_prefill_single_round_by_hand():
    acc = ideal_accounting([SYNTHETIC], block_size=4)
    # distinct cacheable blocks {A[:4], A[:8]} computed once (8) + tails 2 + 3 + 4 + 3 = 20
    assert acc.prompt_tokens == 32
    assert acc.ideal_prefill_tokens == 20
    assert acc.ideal_hit_tokens == 12  # B takes 8, C takes 4
    assert acc.ideal_hit_requests == 2
    assert acc.block_hits == 3 and acc.distinct_hit_blocks == 2
    # peak: 2 shared blocks + private blocks 1 (A) + 1 (B) + 1 (C) + 1 (D); unshared: 3 + 3 + 2 + 1
    assert acc.ideal_peak_blocks == 6
    assert acc.unshared_peak_blocks == 9


def test_ideal_prefill_order_matters_only_through_arrival():
    # C first: its last full block is its tail, computed anyway, and then A and B can hit it too.
    acc = ideal_accounting([[C, A, B]], block_size=4)
    assert acc.ideal_prefill_tokens == 8 + (10 - 8) + (11 - 8)


def test_ideal_prefill_counts_blocks_left_behind_by_outputs():
    # Round 1 leaves behind prompt + output[:-1] = tokens 1..9: full blocks [1..4], [1..8].
    p = [1, 2, 3, 4, 5, 6]
    q = list(range(1, 10)) + [11, 12]  # resends p, the reply and more: 11 tokens, c = 2
    acc = ideal_accounting([[p], [q]], block_size=4, outputs=[[[7, 8, 9, 10]], [[13]]])
    assert acc.ideal_prefill_tokens == 6 + (11 - 8)
    assert acc.ideal_hit_requests == 1
    # round 2 holds 2 shared blocks + ceil((11 + 0) / 4) - 2 = 1 private block
    assert acc.ideal_peak_blocks == max(1 + (3 - 1), 2 + 1)
    # without outputs, q only finds p's first block
    assert ideal_accounting([[p], [q]], block_size=4).ideal_prefill_tokens == 6 + 11 - 4


def test_ideal_accounting_rejects_bad_input():
    with pytest.raises(ValueError):
        ideal_accounting([[A]], block_size=0)
    with pytest.raises(ValueError):
        ideal_accounting([[A, []]], block_size=4)
    with pytest.raises(ValueError):
        ideal_accounting([[A, B]], block_size=4, outputs=[[[1]]])


def test_common_prefix_len():
    assert common_prefix_len([A, B, C]) == 8
    assert common_prefix_len([A, D]) == 0
    assert common_prefix_len([A]) == 0


def _inputs(hit_tokens_per_request: int, requests_per_s: float, num_requests: int = 100, **kw) -> WorthInputs:
    blocks = hit_tokens_per_request // 16
    values = dict(
        num_requests=num_requests,
        hit_tokens=hit_tokens_per_request * num_requests,
        num_hit_requests=num_requests if hit_tokens_per_request else 0,
        block_hits=blocks * num_requests,
        distinct_hit_blocks=blocks,
        prefill_tokens_per_s=3000.0,
        requests_per_s=requests_per_s,
        kv_bytes_held=blocks * 737_280,  # SmolLM2 fp32, 16-token blocks
    )
    values.update(kw)
    return WorthInputs(**values)


def test_verdict_seed_idea_2048_token_prefix_20_per_second_is_worth_it():
    est = estimate_worth(_inputs(2048, requests_per_s=20.0))
    assert est.verdict == WORTH
    assert est.saved_prefill_s_per_request == pytest.approx(2048 / 3000)
    assert est.saved_prefill_s_per_s == pytest.approx(20 * 2048 / 3000)
    assert est.block_repeat_rate == pytest.approx(100.0)
    assert est.mean_hit_tokens == 2048
    assert est.kv_bytes_held == 128 * 737_280


def test_verdict_same_prefix_once_a_minute_is_marginal():
    est = estimate_worth(_inputs(2048, requests_per_s=1 / 60))
    assert est.verdict == MARGINAL
    assert est.saved_prefill_s_per_s == pytest.approx(2048 / 3000 / 60)


def test_verdict_no_hits_or_negligible_reuse_is_not_worth_it():
    assert estimate_worth(_inputs(0, requests_per_s=50.0)).verdict == NOT_WORTH
    assert estimate_worth(_inputs(16, requests_per_s=0.01)).verdict == NOT_WORTH  # 0.05 ms/s saved


def test_verdict_rejects_nonsense():
    with pytest.raises(ValueError):
        estimate_worth(_inputs(2048, requests_per_s=1.0, prefill_tokens_per_s=0.0))
    with pytest.raises(ValueError):
        estimate_worth(_inputs(2048, requests_per_s=-1.0))


# ---------------------------------------------------------------------------- verdict vs measured
def test_verdict_never_says_worth_it_when_caching_on_measured_slower():
    # Issue 17's run: a 2048-token prefix the estimate calls worth it, but on a busy machine caching on
    # ran at 0.16x the throughput of caching off, from one run per mode.
    est = estimate_worth(_inputs(2048, requests_per_s=20.0, on_over_off=0.16, num_timing_repeats=1))
    assert est.verdict == INCONCLUSIVE
    assert est.reason.startswith("the estimate saves 13.653 s of prefill per s, but caching on ran at 0.16x the "
                                 "throughput of caching off (1 timed run per mode): too few or too scattered "
                                 "timings")
    assert "--repeats 3" in est.reason and "--num-threads" in est.reason
    # The calculus's numbers are kept: only the verdict follows the measurement.
    assert est.saved_prefill_s_per_s == pytest.approx(20 * 2048 / 3000)


def test_verdict_scattered_repeats_are_inconclusive_and_consistent_ones_not_worth_it():
    scattered = estimate_worth(_inputs(2048, requests_per_s=20.0, on_over_off=0.5, num_timing_repeats=3,
                                       timing_spread=0.8))
    assert scattered.verdict == INCONCLUSIVE and "3 timed runs per mode, spread 80%" in scattered.reason
    consistent = estimate_worth(_inputs(2048, requests_per_s=20.0, on_over_off=0.5, num_timing_repeats=3,
                                        timing_spread=0.04))
    assert consistent.verdict == NOT_WORTH
    assert consistent.reason == ("the estimate saves 13.653 s of prefill per s, but caching on ran at 0.50x the "
                                 "throughput of caching off (3 timed runs per mode, spread 4%), consistently: here "
                                 "the cache costs more time than the prefill it saves")
    marginal = estimate_worth(_inputs(2048, requests_per_s=1 / 60, on_over_off=0.5, num_timing_repeats=5,
                                      timing_spread=0.1))
    assert marginal.verdict == NOT_WORTH  # "marginal" can't stand either when measured slower


def test_verdict_keeps_the_estimate_when_measured_faster_or_within_tolerance():
    for ratio in (3.0, 1.0, 0.951):  # tolerance 5 %: 0.951 is "as fast"
        assert estimate_worth(_inputs(2048, requests_per_s=20.0, on_over_off=ratio)).verdict == WORTH
    assert estimate_worth(_inputs(2048, requests_per_s=20.0, on_over_off=0.949)).verdict == INCONCLUSIVE
    # No hits: not worth it whatever the timings say.
    assert estimate_worth(_inputs(0, requests_per_s=50.0, on_over_off=0.2)).verdict == NOT_WORTH
    assert estimate_worth(_inputs(0, requests_per_s=50.0, on_over_off=2.0)).verdict == NOT_WORTH


def test_timing_spread_is_the_noisier_mode():
    from prefixcache.bench.runner import timing_spread

    assert timing_spread([1.0], [2.0]) is None
    assert timing_spread([1.0, 1.5, 1.2], [2.0, 2.1, 2.0]) == pytest.approx(0.5)
    assert timing_spread([4.0, 1.0], [1.0]) == pytest.approx(3.0)
