"""``prefixcache bench --workload field``: the field's own load generators against ``prefixcache serve``.

GuideLLM (``guidellm``), SGLang's ``bench_serving`` (the ``sglang`` wheel) and NVIDIA AIPerf (``aiperf``) each
live in their own venv under :func:`venvs_dir` (``prefixcache bench --install-field-tools``, or
``PREFIXCACHE_FIELD_TOOLS=1 bash scripts/setup.sh``): their pins clash with ours and with each other's
(GuideLLM and SGLang would pull a CUDA torch of several GB; here torch is pinned to the CPU build setup.sh
installs, and SGLang comes without its serving runtime, see :mod:`prefixcache.bench.sglang_bench_serving`).

Each installed tool runs unchanged, as a user would run it, on the same small synthetic workload: ``groups``
shared prefixes of ``prefix_tokens`` tokens (SGLang's ``generated-shared-prefix``, GuideLLM's
``prefix_buckets``; AIPerf's ``--shared-system-prompt-length``, one prefix for all), a short question after it,
``max_tokens`` generated tokens, ``concurrency`` requests at once, the tokenizer read from the model's local
directory (nothing downloaded). Before each run the server's cache is flushed and its ``/metrics`` read; after,
the deltas of the hit and query counters are set beside what the tool reports. The theoretical hit rate is that
of an unbounded cache over the shared prefixes alone: ``(requests - prefixes) * prefix_tokens / prompt tokens``
(the chat template's shared opening is not counted, so a measured rate a little above it is expected).

llama.cpp's server (``llama-cpp-python[server]``, the ``llamacpp`` extra plus its server's dependencies, on the
model's GGUF, prompt cache on) is run under the same tools when it is installed; it has no ``/metrics``, so its
server columns stay empty.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.config import DEFAULT_MODEL

TOOLS = ("guidellm", "sglang", "aiperf")
# pip arguments per tool, one pip call per inner list. GuideLLM needs torch: the CPU build setup.sh pins (on
# these machines a local wheel), not PyPI's default CUDA one. SGLang's wheel comes without its dependency tree
# (its serving runtime: CUDA kernels, FlashInfer); these are what its benchmark client imports.
REQUIREMENTS = {
    "guidellm": [["torch==2.13.0", "guidellm>=0.8,<0.9"]],
    "sglang": [["--no-deps", "sglang==0.5.23"],
               ["aiohttp", "datasets", "msgspec", "numpy", "orjson", "pillow", "psutil", "pybase64", "pyzmq",
                "requests", "tqdm", "transformers"]],
    "aiperf": [["aiperf>=0.13,<0.14"]],
}
_READY = ".installed"  # written into a tool's venv when its install finished
VENVS_ENV = "PREFIXCACHE_FIELD_VENVS"
OURS, LLAMA_CPP = "prefixcache", "llama.cpp server"
_COUNTERS = {"vllm:prefix_cache_hits_total": "vllm_hits", "vllm:prefix_cache_queries_total": "vllm_queries",
             "prefixcache:prefix_cache_hits_total": "hits", "prefixcache:prefix_cache_queries_total": "queries"}


def venvs_dir() -> Path:
    """Where the tools' venvs live: ``$PREFIXCACHE_FIELD_VENVS``, else ``.venv-field`` beside ``.venv`` in this
    checkout, else ``~/.cache/prefixcache/field-venvs`` (an installed wheel)."""
    if os.environ.get(VENVS_ENV):
        return Path(os.environ[VENVS_ENV])
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        return checkout / ".venv-field"
    return Path.home() / ".cache" / "prefixcache" / "field-venvs"


def tool_bin(tool: str) -> Path:
    """The ``bin`` folder of ``tool``'s venv."""
    return venvs_dir() / tool / "bin"


def tool_missing(tool: str) -> str | None:
    """Why ``tool`` can't run here (a sentence with the command that installs it), or None."""
    if not (venvs_dir() / tool / _READY).is_file():
        return (f"{tool} is not installed in {venvs_dir() / tool} "
                f"(prefixcache bench --install-field-tools {tool}, or PREFIXCACHE_FIELD_TOOLS=1 bash scripts/setup.sh)")
    return None


def install_tool(tool: str, log: Callable[[str], None] = print) -> float:
    """Creates ``tool``'s venv afresh and installs it from PyPI; returns the seconds it took.

    Raises:
        ValueError: an unknown tool.
        subprocess.CalledProcessError: venv or pip failed (its output went to the log).
    """
    if tool not in REQUIREMENTS:
        raise ValueError(f"unknown field tool {tool!r}; choose from {', '.join(TOOLS)}")
    start = time.monotonic()
    venv = venvs_dir() / tool
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for args in REQUIREMENTS[tool]:
        done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *args],
                              capture_output=True, text=True)
        if done.returncode != 0:
            log(f"prefixcache bench: installing {tool} failed:\n{done.stdout}{done.stderr}")
            done.check_returncode()
    (venv / _READY).write_text(" ".join(" ".join(a) for a in REQUIREMENTS[tool]) + "\n")
    seconds = time.monotonic() - start
    log(f"prefixcache bench: {tool} installed in {venv} ({seconds:.0f} s)")
    return seconds


def install_tools(tools: list[str], log: Callable[[str], None] = print) -> dict[str, float]:
    """Installs ``tools`` side by side (pip waits on downloads more than on the CPU); returns the seconds each
    took. Raises the first failure after all have finished."""
    tools = list(dict.fromkeys(tools))  # a tool named twice: one install, not two racing on one venv
    with ThreadPoolExecutor(max_workers=len(tools) or 1) as pool:
        futures = {t: pool.submit(install_tool, t, log) for t in tools}
    return {t: f.result() for t, f in futures.items()}


# ------------------------------------------------------------------------------------------ workload

@dataclass(frozen=True)
class FieldWorkload:
    """The workload every tool is asked for (sizes in tokens and requests)."""

    groups: int = 2  # distinct shared prefixes (AIPerf: always one shared system prompt)
    num_requests: int = 20
    prefix_tokens: int = 256
    question_tokens: int = 32
    max_tokens: int = 4
    concurrency: int = 4
    seed: int = 1

    def groups_for(self, tool: str) -> int:
        return 1 if tool == "aiperf" else self.groups


def theoretical_hit_rate(workload: FieldWorkload, tool: str, num_requests: int, prompt_tokens: int) -> float:
    """An unbounded cache's hit rate over the shared prefixes alone (fraction of ``prompt_tokens``)."""
    if prompt_tokens <= 0:
        return 0.0
    return max(0, num_requests - workload.groups_for(tool)) * workload.prefix_tokens / prompt_tokens


@dataclass
class FieldRun:
    """One tool's run against one server, as the tool reported it, beside the server's counter deltas.

    Times in ms, throughputs per second; ``server_*`` None where the server has no ``/metrics``.
    """

    tool: str
    server: str
    exit_code: int
    requests: int = 0
    succeeded: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    output_tokens_per_s: float | None = None
    requests_per_s: float | None = None
    prompt_tokens: int = 0  # as the tool counted them (from usage)
    cached_tokens: int = 0  # as the tool reported them
    theoretical_hit_rate: float = 0.0
    server_counters: dict[str, float] | None = None  # deltas over the run
    unrecorded: int = 0  # requests the tool sent but left out of its report (GuideLLM, at the end of a run)
    wall_s: float = 0.0
    note: str = ""
    command: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


# ------------------------------------------------------------------------------------------ servers

@dataclass
class ServerProcess:
    """A server started for the runs: ``prefixcache serve`` or llama.cpp's, on loopback."""

    name: str
    url: str
    popen: subprocess.Popen
    log_path: Path
    has_metrics: bool = True

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()

    def counters(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        values = dict.fromkeys(_COUNTERS.values(), 0.0)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in _COUNTERS:
                    values[_COUNTERS[s.name]] += s.value
        return values


def _start(name: str, argv: list[str], port: int, log_dir: Path, startup_timeout_s: float,
           has_metrics: bool, env: dict[str, str] | None = None) -> ServerProcess:
    from prefixcache.entrypoints.cluster import LOOPBACK

    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name.replace(' ', '-').replace('.', '')}.log"
    log = open(log_path, "wb")
    popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, env={**os.environ, **(env or {})})
    log.close()
    server = ServerProcess(name, f"http://{LOOPBACK}:{port}", popen, log_path, has_metrics)
    deadline = time.monotonic() + startup_timeout_s
    while True:
        try:
            if httpx.get(server.url + ("/health" if has_metrics else "/v1/models"), timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if popen.poll() is not None or time.monotonic() > deadline:
            server.stop()
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{name} did not start (exit {popen.returncode}); its log ends:\n{tail}")
        time.sleep(0.3)


def start_prefixcache(model: str = DEFAULT_MODEL, num_threads: int = 2, block_size: int = 16,
                      log_dir: Path | None = None, startup_timeout_s: float = 300.0,
                      extra_args: tuple[str, ...] = ()) -> ServerProcess:
    """``prefixcache serve`` (float32: the same weights every tool and machine sees) on a free loopback port.

    Raises:
        RuntimeError: it exited or was not healthy within ``startup_timeout_s`` (its log's tail attached).
    """
    from prefixcache.entrypoints.cluster import LOOPBACK, _PACKAGE_ROOT, free_port

    port = free_port()
    argv = [sys.executable, "-m", "prefixcache", "serve", model, "--host", LOOPBACK, "--port", str(port),
            "--dtype", "float32", "--quantization", "none", "--num-threads", str(num_threads),
            "--block-size", str(block_size), "--log-level", "warning", *extra_args]
    path = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
    return _start(OURS, argv, port, Path(log_dir or tempfile.mkdtemp(prefix="prefixcache-field-")),
                  startup_timeout_s, True, {"PYTHONPATH": path})


def llama_cpp_server_missing() -> str | None:
    """Why llama.cpp's OpenAI server can't run here, or None."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install 'llama-cpp-python[server]')"
    for module in ("llama_cpp.server", "sse_starlette", "starlette_context"):
        try:
            if importlib.util.find_spec(module) is None:
                raise ImportError(module)
        except ImportError:
            return f"llama-cpp-python's server is not installed ({module} missing: pip install 'llama-cpp-python[server]')"
    return None


def start_llama_cpp(gguf: Path, model_name: str, num_threads: int, n_ctx: int = 2048,
                    log_dir: Path | None = None, startup_timeout_s: float = 300.0) -> ServerProcess:
    """llama-cpp-python's OpenAI server on ``gguf`` with its prompt cache on (``--cache true``)."""
    from prefixcache.entrypoints.cluster import LOOPBACK, free_port

    port = free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", model_name,
            "--host", LOOPBACK, "--port", str(port), "--n_threads", str(num_threads), "--n_ctx", str(n_ctx),
            "--cache", "true"]
    return _start(LLAMA_CPP, argv, port, Path(log_dir or tempfile.mkdtemp(prefix="prefixcache-field-")),
                  startup_timeout_s, False)


# ------------------------------------------------------------------------------------------ the tools

def _tool_argv(tool: str, url: str, model: str, tokenizer: Path, w: FieldWorkload, out: Path,
               controls: bool = True) -> tuple[list[str], dict]:
    """The tool's command line (as a user would type it) and the environment it needs.

    ``controls``: the server answers ``/health`` and the cache-flush routes (``/flush_cache``,
    ``/reset_prefix_cache``) the tools call; llama.cpp's Python server has neither, so against it
    GuideLLM skips its health probe and SGLang and AIPerf don't flush (a fresh server is the cold start).
    """
    b = tool_bin(tool)
    if tool == "guidellm":
        data = {"kind": "synthetic_text", "prompt_tokens": w.question_tokens, "output_tokens": w.max_tokens,
                "prefix_buckets": [{"prefix_count": w.groups, "prefix_tokens": w.prefix_tokens}]}
        return ([str(b / "guidellm"), "run", "--backend", f"kind=openai_http,target={url},model={model}" + ("" if controls else ",validate_backend=false"),
                 "--profile", f"kind=concurrent,streams={w.concurrency}",
                 "--constraint", f"kind=max_requests,count={w.num_requests}",
                 "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--data", json.dumps(data),
                 "--output", f"kind=json,path={out / 'guidellm.json'}", "--disable-progress"],
                {"HF_HUB_OFFLINE": "1"})
    if tool == "sglang":
        runner = Path(__file__).with_name("sglang_bench_serving.py")
        return ([str(b / "python"), str(runner), "--backend", "sglang-oai", "--base-url", url, "--model", model,
                 "--tokenizer", str(tokenizer), "--dataset-name", "generated-shared-prefix",
                 "--gsp-num-groups", str(w.groups), "--gsp-prompts-per-group", str(-(-w.num_requests // w.groups)),
                 "--gsp-system-prompt-len", str(w.prefix_tokens), "--gsp-question-len", str(w.question_tokens),
                 "--gsp-output-len", str(w.max_tokens), "--num-prompts", str(w.num_requests),
                 "--max-concurrency", str(w.concurrency), "--seed", str(w.seed), "--cache-report", *(["--flush-cache"] if controls else []),
                 "--disable-tqdm", "--output-file", str(out / "sglang.jsonl")],
                {"HF_HUB_OFFLINE": "1"})
    # AIPerf: HF_HUB_OFFLINE=1 makes it ignore a local tokenizer path, so it is left unset (the path is
    # local: nothing is downloaded)
    return ([str(b / "aiperf"), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
             "--tokenizer", str(tokenizer), "--request-count", str(w.num_requests), "--concurrency", str(w.concurrency),
             "--shared-system-prompt-length", str(w.prefix_tokens), "--prompt-input-tokens-mean", str(w.question_tokens),
             "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(w.max_tokens),
             "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--random-seed", str(w.seed),
             *(["--reset-kv-cache"] if controls else []), "--ui-type", "none", "--workers-max", "2", "--artifact-dir", str(out / "aiperf")],
            {"HF_HUB_OFFLINE": ""})


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def _parse(tool: str, out: Path, run: FieldRun) -> None:
    """Fills ``run`` from the tool's own output files."""
    if tool == "guidellm":
        bench = json.loads((out / "guidellm.json").read_text())["benchmarks"][0]
        totals = bench["metrics"]["request_totals"]
        run.succeeded = int(totals["successful"])
        # GuideLLM 0.8 can end a run with a request still in flight, served but in none of its totals
        created = int((bench.get("scheduler_state") or {}).get("created_requests") or totals["total"])
        run.requests, run.unrecorded = created, max(0, created - int(totals["total"]))
        reqs = bench["requests"]["successful"]
        m = bench["metrics"]
        for key, attr in (("time_to_first_token_ms", "ttft"), ("time_per_output_token_ms", "tpot")):
            stats = m[key]["successful"]
            setattr(run, f"{attr}_p50_ms", stats["median"])
            setattr(run, f"{attr}_p99_ms", stats["percentiles"]["p99"])
        run.prompt_tokens = sum(int(r.get("prompt_tokens") or 0) for r in reqs)
        run.cached_tokens = sum(int((r.get("input_metrics") or {}).get("cached_tokens") or 0) for r in reqs)
        duration = bench.get("duration") or 0
        if duration:
            run.output_tokens_per_s = sum(int(r.get("output_tokens") or 0) for r in reqs) / duration
            run.requests_per_s = len(reqs) / duration
    elif tool == "sglang":
        r = json.loads((out / "sglang.jsonl").read_text().strip().splitlines()[-1])
        run.succeeded = int(r["completed"])  # run.requests: the number asked for
        run.ttft_p50_ms, run.ttft_p99_ms = r["median_ttft_ms"], r["p99_ttft_ms"]
        run.tpot_p50_ms, run.tpot_p99_ms = r["median_tpot_ms"], r["p99_tpot_ms"]
        run.output_tokens_per_s, run.requests_per_s = r["output_throughput"], r["request_throughput"]
        report = r.get("cache_report") or {}
        run.prompt_tokens = int(report.get("total_prompt_tokens") or 0)
        run.cached_tokens = int(report.get("total_cached_tokens") or 0)
    else:
        d = json.loads((out / "aiperf" / "profile_export_aiperf.json").read_text())
        value = lambda key, stat="avg": (d.get(key) or {}).get(stat)  # noqa: E731
        run.succeeded = int(value("request_count") or 0)
        run.requests = run.succeeded + len(d.get("error_summary") or [])
        run.ttft_p50_ms, run.ttft_p99_ms = value("time_to_first_token", "p50"), value("time_to_first_token", "p99")
        run.tpot_p50_ms, run.tpot_p99_ms = value("inter_token_latency", "p50"), value("inter_token_latency", "p99")
        run.output_tokens_per_s, run.requests_per_s = value("output_token_throughput"), value("request_throughput")
        run.prompt_tokens = int(value("total_usage_prompt_tokens") or 0)
        run.cached_tokens = int(value("total_usage_prompt_cache_read_tokens") or 0)


def run_tool(tool: str, server: ServerProcess, workload: FieldWorkload, tokenizer: Path, out_dir: Path,
             model_name: str = DEFAULT_MODEL, timeout_s: float = 600.0) -> FieldRun:
    """Runs ``tool`` against ``server`` once: flushes its cache, reads its counters, runs the tool, reads them
    again. Never raises for the tool's own failure: ``exit_code`` and ``note`` say what happened.

    Raises:
        ValueError: ``tool`` is not installed (:func:`tool_missing`).
    """
    missing = tool_missing(tool)
    if missing:
        raise ValueError(missing)
    out = Path(out_dir) / f"{tool}-{server.name.replace(' ', '-').replace('.', '')}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    argv, env = _tool_argv(tool, server.url, model_name, tokenizer, workload, out, server.has_metrics)
    env = {k: v for k, v in {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "NO_COLOR": "1", **env}.items() if v}
    if server.has_metrics:
        httpx.post(server.url + "/flush_cache", timeout=60).raise_for_status()
        before = server.counters()
    start = time.monotonic()
    with open(out / "tool.log", "wb") as log:
        try:
            code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  cwd=out, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = 124
    run = FieldRun(tool, server.name, code, requests=workload.num_requests, wall_s=time.monotonic() - start,
                   command=argv)
    if server.has_metrics:
        after = server.counters()
        run.server_counters = {k: after[k] - before[k] for k in after}
    try:
        _parse(tool, out, run)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        tail = (out / "tool.log").read_text(errors="replace")[-1500:]
        run.note = f"no result to read ({type(e).__name__}: {e}); its log ends: {tail}"
    run.theoretical_hit_rate = theoretical_hit_rate(workload, tool, run.succeeded, run.prompt_tokens)
    return run


# ------------------------------------------------------------------------------------------ the benchmark

TOOL_TITLES = {"guidellm": "GuideLLM", "sglang": "SGLang bench_serving", "aiperf": "NVIDIA AIPerf"}


def run_field_bench(model: str, workload: FieldWorkload, num_threads: int, out_dir: Path,
                    log: Callable[[str], None] = print, with_llama_cpp: bool = True) -> dict:
    """Every installed tool against our server and (when installed) llama.cpp's; returns the result dict
    (``runs``: :class:`FieldRun` as dicts; ``skipped``: tool or server -> why)."""
    from prefixcache.bench.speed import llama_cpp_skip_reason
    from prefixcache.models.loader import resolve_model_dir

    tokenizer = resolve_model_dir(model)
    versions, skipped = {}, {}
    tools = []
    for tool in TOOLS:
        missing = tool_missing(tool)
        if missing:
            skipped[tool] = missing
        else:
            tools.append(tool)
            versions[tool] = _version(tool)
    servers: list[Callable[[], ServerProcess]] = [
        lambda: start_prefixcache(model, num_threads, log_dir=out_dir)]
    reason = llama_cpp_server_missing() if with_llama_cpp else "skipped"
    gguf = None
    if reason is None:
        reason, gguf = llama_cpp_skip_reason(model, num_threads)
    if reason:
        skipped[LLAMA_CPP] = reason
    else:
        servers.append(lambda: start_llama_cpp(gguf, model, num_threads, log_dir=out_dir))
    runs = []
    if tools:
        for start in servers:
            server = start()
            try:
                for i, tool in enumerate(tools):
                    if i and not server.has_metrics:  # no cache-flush route: a fresh server is its cold start
                        server.stop()
                        server = start()
                    log(f"prefixcache bench: field: {tool} against {server.name} ...")
                    run = run_tool(tool, server, workload, tokenizer, out_dir, model)
                    log(f"prefixcache bench: field: {tool} exit {run.exit_code}, {run.succeeded}/{run.requests} ok, "
                        f"hit rate {run.hit_rate:.1%} (theoretical {run.theoretical_hit_rate:.1%}), {run.wall_s:.0f} s")
                    runs.append(run)
            finally:
                server.stop()
    return {"workload": asdict(workload), "model": model, "num_threads": num_threads, "versions": versions,
            "runs": [asdict(r) | {"hit_rate": r.hit_rate} for r in runs], "skipped": skipped}


def _version(tool: str) -> str:
    dist = {"guidellm": "guidellm", "sglang": "sglang", "aiperf": "aiperf"}[tool]
    done = subprocess.run([str(tool_bin(tool) / "python"), "-c",
                           f"import importlib.metadata as m; print(m.version({dist!r}))"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "?"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f}"


def field_markdown(result: dict) -> str:
    """One table per tool: each server's row as that tool reported it, beside our ``/metrics`` deltas."""
    w = result["workload"]
    lines = [f"Each tool's own synthetic shared-prefix workload: {w['num_requests']} requests, {w['groups']} shared "
             f"prefixes of {w['prefix_tokens']} tokens (AIPerf: one shared system prompt), a {w['question_tokens']}-token "
             f"question each, {w['max_tokens']} output tokens, {w['concurrency']} at once; model {result['model']} "
             f"(float32), {result['num_threads']} threads, the cache flushed before each run. Hit rate = the "
             "tool's cached ÷ prompt tokens; theoretical = an unbounded cache over the shared prefixes alone; "
             "`/metrics` = Δ `vllm:prefix_cache_hits_total` over the run.", ""]
    for tool in TOOLS:
        rows = [r for r in result["runs"] if r["tool"] == tool]
        title = f"{TOOL_TITLES[tool]} {result['versions'].get(tool, '')}".strip()
        if not rows:
            lines += [f"**{TOOL_TITLES[tool]}**: not run: {result['skipped'].get(tool, 'not installed')}", ""]
            continue
        lines += [f"**{title}**", "",
                  "| server | ok | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | output tok/s | req/s | hit rate | "
                  "theoretical | cached tokens (tool) | `/metrics` hits |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            counters = r["server_counters"]
            hits = "–" if counters is None else f"{counters['vllm_hits']:,.0f}"
            status = (f"{r['succeeded']}/{r['requests']}" + ("" if r["exit_code"] == 0 else f" (exit {r['exit_code']})")
                      + (f" ({r['unrecorded']} served, not in the tool's report)" if r.get("unrecorded") else ""))
            lines.append(f"| {r['server']} | {status} | {_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p99_ms'])} | "
                         f"{_ms(r['tpot_p50_ms'])} / {_ms(r['tpot_p99_ms'])} | "
                         f"{(r['output_tokens_per_s'] or 0):.1f} | {(r['requests_per_s'] or 0):.2f} | {r['hit_rate']:.1%} | "
                         f"{r['theoretical_hit_rate']:.1%} | {r['cached_tokens']:,} | {hits} |")
        lines.append("")
    if LLAMA_CPP in result["skipped"]:
        lines += [f"{LLAMA_CPP}: not run: {result['skipped'][LLAMA_CPP]}", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_field_outputs(result: dict, out_dir: str | Path) -> list[Path]:
    """``field.json`` and ``field.md`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "field.json").write_text(json.dumps(result, indent=2))
    (out / "field.md").write_text(field_markdown(result))
    return [out / "field.json", out / "field.md"]
