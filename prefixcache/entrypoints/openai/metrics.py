"""Prometheus metrics of the server, named after vLLM's (``vllm:`` → ``prefixcache:``).

Each app owns its own :class:`CollectorRegistry` (no global state). Two sources feed it:

- engine counters and gauges (prefix-cache queries/hits, blocks, evictions, queue lengths) are read
  from an :class:`EngineStats` snapshot taken on the engine thread when ``/metrics`` is scraped;
- per-request counters and histograms (tokens, finish reasons, TTFT, end-to-end latency) are
  observed by :meth:`ServerMetrics.observe_finished` as each request finishes or is aborted.

Token counters count tokens; ``*_seconds`` histograms are in seconds.

The series routers read are also exported under vLLM's own names (:data:`VLLM_ALIASES`), with
vLLM v1's labels ``model_name`` and ``engine`` (``"0"``): llm-d's scheduler, the Gateway API
inference extension's endpoint picker and vLLM's production-stack router scrape
``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` and
the prefix-cache token counters. Each alias has the value of our series of the same suffix.

A prefix-cache hit is a prompt token the cache served, whichever way (full block, partial-block
copy, KV-tier load): ``prefix_cache_hits`` grows by exactly the ``cached_tokens`` each answer's
usage reports, as vLLM's counter does; ``prefix_cache_partial_hits`` and ``kv_tier_hits`` are
parts of it (docs/metrics.md).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from prefixcache.engine.async_engine import EngineStats
from prefixcache.outputs import RequestOutput

PREFIX = "prefixcache:"
VLLM_PREFIX = "vllm:"
# Our series also exported as vllm:<name> (same value; vLLM's kind: counters of tokens, gauges).
VLLM_ALIASES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                "prefix_cache_hits")
_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Yields engine metrics from the latest snapshot (set just before each scrape)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self):
        stats = self.stats
        if stats is None:
            return
        m = stats.metrics
        labels = ["model_name"]
        values = [self.model_name]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache (full blocks, partial-block "
                      "copies, KV-tier loads): the sum of usage cached_tokens.", m.prefix_cache_hits)
        yield counter("prefix_cache_partial_hits", "Of prefix_cache_hits, tokens copied from the first slots of a "
                      "cached block.", m.prefix_cache_partial_hits)
        yield gauge("prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since start.", m.hit_rate)
        yield counter("prefix_cache_hit_requests", "Requests with at least one cached token.", m.num_hit_requests)
        yield counter("prompt_tokens_computed", "Prompt tokens run through the model (recomputes included).",
                      m.prompt_tokens_computed)
        yield counter("num_preemptions", "Requests preempted for lack of KV blocks.", m.num_preemptions)
        yield counter("kv_block_evictions", "Cached KV blocks evicted (for room, expiry, invalidation or a failed step).",
                      m.num_evictions)
        by_reason = CounterMetricFamily(
            PREFIX + "kv_block_evictions_by_reason",
            "Cached KV blocks evicted, by the policy's reason (lru, lfu, ttl, cost, invalidated).",
            labels=[*labels, "reason"],
        )
        for reason, count in sorted(m.evictions_by_reason.items()):
            by_reason.add_metric([*values, reason], count)
        yield by_reason
        yield gauge("kv_cached_bytes", "KV bytes held by cached blocks (in use or free).", m.cached_bytes)
        yield gauge("kv_evicted_block_mean_age_seconds", "Mean seconds from caching to eviction of evicted blocks.",
                    m.mean_evicted_age_s)
        yield counter("parallel_sampling_forks", "Samples forked from n > 1 requests (sharing their blocks).",
                      m.num_forks)
        yield counter("cow_block_copies", "Shared blocks copied on a sample's first write (copy-on-write).",
                      m.num_cow_copies)
        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("kv_blocks_total", "KV pool size in blocks.", m.num_blocks_total)
        yield gauge("kv_blocks_in_use", "KV blocks held by requests (ref_cnt > 0).", m.num_blocks_in_use)
        yield gauge("kv_blocks_cached", "KV blocks holding a prefix hash (in use or free).", m.num_blocks_cached)
        yield gauge("kv_blocks_free", "KV blocks with ref_cnt == 0 (cached or not).", m.num_blocks_free)
        usage = m.num_blocks_in_use / m.num_blocks_total if m.num_blocks_total else 0.0
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use, 0..1.", usage)
        if m.kv_tiers:
            yield from _tier_families(m.kv_tiers, labels, values)
        yield from self._vllm_aliases(stats, usage)

    def _vllm_aliases(self, stats: EngineStats, usage: float):
        """:data:`VLLM_ALIASES` under vLLM's names and labels (``model_name``, ``engine="0"``)."""
        m = stats.metrics
        values = {"num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting,
                  "kv_cache_usage_perc": usage, "prefix_cache_queries": m.prefix_cache_queries,
                  "prefix_cache_hits": m.prefix_cache_hits}
        for name in VLLM_ALIASES:
            kind = CounterMetricFamily if name.startswith("prefix_cache_") else GaugeMetricFamily
            family = kind(VLLM_PREFIX + name, f"{PREFIX}{name}, under vLLM's name.", labels=["model_name", "engine"])
            family.add_metric([self.model_name, "0"], values[name])
            yield family


# (counter name, KVTierStack counter, help) of each tier series, label ``tier`` (disk, redis).
_TIER_COUNTERS = (
    ("kv_tier_queries", "queries", "Prompt tokens looked up in a KV tier (past the pool's hits)."),
    ("kv_tier_hits", "hits", "Prompt tokens loaded from a KV tier (a part of prefix_cache_hits)."),
    ("kv_tier_loaded_bytes", "bytes_loaded", "K/V bytes loaded from a KV tier."),
    ("kv_tier_stored_bytes", "bytes_stored", "K/V bytes stored in a KV tier (write-through)."),
    ("kv_tier_stores", "stores", "Blocks stored in a KV tier."),
    ("kv_tier_store_drops", "store_drops", "Blocks not stored because the writer's queue was full."),
    ("kv_tier_bad_entries", "bad_entries", "Tier entries that failed verification (a miss; removed)."),
    ("kv_tier_errors", "errors", "Tier operations that failed (the tier then rests; requests go on)."),
    ("kv_tier_slow_skips", "slow_skips", "Lookups that skipped a KV tier measured slower than recomputing."),
)


def _tier_families(tiers: dict[str, dict], labels: list[str], values: list[str]):
    """The KV tiers' counters, block latency histograms and usage, one series per tier."""
    from prefixcache.cache.tiers.stack import LATENCY_BOUNDS_S

    for name, key, doc in _TIER_COUNTERS:
        family = CounterMetricFamily(PREFIX + name, doc, labels=[*labels, "tier"])
        for tier, stats in sorted(tiers.items()):
            family.add_metric([*values, tier], stats[key])
        yield family
    for kind in ("load", "store"):
        family = HistogramMetricFamily(PREFIX + f"kv_tier_{kind}_latency_seconds",
                                       f"Seconds to {kind} and verify one block in a KV tier.", labels=[*labels, "tier"])
        for tier, stats in sorted(tiers.items()):
            counts = stats[f"{kind}_latency"]
            cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
            buckets = [(str(b), c) for b, c in zip(LATENCY_BOUNDS_S, cumulative)] + [("+Inf", cumulative[-1])]
            family.add_metric([*values, tier], buckets, sum_value=stats[f"{kind}_seconds"])
        yield family
    for name, key, doc in (("kv_tier_entries", "entries", "Entries a KV tier holds (where it knows)."),
                           ("kv_tier_bytes", "bytes", "Bytes a KV tier holds (where it knows).")):
        family = GaugeMetricFamily(PREFIX + name, doc, labels=[*labels, "tier"])
        for tier, stats in sorted(tiers.items()):
            if key in stats:
                family.add_metric([*values, tier], stats[key])
        yield family


class ServerMetrics:
    """The metrics of one server app.

    Args:
        model_name: the served model name, the ``model_name`` label of every series.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        labels = ["model_name"]
        self._model_name = model_name
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", labels, registry=self.registry
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens of finished requests.", labels, registry=self.registry
        )
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason (stop, length, abort).",
            labels + ["finished_reason"], registry=self.registry,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Seconds from arrival to the first generated token.",
            labels, buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Seconds from arrival to finish.",
            labels, buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )

    def observe_finished(self, out: RequestOutput, request_done: bool = True) -> None:
        """Records one finished (or aborted) sample: its generated tokens; and, for the last
        sample of a request (``request_done``), the request: prompt tokens, finish reason, TTFT
        and end-to-end latency (of its last sample)."""
        name = self._model_name
        self.generation_tokens.labels(name).inc(len(out.token_ids))
        if not request_done:
            return
        self.prompt_tokens.labels(name).inc(out.num_prompt_tokens)
        self.request_success.labels(name, out.finish_reason or "abort").inc()
        if out.ttft_s is not None:
            self.ttft.labels(name).observe(out.ttft_s)
        if out.e2e_s is not None:
            self.e2e.labels(name).observe(out.e2e_s)

    def render(self, stats: EngineStats) -> bytes:
        """The Prometheus text exposition, engine metrics taken from ``stats``."""
        self._engine.stats = stats
        return generate_latest(self.registry)
