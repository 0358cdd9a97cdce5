"""Trace-driven prefix-cache benchmark: a synthetic multi-tenant trace and a model-free replay.

The trace mixes the traffic a shared serving cache sees (token ids are synthetic but fixed by the
seed):

- ``chat``: a system prompt (Zipf-popular, lengths from short to long) + a fresh question;
- ``rag``: a system prompt + a retrieved document (Zipf-popular) + a question;
- ``session``: multi-turn chats; each turn's prompt is the previous prompt + reply + a new message;
- ``oneoff``: a long prompt that shares nothing.

Each tenant has its own system prompts and documents and its own ``cache_salt``, so tenants never
share blocks. ``skew = 0`` makes every popularity uniform (the "uniform" trace).

:func:`simulate` replays a trace through :class:`~prefixcache.cache.kv_cache_manager.KVCacheManager`
alone (no model) on a virtual clock: each request is admitted at its arrival time (cache lookup,
partial hit, allocation of prompt + output), holds its blocks for ``service_s`` and is then freed
tail first. When the pool is full of running requests, the earliest-finishing ones finish first
(the request would have waited for them). Thousands of requests replay in seconds.

``belady`` is an offline reference, not a policy one could run: it knows the trace and evicts the
childless free block whose next use is furthest away (a greedy Belady's MIN restricted to leaves
like every policy here; its priority is fixed when a block is freed, so it is a strong reference,
not a proven bound), so ``cost``'s gain can be read against the gain still available.

Invariants: the same ``TraceConfig`` always gives the same trace; replay is deterministic given
the trace and policy (the wall clock only enters ``requests_per_s``).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.cache.config import DEFAULT_BLOCK_SIZE, CacheConfig
from prefixcache.cache.eviction import EVICTION_POLICIES, LeafHeapPolicy
from prefixcache.cache.hashing import BlockHasher, make_root_key
from prefixcache.cache.kv_cache_manager import KVCacheManager
from prefixcache.request import Request
from prefixcache.sampling_params import SamplingParams

VOCAB = 32_000  # synthetic token ids are drawn from [0, VOCAB)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    arrival_s: float  # seconds since the trace start
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # the reply (replayed, never sampled)
    tenant: str  # also the request's cache_salt
    kind: str  # chat | rag | session | oneoff


@dataclass(frozen=True)
class TraceConfig:
    """Shape of a synthetic trace. Lengths are in tokens, rates in requests per second."""

    num_requests: int = 3000
    seed: int = 0
    skew: float = 1.1  # Zipf exponent of system-prompt and document popularity; 0 = uniform
    num_tenants: int = 4
    system_prompts_per_tenant: int = 16
    system_prompt_lens: tuple[int, ...] = (40, 137, 300, 700, 1500)  # cycled over prompts
    documents_per_tenant: int = 100
    document_len: tuple[int, int] = (300, 900)  # uniform range
    question_len: tuple[int, int] = (10, 60)
    output_len: tuple[int, int] = (16, 120)
    oneoff_len: tuple[int, int] = (200, 1500)
    session_turns: tuple[int, int] = (2, 6)
    mix: tuple[tuple[str, float], ...] = (("chat", 0.45), ("rag", 0.2), ("session", 0.2), ("oneoff", 0.15))
    rate_rps: float = 20.0  # Poisson arrivals


def _zipf_weights(n: int, skew: float) -> list[float]:
    return [1.0 / (i + 1) ** skew for i in range(n)]


def generate_trace(config: TraceConfig) -> list[TraceRequest]:
    """Builds the trace described by ``config`` (deterministic in ``config.seed``)."""
    rng = random.Random(config.seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB) for _ in range(n))

    def length(bounds: tuple[int, int]) -> int:
        return rng.randint(*bounds)

    tenants = [f"tenant{t}" for t in range(config.num_tenants)]
    systems = {
        t: [tokens(config.system_prompt_lens[i % len(config.system_prompt_lens)])
            for i in range(config.system_prompts_per_tenant)]
        for t in tenants
    }
    docs = {t: [tokens(length(config.document_len)) for _ in range(config.documents_per_tenant)] for t in tenants}
    # Popularity: a random permutation per tenant so long and short prompts are both popular.
    sys_w = _zipf_weights(config.system_prompts_per_tenant, config.skew)
    doc_w = _zipf_weights(config.documents_per_tenant, config.skew)
    sys_rank = {t: rng.sample(range(config.system_prompts_per_tenant), config.system_prompts_per_tenant) for t in tenants}
    tenant_w = _zipf_weights(config.num_tenants, config.skew / 2)
    kinds, kind_w = zip(*config.mix)
    sessions: list[tuple[str, tuple[int, ...], int]] = []  # open sessions: (tenant, history, turns left)

    trace, now = [], 0.0
    while len(trace) < config.num_requests:
        now += rng.expovariate(config.rate_rps)
        kind = rng.choices(kinds, kind_w)[0]
        tenant = rng.choices(tenants, tenant_w)[0]
        system = systems[tenant][sys_rank[tenant][rng.choices(range(len(sys_w)), sys_w)[0]]]
        question = tokens(length(config.question_len))
        if kind == "chat":
            prompt = system + question
        elif kind == "rag":
            prompt = system + rng.choices(docs[tenant], doc_w)[0] + question
        elif kind == "oneoff":
            prompt = tokens(length(config.oneoff_len))
        elif sessions and rng.random() < 0.7:  # next turn of an open session
            i = rng.randrange(len(sessions))
            tenant, history, left = sessions[i]
            prompt = history + question
            if left <= 1:
                sessions[i] = sessions[-1]
                sessions.pop()
        else:  # a new session
            prompt, left, i = system + question, length(config.session_turns), -1
        output = tokens(length(config.output_len))
        if kind == "session":
            entry = (tenant, prompt + output, left - 1)
            if i == -1:
                sessions.append(entry)
            elif i < len(sessions) and sessions[i][0] == tenant and left > 1:
                sessions[i] = entry
        trace.append(TraceRequest(now, prompt, output, tenant, kind))
    return trace


class _Future:
    """Which requests of a trace look up each block hash (the Belady reference's oracle)."""

    def __init__(self, uses: dict[bytes, list[int]]) -> None:
        self.uses = uses
        self.now = 0  # index of the request being admitted

    def next_use(self, block_hash: bytes | None) -> int:
        uses = self.uses.get(block_hash, ())
        i = bisect.bisect_right(uses, self.now)
        return uses[i] if i < len(uses) else 1 << 62


def _belady_policy(future: _Future) -> type[LeafHeapPolicy]:
    class BeladyPolicy(LeafHeapPolicy):
        """Furthest next use first, among childless free cached blocks (uncached ones before)."""

        name = "belady"

        def priority(self, block) -> tuple:
            return (-future.next_use(block.block_hash),)  # fixed while free: a use would touch it

    return BeladyPolicy


@dataclass(frozen=True)
class SimResult:
    """Replay result of one policy on one trace."""

    policy: str
    num_requests: int
    prompt_tokens: int  # prompt tokens looked up
    prefill_tokens_saved: int  # prefix-cache hits: full-block and partial-block
    partial_tokens_saved: int  # of those, copied from partial hits
    hit_rate: float  # prefill_tokens_saved / prompt_tokens
    num_evictions: int
    evictions_by_reason: dict[str, int]
    mean_evicted_age_s: float
    requests_per_s: float  # simulation speed (wall clock)


def _future_uses(trace: Sequence[TraceRequest], hasher: BlockHasher, roots: dict, block_size: int) -> _Future:
    """Every block hash a lookup can hit, with the trace positions of the requests that use it."""
    uses: dict[bytes, list[int]] = {}
    for seq, item in enumerate(trace):
        hashes: list = []
        hasher.extend(hashes, item.prompt_token_ids, roots[item.tenant])
        for h in hashes[: (len(item.prompt_token_ids) - 1) // block_size]:
            uses.setdefault(h, []).append(seq)
    return _Future(uses)


def simulate(
    trace: Sequence[TraceRequest],
    policy: str,
    num_blocks: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    service_s: float = 2.0,
    enable_partial_block_reuse: bool = True,
    cache_config: CacheConfig | None = None,
) -> SimResult:
    """Replays ``trace`` through a KV cache manager with eviction ``policy`` (no model).

    Args:
        trace: requests in arrival order.
        policy: a registered eviction policy name, or ``"belady"`` (the offline reference).
        num_blocks: KV pool size in blocks (the memory budget).
        block_size: tokens per block.
        service_s: how long a request holds its blocks after arrival, seconds (virtual).
        enable_partial_block_reuse: count partial-block hits too.
        cache_config: the policies' knobs (``cost_*``, ``cache_ttl_s``); ``block_size``,
            ``eviction_policy`` and ``enable_partial_block_reuse`` are set from the arguments.

    Returns:
        The counters of the replay.

    Raises:
        ValueError: a request needs more blocks than the whole pool, or an unknown policy.
    """
    clock = [0.0]
    hasher = BlockHasher(block_size)
    roots = {t: make_root_key(b"trace-model", t) for t in {r.tenant for r in trace}}
    future = _future_uses(trace, hasher, roots, block_size) if policy == "belady" else None
    config = dataclasses.replace(
        cache_config or CacheConfig(), block_size=block_size, enable_partial_block_reuse=enable_partial_block_reuse,
        eviction_policy=_belady_policy(future) if future else policy,
    )
    kv = KVCacheManager(num_blocks, config, clock=lambda: clock[0])
    running: list[tuple[float, int, Request]] = []  # (finish_s, seq, request)
    start = time.perf_counter()
    for seq, item in enumerate(trace):
        clock[0] = item.arrival_s
        if future is not None:
            future.now = seq
        while running and running[0][0] <= item.arrival_s:
            kv.free(heapq.heappop(running)[2])
        request = Request(
            str(seq), list(item.prompt_token_ids), SamplingParams(max_tokens=len(item.output_token_ids)),
            hasher, roots[item.tenant], arrival_s=item.arrival_s,
        )
        total = request.num_tokens + len(item.output_token_ids)
        if -(-total // block_size) > num_blocks:
            raise ValueError(f"request {seq} needs {total} tokens; the pool holds {num_blocks * block_size}")
        # Prompt and reply allocated at once: the request needs room for both.
        while kv.admit(request, request.num_tokens, num_lookahead_tokens=len(item.output_token_ids)) is None:
            if not running:
                raise ValueError(f"request {seq} does not fit in an empty pool")
            kv.free(heapq.heappop(running)[2])  # wait for the earliest-finishing request
        for token in item.output_token_ids:
            request.append_output_token_ids(token)
        # Re-run caching over the reply's full blocks (the tokens are now known).
        request.num_computed_tokens = request.num_tokens
        kv.allocate_slots(request, 0)
        kv.end_step()
        heapq.heappush(running, (item.arrival_s + service_s, seq, request))
    elapsed = time.perf_counter() - start
    s, evictions = kv.stats, kv.block_pool.eviction_stats
    saved = s.hits  # full-block and partial-block hits alike
    return SimResult(
        policy=policy,
        num_requests=len(trace),
        prompt_tokens=s.queries,
        prefill_tokens_saved=saved,
        partial_tokens_saved=s.partial_hits,
        hit_rate=saved / s.queries if s.queries else 0.0,
        num_evictions=evictions.num_evictions,
        evictions_by_reason=dict(evictions.evictions_by_reason),
        mean_evicted_age_s=evictions.mean_evicted_age_s,
        requests_per_s=len(trace) / elapsed if elapsed > 0 else float("inf"),
    )


TRACE_NUM_BLOCKS = 2048  # the benchmark's KV budget: well below the traces' working set


def run_trace_benchmark(
    policies: Sequence[str] = (*EVICTION_POLICIES, "belady"),
    seeds: Sequence[int] = (0, 1, 2),
    skews: dict[str, float] | None = None,
    num_requests: int = 3000,
    num_blocks: int = TRACE_NUM_BLOCKS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    service_s: float = 2.0,
) -> list[dict]:
    """Replays the skewed and uniform traces for each seed under each policy.

    Args:
        policies: eviction policies to compare (``"belady"``: the offline reference).
        seeds: trace seeds.
        skews: trace name -> Zipf exponent; default ``{"skewed": 1.1, "uniform": 0.0}``.
        num_requests: requests per trace.
        num_blocks: KV budget in blocks (the default is well below the traces' working set).
        block_size: tokens per block.
        service_s: seconds each request holds its blocks.

    Returns:
        One row per (trace, seed, policy): the :class:`SimResult` fields plus ``trace``, ``seed``
        and ``saved_vs_lru`` (prefill tokens saved relative to ``lru`` on the same trace).
    """
    rows = []
    for name, skew in (skews or {"skewed": 1.1, "uniform": 0.0}).items():
        for seed in seeds:
            trace = generate_trace(TraceConfig(num_requests=num_requests, seed=seed, skew=skew))
            results = {p: simulate(trace, p, num_blocks, block_size, service_s) for p in policies}
            base = results.get("lru")
            for p, r in results.items():
                row = {"trace": name, "seed": seed, **dataclasses.asdict(r)}
                if base is not None and base.prefill_tokens_saved:
                    row["saved_vs_lru"] = r.prefill_tokens_saved / base.prefill_tokens_saved - 1.0
                rows.append(row)
    return rows


def trace_markdown(rows: list[dict], num_blocks: int, block_size: int) -> str:
    """The rows of :func:`run_trace_benchmark` as one Markdown table: a row per (trace, seed), ``lru``'s hit rate
    and prefill tokens saved, then each other policy's prefill tokens saved relative to ``lru``'s (exact counts
    of a deterministic replay: the same on every machine)."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    num_requests = rows[0]["num_requests"]
    others = [p for p in policies if p != "lru"]
    by_run: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        by_run.setdefault((r["trace"], r["seed"]), {})[r["policy"]] = r
    lines = [f"The cache manager alone on a simulated trace (`prefixcache/bench/trace.py`: Zipf-popular system "
             "prompts of several lengths, RAG documents, multi-turn sessions and one-off prompts; `uniform`: the "
             f"same with popularity flat, Zipf exponent 0), {num_requests} requests, a pool of {num_blocks} blocks "
             f"of {block_size} tokens; "
             "prefill tokens saved relative to `lru` (`belady`: the offline reference, not a runnable policy).", "",
             "| trace | seed | lru hit rate | lru prefill saved | "
             + " | ".join(f"{p}{' (offline reference)' if p == 'belady' else ''}" for p in others) + " |",
             "|" + "---|" * (4 + len(others))]
    for (trace, seed), run in by_run.items():
        lru = run.get("lru")
        cells = [f"{run[p]['saved_vs_lru']:+.1%}" if "saved_vs_lru" in run.get(p, {}) else "–" for p in others]
        lines.append(f"| {trace} | {seed} | {lru['hit_rate']:.3f} | {lru['prefill_tokens_saved']:,} | "
                     if lru else f"| {trace} | {seed} | – | – | ")
        lines[-1] += " | ".join(cells) + " |"
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # a quick look: python -m prefixcache.bench.trace
    for row in run_trace_benchmark(seeds=(0,), num_requests=1000):
        print(f"{row['trace']:8s} {row['policy']:5s} hit {row['hit_rate']:.3f} "
              f"saved {row['prefill_tokens_saved']:8d} ({row.get('saved_vs_lru', 0):+.1%}) "
              f"evictions {row['num_evictions']:6d} {row['requests_per_s']:.0f} req/s")
