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
the deltas of the hit and query counters are set beside what the tool reports. The theoretical hit rate is exact
(:mod:`prefixcache.bench.theoretical_hits`): the prompts each tool actually sent, read back from its own output
files (SGLang's through :mod:`~prefixcache.bench.sglang_bench_serving`), tokenized as our server tokenizes them,
each request's longest prefix shared with an earlier one, in tokens.

llama.cpp's server (``llama-cpp-python[server]``, the ``llamacpp`` extra plus its server's dependencies, on the
model's GGUF, prompt cache on) is run under the same tools when it is installed. What it needs differently:
``--interrupt_requests false`` (by default a new request cuts the running stream short after one chunk, so all but
one of the concurrent requests come back empty); GuideLLM on ``/v1/completions`` for every server (its chat
requests carry content as a list of parts, which the GGUF's chat template, rendered by llama-cpp-python as is,
can't concatenate); ``max_tokens`` beside AIPerf's ``max_completion_tokens`` (llama-cpp-python reads only the
former). It has no ``/metrics``, no cache-flush route and no usage in its streams, so its hits are read from its
own log (``N prefix-match hit``) and a fresh server is each tool's cold start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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

from prefixcache.bench.field_venvs import venvs_dir
from prefixcache.bench.loopback_server import LoopbackServer, start_loopback_server, start_serve
from prefixcache.config import DEFAULT_MODEL
from prefixcache.entrypoints.cli.cluster import LOOPBACK, free_port

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
OURS, LLAMA_CPP = "prefixcache", "llama.cpp server"
_COUNTERS = {"vllm:prefix_cache_hits_total": "vllm_hits", "vllm:prefix_cache_queries_total": "vllm_queries",
             "prefixcache:prefix_cache_hits_total": "hits", "prefixcache:prefix_cache_queries_total": "queries"}


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


@dataclass
class FieldRun:
    """One tool's run against one server, as the tool reported it, beside the server's counter deltas.

    Times in ms, throughputs per second; ``server_counters`` None where the server has neither ``/metrics``
    nor a log that counts its hits. Hit rates are fractions of prompt tokens.
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
    sent_prompts: int = 0  # the prompts read back from the tool's files (the theoretical rate's requests)
    sent_prompt_tokens: int = 0  # their tokens, as our server tokenizes them
    theoretical_hit_tokens: int = 0
    server_counters: dict[str, float] | None = None  # deltas over the run (llama.cpp: from its log)
    usage_in_stream: bool = True  # the server's streams end with usage (llama-cpp-python's carry none)
    unrecorded: int = 0  # requests the tool sent but left out of its report (GuideLLM, at the end of a run)
    wall_s: float = 0.0
    note: str = ""
    command: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """The tool's cached ÷ prompt tokens where its responses carried usage; else the server's hits (its
        counters, or llama.cpp's log) ÷ the sent prompts' tokens."""
        source = self.hit_rate_source
        if source == "tool":
            return self.cached_tokens / self.prompt_tokens
        if source == "server":
            return self.server_counters.get("hits", 0.0) / self.sent_prompt_tokens
        return 0.0

    @property
    def hit_rate_source(self) -> str:
        """``tool``, ``server`` or ``""`` (nothing to measure it from)."""
        if self.usage_in_stream and self.prompt_tokens:
            return "tool"
        return "server" if self.server_counters and self.sent_prompt_tokens else ""


# ------------------------------------------------------------------------------------------ servers

@dataclass
class ServerProcess(LoopbackServer):
    """A server started for the runs: ``prefixcache serve`` or llama.cpp's, on loopback (``has_metrics``:
    it serves ``/metrics`` and ``/health``; llama.cpp's server has neither, its hits are read from its log)."""

    has_metrics: bool = True

    @classmethod
    def of(cls, server: LoopbackServer, has_metrics: bool) -> ServerProcess:
        return cls(server.name, server.url, server.popen, server.log_path, has_metrics=has_metrics)

    def log_counters(self) -> dict[str, float]:
        """llama-cpp-python's hits since it started, from its log: each ``Llama.generate`` that reuses its
        context prints ``N prefix-match hit, remaining M prompt tokens to eval`` (a full-prompt hit prints
        ``full prompt already cached``, counted as a request with hits of unknown size in ``full_prompt_hits``)."""
        text = self.log_path.read_text(errors="replace")
        hits = [int(m) for m in re.findall(r"Llama\.generate: (\d+) prefix-match hit", text)]
        return {"hits": float(sum(hits)), "requests_with_hits": float(len(hits)),
                "full_prompt_hits": float(text.count("full prompt already cached")),
                # uvicorn's access log: one line per generation request received
                "requests": float(len(re.findall(r'"POST /v1/(?:chat/)?completions HTTP', text)))}

    def counters(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        values = dict.fromkeys(_COUNTERS.values(), 0.0)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in _COUNTERS:
                    values[_COUNTERS[s.name]] += s.value
        return values


def start_prefixcache(model: str = DEFAULT_MODEL, num_threads: int = 2, block_size: int = 16,
                      log_dir: Path | None = None, startup_timeout_s: float = 300.0,
                      extra_args: tuple[str, ...] = ()) -> ServerProcess:
    """``prefixcache serve`` (float32: the same weights every tool and machine sees) on a free loopback port.

    Raises:
        RuntimeError: it exited or was not healthy within ``startup_timeout_s`` (its log's tail attached).
    """
    args = ("--dtype", "float32", "--quantization", "none", "--num-threads", str(num_threads),
            "--block-size", str(block_size), "--log-level", "warning", *extra_args)
    return ServerProcess.of(start_serve(model, args, OURS, log_dir or _field_log_dir(), startup_timeout_s), True)


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
    """llama-cpp-python's OpenAI server on ``gguf`` with its prompt cache on (``--cache true``).

    ``--interrupt_requests false``: its default cuts the running stream short (one chunk, then ``[DONE]``)
    whenever another request waits for its single context, which under concurrency empties every answer
    but the last. ``--disable_ping_events true``: the ``: ping`` comment lines it sends into a stream every 15 s
    (while a request waits its turn, or a loaded machine is slow) are not JSON, and SGLang's client fails on
    them. ``--verbose`` (its default) stays on: the log is where its prefix-match hits are read.
    """
    port = free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", model_name,
            "--host", LOOPBACK, "--port", str(port), "--n_threads", str(num_threads), "--n_ctx", str(n_ctx),
            "--cache", "true", "--interrupt_requests", "false", "--disable_ping_events", "true"]
    server = start_loopback_server(LLAMA_CPP, argv, port, Path(log_dir or _field_log_dir()), startup_timeout_s,
                                   ready_path="/v1/models")  # it has no /health
    return ServerProcess.of(server, False)


def _field_log_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="prefixcache-field-"))


# ------------------------------------------------------------------------------------------ the tools

def _tool_argv(tool: str, url: str, model: str, tokenizer: Path, w: FieldWorkload, out: Path,
               controls: bool = True) -> tuple[list[str], dict]:
    """The tool's command line (as a user would type it) and the environment it needs.

    ``controls``: the server answers ``/health`` and the cache-flush routes (``/flush_cache``,
    ``/reset_prefix_cache``) the tools call; llama.cpp's Python server has neither, so against it
    GuideLLM skips its health probe and SGLang and AIPerf don't flush (a fresh server is the cold start).
    Every other argument is the same for every server, so each tool sends every server the same requests:
    GuideLLM on ``/v1/completions`` (its chat requests carry content parts llama-cpp-python's template
    rendering can't join) and AIPerf with ``max_tokens`` beside its ``max_completion_tokens`` (the only
    name llama-cpp-python reads; ours takes ``max_completion_tokens`` when both come).
    """
    b = tool_bin(tool)
    if tool == "guidellm":
        data = {"kind": "synthetic_text", "prompt_tokens": w.question_tokens, "output_tokens": w.max_tokens,
                "prefix_buckets": [{"prefix_count": w.groups, "prefix_tokens": w.prefix_tokens}]}
        return ([str(b / "guidellm"), "run", "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/completions"
                 + ("" if controls else ",validate_backend=false"),
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
                {"HF_HUB_OFFLINE": "1", PROMPTS_ENV: str(out / SGLANG_PROMPTS)})
    # AIPerf: HF_HUB_OFFLINE=1 makes it ignore a local tokenizer path, so it is left unset (the path is
    # local: nothing is downloaded)
    return ([str(b / "aiperf"), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
             "--tokenizer", str(tokenizer), "--request-count", str(w.num_requests), "--concurrency", str(w.concurrency),
             "--shared-system-prompt-length", str(w.prefix_tokens), "--prompt-input-tokens-mean", str(w.question_tokens),
             "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(w.max_tokens),
             "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
             "--extra-inputs", f"max_tokens:{w.max_tokens}", "--random-seed", str(w.seed),
             *(["--reset-kv-cache"] if controls else []), "--ui-type", "none", "--workers-max", "2", "--artifact-dir", str(out / "aiperf")],
            {"HF_HUB_OFFLINE": ""})


PROMPTS_ENV = "PREFIXCACHE_FIELD_PROMPTS"  # where sglang_bench_serving.py writes the prompts SGLang generated
SGLANG_PROMPTS = "sglang-prompts.json"


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


def _last_error(log: Path) -> str:
    """The tool log's last line that names an error (else its last line), for a one-line note."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no tool log"
    errors = [line for line in lines if re.search(r"Error|Exception|error:", line)]
    return "its log: " + ((errors or lines or ["(empty)"])[-1])[:400]


def sent_prompts(tool: str, out: Path, flushed: bool = True) -> tuple[list, list]:
    """The prompts ``tool`` sent and got answers to, in the order it sent them, read back from its own files
    in ``out``; and the warm-up prompts sent before them on a cache that was not flushed in between.

    Each prompt is a completion prompt (a str) or a chat conversation (a list of message dicts).
    ``flushed``: SGLang's warm-up request (its first prompt) is followed by a cache flush only where the
    server has a flush route; otherwise it is an earlier request whose prefix the measured ones may reuse.

    Raises:
        OSError, ValueError, KeyError: the tool's files are missing or not what this release writes.
    """
    if tool == "guidellm":
        bench = json.loads((out / "guidellm.json").read_text())["benchmarks"][0]
        reqs = sorted(bench["requests"]["successful"] or [],
                      key=lambda r: ((r.get("info") or {}).get("timings") or {}).get("request_start") or 0)
        bodies = [json.loads(r["request_args"])["body"] for r in reqs]
        return [b["prompt"] if "prompt" in b else b["messages"] for b in bodies], []
    if tool == "sglang":
        prompts = json.loads((out / SGLANG_PROMPTS).read_text())
        return prompts, ([] if flushed or not prompts else [prompts[0]])
    sessions = {d["session_id"]: d["payloads"][0]
                for d in json.loads((out / "aiperf" / "inputs.json").read_text())["data"]}
    records = [json.loads(line) for line in (out / "aiperf" / "profile_export.jsonl").read_text().splitlines()
               if line.strip()]
    records = sorted((r for r in records if not r.get("error")), key=lambda r: r["metadata"]["request_start_ns"])
    return [sessions[r["metadata"]["conversation_id"]]["messages"] for r in records], []


def tokenize_prompts(prompts: list, tokenizer) -> list[list[int]]:
    """Token ids as our server makes them: a completion prompt encoded with the tokenizer's special tokens; a
    conversation rendered by the chat template (generation prompt added), its text parts joined, then
    encoded without adding any (the template writes them)."""
    ids = []
    for p in prompts:
        if isinstance(p, str):
            ids.append(list(tokenizer.encode(p, add_special_tokens=True)))
            continue
        messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                     "".join(part.get("text", "") for part in m["content"])} for m in p]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return ids


def _theoretical(run: FieldRun, tool: str, out: Path, flushed: bool, tokenizer_dir: Path) -> None:
    """Fills the theoretical hit rate of what ``tool`` sent (:mod:`prefixcache.bench.theoretical_hits`)."""
    from transformers import AutoTokenizer

    from prefixcache.bench.theoretical_hits import theoretical_hits

    prompts, warm = sent_prompts(tool, out, flushed)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    ids = tokenize_prompts(prompts, tokenizer)
    hits = theoretical_hits(ids, tokenize_prompts(warm, tokenizer))
    run.sent_prompts, run.sent_prompt_tokens, run.theoretical_hit_tokens = len(ids), sum(map(len, ids)), sum(hits)
    run.theoretical_hit_rate = run.theoretical_hit_tokens / run.sent_prompt_tokens if run.sent_prompt_tokens else 0.0
    received = (run.server_counters or {}).get("requests")
    if received is not None and received != len(ids) + len(warm):
        # the log's hits then cover requests the tool did not record (or miss some it did): not comparable
        run.note = (run.note + "; " if run.note else "") + (
            f"the server's log counts {received:.0f} requests, the tool recorded {len(ids)} (+{len(warm)} warm-up): "
            "no measured hit rate")
        run.server_counters = None


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
                   command=argv, usage_in_stream=server.has_metrics)
    if server.has_metrics:
        after = server.counters()
        run.server_counters = {k: after[k] - before[k] for k in after}
    else:  # a fresh server per tool: its whole log is this run's
        run.server_counters = server.log_counters()
    try:
        _parse(tool, out, run)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        run.note = f"no result to read ({type(e).__name__}: {e}); {_last_error(out / 'tool.log')}"
    try:
        if run.succeeded:  # SGLang writes its prompts before its warm-up: a run that failed sent none of them
            _theoretical(run, tool, out, server.has_metrics, tokenizer)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        run.note = (run.note + "; " if run.note else "") + f"no prompts to read back ({type(e).__name__}: {e})"
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
        # a first start after a kernel source change builds the CPU kernels first: minutes on 2 cores
        lambda: start_prefixcache(model, num_threads, log_dir=out_dir, startup_timeout_s=900.0)]
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
        for k, start in enumerate(servers):
            try:
                server = start()
            except RuntimeError as e:
                if k == 0:  # our own server not starting is a failure of this benchmark, not a row
                    raise
                skipped[LLAMA_CPP] = f"did not start: {str(e).splitlines()[0]}"
                continue
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
            "llama_cpp_gguf": gguf.name if gguf is not None and LLAMA_CPP not in skipped else None,
            "runs": [_run_dict(r) for r in runs], "skipped": skipped}


def _run_dict(run: FieldRun) -> dict:
    return asdict(run) | {"hit_rate": run.hit_rate, "hit_rate_source": run.hit_rate_source}


def _version(tool: str) -> str:
    dist = {"guidellm": "guidellm", "sglang": "sglang", "aiperf": "aiperf"}[tool]
    done = subprocess.run([str(tool_bin(tool) / "python"), "-c",
                           f"import importlib.metadata as m; print(m.version({dist!r}))"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "?"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f}"


# What each server needs said under its rows, once (the reasons are in the module docstring)
LLAMA_CPP_LIMITS = (
    "llama.cpp server (llama-cpp-python): its streams carry no `usage` (it ignores `stream_options`), so no tool "
    "can count its prompt or cached tokens: its hit rate is the hits its own log reports (`Llama.generate: N "
    "prefix-match hit`) over the sent prompts' tokens; it ignores `ignore_eos`, so an answer may stop early at "
    "EOS; it serves one request at a time (the others wait for its single context, so their TTFT includes the "
    "wait); it has no cache-flush route, so each tool gets a fresh server.")


def _hit_cell(r: dict) -> str:
    source = r.get("hit_rate_source", "tool" if r["prompt_tokens"] else "")
    if not source:
        return "–"
    return f"{r['hit_rate']:.1%}" + (" (log)" if source == "server" and r["server_counters"] and
                                       "vllm_hits" not in r["server_counters"] else "")


def _server_hits(r: dict) -> str:
    counters = r["server_counters"]
    if not counters:
        return "–"
    if "vllm_hits" in counters:
        return f"{counters['vllm_hits']:,.0f}"
    return f"{counters['hits']:,.0f} (log)"


def field_markdown(result: dict) -> str:
    """One table per tool: each server's row as that tool reported it, beside the server's own hit count
    (our ``/metrics`` deltas, llama.cpp's log) and the exact theoretical hit rate of the prompts sent."""
    w = result["workload"]
    gguf = result.get("llama_cpp_gguf")
    lines = [f"Each tool's own synthetic shared-prefix workload: {w['num_requests']} requests, {w['groups']} shared "
             f"prefixes of {w['prefix_tokens']} tokens (AIPerf: one shared system prompt), a {w['question_tokens']}-token "
             f"question each, {w['max_tokens']} output tokens, {w['concurrency']} at once; model {result['model']} "
             f"(ours: float32" + (f"; llama.cpp: {gguf}" if gguf else "") + f"), {result['num_threads']} threads, the "
             "cache flushed (llama.cpp: a fresh server) before each run. Hit rate = the tool's cached ÷ prompt tokens "
             "from the usage of each answer; theoretical = exact, over the prompts the tool sent (read back from its "
             "files, tokenized as our server does): each request's longest prefix shared with an earlier one, in "
             "tokens, at most all but its last token; server hits = Δ `vllm:prefix_cache_hits_total` over the run "
             "(llama.cpp: its log).", ""]
    notes = []
    for tool in TOOLS:
        rows = [r for r in result["runs"] if r["tool"] == tool]
        title = f"{TOOL_TITLES[tool]} {result['versions'].get(tool, '')}".strip()
        if not rows:
            lines += [f"**{TOOL_TITLES[tool]}**: not run: {result['skipped'].get(tool, 'not installed')}", ""]
            continue
        lines += [f"**{title}**", "",
                  "| server | ok | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | output tok/s | req/s | hit rate | "
                  "theoretical | measured ÷ theoretical | cached tokens (tool) | server hits |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            status = (f"{r['succeeded']}/{r['requests']}" + ("" if r["exit_code"] == 0 else f" (exit {r['exit_code']})")
                      + (f" ({r['unrecorded']} served, not in the tool's report)" if r.get("unrecorded") else ""))
            hit = _hit_cell(r)
            ratio = (f"{r['hit_rate'] / r['theoretical_hit_rate']:.3f}" if hit != "–" and r["theoretical_hit_rate"]
                     else "–")
            cached = f"{r['cached_tokens']:,}" if r.get("usage_in_stream", True) else "–"
            lines.append(f"| {r['server']} | {status} | {_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p99_ms'])} | "
                         f"{_ms(r['tpot_p50_ms'])} / {_ms(r['tpot_p99_ms'])} | "
                         f"{(r['output_tokens_per_s'] or 0):.1f} | {(r['requests_per_s'] or 0):.2f} | {hit} | "
                         f"{r['theoretical_hit_rate']:.1%} | {ratio} | {cached} | {_server_hits(r)} |")
            if r["note"]:
                notes.append(f"{TOOL_TITLES[tool]} against {r['server']}: {r['note'].splitlines()[0][:600]}")
        lines.append("")
    if any(r["server"] == LLAMA_CPP for r in result["runs"]):
        lines += [LLAMA_CPP_LIMITS, ""]
    lines += [n + "\n" for n in notes]
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
