"""``prefixcache bench --workload queue``: the scheduling policies under a queue and memory pressure.

Many clients send requests faster than the engine serves them: members of shared-prefix
*families* (a long system prompt or document + a short question each, family popularity
Zipf-skewed) mixed with *one-offs* that share nothing. The KV pool is well below the working set
(the families' prefixes plus the running requests), so what the cache holds when a request is
admitted decides what it computes.

:func:`simulate_queue` replays such a trace through the real
:class:`~prefixcache.engine.scheduler.Scheduler` and
:class:`~prefixcache.cache.kv_cache_manager.KVCacheManager` (chunked prefill, preemption, the
policy under test) with no model: each step's duration is a cost model (``step_base_s +
step_per_token_s * tokens scheduled``) on a virtual clock, which is also the scheduler's clock
(for the age bound), and the "sampled" tokens are the trace's replies. Thousands of requests
replay in seconds, the same way every time.

Reported per policy: hit rate (prompt tokens served from the cache at admission / prompt tokens),
prefill tokens computed (every token a step computes that is not a decode, so recomputation after
preemption counts), TTFT p50/p99 and worst wait (arrival to first admission), in virtual seconds,
the most overtakes any request suffered (later arrivals admitted before it), preemptions, cached
blocks evicted to make room (the pressure ``lpm`` reorders under; 0: the pool held everything and
``lpm`` admitted exactly as ``fcfs``), and the wall time the scheduler spent per step (the cost of
ordering).

Invariants: the same :class:`QueueConfig` gives the same trace and, per policy, the same numbers
(the wall-clock scheduling time aside).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prefixcache.bench.report import pyplot, write_result_files
from prefixcache.cache.config import CacheConfig, check_int, check_positive_float
from prefixcache.cache.hashing import BlockHasher, make_root_key
from prefixcache.config import SCHEDULING_POLICIES, SchedulerConfig

if TYPE_CHECKING:  # imported by simulate_queue: QueueConfig's defaults serve `bench --help` without torch
    from prefixcache.cache.kv_cache_manager import KVCacheManager
    from prefixcache.engine.scheduler import Scheduler
from prefixcache.request import Request, RequestStatus
from prefixcache.sampling_params import SamplingParams

VOCAB = 32_000


@dataclass(frozen=True)
class QueueConfig:
    """Shape of the queue workload. Lengths in tokens, times in virtual seconds."""

    num_requests: int = 1200
    seed: int = 0
    num_families: int = 32
    family_prefix_len: int = 768  # the shared system prompt / document of a family
    family_skew: float = 0.8  # Zipf exponent of family popularity
    oneoff_fraction: float = 0.3  # share of requests that share nothing
    suffix_len: tuple[int, int] = (16, 96)  # a family member's own question
    oneoff_len: tuple[int, int] = (300, 1000)
    output_len: tuple[int, int] = (8, 48)
    rate_rps: float = 20.0  # Poisson arrivals: faster than FCFS serves them (about 13/s)
    # The engine: a pool well below the working set (32 families x 48 blocks + the running requests).
    block_size: int = 16
    num_blocks: int = 640
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    # Step cost model: a fixed part (weights read, launch) + a part per token scheduled.
    step_base_s: float = 0.01
    step_per_token_s: float = 1e-4

    def validate(self) -> None:
        """Raises :class:`InvalidInputError` naming the first field out of range (the CLI's flags)."""
        check_int("num_requests", self.num_requests, 1)
        check_positive_float("rate_rps", self.rate_rps)
        check_int("num_blocks", self.num_blocks, 1)


@dataclass(frozen=True, slots=True)
class QueueRequest:
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    family: int  # -1: a one-off


def generate_queue_trace(config: QueueConfig) -> list[QueueRequest]:
    """The trace of ``config`` (deterministic in ``config.seed``), in arrival order."""
    rng = random.Random(config.seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB) for _ in range(n))

    prefixes = [tokens(config.family_prefix_len) for _ in range(config.num_families)]
    weights = [1.0 / (i + 1) ** config.family_skew for i in range(config.num_families)]
    trace, now = [], 0.0
    for _ in range(config.num_requests):
        now += rng.expovariate(config.rate_rps)
        if rng.random() < config.oneoff_fraction:
            family, prompt = -1, tokens(rng.randint(*config.oneoff_len))
        else:
            family = rng.choices(range(config.num_families), weights)[0]
            prompt = prefixes[family] + tokens(rng.randint(*config.suffix_len))
        trace.append(QueueRequest(now, prompt, tokens(rng.randint(*config.output_len)), family))
    return trace


@dataclass(frozen=True)
class QueueResult:
    """One policy's replay of the queue trace (times in virtual seconds unless ``_wall``)."""

    policy: str
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    prefill_tokens_computed: int
    ttft_p50_s: float
    ttft_p99_s: float
    worst_wait_s: float
    max_overtakes: int
    num_preemptions: int
    num_evictions: int  # cached blocks evicted to make room
    makespan_s: float
    num_steps: int
    schedule_wall_us_per_step: float


class _Replay:
    """The per-request bookkeeping of one replay."""

    def __init__(self, trace: Sequence[QueueRequest]) -> None:
        self.trace = trace
        self.admitted_s: dict[str, float] = {}
        self.first_token_s: dict[str, float] = {}
        self.admission_order: list[int] = []
        self.prefill_tokens = 0

    def record_step(self, out, now: float) -> int:
        """Counts the step's prefill tokens and first admissions; returns the tokens scheduled."""
        num_tokens = 0
        for seq in out.seqs:
            n = len(seq.token_ids)
            num_tokens += n
            if n > 1 or seq.num_computed_tokens < seq.num_prompt_tokens:  # not a decode
                self.prefill_tokens += n
            if seq.request_id not in self.admitted_s:
                self.admitted_s[seq.request_id] = now
                self.admission_order.append(int(seq.request_id))
        return num_tokens

    def max_overtakes(self) -> int:
        """The most later arrivals admitted before any one request (a Fenwick count over arrival ids)."""
        n = len(self.trace)
        tree = [0] * (n + 1)
        worst = 0
        for i, seq in enumerate(self.admission_order):  # admitted so far with a larger arrival index
            below, j = 0, seq + 1
            while j > 0:
                below += tree[j]
                j -= j & -j
            j = seq + 1
            while j <= n:
                tree[j] += 1
                j += j & -j
            worst = max(worst, i - below)
        return worst


def simulate_queue(trace: Sequence[QueueRequest], policy: str, config: QueueConfig,
                   scheduler_options: dict | None = None) -> QueueResult:
    """Replays ``trace`` through the scheduler with ``policy`` (see the module docstring).

    Args:
        trace: the requests, in arrival order.
        policy: a name of :data:`prefixcache.config.SCHEDULING_POLICIES`.
        config: the engine shape and the step cost model.
        scheduler_options: more :class:`SchedulerConfig` fields (``scheduling_max_wait_s``, ...).

    Raises:
        ValueError: a request longer than the pool; InvalidInputError: a bad option.
    """
    from prefixcache.cache.kv_cache_manager import KVCacheManager
    from prefixcache.engine.scheduler import Scheduler

    clock = [0.0]
    kv = KVCacheManager(config.num_blocks, CacheConfig(block_size=config.block_size), clock=lambda: clock[0])
    sched_config = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, scheduling_policy=policy,
                                   **(scheduler_options or {}))
    scheduler = Scheduler(kv, sched_config, clock=lambda: clock[0])
    hasher, root = BlockHasher(config.block_size), make_root_key(b"queue-model")
    replay = _Replay(trace)
    num_steps, schedule_wall, next_arrival = 0, 0.0, 0
    while next_arrival < len(trace) or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            clock[0] = max(clock[0], trace[next_arrival].arrival_s)
        while next_arrival < len(trace) and trace[next_arrival].arrival_s <= clock[0]:
            item = trace[next_arrival]
            if len(item.prompt_token_ids) + len(item.output_token_ids) > config.num_blocks * config.block_size:
                raise ValueError(f"request {next_arrival} does not fit the pool")
            scheduler.add_request(Request(str(next_arrival), list(item.prompt_token_ids),
                                          SamplingParams(max_tokens=len(item.output_token_ids)), hasher, root,
                                          arrival_s=item.arrival_s))
            next_arrival += 1
        start = time.perf_counter()
        out = scheduler.schedule()
        schedule_wall += time.perf_counter() - start
        num_tokens = replay.record_step(out, clock[0])
        clock[0] += config.step_base_s + config.step_per_token_s * num_tokens
        num_steps += 1
        sampled = {s.request_id: trace[int(s.request_id)].output_token_ids[len(s.output_token_ids)]
                   for s in out.seqs if s.sampling_params is not None}
        for request in scheduler.update_from_output(out, sampled):
            replay.first_token_s.setdefault(request.request_id, clock[0])
            if request.num_output_tokens >= len(trace[int(request.request_id)].output_token_ids):
                scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
    return _result(policy, trace, kv, scheduler, replay, clock[0], num_steps, schedule_wall)


def _result(policy: str, trace: Sequence[QueueRequest], kv: KVCacheManager, scheduler: Scheduler, replay: _Replay,
            makespan_s: float, num_steps: int, schedule_wall: float) -> QueueResult:
    ttft = sorted(replay.first_token_s[str(i)] - r.arrival_s for i, r in enumerate(trace))
    waits = [replay.admitted_s[str(i)] - r.arrival_s for i, r in enumerate(trace)]
    s = kv.stats
    return QueueResult(
        policy=policy, num_requests=len(trace), prompt_tokens=s.queries, hit_tokens=s.hits,
        hit_rate=s.hits / s.queries, prefill_tokens_computed=replay.prefill_tokens,
        ttft_p50_s=statistics.median(ttft), ttft_p99_s=ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        worst_wait_s=max(waits), max_overtakes=replay.max_overtakes(), num_preemptions=scheduler.num_preemptions,
        num_evictions=kv.block_pool.num_allocation_evictions, makespan_s=makespan_s, num_steps=num_steps, schedule_wall_us_per_step=schedule_wall / num_steps * 1e6,
    )


def run_queue_benchmark(config: QueueConfig | None = None, policies: Sequence[str] = SCHEDULING_POLICIES,
                        scheduler_options: dict | None = None) -> dict:
    """Replays the queue trace under each policy; returns the rows and the policy's goals.

    Goals, against ``fcfs``: under memory pressure (``fcfs`` evicted), prefill tokens
    computed <= 0.85x and TTFT p99 <= 1.2x; without it, the same prefill and a makespan <= 1.01x
    (the order costs < 1% throughput); always, no request overtaken more than
    ``scheduling_max_overtakes`` times or waiting longer than ``scheduling_max_wait_s``.

    Raises:
        InvalidInputError: a config field out of range (from :meth:`QueueConfig.validate`).
    """
    config = config or QueueConfig()
    config.validate()
    trace = generate_queue_trace(config)
    options = scheduler_options or {}
    rows = {p: dataclasses.asdict(simulate_queue(trace, p, config, options)) for p in policies}
    bounds = SchedulerConfig(**options)
    base = rows.get("fcfs")
    goals = [g for p, r in rows.items() if p != "fcfs" and base is not None for g in _goals(p, r, base, bounds)]
    return {"config": dataclasses.asdict(config), "scheduler_options": options, "policies": rows, "goals": goals}


def _goals(policy: str, row: dict, base: dict, bounds: SchedulerConfig) -> list[dict]:
    """One policy's goals against ``fcfs``'s row ``base`` (see :func:`run_queue_benchmark`)."""
    def goal(name: str, target: str, value: float, met: bool) -> dict:
        return {"policy": policy, "goal": name, "target": target, "value": value, "met": met}

    prefill = row["prefill_tokens_computed"] / base["prefill_tokens_computed"]
    if base["num_evictions"]:
        p99 = row["ttft_p99_s"] / base["ttft_p99_s"]
        goals = [goal("prefill tokens computed / fcfs", "<= 0.85", prefill, prefill <= 0.85),
                 goal("TTFT p99 / fcfs", "<= 1.2", p99, p99 <= 1.2)]
    else:
        makespan = row["makespan_s"] / base["makespan_s"]
        goals = [goal("prefill tokens computed / fcfs (no pressure)", "== 1", prefill, prefill == 1),
                 goal("makespan / fcfs (no pressure)", "<= 1.01", makespan, makespan <= 1.01)]
    return goals + [
        goal("max overtakes", f"<= {bounds.scheduling_max_overtakes}", row["max_overtakes"],
             row["max_overtakes"] <= bounds.scheduling_max_overtakes),
        goal("worst wait (virtual s)", f"<= {bounds.scheduling_max_wait_s:g}", row["worst_wait_s"],
             row["worst_wait_s"] <= bounds.scheduling_max_wait_s),
    ]


def queue_markdown(result: dict) -> str:
    """The per-policy table and the goals, as Markdown."""
    c = result["config"]
    lines = ["## Queue workload (scheduler replay, virtual time)", "",
             f"{c['num_requests']} requests arriving at {c['rate_rps']:g}/s (Poisson, seed {c['seed']}), a pool of "
             f"{c['num_blocks']} blocks of {c['block_size']} tokens; counts exact, TTFT and waits in virtual "
             "seconds.", "",
             "| policy | hit rate | prefill computed | TTFT p50 (s) | TTFT p99 (s) | worst wait (s) | max overtakes "
             "| preemptions | evictions | makespan (s) | schedule µs/step |", "|" + "---|" * 11]
    for p, r in result["policies"].items():
        lines.append(f"| {p} | {r['hit_rate']:.3f} | {r['prefill_tokens_computed']} | {r['ttft_p50_s']:.2f} | "
                     f"{r['ttft_p99_s']:.2f} | {r['worst_wait_s']:.2f} | {r['max_overtakes']} | "
                     f"{r['num_preemptions']} | {r['num_evictions']} | {r['makespan_s']:.1f} | "
                     f"{r['schedule_wall_us_per_step']:.0f} |")
    lines += ["", "| policy | goal | target | measured | met |", "|---|---|---|---|---|"]
    for g in result["goals"]:
        lines.append(f"| {g['policy']} | {g['goal']} | {g['target']} | {g['value']:.3f} | "
                     f"{'yes' if g['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def write_queue_outputs(result: dict, out_dir: str, plots: bool = True) -> list[Path]:
    """Writes ``queue.json``, ``queue.md`` and (with ``plots``) ``queue.png`` into ``out_dir``
    (through :func:`prefixcache.bench.report.write_result_files`).

    Raises:
        ValueError: ``plots`` without matplotlib installed.
    """
    def plot(out: Path) -> list[Path]:
        write_queue_plot(result, out / "queue.png")
        return [out / "queue.png"]

    return write_result_files(out_dir, "queue", result, queue_markdown(result), plot if plots else None)


def write_queue_plot(result: dict, path) -> None:
    """Bars per policy: prefill tokens computed (relative to fcfs), TTFT p50/p99, worst wait."""
    plt = pyplot()
    rows = result["policies"]
    names = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(names, [rows[p]["prefill_tokens_computed"] / 1e3 for p in names], color="tab:blue")
    axes[0].set_title("prefill tokens computed (k)")
    width = 0.38
    xs = range(len(names))
    axes[1].bar([x - width / 2 for x in xs], [rows[p]["ttft_p50_s"] for p in names], width, label="p50")
    axes[1].bar([x + width / 2 for x in xs], [rows[p]["ttft_p99_s"] for p in names], width, label="p99")
    axes[1].set_xticks(list(xs), names)
    axes[1].set_title("TTFT (virtual s)")
    axes[1].legend()
    axes[2].bar(names, [rows[p]["worst_wait_s"] for p in names], color="tab:red")
    axes[2].set_title("worst wait to admission (virtual s)")
    fig.suptitle(f"queue workload: {result['config']['num_requests']} requests at "
                 f"{result['config']['rate_rps']:g}/s, {result['config']['num_blocks']}-block pool")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
