"""``prefixcache bench --workload restart``: what the KV tiers buy after a restart and on a replica.

Each phase runs in its own Python process (a real restart: nothing survives in
memory), on the speed workload's prompts (a ~2,032-token shared system prompt + one customer message
each, :func:`~prefixcache.bench.workloads.build_speed_prompts`), greedy, all phases with the same hash
seed, threads, dtype and block size:

=========== ================================================================================
``first``   process A, disk tier + Redis tier, both empty: prompt 0 is the **cold** request (nothing
            reused; its blocks are written through to both tiers), then prompts 1..``num_warm`` one
            at a time are **warm** (the prefix in A's pool), then prompt X (one more customer
            message) under a private ``cache_salt``: computed from nothing, the reference tokens;
            the writer is flushed before A exits.
``restart`` process B, the same disk directory, no Redis: prompt X is its first request
            (**restart TTFT**: the shared prefix comes from disk, X's own tail is computed), then
            prompts 1.. warm in B's pool. Before B starts, the tier files are dropped from the OS
            page cache (``posix_fadvise(DONTNEED)``), so B reads the disk, not memory A left.
``replica`` process C, Redis only: prompt X is its first request (**cross-replica TTFT**: the
            shared prefix comes from the Redis that A filled).
=========== ================================================================================

TTFT is the engine's (arrival to first token, model loading not included). X's greedy tokens must be
the same in A (cold), B and C (``tokens_match``): a tier hit is exact. From the tier counters:
seconds per block loaded (``load_s_per_block``) vs the cold request's prefill seconds per block
(``recompute_s_per_block``). Redis: ``--kv-redis-url`` when given, else a ``redis-server`` started
on loopback for the run (the replica phase is skipped, with the reason, when there is neither).
Targets: restart TTFT <= 2x warm and <= 0.15x cold (a restart should cost little more than a warm hit).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from prefixcache.bench.goals import goal
from prefixcache.bench.loopback_redis import LoopbackRedis
from prefixcache.bench.report import pyplot, write_result_files

PHASES = ("first", "restart", "replica")
HASH_SEED = 20261130  # the run's shared hash seed (a deployment secret in production)


@dataclass(frozen=True)
class RestartOptions:
    """Sizes and engine options of the restart workload (defaults: the speed workload's prompt sizes)."""

    model: str
    num_threads: int
    prefix_tokens: int = 2032  # shared system prompt, tokens
    num_warm: int = 5  # warm requests per process (prompts 1..num_warm in A, then in B)
    max_tokens: int = 8  # greedy tokens per request (prompt X's are compared across processes)
    block_size: int = 16
    engine_options: dict = field(default_factory=dict)  # dtype, quantization
    kv_redis_url: str | None = None  # None: start a redis-server for the run
    drop_page_cache: bool = True

    def validate(self) -> None:
        """Raises ValueError naming the first bad size."""
        for name, low in (("num_threads", 1), ("prefix_tokens", 1), ("num_warm", 2), ("max_tokens", 1),
                          ("block_size", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"restart {name} must be an integer >= {low}, got {v!r}")


# ---------------------------------------------------------------------------------------- a phase


def run_phase(spec: dict) -> dict:
    """One process's part (``spec``: phase, model, engine options, tiers, prompts); returns its numbers.

    Runs in the child process started by :func:`_spawn` (``python -m prefixcache.bench.restart``).
    """
    from prefixcache.llm import LLM
    from prefixcache.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(spec["model"], **spec["engine"])
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    requests = []
    for prompt, salt in zip(spec["prompts"], spec.get("salts") or [None] * len(spec["prompts"])):
        (o,) = llm.generate([prompt], params, use_tqdm=False, cache_salt=salt)
        requests.append({"ttft_s": o.ttft_s, "num_prompt_tokens": o.num_prompt_tokens,
                         "num_cached_tokens": o.num_cached_tokens, "token_ids": list(o.token_ids)})
    tiers = llm.engine.kv_tiers
    if tiers is not None:
        tiers.flush()
    stats = llm.engine.get_metrics().kv_tiers
    llm.engine.close()
    return {"phase": spec["phase"], "model_load_s": load_s, "requests": requests, "kv_tiers": stats}


def _spawn(spec: dict, timeout_s: float = 900) -> dict:
    """Runs :func:`run_phase` in a new Python process; raises RuntimeError with its stderr on failure."""
    done = subprocess.run([sys.executable, "-m", "prefixcache.bench.restart"], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"restart phase {spec['phase']!r} failed (exit {done.returncode}): "
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def drop_page_cache(directory: Path) -> int:
    """Asks the OS to drop ``directory``'s files from its page cache; returns the files advised."""
    n = 0
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


# ---------------------------------------------------------------------------------------- run


def run_restart(opts: RestartOptions, tokenizer, log=print) -> dict:
    """Runs the three phases of the module docstring; returns the report's ``restart`` section.

    Args:
        opts: sizes, model and engine options.
        tokenizer: the model's tokenizer (builds the prompts).
        log: one line per phase.

    Raises:
        ValueError: a bad size. RuntimeError: a phase's process failed.
    """
    from prefixcache.bench.workloads import build_speed_prompts

    opts.validate()
    prompts = build_speed_prompts(tokenizer, opts.num_warm + 2, opts.prefix_tokens)
    shared, x = prompts.shared[:-1], prompts.shared[-1]
    work = Path(tempfile.mkdtemp(prefix="prefixcache-restart-"))
    redis_server, skip_replica = None, None
    try:
        redis_url = opts.kv_redis_url
        if redis_url is None:
            binary = shutil.which("redis-server")
            if binary is None:
                skip_replica = "no --kv-redis-url and no redis-server on PATH"
            else:
                redis_server = LoopbackRedis(work, binary)
                redis_url = redis_server.url
        base = {"model": opts.model, "max_tokens": opts.max_tokens}
        engine = dict(opts.engine_options, num_threads=opts.num_threads, block_size=opts.block_size,
                      hash_seed=HASH_SEED)
        disk = str(work / "disk")
        log(f"[restart] process A: cold + {opts.num_warm} warm requests, writing through to the tiers")
        first = _spawn(dict(base, phase="first", prompts=[*shared, x], salts=[None] * len(shared) + ["reference"],
                            engine=dict(engine, kv_disk_dir=disk, kv_redis_url=redis_url)))
        dropped = drop_page_cache(Path(disk)) if opts.drop_page_cache else 0
        log(f"[restart] process B: restart over the disk tier ({dropped} files dropped from the page cache)")
        restart = _spawn(dict(base, phase="restart", prompts=[x, *shared[1:]],
                              engine=dict(engine, kv_disk_dir=disk)))
        replica = None
        if skip_replica is None:
            log("[restart] process C: a replica over the Redis tier")
            replica = _spawn(dict(base, phase="replica", prompts=[x],
                                  engine=dict(engine, kv_redis_url=redis_url)))
    finally:
        if redis_server is not None:
            redis_server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return restart_report(opts, prompts.prefix_tokens, first, restart, replica, skip_replica, dropped)


def _per_block_load_s(phase: dict | None, tier: str, block_size: int) -> float | None:
    """Seconds per block the phase's ``tier`` spent loading (sum of load latencies / blocks hit)."""
    stats = (phase or {}).get("kv_tiers", {}).get(tier)
    if not stats or not stats["hits"]:
        return None
    return stats["load_seconds"] / (stats["hits"] / block_size)


def restart_report(opts: RestartOptions, prefix_tokens: int, first: dict, restart: dict, replica: dict | None,
                   skip_replica: str | None, dropped_files: int) -> dict:
    """The ``restart`` section from the phases' numbers (see the module docstring)."""
    cold, reference = first["requests"][0], first["requests"][-1]
    warm = [r["ttft_s"] for r in first["requests"][1:-1]]
    restart_first, restart_warm = restart["requests"][0], [r["ttft_s"] for r in restart["requests"][1:]]
    want = reference["token_ids"]
    cold_blocks = cold["num_prompt_tokens"] / opts.block_size
    section = {
        "options": asdict(opts),
        "prefix_tokens": prefix_tokens,
        "cold_prompt_tokens": cold["num_prompt_tokens"],
        "cold_ttft_s": cold["ttft_s"],
        "cold_cached_tokens": cold["num_cached_tokens"],
        "warm_cached_tokens": first["requests"][1]["num_cached_tokens"],
        "reference_cached_tokens": reference["num_cached_tokens"],  # 0: X computed from nothing in A
        "warm_ttft_s": statistics.median(warm),
        "restart_ttft_s": restart_first["ttft_s"],
        "restart_cached_tokens": restart_first["num_cached_tokens"],
        "restart_warm_ttft_s": statistics.median(restart_warm),
        "restart_warm_cached_tokens": restart["requests"][1]["num_cached_tokens"],
        "replica_ttft_s": replica["requests"][0]["ttft_s"] if replica else None,
        "replica_cached_tokens": replica["requests"][0]["num_cached_tokens"] if replica else None,
        "replica_skipped": skip_replica,
        "tokens_match": restart_first["token_ids"] == want and (replica is None
                                                                or replica["requests"][0]["token_ids"] == want),
        "recompute_s_per_block": cold["ttft_s"] / cold_blocks,
        "disk_load_s_per_block": _per_block_load_s(restart, "disk", opts.block_size),
        "redis_load_s_per_block": _per_block_load_s(replica, "redis", opts.block_size),
        "page_cache_dropped_files": dropped_files,
        "model_load_s": {p["phase"]: p["model_load_s"] for p in (first, restart, replica) if p},
        "phases": [p for p in (first, restart, replica) if p],
    }
    section["goals"] = restart_goals(section)
    return section


def restart_goals(s: dict) -> list[dict]:
    """The targets: restart TTFT <= 2x warm and <= 0.15x cold; replica likewise; exact tokens."""
    def ratio(a, b):
        return a / b if a is not None and b else None

    goals = [goal("prompt X's tokens equal in every process", s["tokens_match"], "true", s["tokens_match"])]
    for name in ("restart", "replica"):
        t = s[f"{name}_ttft_s"]
        for base, target in (("warm", 2.0), ("cold", 0.15)):
            r = ratio(t, s[f"{base}_ttft_s"])
            goals.append(goal(f"{name} TTFT / {base} TTFT", r, f"<= {target:g}", None if r is None else r <= target))
    return goals


def restart_markdown(s: dict) -> str:
    """The section as a Markdown table (TTFT in seconds, ratios to cold)."""
    rows = [("cold (nothing reused)", s["cold_ttft_s"], s["cold_cached_tokens"]),
            ("warm (prefix in the pool, same process; median)", s["warm_ttft_s"], s["warm_cached_tokens"]),
            ("restart: first request, prefix from the disk tier", s["restart_ttft_s"], s["restart_cached_tokens"]),
            ("after restart: A's warm prompts again (prefix from the pool, the rest from disk; median)",
             s["restart_warm_ttft_s"], s["restart_warm_cached_tokens"]),
            ("replica: first request, prefix from Redis", s["replica_ttft_s"], s["replica_cached_tokens"])]
    lines = [f"### Restart and replica TTFT ({s['cold_prompt_tokens']:,}-token prompt, "
             f"{s['prefix_tokens']:,}-token shared prefix)", "",
             "| request | TTFT s | / cold | cached tokens |", "|---|---|---|---|"]
    for label, t, cached in rows:
        cell = "skipped: " + s["replica_skipped"] if t is None else f"{t:.3f}"
        rel = "" if t is None else f"{t / s['cold_ttft_s']:.3f}"
        lines.append(f"| {label} | {cell} | {rel} | {'' if cached is None else cached} |")
    per = [f"recompute {s['recompute_s_per_block'] * 1e3:.2f} ms/block (cold prefill)"]
    for tier in ("disk", "redis"):
        v = s[f"{tier}_load_s_per_block"]
        if v is not None:
            per.append(f"{tier} load {v * 1e3:.2f} ms/block")
    lines += ["", "Per block: " + ", ".join(per) + f". Tokens equal across processes: {s['tokens_match']}."]
    return "\n".join(lines)


def write_restart_outputs(section: dict, out_dir: str | Path, plots: bool = True) -> list[Path]:
    """Writes restart.json, restart.md and (with ``plots``) restart.png under ``out_dir``."""
    return write_result_files(out_dir, "restart", section, restart_markdown(section) + "\n",
                              partial(_restart_plot, section) if plots else None)


def _restart_plot(section: dict, out: Path) -> list[Path]:
    """``restart.png``: TTFT of the cold, warm, restart and replica requests (replica 0 when skipped)."""
    plt = pyplot()
    labels = ["cold", "warm", "restart\n(disk)", "replica\n(Redis)"]
    values = [section["cold_ttft_s"], section["warm_ttft_s"], section["restart_ttft_s"],
              section["replica_ttft_s"] or 0.0]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, values, color=["#999999", "#4c72b0", "#55a868", "#c44e52"])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.3f} s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"First-token latency, {section['prefix_tokens']:,}-token shared prefix")
    fig.tight_layout()
    path = out / "restart.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def _main() -> None:
    spec = json.loads(sys.stdin.read())
    result = run_phase(spec)
    sys.stdout.write("\n" + json.dumps(result) + "\n")


if __name__ == "__main__":
    _main()
