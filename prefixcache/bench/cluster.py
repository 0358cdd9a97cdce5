"""``prefixcache bench --workload cluster``: what routing buys when replicas sit behind a router.

Workload: K system prompts (distinct within their first 16-token block) × M chat requests each (a distinct
question per request), greedy, ``max_tokens`` tokens each, sent through the SGLang model gateway
in prefix-major waves (the 1st request of every system prompt in a seeded random order, then the
2nd of every one, ...) by ``concurrency`` clients. Runs, each on caches reset beforehand (``POST /reset_prefix_cache``):

- ``single``: one replica alone, the baseline: every system prompt is computed once;
- ``cache_aware``, ``round_robin``, ``random``: N replicas behind the gateway with that policy;
- ``round_robin+redis``: N new replicas sharing a Redis KV tier (a ``redis-server`` started on
  loopback for the run, one hash seed), round robin: a replica loads what another one computed
  instead of computing it (skipped, with the reason, without ``redis-server`` or with
  ``shared_tier=False``).

Per run, from the replicas' ``/metrics`` (deltas over the run, summed over replicas): prompt tokens
computed (prefill, recomputes included), hits and queries (hit rate = hits / queries), evictions
(0 means every pool was big enough, so the single replica's smaller pool changed nothing); from the
client: the sum of ``usage.prompt_tokens_details.cached_tokens`` (full-block hits plus tokens
copied by partial-block reuse), TTFT p50/p99 (streamed, to the first content chunk), output tokens/s (all completion tokens
/ wall time), and how many requests each replica served.

The issue's targets: with 2 replicas, cache_aware computes <= 1.1x the single replica's prefill
tokens (round_robin and random compute about 2x on the first pass of each system prompt), and
with the shared Redis tier round_robin computes <= 1.2x cache_aware's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.bench.loopback_redis import LoopbackRedis
from prefixcache.bench.report import pyplot, write_result_files
from prefixcache.bench.restart import HASH_SEED
from prefixcache.bench.texts import SUPPORT_POLICY
from prefixcache.config import DEFAULT_MODEL
from prefixcache.entrypoints.cli.cluster import Cluster, ClusterOptions
from prefixcache.sample_texts import QUESTIONS, SYSTEM_PROMPT

POLICIES = ("cache_aware", "round_robin", "random")
_COUNTERS = {"prefixcache:prompt_tokens_computed_total": "prompt_tokens_computed",
             "prefixcache:prefix_cache_hits_total": "hits", "prefixcache:prefix_cache_queries_total": "queries",
             "prefixcache:kv_block_evictions_total": "evictions", "prefixcache:kv_tier_hits_total": "tier_hits"}
TIER_RUN = "round_robin+redis"


@dataclass(frozen=True)
class ClusterBenchOptions:
    """Sizes of the cluster benchmark (the ``bench`` flags of the same meaning)."""

    model: str = DEFAULT_MODEL
    num_replicas: int = 2
    num_prefixes: int = 8  # K system prompts
    num_requests: int = 4  # M requests per system prompt
    max_tokens: int = 8
    concurrency: int = 4  # clients sending at once
    policy_words: int = 120  # words of the support policy appended to each system prompt
    num_threads: int = 1  # torch threads per replica
    num_blocks: int = 256  # KV blocks per replica (enough that nothing is evicted at the default sizes)
    block_size: int = 16
    seed: int = 0  # the order of the requests within each wave
    shared_tier: bool = True  # also run round robin over replicas sharing a Redis KV tier


def system_prompts(opts: ClusterBenchOptions) -> list[str]:
    """K system prompts that differ in their first few words (no two share a cached block)."""
    policy = " ".join(SUPPORT_POLICY.split()[: opts.policy_words])
    return [f"Deployment {k + 1} of {opts.num_prefixes}. {SYSTEM_PROMPT} {policy}" for k in range(opts.num_prefixes)]


def requests(opts: ClusterBenchOptions) -> list[tuple[int, list[dict[str, str]]]]:
    """(system prompt index, messages) in sending order: prefix-major waves, each wave in its own
    seeded random order (in a fixed order, round robin over an even number of prompts would send
    every request of a prompt to the same replica)."""
    systems = system_prompts(opts)
    rng = random.Random(opts.seed)
    waves = [rng.sample(range(opts.num_prefixes), opts.num_prefixes) for _ in range(opts.num_requests)]
    return [(k, [{"role": "system", "content": systems[k]},
                 {"role": "user", "content": f"(request {m + 1}) {QUESTIONS[(k + m) % len(QUESTIONS)]}"}])
            for m, wave in enumerate(waves) for k in wave]


def replica_counters(url: str) -> dict[str, float]:
    """The replica's :data:`_COUNTERS` and ``requests`` (finished requests, all finish reasons)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    counters = dict.fromkeys(_COUNTERS.values(), 0.0)
    for s in samples:
        if s.name in _COUNTERS:
            counters[_COUNTERS[s.name]] += s.value
    counters["requests"] = sum(s.value for s in samples if s.name == "prefixcache:request_success_total")
    return counters


def _stream_chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    """One streamed chat request: TTFT (s, to the first content chunk) and the usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, usage = None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"bench request failed: HTTP {response.status_code} {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    return {"ttft_s": ttft, "usage": usage}


def run_policy(url: str, replica_urls: list[str], opts: ClusterBenchOptions, served_model_name: str) -> dict:
    """Sends the workload to ``url``; returns the run's measurements (see the module docstring)."""
    for replica in replica_urls:
        httpx.post(replica + "/reset_prefix_cache", timeout=30).raise_for_status()
    before = [replica_counters(u) for u in replica_urls]
    work = requests(opts)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(opts.concurrency) as pool:
        results = list(pool.map(lambda r: _stream_chat(url, served_model_name, r[1], opts.max_tokens), work))
    wall_s = time.perf_counter() - start
    after = [replica_counters(u) for u in replica_urls]
    per_replica = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    total = {k: sum(r[k] for r in per_replica) for k in _COUNTERS.values()}
    ttfts = sorted(r["ttft_s"] for r in results)
    completion_tokens = sum(r["usage"]["completion_tokens"] for r in results)
    return {
        "prompt_tokens_computed": total["prompt_tokens_computed"],
        "prefix_cache_hits": total["hits"],
        "prefix_cache_queries": total["queries"],
        "kv_tier_hits": total["tier_hits"],
        "hit_rate": total["hits"] / total["queries"] if total["queries"] else 0.0,
        "cached_tokens_reported": sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results),
        "evictions": total["evictions"],
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "output_tokens_per_s": completion_tokens / wall_s,
        "wall_s": wall_s,
        "num_requests": len(results),
        "prompt_tokens_computed_per_replica": [r["prompt_tokens_computed"] for r in per_replica],
        "requests_per_replica": [r["requests"] for r in per_replica],
    }


def run_cluster_bench(opts: ClusterBenchOptions, log=print) -> dict:
    """The single-replica baseline, then each of :data:`POLICIES` on ``num_replicas`` replicas."""
    serve_args = (opts.model, "--num-blocks", str(opts.num_blocks), "--block-size", str(opts.block_size),
                  "--num-threads", str(opts.num_threads), "--log-level", "warning",
                  "--dtype", "float32", "--quantization", "none")  # the pool check's format (bench/cli.py), on any CPU
    runs: dict[str, dict] = {}
    with Cluster(ClusterOptions(opts.num_replicas, POLICIES[0], serve_args, stop_timeout_s=20)) as cluster:
        urls = [r.url for r in cluster.replicas]
        name = _served_model_name(urls[0])
        log(f"[cluster] single replica ({urls[0]}) ...")
        runs["single"] = run_policy(urls[0], urls[:1], opts, name)
        for policy in POLICIES:
            if policy != cluster.options.policy:
                cluster.switch_policy(policy)
            log(f"[cluster] {policy} over {len(urls)} replicas ...")
            runs[policy] = run_policy(cluster.url, urls, opts, name)
    skipped = _run_shared_tier(opts, serve_args, name, runs, log)
    single = runs["single"]["prompt_tokens_computed"]
    for run in runs.values():
        run["prefill_vs_single"] = run["prompt_tokens_computed"] / single if single else None
    ratio = runs["cache_aware"]["prefill_vs_single"]
    goals = [{"goal": "cache_aware prefill tokens <= 1.1x a single replica's", "value": ratio,
              "target": "<= 1.1", "met": ratio is not None and ratio <= 1.1},
             {"goal": "cache_aware TTFT p50 < round_robin's", "value": runs["cache_aware"]["ttft_p50_s"],
              "target": f"< {runs['round_robin']['ttft_p50_s']:.4f}",
              "met": runs["cache_aware"]["ttft_p50_s"] < runs["round_robin"]["ttft_p50_s"]}]
    if TIER_RUN in runs:
        tier_ratio = runs[TIER_RUN]["prompt_tokens_computed"] / runs["cache_aware"]["prompt_tokens_computed"]
        goals.append({"goal": "round_robin + Redis tier prefill tokens <= 1.2x cache_aware's", "value": tier_ratio,
                      "target": "<= 1.2", "met": tier_ratio <= 1.2})
    return {"options": dataclasses.asdict(opts), "runs": runs, "goals": goals, "skipped": skipped}


def _run_shared_tier(opts: ClusterBenchOptions, serve_args: tuple, name: str, runs: dict, log) -> dict:
    """Adds :data:`TIER_RUN` to ``runs`` (new replicas over a new Redis); returns {run: why skipped}."""
    binary = shutil.which("redis-server")
    if not opts.shared_tier or binary is None:
        return {TIER_RUN: "shared_tier=False" if not opts.shared_tier else "no redis-server on PATH"}
    with tempfile.TemporaryDirectory(prefix="prefixcache-cluster-") as work:
        redis = LoopbackRedis(Path(work), binary)
        try:
            tier_args = (*serve_args, "--kv-redis-url", redis.url, "--hash-seed", str(HASH_SEED))
            with Cluster(ClusterOptions(opts.num_replicas, "round_robin", tier_args, stop_timeout_s=20)) as cluster:
                urls = [r.url for r in cluster.replicas]
                log(f"[cluster] round_robin over {len(urls)} replicas sharing a Redis KV tier ...")
                runs[TIER_RUN] = run_policy(cluster.url, urls, opts, name)
        finally:
            redis.stop()
    return {}


def _served_model_name(replica_url: str) -> str:
    return httpx.get(replica_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def markdown(result: dict) -> str:
    """The result as a Markdown table."""
    o = result["options"]
    lines = [f"## cluster: {o['num_prefixes']} system prompts x {o['num_requests']} requests, "
             f"{o['num_replicas']} replicas, {o['concurrency']} clients, {o['max_tokens']} tokens each", "",
             "| run | prefill tokens computed | vs single | hit rate | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s "
             "| requests per replica | tokens loaded from the Redis tier |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["runs"].items():
        lines.append(f"| {name} | {r['prompt_tokens_computed']:.0f} | {r['prefill_vs_single']:.2f}x "
                     f"| {r['hit_rate']:.1%} | {1000 * r['ttft_p50_s']:.0f} | {1000 * r['ttft_p99_s']:.0f} "
                     f"| {r['output_tokens_per_s']:.1f} "
                     f"| {' / '.join(f'{n:.0f}' for n in r['requests_per_replica'])} | {r['kv_tier_hits']:.0f} |")
    lines += [f"| {run} | skipped: {why} |" for run, why in result.get("skipped", {}).items()]
    lines += [""] + [f"- {g['goal']}: {g['value']:.3f} (target {g['target']}): {'met' if g['met'] else 'NOT met'}"
                     for g in result["goals"]]
    return "\n".join(lines) + "\n"


def write_cluster_outputs(result: dict, out_dir: str, plots: bool = True) -> list[Path]:
    """cluster.json, cluster.md and (with ``plots``) cluster.png in ``out_dir``."""
    return write_result_files(out_dir, "cluster", result, markdown(result), partial(_plot, result) if plots else None)


def _plot(result: dict, out: Path) -> list[Path]:
    """``cluster.png``: prefill tokens, TTFT p50/p99 and output tokens/s per run."""
    plt = pyplot()
    path = out / "cluster.png"
    names = list(result["runs"])
    runs = [result["runs"][n] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [r["prompt_tokens_computed"] for r in runs], color="tab:blue")
    axes[0].set_title("prefill tokens computed")
    for label, key in (("p50", "ttft_p50_s"), ("p99", "ttft_p99_s")):
        axes[1].plot(names, [1000 * r[key] for r in runs], marker="o", label=label)
    axes[1].set_title("TTFT (ms)")
    axes[1].legend()
    axes[2].bar(names, [r["output_tokens_per_s"] for r in runs], color="tab:green")
    axes[2].set_title("output tokens/s")
    for ax in axes:
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
