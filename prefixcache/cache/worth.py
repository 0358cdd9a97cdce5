""""Is prefix caching worth enabling?" — the estimate and the verdict, from measured numbers.

The calculus: prefix caching saves the prefill of every reused token, as often as the prefix is
reused, and holds the KV of the cached prefix in memory to do so::

    saved_s_per_s = hit_tokens_per_request / prefill_tokens_per_s * requests_per_s
                    (prefill seconds saved per second of traffic)
    value_per_gib = saved_s_per_s / (bytes of KV held by the cache / 2**30)

E.g. a 2048-token prefix at ~3000 prefill tokens/s is 0.68 s per hit; reused 20 times a second that
saves 13.7 s of prefill per second for 96 MB of KV (SmolLM2, fp32): clearly worth it. Reused once a
minute, it saves 0.011 s per second: marginal. No hits at all: not worth it (only the hashing cost
remains). The inputs come from a benchmark run (`prefixcache bench`) or a live server's traffic
(`GET /v1/cache/stats`, the dashboard).

The estimate must agree with what was measured: when the bench timed caching on *slower* than
caching off (throughput ratio below ``1 - SLOWER_TOLERANCE``), a "worth it" or "marginal" estimate
is not reported as such. With few or scattered timings (fewer than ``MIN_CONFIRMING_REPEATS`` runs
per mode, or runs of one mode more than ``NOISY_SPREAD`` apart) the verdict is "inconclusive", the
reason saying why (a busy machine: e.g. more torch threads than free cores makes runs 10-30x
slower at random) and what to rerun; with repeated, consistent timings it is "not worth it".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

WORTH = "worth it"
MARGINAL = "marginal"
NOT_WORTH = "not worth it"
INCONCLUSIVE = "inconclusive"

# Thresholds of the verdict (prefill seconds saved per second of traffic, and per GiB held).
WORTH_MIN_SAVED_S_PER_S = 0.05  # saves >= 5 % of a core-second of prefill every second
WORTH_MIN_SAVED_S_PER_S_PER_GIB = 0.05
NOT_WORTH_MAX_SAVED_S_PER_S = 0.001  # below 0.1 % of a second per second: noise
# Consistency with the measured throughput of caching on vs off.
SLOWER_TOLERANCE = 0.05  # on / off below 0.95: caching on measured slower
MIN_CONFIRMING_REPEATS = 3  # timed runs per mode needed to trust "slower" over noise
NOISY_SPREAD = 0.25  # (slowest / fastest - 1) of one mode's runs above this: noisy timings


@dataclass(frozen=True)
class WorthInputs:
    """What the estimate needs, measured.

    Attributes:
        num_requests: requests observed.
        hit_tokens: prompt tokens served from the cache, over all requests.
        num_hit_requests: requests with at least one cached token.
        block_hits: cache hits in blocks, over all requests.
        distinct_hit_blocks: distinct cached blocks that served at least one hit.
        prefill_tokens_per_s: prefill throughput without the cache (cold), tokens/s.
        requests_per_s: traffic rate, requests/s.
        kv_bytes_held: bytes of KV the cache holds to serve those hits.
        on_over_off: measured throughput with caching on / off on the same requests (None: not
            measured; the verdict is then the estimate's).
        num_timing_repeats: timed runs per mode behind ``on_over_off``.
        timing_spread: slowest / fastest - 1 over the runs of the noisier mode (None: one run).
    """

    num_requests: int
    hit_tokens: int
    num_hit_requests: int
    block_hits: int
    distinct_hit_blocks: int
    prefill_tokens_per_s: float
    requests_per_s: float
    kv_bytes_held: int
    on_over_off: float | None = None
    num_timing_repeats: int = 1
    timing_spread: float | None = None


@dataclass(frozen=True)
class WorthEstimate:
    """The estimate and verdict for one workload.

    Attributes:
        block_repeat_rate: mean reuses of each cached block that served a hit (hits / distinct).
        mean_hit_tokens: mean cached tokens of the requests that hit.
        saved_prefill_s_per_request: prefill seconds saved per request (all requests).
        saved_prefill_s_per_s: prefill seconds saved per second of traffic.
        kv_bytes_held: bytes of KV held by the cache.
        saved_s_per_s_per_gib: ``saved_prefill_s_per_s`` per GiB held.
        verdict: "worth it", "marginal", "not worth it" or "inconclusive" (see the module docstring).
        reason: one sentence with the numbers behind the verdict.
    """

    block_repeat_rate: float
    mean_hit_tokens: float
    saved_prefill_s_per_request: float
    saved_prefill_s_per_s: float
    kv_bytes_held: int
    saved_s_per_s_per_gib: float
    verdict: str
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_worth(x: WorthInputs) -> WorthEstimate:
    """Applies the calculus of the module docstring.

    Raises:
        ValueError: a negative count or a non-positive prefill rate.
    """
    if min(x.num_requests, x.hit_tokens, x.num_hit_requests, x.block_hits, x.distinct_hit_blocks,
           x.kv_bytes_held) < 0 or x.requests_per_s < 0:
        raise ValueError(f"counts and rates must be >= 0, got {x}")
    if x.prefill_tokens_per_s <= 0:
        raise ValueError(f"prefill_tokens_per_s must be > 0, got {x.prefill_tokens_per_s}")
    repeat = x.block_hits / x.distinct_hit_blocks if x.distinct_hit_blocks else 0.0
    mean_hit = x.hit_tokens / x.num_hit_requests if x.num_hit_requests else 0.0
    saved_per_req = (x.hit_tokens / x.num_requests if x.num_requests else 0.0) / x.prefill_tokens_per_s
    saved_per_s = saved_per_req * x.requests_per_s
    gib = x.kv_bytes_held / 2**30
    per_gib = saved_per_s / gib if gib > 0 else 0.0
    numbers = (
        f"{mean_hit:.0f}-token hits on {x.num_hit_requests}/{x.num_requests} requests save "
        f"{saved_per_req * 1e3:.1f} ms of prefill per request = {saved_per_s:.3f} s/s at "
        f"{x.requests_per_s:.2f} req/s, for {x.kv_bytes_held / 2**20:.1f} MiB of KV held"
    )
    verdict, reason = _estimate_verdict(x, saved_per_s, per_gib, numbers)
    verdict, reason = _check_against_measured(x, verdict, reason, saved_per_s)
    return WorthEstimate(
        block_repeat_rate=repeat,
        mean_hit_tokens=mean_hit,
        saved_prefill_s_per_request=saved_per_req,
        saved_prefill_s_per_s=saved_per_s,
        kv_bytes_held=x.kv_bytes_held,
        saved_s_per_s_per_gib=per_gib,
        verdict=verdict,
        reason=reason,
    )


def _estimate_verdict(x: WorthInputs, saved_per_s: float, per_gib: float, numbers: str) -> tuple[str, str]:
    """The verdict of the calculus alone."""
    if x.hit_tokens == 0:
        verdict, reason = NOT_WORTH, (
            "no prompt shares a full block with an earlier one, so the cache only adds hashing and "
            "holds memory for nothing"
        )
    elif saved_per_s < NOT_WORTH_MAX_SAVED_S_PER_S:
        verdict, reason = NOT_WORTH, f"reuse is too rare to matter: {numbers}"
    elif saved_per_s >= WORTH_MIN_SAVED_S_PER_S and per_gib >= WORTH_MIN_SAVED_S_PER_S_PER_GIB:
        verdict, reason = WORTH, f"{numbers} ({per_gib:.2f} s/s per GiB)"
    else:
        verdict, reason = MARGINAL, f"{numbers} ({per_gib:.3f} s/s per GiB): small gain for the memory"
    return verdict, reason


def _check_against_measured(x: WorthInputs, verdict: str, reason: str, saved_per_s: float) -> tuple[str, str]:
    """Keeps the estimate's verdict unless the bench measured caching on slower than off."""
    slower = x.on_over_off is not None and x.on_over_off < 1 - SLOWER_TOLERANCE
    if verdict == NOT_WORTH or not slower:
        return verdict, reason
    runs = f"{x.num_timing_repeats} timed run{'s' if x.num_timing_repeats != 1 else ''} per mode"
    spread = "" if x.timing_spread is None else f", spread {x.timing_spread:.0%}"
    measured = (f"the estimate saves {saved_per_s:.3f} s of prefill per s, but caching on ran at "
                f"{x.on_over_off:.2f}x the throughput of caching off ({runs}{spread})")
    noisy = (x.num_timing_repeats < MIN_CONFIRMING_REPEATS or x.timing_spread is None
             or x.timing_spread > NOISY_SPREAD)
    if noisy:
        return INCONCLUSIVE, (
            f"{measured}: too few or too scattered timings to tell a real cost from a busy machine (more "
            "torch threads than free cores makes runs many times slower at random); rerun on a quiet "
            f"machine with --num-threads below the free cores and --repeats {MIN_CONFIRMING_REPEATS}")
    return NOT_WORTH, f"{measured}, consistently: here the cache costs more time than the prefill it saves"
