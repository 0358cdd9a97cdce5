"""The operator dashboard's data: ``GET /v1/cache/stats`` (JSON) and its history.

:class:`DashboardState` gathers, per app:

- the engine's counters (the same :class:`~prefixcache.engine.async_engine.EngineStats` snapshot that
  ``/metrics`` renders, so the totals here equal the Prometheus series);
- a ring buffer of per-interval samples (``history``): tokens queried and hit, evictions by reason,
  tier hits, blocks and queues at the end of each interval (sampled every ``interval_s`` by a task,
  and by the endpoint itself when an interval has passed);
- TTFT of finished requests, cold (no cached token) and warm, as ``/metrics`` observes it: count and
  sum since start, p50/p99 over the last ``ttft_window`` of each kind;
- the prefix tree and the cache breakers from :class:`~prefixcache.engine.cache_insight.CacheInsight`;
- the pool's blocks per KV-cache group (:func:`kv_group_stats`: full attention, or a sliding window
  of W keys), taken with the tree;
- the "worth enabling" verdict (:func:`prefixcache.cache.worth.estimate_worth`) from the live traffic:
  cold prefill speed = prompt tokens / TTFT of cold requests; request rate over the history window.

Visibility: under tenant isolation a viewer (an API key) sees the server-wide numbers, but only its own
tenant's cached prefixes and breakers (plus approved shared prefixes); text (previews, breaker spans)
only when previews are on, which under ``--tenant-isolation`` is off unless the operator turns it on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass

from prefixcache.cache.worth import WorthInputs, estimate_worth
from prefixcache.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStats, take_stats
from prefixcache.engine.cache_insight import CacheInsight, empty_report
from prefixcache.engine.llm_engine import EngineMetrics, LLMEngine
from prefixcache.outputs import RequestOutput


STATS_WAIT_S = 0.5  # how long /v1/cache/stats waits for the engine thread before answering with the last tree


@dataclass(frozen=True)
class DashboardOptions:
    """Dashboard settings.

    Attributes:
        previews: show decoded text (prefix previews, breaker spans): ``None`` = on, except under
            tenant isolation; a tenant only ever sees its own namespace's text.
        interval_s: seconds per history sample, > 0.
        history_len: samples kept (the ring buffer's size), >= 1.
        ttft_window: recent TTFTs of each kind kept for the percentiles, >= 1.
        max_breaker_chains: recent prompts per namespace the breakers are found against.
    """

    previews: bool | None = None
    interval_s: float = 5.0
    history_len: int = 120
    ttft_window: int = 1024
    max_breaker_chains: int = 64

    def validate(self) -> None:
        """Raises ValueError naming the bad field."""
        if not self.interval_s > 0:
            raise ValueError(f"dashboard interval_s must be > 0, got {self.interval_s!r}")
        for name in ("history_len", "ttft_window", "max_breaker_chains"):
            if getattr(self, name) < 1:
                raise ValueError(f"dashboard {name} must be >= 1, got {getattr(self, name)!r}")


class _TTFT:
    """TTFTs of one kind: count and sum since start, recent values for percentiles."""

    def __init__(self, window: int) -> None:
        self.count = 0
        self.sum_s = 0.0
        self.prompt_tokens = 0
        self.recent: deque[float] = deque(maxlen=window)

    def observe(self, ttft_s: float, prompt_tokens: int) -> None:
        self.count += 1
        self.sum_s += ttft_s
        self.prompt_tokens += prompt_tokens
        self.recent.append(ttft_s)

    def to_dict(self) -> dict:
        values = sorted(self.recent)
        return {"count": self.count, "sum_s": self.sum_s, "p50_s": percentile(values, 50),
                "p99_s": percentile(values, 99)}


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (the smallest value with at least q % at or below it)."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


def _delta_by_key(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


class DashboardState:
    """The data behind ``/v1/cache/stats`` and ``/dashboard`` (see the module docstring).

    Args:
        engine: the served async engine (its engine gets a :class:`CacheInsight` finish hook).
        model_name: the served model name.
        tenant_isolation: the server isolates tenants (then previews default off).
        options: settings; validated.

    Raises:
        ValueError: a bad option.
    """

    def __init__(self, engine: AsyncLLMEngine, model_name: str, tenant_isolation: bool,
                 options: DashboardOptions | None = None) -> None:
        options = options or DashboardOptions()
        options.validate()
        self.engine = engine
        self.model_name = model_name
        self.options = options
        self.previews = (not tenant_isolation) if options.previews is None else options.previews
        self.insight = CacheInsight(engine.engine, options.max_breaker_chains)
        self.ttft = {"cold": _TTFT(options.ttft_window), "warm": _TTFT(options.ttft_window)}
        self.num_finished = 0
        self.history: deque[dict] = deque(maxlen=options.history_len)
        self.started_s = time.time()
        self._last: tuple[float, EngineStats] | None = None
        self._task: asyncio.Task | None = None
        # Per viewer: the snapshot asked of the engine thread and not taken yet, and the last tree taken.
        self._pending: dict[str | None, asyncio.Future] = {}
        self._reports: dict[str | None, dict] = {}

    # ------------------------------------------------------------------ observing
    def observe_finished(self, out: RequestOutput, request_done: bool = True) -> None:
        """Records a finished request's TTFT as ``ServerMetrics.observe_finished`` does (the last
        sample of a request, when it has a TTFT), cold or warm by its cached tokens."""
        if not request_done:
            return
        self.num_finished += 1
        if out.ttft_s is not None:
            kind = "warm" if out.num_cached_tokens > 0 else "cold"
            self.ttft[kind].observe(out.ttft_s, out.num_prompt_tokens)

    def sample(self, stats: EngineStats, now_s: float | None = None) -> None:
        """Appends a history sample if an interval has passed since the last (the first call only
        sets the baseline)."""
        now_s = time.time() if now_s is None else now_s
        if self._last is None:
            self._last = (now_s, stats)
            return
        last_s, last = self._last
        if now_s - last_s < self.options.interval_s:
            return
        m, b = stats.metrics, last.metrics
        queries, hits = m.prefix_cache_queries - b.prefix_cache_queries, m.prefix_cache_hits - b.prefix_cache_hits
        self.history.append({
            "t": now_s, "duration_s": now_s - last_s,
            "requests": m.num_requests - b.num_requests,
            "queries": queries, "hits": hits,
            "partial_hits": m.prefix_cache_partial_hits - b.prefix_cache_partial_hits,
            "hit_rate": hits / queries if queries else None,
            "prompt_tokens_computed": m.prompt_tokens_computed - b.prompt_tokens_computed,
            "evictions_by_reason": _delta_by_key(m.evictions_by_reason, b.evictions_by_reason),
            "tier_hits": {t: s["hits"] - b.kv_tiers.get(t, {}).get("hits", 0) for t, s in m.kv_tiers.items()},
            "blocks_in_use": m.num_blocks_in_use, "blocks_cached": m.num_blocks_cached,
            "blocks_free": m.num_blocks_free,
            "requests_running": stats.num_running, "requests_waiting": stats.num_waiting,
        })
        self._last = (now_s, stats)

    async def _sample_forever(self) -> None:
        while True:
            with contextlib.suppress(EngineDeadError):
                self.sample(await self.engine.get_stats())
            await asyncio.sleep(self.options.interval_s)

    def start(self) -> None:
        """Starts the sampling task on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._sample_forever(), name="prefixcache-dashboard")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ------------------------------------------------------------------ reporting
    async def _snapshot(self, tenant: str | None) -> tuple[EngineStats, dict, bool]:
        """Counters and the viewer's tree taken together on the engine thread, between steps; when a
        step keeps the thread longer than :data:`STATS_WAIT_S`, the counters as of the last step
        (``get_stats``, which never waits) with the tree this viewer got last (empty if none), and
        True (stale). The snapshot still pending is kept for the next call, which
        takes it when done (one pending per viewer however often the page polls).

        Raises:
            EngineDeadError: the engine loop has failed.
        """
        def take(engine: LLMEngine) -> tuple[EngineStats, dict]:  # one snapshot: counters and tree agree
            return take_stats(engine), {**self.insight.report(tenant, self.previews),
                                        "kv_groups": kv_group_stats(engine)}

        pending = self._pending.get(tenant)
        if pending is not None and pending.done():  # finished while nobody waited: keep its tree, ask anew
            del self._pending[tenant]
            if not pending.cancelled() and pending.exception() is None:
                self._reports[tenant] = pending.result()[1]
            pending = None  # a failure is not kept: the fresh snapshot raises the engine's error, if any
        if pending is None:
            pending = self._pending[tenant] = asyncio.ensure_future(self.engine.inspect(take))
        done, _ = await asyncio.wait({pending}, timeout=STATS_WAIT_S)
        if pending in done:
            if self._pending.get(tenant) is pending:  # another poll of this viewer may have taken it first
                del self._pending[tenant]
            stats, report = pending.result()  # the engine's error, if any, as before
            self._reports[tenant] = report
            return stats, report, False
        return await self.engine.get_stats(), self._reports.get(tenant) or empty_report(), True

    async def stats(self, tenant: str | None) -> dict:
        """The ``/v1/cache/stats`` document for a viewer (``tenant`` under isolation, else None).

        It answers within about :data:`STATS_WAIT_S` even while a long prefill runs: then
        ``tree_stale`` is true, the counters are those of the last step, and the prefix tree, the
        breakers and the verdict's tree inputs were taken earlier, at ``tree_as_of_s`` (``None``, and
        empty, before any was taken). Otherwise everything is one snapshot taken now.

        Raises:
            EngineDeadError: the engine loop has failed.
        """
        stats, report, tree_stale = await self._snapshot(tenant)
        self.sample(stats)
        m = stats.metrics
        now = time.time()
        return {
            "model": self.model_name, "time_s": now, "uptime_s": now - self.started_s,
            "interval_s": self.options.interval_s, "previews": self.previews,
            "tree_stale": tree_stale, "tree_as_of_s": report["time_s"],
            "totals": {
                "requests": m.num_requests, "hit_requests": m.num_hit_requests,
                "finished_requests": self.num_finished,
                "prefix_cache_queries": m.prefix_cache_queries, "prefix_cache_hits": m.prefix_cache_hits,
                "prefix_cache_partial_hits": m.prefix_cache_partial_hits,
                "prefix_cache_tier_hits": m.prefix_cache_tier_hits, "hit_rate": m.hit_rate,
                "prefill_tokens_saved": m.prefix_cache_hits,  # every kind of hit is prefill not run
                "prompt_tokens_computed": m.prompt_tokens_computed, "num_preemptions": m.num_preemptions,
            },
            "requests": {"running": stats.num_running, "waiting": stats.num_waiting},
            "ttft": {kind: t.to_dict() for kind, t in self.ttft.items()},
            "pool": _pool(m, self.engine.engine.kv_cache_bytes_per_block),
            "tiers": {name: {k: v for k, v in s.items() if not k.endswith("_latency")}
                      for name, s in m.kv_tiers.items()},
            "history": list(self.history),
            "worth": self._worth(m, report),
            "prefixes": report["prefixes"],
            "breakers": report["breakers"],
            "zero_hits": report["zero_hits"],  # requests that served no cached token, and why (in words)
            "pins": report["pins"],  # cache breakpoints' pinned blocks (cache/pins.py), as of the tree
            "kv_groups": report.get("kv_groups", []),  # blocks per KV-cache group, as of the tree
        }

    def _worth(self, m: EngineMetrics, report: dict) -> dict:
        """The live verdict, or why there is none yet."""
        cold = self.ttft["cold"]
        if cold.count == 0 or cold.sum_s <= 0:
            return {"verdict": None, "reason": "no cold request finished yet: the prefill speed is unknown"}
        span_s = sum(s["duration_s"] for s in self.history)
        requests_per_s = (sum(s["requests"] for s in self.history) / span_s if span_s > 0
                          else m.num_requests / max(time.time() - self.started_s, 1e-9))
        inputs = WorthInputs(
            num_requests=m.num_requests, hit_tokens=m.prefix_cache_hits,
            num_hit_requests=m.num_hit_requests, block_hits=report["block_hits"],
            distinct_hit_blocks=report["distinct_hit_blocks"],
            prefill_tokens_per_s=cold.prompt_tokens / cold.sum_s, requests_per_s=requests_per_s,
            kv_bytes_held=m.cached_bytes,
        )
        return {**estimate_worth(inputs).to_dict(), "inputs": inputs.__dict__}


def kv_group_stats(engine: LLMEngine) -> list[dict]:
    """The pool's blocks per KV-cache group (:mod:`prefixcache.cache.kv_cache_groups`), group 0 first;
    call on the engine thread, between steps.

    Each entry: ``group_id``; ``kind`` (``"full_attention"`` / ``"sliding_attention"``) and ``window``
    (keys a sliding layer's query reads, ``None`` for full); ``label`` (``"full attention"`` or
    ``"sliding window W"``); ``layers`` (the model's layer indices whose K/V its blocks hold); and
    :meth:`~prefixcache.cache.block_pool.BlockPool.group_block_counts`' ``in_use``, ``cached``,
    ``cached_free``, ``retained`` (blocks). A model whose layers are all full has one group, whose
    counts are the pool's. Free blocks without a hash belong to no group: they are the pool's
    ``blocks_free`` less the groups' ``cached_free``. There is no hit rate per group: a request's hit
    length is what every group serves (the same tokens for all), so the pool's hit rate is each
    group's.
    """
    groups = engine.kv_cache_groups
    counts = engine.kv_cache_manager.block_pool.group_block_counts(groups.num_groups)
    return [{"group_id": g.group_id, "kind": g.spec.kind.value, "window": g.spec.window,
             "label": f"sliding window {g.spec.window}" if g.is_sliding else "full attention",
             "layers": list(g.layer_ids), **c} for g, c in zip(groups.groups, counts)]


def _pool(m: EngineMetrics, bytes_per_block: int) -> dict:
    return {
        "blocks_total": m.num_blocks_total, "blocks_in_use": m.num_blocks_in_use,
        "blocks_cached": m.num_blocks_cached, "blocks_free": m.num_blocks_free,
        "bytes_per_block": bytes_per_block, "total_bytes": m.num_blocks_total * bytes_per_block,
        "in_use_bytes": m.num_blocks_in_use * bytes_per_block, "cached_bytes": m.cached_bytes,
        "usage": m.num_blocks_in_use / m.num_blocks_total if m.num_blocks_total else 0.0,
        "evictions": m.num_evictions, "evictions_by_reason": dict(m.evictions_by_reason),
        "mean_evicted_age_s": m.mean_evicted_age_s,
    }
