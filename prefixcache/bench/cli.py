"""``prefixcache bench``'s command line: its flags, their checks and :func:`run_cli`.

Only what ``bench --help`` and the checks need is imported at the top (no torch, no engine), so
``bench --help`` and a bad flag (``--workload foo``) answer in a fraction of a second; each
workload's module is imported when it runs (the model workloads: :mod:`prefixcache.bench.runner`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import sys
import tempfile
import time

from prefixcache.bench.options import SPEED, BenchOptions, SpeedSizes, check_positive
from prefixcache.bench.queue import QueueConfig
from prefixcache.bench.workloads import WORKLOAD_NAMES, check_workload_args
from prefixcache.bench.worth import MIN_CONFIRMING_REPEATS
from prefixcache.config import EngineConfig
from prefixcache.errors import InvalidInputError
from prefixcache.entrypoints.cli.num_threads import NUM_THREADS_HELP, choose_num_threads


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``prefixcache bench``'s flags; their defaults are :class:`BenchOptions`' (declared once)."""
    d = BenchOptions()
    p.add_argument("--workload", default="all",
                   help=f"'all' (= {', '.join(WORKLOAD_NAMES)}) or a comma-separated list of those and of "
                        f"'{SPEED}' (side-by-side speed table vs transformers and llama.cpp, a few minutes), "
                        "'trace' (eviction-policy trace simulation, no model), 'restart' (TTFT after a "
                        "restart over the disk KV tier and on a replica over Redis, 3 processes, ~1 min), "
                        "'queue' (scheduling policies under a queue and memory pressure: scheduler replay, no model), "
                        "'cluster' (replicas behind the SGLang gateway: cache_aware vs round_robin vs random vs "
                        "one replica; see --cluster-*), 'flood' (an agent's system prompt under a cache breakpoint "
                        "against one-off prompts, per eviction policy: cache replay, no model), 'field' (GuideLLM, "
                        "SGLang's bench_serving and AIPerf, whichever --install-field-tools installed, against "
                        "`prefixcache serve` and, when installed, llama.cpp's server; 20 requests unless --num-requests) "
                        "and 'memory' (each weight format's resident memory in a `prefixcache serve` with its 1 GiB "
                        "KV pool, a process each; 1 thread unless --num-threads)")
    p.add_argument("--model", default=d.model, help="built-in name, a local HF directory (config.json + "
                                                     "*.safetensors) or a local .gguf file; never downloaded from the Hub")
    p.add_argument("--num-requests", type=int, default=d.num_requests,
                   help="requests per workload (per round for multi-turn); default: seed 10, multi-turn 4, others 6")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens generated per request")
    p.add_argument("--num-turns", type=int, default=d.num_turns, help="multi-turn: turns per chat (1-8)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--text-scale", type=float, default=d.text_scale,
                   help="keep this fraction of the long shared texts (quick runs)")
    p.add_argument("--num-threads", type=int, default=None,
                   help=NUM_THREADS_HELP.replace("torch CPU threads", "torch CPU threads, and llama.cpp's in the "
                                                 "speed workload"))
    p.add_argument("--repeats", type=int, default=d.repeats, help="throughput runs per mode, median wall (no-sharing: >= 3; a sharing workload whose "
                        f"caching-on runs time slower than off is repeated to {MIN_CONFIRMING_REPEATS})")
    p.add_argument("--cold-samples", type=int, default=d.cold_samples, help="requests timed alone on an empty cache")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--skip-llamacpp", action="store_true", help="speed and field: skip the llama.cpp baseline")
    p.add_argument("--skip-vllm", action="store_true",
                   help="speed: skip vLLM's CPU build (measured when PREFIXCACHE_BASELINES=vllm set-up installed it)")
    p.add_argument("--skip-openvino", action="store_true",
                   help="speed: skip OpenVINO GenAI (measured when PREFIXCACHE_BASELINES=openvino set-up installed it)")
    p.add_argument("--speed-long", action="store_true",
                   help="speed: also measure long context (8,000-token prefill, decode at 8k; a few minutes more)")
    p.add_argument("--speed-prefix-tokens", type=int, default=SpeedSizes.prefix_tokens,
                   help="speed: tokens of the shared system prompt (the warm requests reuse it)")
    p.add_argument("--dtype", default=None, choices=EngineConfig.choices("dtype"),
                   help="our engine's weights and KV dtype (default float32; the baselines keep theirs)")
    p.add_argument("--quantization", default=None, choices=EngineConfig.choices("quantization"),
                   help="our engine's weight format (default none; int8, int4, int4-int8: see "
                        "docs/weight-formats-and-kernels.md)")
    p.add_argument("--attention-dtype", default=None, choices=EngineConfig.choices("attention_dtype"),
                   help="our engine's prompt-attention products (default float; int8: the paged kernel's AVX2 "
                        "form's int8 products, docs/weight-formats-and-kernels.md)")
    p.add_argument("--skip-micro", action="store_true", help="skip the hash + lookup micro-benchmark")
    p.add_argument("--no-plots", action="store_true", help="write JSON and Markdown only")
    p.add_argument("--out", default=d.out, help="output directory")
    p.add_argument("--report", action="append", default=None, metavar="PAGE",
                   help="also put the tables this run wrote into PAGE (e.g. docs/benchmarks.md), each between its "
                        "<!-- bench:NAME:begin/end --> markers with the machine, date, commit and command; repeat it "
                        "for more pages: those after the first (e.g. README.md) only get the sections they have markers for")
    p.add_argument("--install-field-tools", nargs="?", const="all", default=None, metavar="TOOLS",
                   help="create the venvs of the field's load generators ('all' or a comma list of guidellm, sglang, "
                        "aiperf; from PyPI, a few minutes) for --workload field, then exit")
    p.add_argument("--kv-redis-url", default=None,
                   help="restart: the Redis of the replica phase (default: a redis-server started on loopback)")
    c = p.add_argument_group("--workload cluster (--num-requests: per system prompt, default 4; --num-threads: "
                             "per replica, default 1; --max-tokens, --model, --out, --no-plots apply)")
    c.add_argument("--cluster-replicas", type=int, default=2, help="replicas behind the gateway")
    c.add_argument("--cluster-prefixes", type=int, default=8, help="distinct system prompts")
    c.add_argument("--cluster-concurrency", type=int, default=4, help="clients sending at once")
    q = p.add_argument_group("--workload queue (--num-requests: default 1200; --out, --no-plots apply)")
    q.add_argument("--queue-rate-rps", type=float, default=QueueConfig.rate_rps,
                   help="arrivals per virtual second (Poisson; a 640-block pool serves about 13/s)")
    q.add_argument("--queue-num-blocks", type=int, default=QueueConfig.num_blocks,
                   help="KV pool blocks of 16 tokens (1200 requests allocate under 24,000: 30000 never evicts)")
    p.add_argument("--no-partial-block-reuse", action="store_true",
                   help="full-block sharing only (then computed must equal the ideal exactly)")
    p.add_argument("--scheduling-policy", default=None, choices=EngineConfig.choices("scheduling_policy"),
                   help="our engine's waiting-queue order (default: EngineConfig's); 'queue' compares them all")


def run_trace_cli(out_dir: str | None, block_size: int) -> None:
    """``--workload trace``: the eviction-policy trace simulation (no model); ``trace.json`` and ``trace.md``
    into ``out_dir``."""
    from prefixcache.bench.trace import TRACE_NUM_BLOCKS, run_trace_benchmark, trace_markdown

    rows = run_trace_benchmark(num_blocks=TRACE_NUM_BLOCKS, block_size=block_size)
    table = trace_markdown(rows, TRACE_NUM_BLOCKS, block_size)
    for r in rows:
        print(f"{r['trace']:8s} seed {r['seed']} {r['policy']:5s} hit rate {r['hit_rate']:.3f} "
              f"prefill saved {r['prefill_tokens_saved']:8d} ({r.get('saved_vs_lru', 0.0):+.1%} vs lru) "
              f"evictions {r['num_evictions']:6d} {r['requests_per_s']:6.0f} req/s")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "trace.json"), "w") as f:
            json.dump(rows, f, indent=2)
        with open(os.path.join(out_dir, "trace.md"), "w") as f:
            f.write(table)


def run_flood_cli(out_dir: str | None) -> None:
    """``--workload flood``: cache breakpoints against an agent flood (:mod:`prefixcache.bench.flood`, no
    model); the table on stdout, JSON and Markdown into ``out_dir``."""
    from prefixcache.bench.flood import flood_markdown, run_flood_benchmark

    rows = run_flood_benchmark()
    table = flood_markdown(rows)
    print(table, end="")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "flood.json"), "w") as f:
            json.dump(rows, f, indent=2)
        with open(os.path.join(out_dir, "flood.md"), "w") as f:
            f.write(table)


def run_restart_cli(args: argparse.Namespace, num_threads: int) -> None:
    """``--workload restart``: the restart / replica TTFT (:mod:`prefixcache.bench.restart`)."""
    from prefixcache.bench.restart import RestartOptions, restart_markdown, run_restart, write_restart_outputs
    from transformers import AutoTokenizer

    from prefixcache.models.loader import resolve_model_dir

    opts = RestartOptions(model=args.model, num_threads=num_threads, block_size=args.block_size,
                          engine_options=_engine_options(args), kv_redis_url=args.kv_redis_url)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model), local_files_only=True)
    section = run_restart(opts, tokenizer, log=lambda s: print(s, file=sys.stderr))
    print(restart_markdown(section))
    if args.out:
        for path in write_restart_outputs(section, args.out, plots=not args.no_plots):
            print(f"wrote {path}", file=sys.stderr)


def queue_config(args: argparse.Namespace) -> QueueConfig:
    """The queue workload's sizes from the ``--queue-*`` and ``--num-requests`` flags."""
    config = dataclasses.replace(QueueConfig(), rate_rps=args.queue_rate_rps, num_blocks=args.queue_num_blocks)
    if args.num_requests is not None:
        config = dataclasses.replace(config, num_requests=args.num_requests)
    return config


def queue_variant(args: argparse.Namespace) -> str:
    """The queue run's sizes that differ from :class:`QueueConfig`'s, as its page section's suffix
    (``14rps``, ``30000blocks``, ``600requests``; empty for the defaults), so each variant keeps its own table."""
    config, default = queue_config(args), QueueConfig()
    return "-".join(f"{getattr(config, field):g}{unit}" for field, unit in (
        ("rate_rps", "rps"), ("num_blocks", "blocks"), ("num_requests", "requests"))
        if getattr(config, field) != getattr(default, field))


def run_queue_cli(args: argparse.Namespace) -> None:
    """``--workload queue``: the scheduling policies on the queue workload (scheduler replay, no
    model); ``queue.json``, ``queue.md`` and ``queue.png`` into ``--out``.

    Raises:
        InvalidInputError: a flag out of range (naming its field).
    """
    from prefixcache.bench.queue import queue_markdown, run_queue_benchmark, write_queue_outputs

    result = run_queue_benchmark(queue_config(args))
    print(queue_markdown(result))
    if args.out:
        for path in write_queue_outputs(result, args.out, not args.no_plots):
            print(f"wrote {path}", file=sys.stderr)


TRACE = "trace"  # --workload trace: the eviction-policy simulation (no model)
RESTART = "restart"  # --workload restart: restart / replica TTFT over the KV tiers (its own processes)
QUEUE = "queue"  # --workload queue: the scheduling policies, scheduler replay (no model)
CLUSTER = "cluster"  # --workload cluster: replicas behind the SGLang gateway (its own processes)
FLOOD = "flood"  # --workload flood: an agent's system prompt against one-off prompts, pinned or not (no model)
FIELD = "field"  # --workload field: the field's load generators against `prefixcache serve` (their own processes)
MEMORY = "memory"  # --workload memory: each weight format's resident memory in `prefixcache serve` (a process each)
CLI_WORKLOADS = (*WORKLOAD_NAMES, SPEED, TRACE, RESTART, QUEUE, CLUSTER, FLOOD, FIELD, MEMORY)  # every name --workload accepts, besides 'all'


def parse_workloads(arg: str) -> tuple[str, ...]:
    """``--workload``'s comma list, ``all`` expanded to :data:`WORKLOAD_NAMES`, duplicates dropped.

    Raises:
        ValueError: an unknown name, listing every accepted one.
    """
    names = tuple(dict.fromkeys(n for w in arg.split(",")
                                for n in (WORKLOAD_NAMES if w.strip() == "all" else (w.strip(),))))
    unknown = [n for n in names if n not in CLI_WORKLOADS]
    if unknown or not names:
        raise ValueError(f"--workload: unknown workload {', '.join(map(repr, unknown)) or repr(arg)}; choose 'all' "
                         f"or a comma-separated list of {', '.join(CLI_WORKLOADS)}")
    return names


def _engine_options(args: argparse.Namespace) -> dict:
    """Our engines' options from the flags (the baselines keep theirs)."""
    options = {"enable_partial_block_reuse": False} if args.no_partial_block_reuse else {}
    if args.dtype is not None:
        options["dtype"] = args.dtype
    if args.quantization is not None:
        options["quantization"] = args.quantization
    if getattr(args, "attention_dtype", None) is not None:
        options["attention_dtype"] = args.attention_dtype
    if args.scheduling_policy is not None:
        options["scheduling_policy"] = args.scheduling_policy
    return options


def run_cluster_cli(args: argparse.Namespace, num_threads: int | None) -> None:
    """``--workload cluster``: :mod:`prefixcache.bench.cluster`; cluster.json/.md/.png into ``--out``."""
    from prefixcache.bench.cluster import ClusterBenchOptions, markdown, run_cluster_bench, write_cluster_outputs

    opts = ClusterBenchOptions(model=args.model, num_replicas=args.cluster_replicas,
                               num_prefixes=args.cluster_prefixes, num_requests=args.num_requests or 4,
                               max_tokens=args.max_tokens,
                               concurrency=args.cluster_concurrency, num_threads=num_threads or 1,
                               block_size=args.block_size)
    result = run_cluster_bench(opts, log=lambda s: print(s, file=sys.stderr))
    if args.out:
        for path in write_cluster_outputs(result, args.out, plots=not args.no_plots):
            print(f"wrote {path}", file=sys.stderr)
    print(markdown(result))


@contextlib.contextmanager
def _naming_flags(flags: dict[str, str]):
    """Re-raises an :class:`InvalidInputError` whose field is one of ``flags``' with that field's flag
    in front (``num_turns must be ...`` -> ``--num-turns: num_turns must be ...``)."""
    try:
        yield
    except InvalidInputError as e:
        if e.field not in flags:
            raise
        raise ValueError(f"{flags[e.field]}: {e}") from None


def check_bench_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Checks every ``bench`` flag before anything runs or loads: the engine options as ``serve``
    does, the counts, each model workload's sizes (the model-free workloads run first, so a bad
    value found later would wait for them and the model's load), and ``--out``: a directory it can
    write (created here; an existing file is refused).

    Returns:
        The workload names (:func:`parse_workloads`).

    Raises:
        ValueError: the first bad flag, named.
    """
    names = parse_workloads(args.workload)
    from prefixcache.entrypoints.cli.serve import engine_config_from_args  # the HTTP server's imports: after
    from prefixcache.bench.cluster import ClusterBenchOptions
    from prefixcache.entrypoints.cli.preflight import (check_engine_resources, check_kv_pool, check_writable_dir,
                                                       model_shape)

    config = engine_config_from_args(args, model_flag="--model", overrides=_engine_options(args))
    check_positive((("--max-tokens", args.max_tokens), ("--repeats", args.repeats),
                    ("--cold-samples", args.cold_samples), ("--cluster-replicas", args.cluster_replicas),
                    ("--cluster-prefixes", args.cluster_prefixes), ("--cluster-concurrency", args.cluster_concurrency),
                    *((("--num-requests", args.num_requests),) if args.num_requests is not None else ())))
    for name in names:
        if name in WORKLOAD_NAMES:
            with _naming_flags({"num_requests": "--num-requests", "num_turns": "--num-turns", "text_scale": "--text-scale"}):
                check_workload_args(name, args.num_requests, args.num_turns, args.text_scale)
    if QUEUE in names:
        with _naming_flags({"num_requests": "--num-requests", "rate_rps": "--queue-rate-rps",
                            "num_blocks": "--queue-num-blocks"}):
            queue_config(args).validate()
    if set(names) - {TRACE, QUEUE, FLOOD}:  # a workload that loads the model: --block-size within its context
        check_engine_resources(config, pool=False)  # (the workloads size their own pools)
    if CLUSTER in names:  # its replicas' pools and weights, all on this machine (100,000 were started)
        replica = dataclasses.replace(config, num_blocks=ClusterBenchOptions.num_blocks, kv_cache_memory_bytes=None,
                                      dtype="float32")  # the replicas' serve flags (bench/cluster.py)
        check_kv_pool(replica, model_shape(config.model), replicas=args.cluster_replicas, flag="--cluster-replicas")
    if args.out:  # an existing file or /proc/x fails here, not after the run
        check_writable_dir(args.out, "--out")
    for page in args.report or ():
        if not args.out or os.path.isdir(page):
            raise ValueError("--report needs --out (the tables it copies) and a Markdown file, "
                             f"got --report {page!r} --out {args.out!r}")
    return names


def run_cli(args: argparse.Namespace) -> int:
    """Checks the flags, then runs each workload named by ``--workload``, then (``--report``) puts the tables
    it wrote into the page; returns the exit status.

    Raises:
        ValueError: a bad flag, named (before anything runs or loads), or a ``--report`` page that can't be
            written.
    """
    started_s = time.time()
    if getattr(args, "install_field_tools", None) is not None:
        return _install_field_tools(args.install_field_tools)
    names = check_bench_args(args)
    status = _run_workloads(args, names)
    if args.report is not None:
        from prefixcache.bench.report_page import report_run
        from prefixcache.entrypoints.cli.serve import engine_config_from_args

        command = shlex.join(["prefixcache", *getattr(args, "argv", ["bench"])])
        # the format that ran (auto resolved as the run resolved it), so its section names what was measured
        config = engine_config_from_args(args, model_flag="--model", overrides=_engine_options(args))
        for i, page in enumerate(args.report):  # the first page gets new sections appended, the others don't
            stems = report_run(page, args.out, started_s, command, model=args.model, append=i == 0,
                               fmt=(config.dtype, config.quantization + ("-int8-attention" if config.attention_dtype == "int8"
                                                                         else "")),
                               variants={QUEUE: queue_variant(args)})
            print(f"prefixcache bench: --report: {', '.join(stems) or 'no table'} written into {page}", file=sys.stderr)
    return status


def _install_field_tools(arg: str) -> int:
    """``--install-field-tools``: the named tools' venvs (:mod:`prefixcache.bench.field`); returns the exit status.

    Raises:
        ValueError: an unknown tool name.
    """
    from prefixcache.bench.field import TOOLS, install_tools

    tools = list(TOOLS) if arg.strip() == "all" else [t.strip() for t in arg.split(",") if t.strip()]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown or not tools:
        raise ValueError(f"--install-field-tools: unknown tool {', '.join(map(repr, unknown)) or repr(arg)}; "
                         f"choose 'all' or a comma-separated list of {', '.join(TOOLS)}")
    install_tools(tools, log=lambda s: print(s, file=sys.stderr, flush=True))
    return 0


def run_field_cli(args: argparse.Namespace, num_threads: int | None) -> None:
    """``--workload field``: :mod:`prefixcache.bench.field`; field.json and field.md into ``--out``."""
    from pathlib import Path

    from prefixcache.bench.field import FieldWorkload, field_markdown, run_field_bench, write_field_outputs

    workload = FieldWorkload(num_requests=args.num_requests or FieldWorkload.num_requests, max_tokens=args.max_tokens)
    out = Path(args.out or tempfile.mkdtemp(prefix="prefixcache-field-"))
    result = run_field_bench(args.model, workload, num_threads or 2, out / "field-runs",
                             log=lambda s: print(s, file=sys.stderr, flush=True), with_llama_cpp=not args.skip_llamacpp)
    if args.out:
        for path in write_field_outputs(result, args.out):
            print(f"wrote {path}", file=sys.stderr)
    print(field_markdown(result))


def run_memory_cli(args: argparse.Namespace) -> None:
    """``--workload memory``: :mod:`prefixcache.bench.memory`; memory.json and memory.md into ``--out``."""
    from prefixcache.bench.memory import memory_markdown, run_memory_benchmark, write_memory_outputs

    result = run_memory_benchmark(args.model, num_threads=args.num_threads or 1, block_size=args.block_size,
                                  log=lambda s: print(s, file=sys.stderr, flush=True))
    if args.out:
        for path in write_memory_outputs(result, args.out):
            print(f"wrote {path}", file=sys.stderr)
    print(memory_markdown(result))


def _run_workloads(args: argparse.Namespace, names: tuple[str, ...]) -> int:
    """The workloads of ``names`` (checked), in order; returns the exit status."""
    cluster_threads = args.num_threads  # per replica; the cluster workload has its own default (1)
    threads_note = choose_num_threads(args) if set(names) - {TRACE, QUEUE, CLUSTER, FLOOD, FIELD, MEMORY} else None
    if threads_note:
        print(f"prefixcache bench: {threads_note}", file=sys.stderr, flush=True)
    if TRACE in names:  # simulation only; `all` means the model workloads
        run_trace_cli(args.out, args.block_size)
    if FLOOD in names:
        run_flood_cli(args.out)
    if RESTART in names:  # its own processes
        run_restart_cli(args, args.num_threads)
    if QUEUE in names:
        run_queue_cli(args)
    if CLUSTER in names:  # its own processes: replicas and the gateway
        run_cluster_cli(args, cluster_threads)
    if FIELD in names:  # its own processes: the servers and the tools
        run_field_cli(args, args.num_threads)
    if MEMORY in names:  # its own processes: a server per format
        run_memory_cli(args)
    names = tuple(n for n in names if n not in (TRACE, RESTART, QUEUE, CLUSTER, FLOOD, FIELD, MEMORY))
    if not names:
        return 0
    opts = BenchOptions(
        model=args.model, workloads=names, num_requests=args.num_requests, max_tokens=args.max_tokens,
        num_turns=args.num_turns, block_size=args.block_size, text_scale=args.text_scale, num_threads=args.num_threads,
        repeats=args.repeats,
        cold_samples=args.cold_samples, skip_hf=args.skip_hf, micro=not args.skip_micro, out=args.out,
        plots=not args.no_plots,
        engine_options=_engine_options(args),
        speed=SpeedSizes(prefix_tokens=args.speed_prefix_tokens, long=args.speed_long),
        skip_llamacpp=args.skip_llamacpp, skip_vllm=args.skip_vllm, skip_openvino=args.skip_openvino,
    )
    from prefixcache.bench import runner
    from prefixcache.bench.report import markdown

    result = runner.run_bench(opts, log=lambda s: print(s, file=sys.stderr))

    print(markdown(result))
    return 0
