"""``prefixcache bench``: what prefix caching buys on each workload, vs. caching off and transformers.

Per workload, on the same model, threads and prompts (greedy; every request makes exactly
``max_tokens`` tokens, ``ignore_eos``):

1. throughput: all requests of a round arrive together; caching on, then off (fresh cache each
   time): wall time, output tokens/s, prefill tokens computed, hits, peak KV blocks in use (sampled
   after every schedule), and whether the outputs are identical;
2. latency: each request alone, ``max_tokens=1``: TTFT cold (empty cache) and warm (cache holding
   the earlier requests' blocks);
3. transformers: the three variants of :mod:`prefixcache.bench.hf_baselines`;
4. accounting against the ideal of :mod:`prefixcache.bench.accounting`, and the "worth enabling"
   estimate of :mod:`prefixcache.bench.worth`.

Plus the chain-hash + verify + lookup micro-benchmark. Results: ``bench.json``, ``bench.md`` and
PNGs in ``--out``.

``--workload speed`` (not part of ``all``: it takes a few minutes, and ``--speed-long`` more) is the
side-by-side speed table of :mod:`prefixcache.bench.speed`: prefixcache vs transformers vs llama.cpp.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import random
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from prefixcache.bench.accounting import IdealAccounting, ideal_accounting
from prefixcache.bench.goals import goal as _goal
from prefixcache.bench.options import SPEED, BenchOptions, check_positive
from prefixcache.bench.speed import run_speed
from prefixcache.bench.workloads import WORKLOAD_NAMES, Workload, build_workload
from prefixcache.bench.worth import MIN_CONFIRMING_REPEATS, WorthInputs, estimate_worth
from prefixcache.cache.breakers import explain_zeros
from prefixcache.cache.config import DEFAULT_BLOCK_SIZE, CacheConfig
from prefixcache.config import EngineConfig
from prefixcache.cache.hashing import BlockHasher, make_root_key
from prefixcache.cache.kv_cache_manager import KVCacheManager
from prefixcache.request import Request
from prefixcache.llm import LLM
from prefixcache.models.loader import LoadedModel, load_model
from prefixcache.outputs import RequestOutput
from prefixcache.sampling_params import SamplingParams

SHARING_GOAL_WORKLOADS = ("system-prompt", "few-shot")
SPEED_ON_OFF_PAIRS = 9  # pairs of no-sharing runs (caching on, then off) behind the speed table's on / off row


@dataclass
class EngineRun:
    """One pass of a workload through our engine."""

    rounds: list[list[list[int]]] = field(default_factory=list)
    outputs: list[list[RequestOutput]] = field(default_factory=list)
    wall_s: float = 0.0
    peak_blocks_in_use: int = 0
    prompt_tokens_computed: int = 0
    num_evictions: int = 0
    num_preemptions: int = 0

    @property
    def flat(self) -> list[RequestOutput]:
        return [o for r in self.outputs for o in r]


# ---------------------------------------------------------------------------------------- engine


def _num_blocks_for(rounds: list[list[list[int]]] | None, opts: BenchOptions, default_blocks: int) -> int:
    """A pool that holds every request of every known round unshared, so nothing is evicted.

    Rounds built later (multi-turn) get the default pool (1 GiB), ample for the default sizes; the
    report's ``num_evictions`` says if it was not.
    """
    if not rounds:
        return default_blocks
    need = sum(-(-(len(p) + opts.max_tokens) // opts.block_size) for r in rounds for p in r)
    return max(default_blocks, need + 8)


def run_rounds(llm: LLM, workload: Workload, params: SamplingParams,
               rounds: list[list[list[int]]] | None = None) -> EngineRun:
    """Runs a workload round by round through ``llm``'s engine, sampling blocks in use.

    Args:
        llm: the engine to use (its cache is not reset here).
        workload: the workload; its ``build_round`` is used when ``rounds`` is None.
        params: sampling parameters of every request.
        rounds: replay these prompts instead of building them.

    Returns:
        The run; ``prompt_tokens_computed`` etc. are this run's deltas.
    """
    engine = llm.engine
    kv = engine.kv_cache_manager
    run = EngineRun()
    m0 = engine.get_metrics()
    original_schedule = engine.scheduler.schedule

    def schedule():  # sample the pool right after allocation, before finished requests free blocks
        out = original_schedule()
        run.peak_blocks_in_use = max(run.peak_blocks_in_use, kv.block_pool.num_blocks - kv.num_free_blocks)
        return out

    engine.scheduler.schedule = schedule
    try:
        start = time.perf_counter()
        num_rounds = len(rounds) if rounds is not None else workload.num_rounds
        for k in range(num_rounds):
            prompts = rounds[k] if rounds is not None else workload.build_round(
                k, [[o.token_ids for o in r] for r in run.outputs])
            ids = [engine.add_request(p, params) for p in prompts]
            done: dict[str, RequestOutput] = {}
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
            run.rounds.append([list(p) for p in prompts])
            run.outputs.append([done[i] for i in ids])
        run.wall_s = time.perf_counter() - start
    finally:
        del engine.scheduler.schedule  # back to the class's method
    m1 = engine.get_metrics()
    run.prompt_tokens_computed = m1.prompt_tokens_computed - m0.prompt_tokens_computed
    run.num_evictions = m1.num_evictions - m0.num_evictions
    run.num_preemptions = m1.num_preemptions - m0.num_preemptions
    return run


def time_alone(llm: LLM, prompt: list[int]) -> RequestOutput:
    """One request on an idle engine, one token: its TTFT is pure prefill (+ lookup)."""
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]


def _warm_up(llm: LLM) -> None:
    # 5 tokens: no full block, so nothing is cached; first-call overheads are paid here.
    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _p90(xs: Sequence[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------------------- workload


def bench_workload(loaded: LoadedModel, name: str, opts: BenchOptions, hf=None, log=print) -> dict:
    """Measures one workload; returns its report section (see the module docstring)."""
    workload = build_workload(name, loaded.tokenizer, loaded.eos_token_ids, opts.num_requests, opts.num_turns,
                              opts.text_scale)
    params = SamplingParams(temperature=0, max_tokens=opts.max_tokens, ignore_eos=True)
    base = dict(block_size=opts.block_size, num_threads=opts.num_threads, **opts.engine_options)
    static_rounds = [workload.build_round(0, [])] if workload.num_rounds == 1 else None
    num_blocks = _num_blocks_for(static_rounds, opts, _default_pool_blocks(loaded, opts))
    on_llm = LLM(opts.model, loaded=loaded, enable_prefix_caching=True, num_blocks=num_blocks, **base)
    off_llm = LLM(opts.model, loaded=loaded, enable_prefix_caching=False, num_blocks=num_blocks, **base)
    runs = _throughput_runs(on_llm, off_llm, workload, params, opts, name, log)
    del off_llm
    log(f"[{name}] TTFT alone ...")
    ttft = _ttft_alone(on_llm, [p for r in runs.on.rounds for p in r], opts)
    kv_bytes_per_block = on_llm.engine.kv_cache_bytes_per_block
    partial_reuse = on_llm.engine.config.enable_partial_block_reuse
    del on_llm
    report = _workload_report(name, workload, opts, runs, ttft, num_blocks, kv_bytes_per_block, partial_reuse)
    if hf is not None:
        report["hf"] = _bench_hf(hf, runs.on.rounds, opts, report, runs.on.flat, log, name)
    report["worth"] = estimate_worth(WorthInputs(
        num_requests=report["num_requests"],
        hit_tokens=report["prefill"]["hit_tokens"],
        num_hit_requests=report["prefill"]["hit_requests"],
        block_hits=runs.ideal.block_hits,
        distinct_hit_blocks=runs.ideal.distinct_hit_blocks,
        prefill_tokens_per_s=report["ttft"]["cold_prefill_tokens_per_s"],
        requests_per_s=report["num_requests"] / report["throughput"]["wall_s_cache_on"],
        kv_bytes_held=runs.ideal.distinct_hit_blocks * kv_bytes_per_block,
        on_over_off=report["throughput"]["on_over_off"],
        num_timing_repeats=runs.repeats,
        timing_spread=report["throughput"]["timing_spread"],
    )).to_dict()
    report["goals"] = workload_goals(report)
    return report


@dataclass
class _Runs:
    """The throughput runs of one workload: caching on and off, wall times of every repeat."""

    on: EngineRun
    off: EngineRun
    on_walls: list[float]
    off_walls: list[float]
    repeats: int
    ideal: IdealAccounting | None = None  # of the on run's rounds and outputs


def _throughput_runs(on_llm: LLM, off_llm: LLM, workload: Workload, params: SamplingParams, opts: BenchOptions,
                     name: str, log) -> _Runs:
    """Caching on (this run also builds multi-turn's rounds), then off, then interleaved repeats
    (fresh cache each time). A sharing workload whose caching-on runs timed slower than off gets
    repeats up to ``MIN_CONFIRMING_REPEATS`` per mode, so the verdict can tell noise from cost."""
    repeats = max(opts.repeats, 3) if not workload.sharing else opts.repeats
    log(f"[{name}] caching on ...")
    _warm_up(on_llm)
    on = run_rounds(on_llm, workload, params)
    _warm_up(off_llm)
    log(f"[{name}] caching off ...")
    off = run_rounds(off_llm, workload, params, on.rounds)
    runs = _Runs(on, off, [on.wall_s], [off.wall_s], repeats)
    for _ in range(repeats - 1):
        _repeat(runs, on_llm, off_llm, workload, params)
    if workload.sharing and statistics.median(runs.on_walls) > statistics.median(runs.off_walls):
        # Sharing should make caching on faster: check that "slower" is not a busy machine's noise.
        log(f"[{name}] caching on timed slower than off: repeating to {MIN_CONFIRMING_REPEATS} runs per mode ...")
        while len(runs.on_walls) < MIN_CONFIRMING_REPEATS:
            _repeat(runs, on_llm, off_llm, workload, params)
        runs.repeats = len(runs.on_walls)
    outputs_tokens = [[o.token_ids for o in r] for r in on.outputs]
    runs.ideal = ideal_accounting(on.rounds, opts.block_size, outputs_tokens)
    return runs


def _repeat(runs: _Runs, on_llm: LLM, off_llm: LLM, workload: Workload, params: SamplingParams) -> None:
    """One more timed run per mode, back to back, same prompts (caching on from an empty cache). The
    order alternates: off first after the on-first initial pair, then on first, ..., so whatever the
    first (or second) run of a pair pays does not always land on the same mode."""
    on_llm.reset_prefix_cache()
    modes = [(on_llm, runs.on_walls), (off_llm, runs.off_walls)]
    for llm, walls in modes[::-1] if len(runs.on_walls) % 2 else modes:
        walls.append(run_rounds(llm, workload, params, runs.on.rounds).wall_s)


def timing_spread(*walls: Sequence[float]) -> float | None:
    """Slowest / fastest - 1 of the runs of each mode, the larger of the modes (None: one run each)."""
    spreads = [max(w) / min(w) - 1 for w in walls if len(w) > 1]
    return max(spreads) if spreads else None


def _ttft_alone(llm: LLM, prompts: list, opts: BenchOptions) -> dict[str, list[float]]:
    """Each request alone: ``cold_samples`` of them on an empty cache, then all in order (warm when
    they hit). Returns the TTFTs (seconds) and cold prefill speeds (tokens/s)."""
    cold_idx = list(range(min(opts.cold_samples, len(prompts))))
    cold_ttft, warm_ttft, cold_tokens_per_s = [], [], []
    for i in cold_idx:
        llm.reset_prefix_cache()
        o = time_alone(llm, prompts[i])
        cold_ttft.append(o.ttft_s)
        cold_tokens_per_s.append(o.num_prompt_tokens / o.ttft_s)
    llm.reset_prefix_cache()
    for i, p in enumerate(prompts):
        o = time_alone(llm, p)
        if o.num_cached_tokens > 0:
            warm_ttft.append(o.ttft_s)
        elif i not in cold_idx:
            cold_ttft.append(o.ttft_s)
            cold_tokens_per_s.append(o.num_prompt_tokens / o.ttft_s)
    return {"cold": cold_ttft, "warm": warm_ttft, "cold_tokens_per_s": cold_tokens_per_s}


def _workload_report(name: str, workload: Workload, opts: BenchOptions, runs: _Runs, ttft: dict, num_blocks: int,
                     kv_bytes_per_block: int, partial_reuse: bool) -> dict:
    """The workload's report section from its measurements: prefill accounting, TTFT, throughput, KV."""
    on, off, ideal = runs.on, runs.off, runs.ideal
    flat_on, flat_off = on.flat, off.flat
    flat_prompts = [p for r in on.rounds for p in r]
    hit_tokens = sum(o.num_cached_tokens for o in flat_on)
    prompt_tokens = sum(o.num_prompt_tokens for o in flat_on)
    num_output_tokens = sum(len(o.token_ids) for o in flat_on)
    wall_on, wall_off = statistics.median(runs.on_walls), statistics.median(runs.off_walls)
    tok_s_on, tok_s_off = num_output_tokens / wall_on, num_output_tokens / wall_off
    cold, warm = ttft["cold"], ttft["warm"]
    return {
        "name": name,
        "description": workload.description,
        "sharing": workload.sharing,
        "num_requests": len(flat_on),
        "num_rounds": len(on.rounds),
        "max_tokens": opts.max_tokens,
        "block_size": opts.block_size,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_per_request": [len(p) for p in flat_prompts],
        "prefill": {
            "computed_cache_off": off.prompt_tokens_computed,
            "computed_cache_on": on.prompt_tokens_computed,
            "ideal": ideal.ideal_prefill_tokens,
            "computed_over_ideal": _ratio(on.prompt_tokens_computed, ideal.ideal_prefill_tokens),
            "hit_tokens": hit_tokens,
            "ideal_hit_tokens": ideal.ideal_hit_tokens,
            "hit_rate": hit_tokens / prompt_tokens,
            "hit_requests": sum(o.num_cached_tokens > 0 for o in flat_on),
            "ideal_hit_requests": ideal.ideal_hit_requests,
            "computed_equals_ideal": on.prompt_tokens_computed == ideal.ideal_prefill_tokens,
            "partial_block_reuse": partial_reuse,
            "computed_equals_prompt_minus_hits": on.prompt_tokens_computed == prompt_tokens - hit_tokens,
            # requests that served no cached token, and why in words (case C23)
            "zero_hits": explain_zeros(flat_prompts, [o.num_cached_tokens for o in flat_on], opts.block_size),
        },
        "ttft": {
            "cold_median_s": _median(cold), "cold_p90_s": _p90(cold), "num_cold": len(cold),
            "warm_median_s": _median(warm), "warm_p90_s": _p90(warm), "num_warm": len(warm),
            "warm_over_cold": _ratio(_median(warm), _median(cold)),
            "batch_cache_on_median_s": _median([o.ttft_s for o in flat_on]),
            "batch_cache_off_median_s": _median([o.ttft_s for o in flat_off]),
            "cold_prefill_tokens_per_s": _median(ttft["cold_tokens_per_s"]),
        },
        "throughput": {
            "output_tokens": num_output_tokens,
            "repeats": runs.repeats,
            "wall_s_cache_on": wall_on, "wall_s_cache_off": wall_off,
            "output_tokens_per_s_cache_on": tok_s_on, "output_tokens_per_s_cache_off": tok_s_off,
            "on_over_off": tok_s_on / tok_s_off,
            "timing_spread": timing_spread(runs.on_walls, runs.off_walls),
        },
        "kv": {
            "peak_blocks_cache_on": on.peak_blocks_in_use,
            "peak_blocks_cache_off": off.peak_blocks_in_use,
            "ideal_peak_blocks": ideal.ideal_peak_blocks,
            "unshared_peak_blocks": ideal.unshared_peak_blocks,
            "peak_on_over_ideal": _ratio(on.peak_blocks_in_use, ideal.ideal_peak_blocks),
            "bytes_per_block": kv_bytes_per_block,
            "num_blocks": num_blocks,
            "num_evictions": on.num_evictions,
            "num_preemptions": on.num_preemptions + off.num_preemptions,
        },
        "outputs_equal_on_off": [o.token_ids for o in flat_on] == [o.token_ids for o in flat_off],
    }


def _default_pool_blocks(loaded: LoadedModel, opts: BenchOptions) -> int:
    from prefixcache.config import DEFAULT_KV_CACHE_MEMORY_BYTES
    from prefixcache.runner.kv_pool import num_blocks_for_memory

    c = loaded.config
    dtype = next(loaded.model.parameters()).dtype
    return num_blocks_for_memory(DEFAULT_KV_CACHE_MEMORY_BYTES, c.num_hidden_layers, opts.block_size,
                                 c.num_key_value_heads, c.head_dim, dtype)


def _bench_hf(hf, rounds, opts: BenchOptions, report: dict, flat_on: list[RequestOutput], log, name) -> dict:
    runs = {}
    for variant in ("no_reuse", "prefix_copy", "batched"):
        log(f"[{name}] transformers {variant} ...")
        runs[variant] = hf.run(variant, rounds, opts.max_tokens)
    tok_s_on = report["throughput"]["output_tokens_per_s_cache_on"]
    best = max(runs, key=lambda v: runs[v].output_tokens_per_s)
    ours_ids = [o.token_ids for o in flat_on]
    return {
        **{v: r.summary() for v, r in runs.items()},
        "ours_over": {v: tok_s_on / r.output_tokens_per_s for v, r in runs.items()},
        "best_variant": best,
        "ours_over_best": tok_s_on / runs[best].output_tokens_per_s,
        "warm_ttft_over_prefix_copy_ttft": _ratio(report["ttft"]["warm_median_s"],
                                                  runs["prefix_copy"].summary()["ttft_median_s"]),
        "cold_ttft_over_no_reuse_ttft": _ratio(report["ttft"]["cold_median_s"],
                                               runs["no_reuse"].summary()["ttft_median_s"]),
        "same_outputs_as_no_reuse": sum(a == b for a, b in zip(ours_ids, runs["no_reuse"].output_token_ids))
        / len(ours_ids),
    }


# ---------------------------------------------------------------------------------------- goals


def workload_goals(r: dict) -> list[dict]:
    """The issue's goals that apply to this workload, with the measured value and whether met."""
    goals = []
    name = r["name"]
    if r["sharing"]:
        # The ideal shares full blocks only; partial-block reuse may compute less (copied slots).
        p = r["prefill"]
        if p["partial_block_reuse"]:
            goals.append(_goal("prefill computed / full-block ideal (partial-block reuse on)",
                               p["computed_over_ideal"], "<= 1.00", p["computed_cache_on"] <= p["ideal"]))
        else:
            goals.append(_goal("prefill computed / ideal", p["computed_over_ideal"], "= 1.00",
                               p["computed_equals_ideal"]))
    if name == "system-prompt":
        v = r["ttft"]["warm_over_cold"]
        goals.append(_goal("warm TTFT / cold TTFT", v, "<= 0.10", None if v is None else v <= 0.10))
    if name in SHARING_GOAL_WORKLOADS and "hf" in r:
        v = r["hf"]["warm_ttft_over_prefix_copy_ttft"]
        goals.append(_goal("warm TTFT / transformers DynamicCache-copy TTFT", v, "<= 0.5",
                           None if v is None else v <= 0.5))
        v = r["hf"]["ours_over_best"]
        goals.append(_goal(f"output tok/s / best transformers ({r['hf']['best_variant']})", v, ">= 3",
                           v >= 3))
    if name == "no-sharing":
        v = r["throughput"]["on_over_off"]
        goals.append(_goal("output tok/s caching on / off", v, ">= 0.99", v >= 0.99))
    return goals


# ---------------------------------------------------------------------------------------- micro


def hash_lookup_throughput(block_size: int, num_tokens: int = 4096, seconds: float = 0.3) -> dict:
    """Chain hash + verify + lookup of a fully cached ``num_tokens``-token prompt, in tokens/s.

    ``hash``: ``Request`` construction (all block hashes, as the engine does on arrival);
    ``lookup``: ``KVCacheManager.get_computed_blocks`` (hash-map lookups + token and parent
    verification of every block); ``total``: both, per request.
    """
    rng = random.Random(0)
    tokens = [rng.randrange(100, 49000) for _ in range(num_tokens)]
    hasher = BlockHasher(block_size)
    root = make_root_key(b"\0" * 32)
    params = SamplingParams(temperature=0, max_tokens=1)
    manager = KVCacheManager(num_tokens // block_size + 2, CacheConfig(block_size=block_size))
    first = Request("prime", tokens, params, hasher, root)
    manager.allocate_slots(first, num_tokens)
    manager.free(first)  # blocks stay cached, hit-able

    def rate(fn) -> float:  # the garbage collector paused while timing, as timeit does
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            n, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds or n < 3:
                fn()
                n += 1
        finally:
            if gc_was_enabled:
                gc.enable()
        return n * num_tokens / elapsed

    req = Request("probe", tokens, params, hasher, root)
    blocks, hit = manager.get_computed_blocks(req)
    expected_hit = (num_tokens - 1) // block_size * block_size
    if hit != expected_hit:
        raise RuntimeError(f"micro-benchmark lookup found {hit} tokens, expected {expected_hit}")
    hash_rate = rate(lambda: hasher.extend([], tokens, root))
    lookup_rate = rate(lambda: manager.get_computed_blocks(req))
    total_rate = rate(lambda: manager.get_computed_blocks(Request("r", tokens, params, hasher, root)))
    return {"block_size": block_size, "num_tokens": num_tokens, "hash_tokens_per_s": hash_rate,
            "lookup_verify_tokens_per_s": lookup_rate, "total_tokens_per_s": total_rate}


# ---------------------------------------------------------------------------------------- run


def run_bench(opts: BenchOptions, loaded: LoadedModel | None = None, log=print) -> dict:
    """Runs the selected workloads and the micro-benchmark; writes the outputs when ``opts.out``."""
    for w in opts.workloads:
        if w not in (*WORKLOAD_NAMES, SPEED):
            raise ValueError(f"workload must be one of {(*WORKLOAD_NAMES, SPEED)} or 'all', got {w!r}")
    check_positive((("max_tokens", opts.max_tokens), ("block_size", opts.block_size),
                    ("num_threads", opts.num_threads), ("repeats", opts.repeats), ("cold_samples", opts.cold_samples)))
    started = datetime.datetime.now().astimezone()
    load_start = os.getloadavg()
    engine_config = EngineConfig.from_kwargs(**opts.engine_options)
    micro = []
    if opts.micro:  # first: pure-Python bookkeeping, timed before any model or engine thread runs here
        log("[micro] hash + verify + lookup ...")
        micro = [hash_lookup_throughput(bs, seconds=opts.micro_seconds) for bs in opts.micro_block_sizes]
    loaded = loaded or load_model(opts.model, dtype=engine_config.torch_dtype, quantization=engine_config.quantization,
                                  attention_dtype=engine_config.attention_dtype)
    torch.set_num_threads(opts.num_threads)
    hf = None
    if not opts.skip_hf:
        from prefixcache.bench.hf_baselines import HFBaselines, load_hf_model

        hf = HFBaselines(load_hf_model(loaded.model_dir), loaded.eos_token_ids[0], opts.num_threads)
    workloads = [bench_workload(loaded, name, opts, hf, log) for name in opts.workloads if name != SPEED]
    speed = _bench_speed(loaded, opts, hf, workloads, log) if SPEED in opts.workloads else None
    goals = [dict(g, workload=w["name"]) for w in (*workloads, *([speed] if speed else [])) for g in w["goals"]]
    for m in micro:
        if m["block_size"] == DEFAULT_BLOCK_SIZE:
            goals.append(dict(_goal("hash + verify + lookup tokens/s at block size 16", m["total_tokens_per_s"],
                                    ">= 30e6", m["total_tokens_per_s"] >= 30e6), workload="micro"))
    result = {
        "date": started.isoformat(timespec="seconds"),
        "command": "prefixcache bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if sys.argv[1:2] == ["bench"] else None,
        "machine": {
            "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "threads": opts.num_threads,
            "torch": torch.__version__,
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
        },
        "model": opts.model,
        "options": dataclasses.asdict(opts),
        "workloads": workloads,
        "speed": speed,
        "micro": micro,
        "goals": goals,
    }
    if opts.out:
        from prefixcache.bench.report import write_outputs

        for path in write_outputs(result, opts.out, plots=opts.plots):
            log(f"wrote {path}")
    return result


def _bench_speed(loaded: LoadedModel, opts: BenchOptions, hf, workloads: list[dict], log) -> dict:
    """The speed table; its caching on / off row from this run's no-sharing workload, else measured here."""
    no_sharing = next((w for w in workloads if w["name"] == "no-sharing"), None)
    if no_sharing is not None:
        return run_speed(loaded, opts, hf, no_sharing["throughput"]["on_over_off"],
                         "the no-sharing workload of this run", log)
    workload = build_workload("no-sharing", loaded.tokenizer, loaded.eos_token_ids, opts.num_requests)
    params = SamplingParams(temperature=0, max_tokens=opts.max_tokens, ignore_eos=True)
    base = dict(block_size=opts.block_size, num_threads=opts.num_threads, **opts.engine_options)
    num_blocks = _num_blocks_for([workload.build_round(0, [])], opts, _default_pool_blocks(loaded, opts))
    on_llm = LLM(opts.model, loaded=loaded, enable_prefix_caching=True, num_blocks=num_blocks, **base)
    off_llm = LLM(opts.model, loaded=loaded, enable_prefix_caching=False, num_blocks=num_blocks, **base)
    # >= 5 pairs of runs, each pair's on and off back to back (the order alternating): this VM's speed
    # drifts by tens of percent over minutes, so the ratio is the median of the pairs' ratios
    pair_opts = dataclasses.replace(opts, repeats=max(opts.repeats, SPEED_ON_OFF_PAIRS))
    runs = _throughput_runs(on_llm, off_llm, workload, params, pair_opts, "speed: no-sharing", log)
    del on_llm, off_llm
    on_over_off = statistics.median(off / on for on, off in zip(runs.on_walls, runs.off_walls))  # same tokens
    return run_speed(loaded, opts, hf, on_over_off, "the no-sharing workload, measured for this table "
                     f"({workload.num_requests} requests x {opts.max_tokens} tokens; median of {runs.repeats} "
                     "back-to-back pairs of runs, on / off order alternating, of the pair's off / on time)", log)
