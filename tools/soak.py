"""Bounded-time soak test of a live ``prefixcache serve`` over loopback (run by hand, not a unit test).

Usage::

    # starts its own server (flags this script doesn't know go to `prefixcache serve`), 5 minutes:
    python tools/soak.py --clients 48 --duration-s 300 --json soak.json --num-threads 2 --num-blocks 2048
    # an already running server (RSS needs its pid; the greedy reference server still starts here,
    # with the serve flags given, which should match the target's):
    python tools/soak.py --url http://127.0.0.1:8000 --pid 1234 --duration-s 60
    # soak around a known engine bug while it is being fixed:
    python tools/soak.py --skip-bad top_p_1e-46

What it does:

1. Starts ``prefixcache serve MODEL --host 127.0.0.1 --port FREE`` (its log goes to a file), waits for
   ``/health``, sends a warm-up (short requests, a concurrent burst, each bad input once: growth
   should measure the soak, not first-use costs), drains, and reads the server's RSS (``VmRSS`` of
   ``/proc/PID/status``).
2. For ``--duration-s`` seconds, ``--clients`` concurrent clients each send one request after
   another: chat and completion requests sharing a few long system prompts (the prefix cache is
   hit), mostly streamed, some not, random ``max_tokens``, greedy and sampled (some with ``n=2``).
   ``--disconnect-fraction`` of them close the stream after a random number of chunks,
   ``--slow-fraction`` sleep between chunks. One more client sends the bad-input set round robin
   (``--bad-interval-s`` apart; the 10 MB prompt at most once a minute): malformed JSON, empty
   prompts, a prompt longer than the context, ``max_tokens`` 0 and 10**9, ``temperature`` -1,
   ``top_p`` 0, 1e-46 and 1.5, token ids outside the vocabulary, an unknown model, a lone surrogate
   ``"\\ud800"``, a 10 MB prompt, ``n`` 1000, and wrong types. Each bad input expects a 4xx with
   OpenAI's error body (``top_p`` 1e-46 may also get 200: the engine then samples the argmax).
3. Drains: polls ``/metrics`` until ``prefixcache:num_requests_running`` and ``_waiting`` are 0
   (``--drain-timeout-s``), then reads ``prefixcache:kv_blocks_in_use`` and the RSS again.
4. Sends ~6 greedy prompts (chat and completion, some sharing the soak's system prompts, 24
   tokens) to the soaked server, stops it, starts a fresh server with the same flags and sends them
   again; the texts must be equal (the server returns no token ids, so text equality stands in).

The clients run in this process, on the server's machine: on a few cores their CPU use inflates the
latencies, so give the server fewer ``--num-threads`` than there are cores. ``/health`` answering
503 (the engine loop died) ends the load early (``--keep-going`` doesn't); the report says so.

The report (printed; ``--json PATH`` writes it; ``--report PAGE`` puts its table into PAGE's ``soak``
section, e.g. ``docs/benchmarks.md``; ``--trace PATH`` writes every request as a JSON line) has requests by kind, responses by status, the unexpected outcomes grouped (kind, status,
problem) with when the first was sent and answered, the first 5xx and the bad inputs sent in the
10 s before it (the likely trigger), per-bad-input statuses and worst latency, TTFT and end-to-end p50/p99 of the good
requests (TTFT: streams that got a token, slow readers included; end-to-end: complete requests,
slow readers and disconnects excluded), the drain, RSS before/after, a timeline (``/health``,
running, waiting, KV blocks in use and RSS every ``--monitor-interval-s``) and the greedy comparison.

Checks (exit status 1 unless all pass; 2 when the server could not be started):

- ``no_5xx``: no request (good or bad) got a 5xx.
- ``good_requests_ok``: every good request got 200 and a complete answer: valid SSE events, no
  error event, ``[DONE]``, a ``finish_reason`` other than ``error`` for each choice, no time-out and
  no dropped connection (a requested disconnect only needs 200 and clean events until it closes).
- ``bad_inputs_expected``: every bad input was sent at least once and always got its expected
  status (and a 4xx carried ``{"error": {"message": ...}}``).
- ``drained_no_blocks_in_use``: the server went idle within the drain timeout and then held 0 KV
  blocks (cached blocks have no holder, so a leak shows here).
- ``rss_growth``: RSS after the drain minus RSS before the soak < ``--max-rss-growth-mb`` (MiB;
  skipped with ``--url`` and no ``--pid``).
- ``greedy_equal``: every greedy output of the soaked server equals the fresh server's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "smollm2-135m"
HEALTH_TIMEOUT_S = 180.0
BIG_PROMPT_BYTES = 10 * 1000 * 1000
MAX_PRINTED_GROUPS = 30  # unexpected-outcome groups printed (the JSON report has all)
ROLES = [
    "a patient librarian at a large city library who helps visitors find books and use the catalogue",
    "a support engineer for a cloud storage product who helps customers with uploads and billing",
    "a cooking instructor who teaches beginners to plan, shop for and cook simple weekly meals",
]
NOUNS = ["opening hours", "late fees", "passwords", "invoices", "recipes", "knives", "backups", "quotas",
         "e-books", "refunds", "ovens", "reservations", "folders", "spices", "receipts", "printers"]
VERBS = ["answer", "explain", "reply", "respond", "summarize", "clarify"]
MANNERS = ["briefly", "politely", "step by step", "in plain words", "with one example", "carefully"]
QUESTIONS = [
    "What should I do first?", "Can you explain how this works?", "What are the most common mistakes?",
    "How long does it usually take?", "Is there a cheaper way?", "What do you recommend for a beginner?",
    "Give me three tips.", "What is the difference between the two options?", "Why did my last attempt fail?",
    "Can you summarize the rules?", "Who should I ask if this does not work?", "What happens next?",
]
GOOD_KINDS = [f"{e}_{m}" for e in ("chat", "completion") for m in ("stream", "plain", "disconnect", "slow")]


# ---------------------------------------------------------------------------- records
@dataclass(slots=True)
class Outcome:
    """One request's result, as the client saw it."""

    kind: str  # "chat_stream", ..., or "bad:<name>"
    status: int  # HTTP status; 0 when no response came back
    start_s: float  # when it was sent, seconds since the soak began
    e2e_s: float  # seconds from send to the last byte read (or the close)
    ttft_s: float | None = None  # seconds to the first streamed text, streams only
    problem: str | None = None  # why this outcome was not expected; None when it was
    timed: bool = False  # counts towards the end-to-end percentiles


@dataclass(frozen=True)
class GoodSpec:
    """A well-formed request of the soak mix."""

    kind: str
    path: str  # "/v1/chat/completions" or "/v1/completions"
    body: dict
    disconnect_after: int | None = None  # close the stream after this many data events
    slow_s: float = 0.0  # seconds slept after each streamed event


@dataclass(frozen=True)
class BadInput:
    """A malformed or out-of-range request and the statuses it may get."""

    name: str
    path: str
    body: dict | bytes  # bytes are sent as they are (malformed JSON)
    also_ok: frozenset[int] = frozenset()  # accepted besides any 4xx
    stream: bool = False  # on 200, read a couple of events and close (max_tokens 10**9)
    every_s: float = 0.0  # send at most once per this many seconds

    def encoded(self) -> bytes:
        """The body as JSON bytes; ASCII escapes keep a lone surrogate as ``\\ud800`` on the wire."""
        if isinstance(self.body, bytes):
            return self.body
        return json.dumps({**self.body, "stream": True} if self.stream else self.body).encode()


@dataclass(frozen=True)
class Workload:
    """What the clients draw from: the model, the shared system prompts and the bad-input set."""

    model: str
    system_prompts: list[str]
    bad_inputs: list[BadInput]


# ---------------------------------------------------------------------------- the server process
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int | None) -> float | None:
    """``VmRSS`` of process ``pid`` in MiB (None without a pid or once it's gone)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB → MiB
    except OSError:
        return None
    return None


class ServerProcess:
    """``prefixcache serve MODEL FLAGS`` on a free loopback port, its output in ``log_path``.

    Use as a context manager: the process is stopped on exit, also on Ctrl-C or an error.
    """

    def __init__(self, model: str, flags: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        has_level = any(f == "--log-level" or f.startswith("--log-level=") for f in flags)
        self.cmd = [sys.executable, "-m", "prefixcache.entrypoints.cli.main", "serve", model, *flags,
                    "--host", "127.0.0.1", "--port", str(self.port), *([] if has_level else ["--log-level", "warning"])]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # Ctrl-C reaches us; we stop it
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Terminates the server (SIGTERM, then SIGKILL after ``timeout_s``); returns its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    async def wait_healthy(self, client: httpx.AsyncClient, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        """Polls ``/health`` every 0.3 s until 200.

        Raises:
            RuntimeError: the process exited or ``timeout_s`` passed; the message has the log's tail.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log_tail(self.log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(self.url + "/health", timeout=2)).status_code == 200:
                    return
            await asyncio.sleep(0.3)
        raise RuntimeError(f"server not healthy after {timeout_s:.0f} s:\n{log_tail(self.log_path)}")


def log_tail(path: Path | None, num_lines: int = 25) -> str:
    """The last ``num_lines`` lines of a server log ('' without one)."""
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


async def scrape_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """``/metrics`` as sample name → value (unlabelled samples and the first of each labelled one).

    Raises:
        httpx.HTTPStatusError: /metrics answered an error (a dead engine answers 503).
    """
    r = await client.get(url + "/metrics", timeout=10)
    r.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            values.setdefault(s.name, s.value)
    return values


async def drain(client: httpx.AsyncClient, url: str, timeout_s: float) -> dict[str, Any]:
    """Waits until no request runs or waits, then up to 2 s more for ``kv_blocks_in_use`` to reach 0.

    Returns:
        ``idle`` (bool), ``waited_s``, the last ``num_requests_running`` / ``_waiting``,
        ``kv_blocks_in_use`` / ``_total`` (None when /metrics failed), and ``error``.
    """
    start = time.monotonic()
    deadline, grace_until = start + timeout_s, None
    m: dict[str, float] = {}
    error = None
    while time.monotonic() < deadline:
        try:
            m, error = await scrape_metrics(client, url), None
        except httpx.HTTPStatusError as e:  # a dead engine: no point waiting
            m, error = {}, f"/metrics: HTTP {e.response.status_code}: {error_message(e.response)}"
            break
        except httpx.HTTPError as e:
            error = f"/metrics: {e!r}"
        else:
            idle = m["prefixcache:num_requests_running"] == 0 and m["prefixcache:num_requests_waiting"] == 0
            if idle and grace_until is None:
                grace_until = time.monotonic() + 2.0
            if idle and (m["prefixcache:kv_blocks_in_use"] == 0 or time.monotonic() > grace_until):
                break
            grace_until = grace_until if idle else None
        await asyncio.sleep(0.2)
    get = m.get
    idle = bool(m) and get("prefixcache:num_requests_running") == 0 and get("prefixcache:num_requests_waiting") == 0
    return {
        "idle": idle,
        "waited_s": round(time.monotonic() - start, 2),
        "num_requests_running": get("prefixcache:num_requests_running"),
        "num_requests_waiting": get("prefixcache:num_requests_waiting"),
        "kv_blocks_in_use": get("prefixcache:kv_blocks_in_use"),
        "kv_blocks_total": get("prefixcache:kv_blocks_total"),
        "prefix_cache_hit_rate": get("prefixcache:prefix_cache_hit_rate"),
        "error": error,
    }


# ---------------------------------------------------------------------------- the workload
def system_prompts(num_words: int, seed: int) -> list[str]:
    """One long system prompt per role, ~``num_words`` words of numbered rules (deterministic)."""
    prompts = []
    for i, role in enumerate(ROLES):
        rng = random.Random(seed * 1000 + i)
        parts = [f"You are {role}. Follow every rule below."]
        k = 1
        while sum(len(p.split()) for p in parts) < num_words:
            parts.append(f"Rule {k}: when someone asks about {rng.choice(NOUNS)}, {rng.choice(VERBS)} "
                         f"{rng.choice(MANNERS)} and mention {rng.choice(NOUNS)} if it helps.")
            k += 1
        prompts.append(" ".join(parts))
    return prompts


def completion_prompt(system: str | None, question: str) -> str:
    """A completion prompt sharing the chat requests' system prompt as its prefix."""
    return f"{system}\n\nQuestion: {question}\nAnswer:" if system else f"Question: {question}\nAnswer:"


def make_good_spec(rng: random.Random, work: Workload, args: argparse.Namespace, tag: str) -> GoodSpec:
    """Draws one request of the mix: endpoint, mode (stream, plain, disconnect, slow) and sampling.

    Args:
        tag: made part of the question so that prompts differ after the shared system prompt.
    """
    chat = rng.random() < 0.5
    r = rng.random()
    mode = ("disconnect" if r < args.disconnect_fraction else
            "slow" if r < args.disconnect_fraction + args.slow_fraction else
            "plain" if r < args.disconnect_fraction + args.slow_fraction + args.plain_fraction else "stream")
    system = rng.choice(work.system_prompts) if rng.random() < 0.9 else None
    question = f"{rng.choice(QUESTIONS)} ({tag})"
    body: dict[str, Any] = {"model": work.model, "max_tokens": rng.randint(1, args.max_tokens)}
    if chat:
        body["messages"] = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}]
    else:
        body["prompt"] = completion_prompt(system, question)
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([0.9, 1.0]))
        if rng.random() < 0.3:
            body["seed"] = rng.randrange(1 << 31)
        if rng.random() < 0.1:
            body["n"] = 2
    if mode != "plain":
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return GoodSpec(
        kind=f"{'chat' if chat else 'completion'}_{mode}",
        path="/v1/chat/completions" if chat else "/v1/completions",
        body=body,
        disconnect_after=rng.randint(0, body["max_tokens"]) if mode == "disconnect" else None,
        slow_s=rng.uniform(0.05, 0.25) if mode == "slow" else 0.0,
    )


def bad_inputs(model: str, max_model_len: int, vocab_size: int | None) -> list[BadInput]:
    """The bad-input set. Every entry expects a 4xx; ``top_p`` 1e-46 may also get 200.

    Args:
        max_model_len: the server's context in tokens (``/v1/models``).
        vocab_size: the model's vocabulary size, for the exact boundary id (None: that case is left out).
    """
    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    hi = {"model": model, "prompt": "Hello", "max_tokens": 4}
    msg = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    cases = [
        BadInput("malformed_json", cmpl, b'{"model": "' + model.encode() + b'", "prompt": "hi", "max_tokens": 4'),
        BadInput("empty_prompt", cmpl, {**hi, "prompt": ""}),
        BadInput("empty_token_ids", cmpl, {**hi, "prompt": []}),
        BadInput("empty_messages", chat, {**msg, "messages": []}),
        BadInput("prompt_over_context", cmpl, {**hi, "prompt": "hello " * (max_model_len + 16)}),
        BadInput("max_tokens_0", cmpl, {**hi, "max_tokens": 0}),
        BadInput("max_tokens_huge", chat, {**msg, "max_tokens": 10**9}, stream=True),
        BadInput("temperature_-1", cmpl, {**hi, "temperature": -1}),
        BadInput("top_p_0", cmpl, {**hi, "temperature": 1, "top_p": 0}),
        BadInput("top_p_1e-46", cmpl, {**hi, "temperature": 1, "top_p": 1e-46}, also_ok=frozenset({200})),
        BadInput("top_p_1.5", chat, {**msg, "top_p": 1.5}),
        BadInput("token_id_huge", cmpl, {**hi, "prompt": [1, 2, 2**31 - 1]}),
        BadInput("token_id_negative", cmpl, {**hi, "prompt": [1, -1]}),
        BadInput("unknown_model", cmpl, {**hi, "model": "no-such-model"}),
        BadInput("lone_surrogate_prompt", cmpl, {**hi, "prompt": "Hello \ud800 world"}),
        BadInput("lone_surrogate_chat", chat, {**msg, "messages": [{"role": "user", "content": "Hi \ud800"}]}),
        BadInput("prompt_10mb", cmpl, {**hi, "prompt": ("All work and no play. " * (BIG_PROMPT_BYTES // 22 + 1))
                                        [:BIG_PROMPT_BYTES]}, every_s=60.0),
        BadInput("n_1000", chat, {**msg, "n": 1000}),
        BadInput("type_max_tokens_str", chat, {**msg, "max_tokens": "16"}),
        BadInput("type_prompt_int", cmpl, {**hi, "prompt": 5}),
        BadInput("type_temperature_str", cmpl, {**hi, "temperature": "hot"}),
        BadInput("type_messages_str", chat, {**msg, "messages": "Hello"}),
        BadInput("type_stream_str", cmpl, {**hi, "stream": "yes"}),
    ]
    if vocab_size is not None:
        cases.append(BadInput("token_id_eq_vocab", cmpl, {**hi, "prompt": [1, 2, vocab_size]}))
    return cases


def local_vocab_size(model: str) -> int | None:
    """``vocab_size`` from the local model's ``config.json`` (None if it can't be read)."""
    try:
        from prefixcache.models.loader import resolve_model_dir

        return int(json.loads((resolve_model_dir(model) / "config.json").read_text())["vocab_size"])
    except Exception:  # a .gguf, a model not on this machine...: leave the boundary case out
        return None


# ---------------------------------------------------------------------------- sending
def _chunk_text(event: dict) -> str:
    """The text a streamed chunk carries (chat delta or completion text)."""
    texts = [c.get("text") or (c.get("delta") or {}).get("content") or "" for c in event.get("choices") or []]
    return "".join(texts)


async def read_stream(resp: httpx.Response, spec: GoodSpec, out: Outcome, t_send: float) -> None:
    """Reads an SSE response into ``out``: TTFT, and ``problem`` for a broken or failed stream.

    Stops after ``spec.disconnect_after`` data events when set (the caller's close then aborts the
    request on the server); sleeps ``spec.slow_s`` seconds after each event.
    """
    n = spec.body.get("n", 1)
    finish: dict[int, str | None] = {}
    num_events, done, usage = 0, False, False
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        if spec.disconnect_after is not None and num_events >= spec.disconnect_after:
            return
        num_events += 1
        if line == "data: [DONE]":
            done = True
            break
        try:
            event = json.loads(line[6:])
        except ValueError:
            out.problem = f"invalid SSE data: {line[:80]!r}"
            return
        if "error" in event:
            out.problem = f"error event in stream: {str(event['error'].get('message'))[:160]}"
            return
        if out.ttft_s is None and _chunk_text(event):
            out.ttft_s = time.perf_counter() - t_send
        usage = usage or bool(event.get("usage"))
        for c in event.get("choices") or []:
            if c.get("finish_reason") is not None:
                finish[c.get("index", 0)] = c["finish_reason"]
        if spec.slow_s:
            await asyncio.sleep(spec.slow_s)
    if spec.disconnect_after is not None and not done:
        out.problem = f"stream ended after {num_events} events, before the planned disconnect"
    elif not done:
        out.problem = "stream ended without data: [DONE]"
    elif sorted(finish) != list(range(n)) or "error" in finish.values():
        out.problem = f"finish_reason by choice {finish} (expected one of stop/length for each of {n})"
    elif spec.body.get("stream_options") and not usage:
        out.problem = "include_usage set but no usage chunk"


def check_plain(resp: httpx.Response, spec: GoodSpec) -> str | None:
    """Why a non-streamed 200 answer is broken, or None."""
    try:
        data = resp.json()
        reasons = sorted((c["index"], c["finish_reason"]) for c in data["choices"])
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable answer: {e!r} {resp.text[:80]!r}"
    n = spec.body.get("n", 1)
    if [i for i, _ in reasons] != list(range(n)) or any(r not in ("stop", "length") for _, r in reasons):
        return f"finish reasons {reasons} (expected stop/length for each of {n} choices)"
    return None


def error_message(resp: httpx.Response) -> str:
    """The OpenAI error body's message, or the start of the raw body."""
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        return str(resp.json()["error"]["message"])[:160]
    return resp.text[:160]


async def send_good(client: httpx.AsyncClient, url: str, spec: GoodSpec, t0: float) -> Outcome:
    """Sends one good request and judges the answer; never raises for HTTP or stream trouble.

    Args:
        t0: the soak's start (``time.perf_counter()``), for ``Outcome.start_s``.
    """
    t_send = time.perf_counter()
    out = Outcome(spec.kind, 0, round(t_send - t0, 3), 0.0)
    try:
        if spec.body.get("stream"):
            async with client.stream("POST", url + spec.path, json=spec.body) as resp:
                out.status = resp.status_code
                if resp.status_code == 200:
                    await read_stream(resp, spec, out, t_send)
                else:
                    await resp.aread()
                    out.problem = f"HTTP {resp.status_code}: {error_message(resp)}"
        else:
            resp = await client.post(url + spec.path, json=spec.body)
            out.status = resp.status_code
            out.problem = check_plain(resp, spec) if resp.status_code == 200 else \
                f"HTTP {resp.status_code}: {error_message(resp)}"
    except httpx.TimeoutException as e:
        out.problem = f"client time-out ({type(e).__name__})"
    except httpx.HTTPError as e:
        out.problem = f"connection error: {e!r}"[:160]
    out.e2e_s = time.perf_counter() - t_send
    out.timed = out.problem is None and spec.disconnect_after is None and not spec.slow_s
    return out


async def send_bad(client: httpx.AsyncClient, url: str, bad: BadInput, t0: float, timeout_s: float) -> Outcome:
    """Sends one bad input; ``problem`` is set unless the status (and error body) is as expected.

    Args:
        timeout_s: client time-out in seconds (a bad input should be answered at once).
    """
    t_send = time.perf_counter()
    out = Outcome(f"bad:{bad.name}", 0, round(t_send - t0, 3), 0.0)
    headers = {"content-type": "application/json"}
    try:
        async with client.stream("POST", url + bad.path, content=bad.encoded(), headers=headers,
                                 timeout=httpx.Timeout(timeout_s, connect=30)) as resp:
            out.status = resp.status_code
            if bad.stream and resp.status_code == 200:
                async for _ in resp.aiter_lines():  # accepted: read the first line and close (abort)
                    break
            else:
                await resp.aread()
    except httpx.TimeoutException as e:
        out.problem = f"client time-out ({type(e).__name__})"
    except httpx.HTTPError as e:
        out.problem = f"connection error: {e!r}"[:160]
    out.e2e_s = time.perf_counter() - t_send
    if out.problem is None:
        if 400 <= out.status < 500:
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError, httpx.ResponseNotRead):
                if resp.json()["error"]["message"]:
                    return out
            out.problem = f"HTTP {out.status} without an OpenAI error body: {resp.text[:80]!r}"
        elif out.status not in bad.also_ok:
            expected = " or ".join(["4xx", *map(str, sorted(bad.also_ok))])
            body = error_message(resp) if not bad.stream else ""
            out.problem = f"HTTP {out.status} (expected {expected}) {body}".strip()
    return out


# ---------------------------------------------------------------------------- the soak
@dataclass
class SoakRun:
    """State shared by the soak's tasks."""

    client: httpx.AsyncClient
    url: str
    pid: int | None
    work: Workload
    args: argparse.Namespace
    t0: float  # time.perf_counter() at the start
    deadline: float  # time.perf_counter() at which no new request starts
    stop: asyncio.Event  # set early when the server's engine died (unless --keep-going)
    outcomes: list[Outcome] = field(default_factory=list)
    timeline: list[dict] = field(default_factory=list)  # see :func:`monitor`
    stopped_early: str | None = None  # why the soak ended before the deadline

    def running(self) -> bool:
        return time.perf_counter() < self.deadline and not self.stop.is_set()


async def good_client(run: SoakRun, client_id: int) -> None:
    """One client: good requests back to back while the soak runs."""
    rng = random.Random(run.args.soak_seed * 100_003 + client_id)
    i = 0
    while run.running():
        spec = make_good_spec(rng, run.work, run.args, f"client {client_id}, request {i}")
        run.outcomes.append(await send_good(run.client, run.url, spec, run.t0))
        i += 1


async def bad_client(run: SoakRun) -> None:
    """Starts the bad inputs round robin, ``--bad-interval-s`` seconds apart, while the soak runs.

    Each is its own task (one that hangs doesn't hold up the rest), with ``--bad-timeout-s``.
    """
    last_sent: dict[str, float] = {}
    tasks = []
    i = 0

    async def send(bad: BadInput) -> None:
        run.outcomes.append(await send_bad(run.client, run.url, bad, run.t0, run.args.bad_timeout_s))

    while run.running() and run.work.bad_inputs:
        bad = run.work.bad_inputs[i % len(run.work.bad_inputs)]
        i += 1
        now = time.perf_counter()
        if bad.name in last_sent and now - last_sent[bad.name] < bad.every_s:
            continue
        last_sent[bad.name] = now
        tasks.append(asyncio.create_task(send(bad)))
        await asyncio.sleep(run.args.bad_interval_s)
    await asyncio.gather(*tasks)


async def monitor(run: SoakRun) -> None:
    """Every ``--monitor-interval-s`` s: ``/health``, ``/metrics`` (running, waiting, KV blocks in
    use) and the RSS in MiB into ``run.timeline``; stops the soak once ``/health`` says the engine
    died (503), unless ``--keep-going``."""
    names = ("num_requests_running", "num_requests_waiting", "kv_blocks_in_use")
    while run.running():
        point: dict[str, Any] = {"t_s": round(time.perf_counter() - run.t0, 1), "rss_mib": rss_mib(run.pid)}
        try:
            health = await run.client.get(run.url + "/health", timeout=10)
            point["health"] = health.status_code
            m = await scrape_metrics(run.client, run.url)
            point.update({n: m.get(f"prefixcache:{n}") for n in names})
        except httpx.HTTPError as e:
            point["error"] = repr(e)[:120]
        run.timeline.append(point)
        if point.get("health") == 503 and not run.args.keep_going:
            run.stopped_early = f"/health answered 503 at {point['t_s']} s: {error_message(health)}"
            run.stop.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(run.stop.wait(), run.args.monitor_interval_s)


async def run_soak(client: httpx.AsyncClient, url: str, pid: int | None, work: Workload,
                   args: argparse.Namespace) -> SoakRun:
    """Runs ``args.clients`` good clients, the bad-input client and the monitor for
    ``args.duration_s`` seconds (or until the engine dies).

    Requests in flight at the end finish (or time out) before this returns.
    """
    t0 = time.perf_counter()
    run = SoakRun(client, url, pid, work, args, t0, t0 + args.duration_s, asyncio.Event())
    await asyncio.gather(*(good_client(run, c) for c in range(args.clients)), bad_client(run), monitor(run))
    return run


async def warm_up(client: httpx.AsyncClient, url: str, work: Workload, clients: int = 1,
                  bad_timeout_s: float = 60.0) -> list[int]:
    """Requests before the RSS baseline, so that growth measures the soak, not first-use costs:
    each system prompt on both endpoints (one stream), a burst of ``clients`` concurrent chats (the
    batch sizes the soak reaches) and each bad input once (its error paths).

    Returns:
        Their statuses.
    """
    statuses = []
    for i, system in enumerate(work.system_prompts):
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "system", "content": system},
                                                                    {"role": "user", "content": "Hello"}]}),
                           ("/v1/completions", {"prompt": completion_prompt(system, "Hello")})):
            body = {"model": work.model, "max_tokens": 4, "temperature": 0, "stream": i == 0, **body}
            statuses.append((await client.post(url + path, json=body)).status_code)
    burst = [{"model": work.model, "max_tokens": 8, "temperature": 0,
              "messages": [{"role": "system", "content": work.system_prompts[k % len(work.system_prompts)]},
                           {"role": "user", "content": f"Warm-up question {k}."}]} for k in range(clients)]
    answers = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=b) for b in burst))
    statuses += [a.status_code for a in answers]
    for bad in work.bad_inputs:
        statuses.append((await send_bad(client, url, bad, time.perf_counter(), bad_timeout_s)).status)
    return statuses


# ---------------------------------------------------------------------------- greedy correctness
def greedy_prompts(work: Workload) -> list[tuple[str, str, dict]]:
    """~6 greedy requests (name, path, body), some sharing the soak's system prompts."""
    s = work.system_prompts
    base = {"model": work.model, "max_tokens": 24, "temperature": 0}

    def chat(system: str | None, question: str) -> dict:
        return {**base, "messages": ([{"role": "system", "content": system}] if system else [])
                + [{"role": "user", "content": question}]}

    return [
        ("chat_system0", "/v1/chat/completions", chat(s[0], "What should I do first?")),
        ("chat_system0_other", "/v1/chat/completions", chat(s[0], "Give me three tips.")),
        ("chat_system1", "/v1/chat/completions", chat(s[1], "Why did my last attempt fail?")),
        ("chat_no_system", "/v1/chat/completions", chat(None, "What is the capital of France?")),
        ("completion_system2", "/v1/completions", {**base, "prompt": completion_prompt(s[2], "What happens next?")}),
        ("completion_plain", "/v1/completions", {**base, "prompt": "The three primary colors are"}),
    ]


async def greedy_outputs(client: httpx.AsyncClient, url: str, work: Workload) -> dict[str, str]:
    """Each greedy prompt's text (``"<HTTP status>: message"`` when it failed), sent one at a time."""
    texts = {}
    for name, path, body in greedy_prompts(work):
        try:
            r = await client.post(url + path, json=body)
        except httpx.HTTPError as e:
            texts[name] = f"<no response>: {e!r}"
            continue
        if r.status_code != 200:
            texts[name] = f"<HTTP {r.status_code}>: {error_message(r)}"
            continue
        choice = r.json()["choices"][0]
        texts[name] = choice["message"]["content"] if "message" in choice else choice["text"]
    return texts


def compare_greedy(soaked: dict[str, str], fresh: dict[str, str]) -> dict[str, Any]:
    """``{"num_equal", "num_prompts", "mismatches": [{name, soaked, fresh}]}``."""
    mismatches = [{"name": k, "soaked": soaked[k], "fresh": fresh.get(k)} for k in soaked if soaked[k] != fresh.get(k)]
    return {"num_equal": len(soaked) - len(mismatches), "num_prompts": len(soaked), "mismatches": mismatches}


# ---------------------------------------------------------------------------- the report
def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile ``p`` in [0, 1] of ``values`` (None when empty), rounded to ms."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, min(len(ordered) - 1, math.ceil(p * len(ordered)) - 1))], 3)


def unexpected_groups(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """The unexpected outcomes grouped by (kind, status, problem), in the order of their first answer.

    Each group: ``kind, status, problem, count, first_sent_s, first_answered_s`` (seconds since the
    soak began; "answered" is when the client saw the failure).
    """
    groups: dict[tuple, dict] = {}
    for o in sorted(outcomes, key=lambda o: o.start_s + o.e2e_s):
        if o.problem is not None or o.status >= 500:
            entry = groups.setdefault((o.kind, o.status, o.problem), {
                "kind": o.kind, "status": o.status, "problem": o.problem, "count": 0,
                "first_sent_s": o.start_s, "first_answered_s": round(o.start_s + o.e2e_s, 3)})
            entry["count"] += 1
    return list(groups.values())


def first_5xx(outcomes: list[Outcome]) -> dict[str, Any] | None:
    """The first 5xx answer, and the bad inputs sent in the 10 s before it (the likely trigger)."""
    fives = sorted((o for o in outcomes if o.status >= 500), key=lambda o: o.start_s + o.e2e_s)
    if not fives:
        return None
    f = fives[0]
    at_s = round(f.start_s + f.e2e_s, 3)
    before = [f"{o.kind} sent at {o.start_s:.1f} s -> {o.status}" for o in sorted(outcomes, key=lambda o: o.start_s)
              if o.kind.startswith("bad:") and at_s - 10 <= o.start_s <= at_s]
    return {"kind": f.kind, "status": f.status, "sent_s": f.start_s, "answered_s": at_s, "problem": f.problem,
            "bad_inputs_sent_in_the_10_s_before": before}


def summarize(outcomes: list[Outcome], bad_names: list[str]) -> dict[str, Any]:
    """Counts, latencies, unexpected outcomes and per-bad-input results of the soak's requests."""
    fives = [o for o in outcomes if o.status >= 500]
    bad = {}
    for name in bad_names:
        sent = [o for o in outcomes if o.kind == f"bad:{name}"]
        bad[name] = {"sent": len(sent), "statuses": dict(sorted(Counter(str(o.status) for o in sent).items())),
                     "ok": bool(sent) and all(o.problem is None for o in sent),
                     "max_latency_s": round(max((o.e2e_s for o in sent), default=0.0), 3)}
    good = [o for o in outcomes if not o.kind.startswith("bad:")]
    return {
        "requests": {"total": len(outcomes), "good": len(good), "bad": len(outcomes) - len(good),
                     "by_kind": dict(sorted(Counter(o.kind for o in outcomes).items()))},
        "statuses": dict(sorted(Counter(str(o.status) for o in outcomes).items())),
        "num_5xx": len(fives),
        "num_good_failed": sum(o.problem is not None for o in good),
        "unexpected": unexpected_groups(outcomes),
        "first_5xx": first_5xx(outcomes),
        "bad_inputs": bad,
        "latency_s": {
            "ttft_p50": percentile([o.ttft_s for o in good if o.ttft_s is not None and o.problem is None], 0.5),
            "ttft_p99": percentile([o.ttft_s for o in good if o.ttft_s is not None and o.problem is None], 0.99),
            "e2e_p50": percentile([o.e2e_s for o in good if o.timed], 0.5),
            "e2e_p99": percentile([o.e2e_s for o in good if o.timed], 0.99),
            "num_ttft": sum(o.ttft_s is not None and o.problem is None for o in good),
            "num_e2e": sum(o.timed for o in good),
        },
    }


def checks(report: dict[str, Any], max_rss_growth_mib: float) -> dict[str, dict[str, Any]]:
    """The pass/fail checks (see the module docstring): name → ``{"ok": bool | None, "detail"}``.

    ``ok`` is None for a check that was skipped (it doesn't fail the run).
    """
    s, d, rss, greedy = report["soak"], report["drain"], report["rss_mib"], report["greedy"]
    bad_failed = [name for name, b in s["bad_inputs"].items() if b["sent"] and not b["ok"]]
    unsent = [name for name, b in s["bad_inputs"].items() if not b["sent"]]
    growth = rss["growth"]
    return {
        "no_5xx": {"ok": s["num_5xx"] == 0, "detail": f"{s['num_5xx']} responses with a 5xx"},
        "good_requests_ok": {"ok": s["num_good_failed"] == 0,
                             "detail": f"{s['num_good_failed']} of {s['requests']['good']} good requests failed"},
        "bad_inputs_expected": {"ok": not bad_failed and not unsent,
                                "detail": f"unexpected status: {bad_failed}; never sent: {unsent}"},
        "drained_no_blocks_in_use": {
            "ok": d["idle"] and d["kv_blocks_in_use"] == 0,
            "detail": f"idle={d['idle']} after {d['waited_s']} s, kv_blocks_in_use={d['kv_blocks_in_use']}"
                      + (f" ({d['error']})" if d["error"] else "")},
        "rss_growth": {"ok": None if growth is None else growth < max_rss_growth_mib,
                       "detail": "skipped (no pid)" if growth is None else
                       f"{growth:+.1f} MiB (limit {max_rss_growth_mib} MiB)"},
        "greedy_equal": {"ok": None if greedy is None else greedy["num_equal"] == greedy["num_prompts"],
                         "detail": "skipped" if greedy is None else
                         f"{greedy['num_equal']} of {greedy['num_prompts']} equal to a fresh server"},
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as readable text."""
    s = report["soak"]
    lines = [f"soak: {report['config']['clients']} clients for {report['config']['duration_s']} s against "
             f"{report['server']['url']} (load ran {report['soak_wall_s']} s; {report['wall_s']} s in all)"]
    if report["stopped_early"]:
        lines.append(f"STOPPED EARLY: {report['stopped_early']}")
    lines += [
             f"requests: {s['requests']['total']} ({s['requests']['good']} good, {s['requests']['bad']} bad)",
             "  by kind: " + ", ".join(f"{k} {v}" for k, v in s["requests"]["by_kind"].items()),
             "statuses: " + ", ".join(f"{k}: {v}" for k, v in s["statuses"].items()),
             "latency (s): " + ", ".join(f"{k} {v}" for k, v in s["latency_s"].items())]
    lines.append(f"unexpected outcomes ({sum(e['count'] for e in s['unexpected'])}):")
    lines += [f"  {e['count']:5d} x {e['kind']} -> {e['status']}: {e['problem']} "
              f"(first sent at {e['first_sent_s']:.1f} s, answered at {e['first_answered_s']:.1f} s)"
              for e in s["unexpected"][:MAX_PRINTED_GROUPS]] or ["  none"]
    if len(s["unexpected"]) > MAX_PRINTED_GROUPS:
        lines.append(f"  ... {len(s['unexpected']) - MAX_PRINTED_GROUPS} more groups in the JSON report")
    if s["first_5xx"]:
        f = s["first_5xx"]
        lines.append(f"first 5xx: {f['kind']} -> {f['status']} answered at {f['answered_s']:.1f} s "
                     f"(sent at {f['sent_s']:.1f} s): {f['problem']}")
        lines.append(f"  the last bad inputs sent up to then: {f['bad_inputs_sent_in_the_10_s_before'][-5:]}")
    lines.append("bad inputs (name: sent, statuses, max latency):")
    lines += [f"  {'ok  ' if b['ok'] else 'FAIL'} {name}: {b['sent']}, {b['statuses']}, {b['max_latency_s']} s"
              for name, b in s["bad_inputs"].items()]
    d, rss = report["drain"], report["rss_mib"]
    lines.append(f"drain: {d}")
    lines.append(f"rss (MiB): before {rss['before']}, after {rss['after']}, growth {rss['growth']}")
    lines.append(f"health after the soak: {report['server']['health_after']}")
    g = report["greedy"]
    if g is not None:
        lines.append(f"greedy: {g['num_equal']} of {g['num_prompts']} equal")
        lines += [f"  {m['name']}: soaked {m['soaked']!r} != fresh {m['fresh']!r}" for m in g["mismatches"]]
    lines.append("checks:")
    lines += [f"  {'skip' if c['ok'] is None else 'ok  ' if c['ok'] else 'FAIL'} {name}: {c['detail']}"
              for name, c in report["checks"].items()]
    if report.get("server_log_tail"):
        lines += ["soaked server's log (tail):", report["server_log_tail"]]
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)


SECTION = "soak"  # the page section --report fills


def soak_markdown(report: dict[str, Any]) -> str:
    """The report as the Markdown table of ``--report`` (the page's ``soak`` section): the run's size, the
    requests and statuses, the unexpected outcomes, latencies, the drain, RSS, greedy equality, the checks."""
    c, s, d, rss = report["config"], report["soak"], report["drain"], report["rss_mib"]
    lat = s["latency_s"]

    def secs(a: float | None, b: float | None) -> str:
        return " / ".join("–" if x is None else f"{x:.1f} s" for x in (a, b))

    by_kind = s["requests"]["by_kind"]
    good_kinds = {k: v for k, v in by_kind.items() if not k.startswith("bad:")}
    hit, blocks = d.get("prefix_cache_hit_rate"), d.get("kv_blocks_in_use")
    g = report["greedy"]
    rows = [
        ("load", f"{c['clients']} clients for {c['duration_s']:g} s (ran {report['soak_wall_s']} s), "
                 f"{c['disconnect_fraction']:g} of the streams closed mid-way, {c['slow_fraction']:g} read slowly"
                 + (f"; STOPPED EARLY: {report['stopped_early']}" if report["stopped_early"] else "")),
        ("requests", f"{s['requests']['total']}: {s['requests']['good']} good ("
                     + ", ".join(f"{k} {v}" for k, v in good_kinds.items()) + f"), {s['requests']['bad']} bad inputs "
                     f"of {len(s['bad_inputs'])} kinds"),
        ("statuses", ", ".join(f"{k}: {v}" for k, v in s["statuses"].items()) + f"; {s['num_5xx']} 5xx"),
        ("unexpected outcomes", str(sum(e["count"] for e in s["unexpected"]))),
        ("TTFT p50 / p99", secs(lat["ttft_p50"], lat["ttft_p99"]) + f" ({lat['num_ttft']} streams)"),
        ("end-to-end p50 / p99", secs(lat["e2e_p50"], lat["e2e_p99"]) + f" ({lat['num_e2e']} complete requests)"),
        ("after the drain", f"{'unknown' if blocks is None else f'{blocks:g}'} KV blocks in use, idle {d['idle']}, "
                            f"`/health` "
                            f"{report['server']['health_after']}"
                            + ("" if hit is None else f", prefix-cache hit rate {hit:.1%}")),
        ("server RSS", "not measured (no pid)" if rss["growth"] is None else
         f"{rss['before']} → {rss['after']} MiB ({rss['growth']:+.1f} MiB)"),
        ("greedy outputs vs a fresh server",
         "skipped" if g is None else f"{g['num_equal']} of {g['num_prompts']} equal"),
        ("checks", ", ".join(f"{name} {'skipped' if ch['ok'] is None else 'ok' if ch['ok'] else 'FAILED'}"
                             for name, ch in report["checks"].items())),
    ]
    return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]) + "\n"


# ---------------------------------------------------------------------------- main
async def soak_server(client: httpx.AsyncClient, url: str, pid: int | None, args: argparse.Namespace,
                      work: Workload) -> dict[str, Any]:
    """Warm-up, RSS baseline, soak, drain, RSS, health and the soaked server's greedy outputs."""
    warm = await warm_up(client, url, work, args.clients, args.bad_timeout_s)
    await drain(client, url, args.drain_timeout_s)
    rss_before = rss_mib(pid)
    start = time.perf_counter()
    run = await run_soak(client, url, pid, work, args)
    if args.trace:
        with open(args.trace, "w") as f:
            f.writelines(json.dumps(asdict(o)) + "\n" for o in sorted(run.outcomes, key=lambda o: o.start_s))
    soak_wall_s = time.perf_counter() - start
    drained = await drain(client, url, args.drain_timeout_s)
    await asyncio.sleep(0.5)
    rss_after = rss_mib(pid)
    try:
        health = (await client.get(url + "/health", timeout=10)).status_code
    except httpx.HTTPError as e:
        health = f"no response: {e!r}"
    growth = None if rss_before is None or rss_after is None else round(rss_after - rss_before, 1)
    return {
        "warm_up_statuses": dict(Counter(map(str, warm))),
        "soak_wall_s": round(soak_wall_s, 1),
        "stopped_early": run.stopped_early,
        "soak": summarize(run.outcomes, [b.name for b in work.bad_inputs]),
        "drain": drained,
        "timeline": run.timeline,
        "rss_mib": {"before": rss_before and round(rss_before, 1), "after": rss_after and round(rss_after, 1),
                    "growth": growth},
        "health_after": health,
        "greedy_soaked": await greedy_outputs(client, url, work),
    }


async def fresh_greedy(client: httpx.AsyncClient, model: str, flags: list[str], work: Workload,
                       log_path: Path) -> dict[str, str]:
    """The greedy prompts' texts on a fresh server started with the same model and flags."""
    with ServerProcess(model, flags, log_path) as fresh:
        await fresh.wait_healthy(client)
        return await greedy_outputs(client, fresh.url, work)


async def run(args: argparse.Namespace, flags: list[str]) -> dict[str, Any]:
    """The whole soak; returns the report (with ``checks`` and ``passed``)."""
    t_start = time.perf_counter()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="prefixcache-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    timeout = httpx.Timeout(args.request_timeout_s, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        with contextlib.ExitStack() as stack:
            if args.url:
                url, pid, soaked_log = args.url.rstrip("/"), args.pid, None
            else:
                server = stack.enter_context(ServerProcess(args.model, flags, log_dir / "soaked_server.log"))
                await server.wait_healthy(client)
                url, pid, soaked_log = server.url, server.pid, server.log_path
            card = (await client.get(url + "/v1/models")).json()["data"][0]
            work = Workload(card["id"], system_prompts(args.system_words, args.soak_seed),
                            [b for b in bad_inputs(card["id"], card["max_model_len"], local_vocab_size(args.model))
                             if b.name not in args.skip_bad])
            result = await soak_server(client, url, pid, args, work)
            exit_code = None if args.url else server.stop()
        greedy_soaked, fresh = result.pop("greedy_soaked"), None
        if not args.no_greedy_check:
            try:
                fresh = await fresh_greedy(client, args.model, flags, work, log_dir / "fresh_server.log")
            except RuntimeError as e:
                fresh = {name: f"<fresh server failed: {str(e)[:200]}>" for name in greedy_soaked}
    report = {
        "config": {k: v for k, v in vars(args).items()}, "server_flags": flags,
        "server": {"url": url, "pid": pid, "log": str(soaked_log) if soaked_log else None, "exit_code": exit_code,
                   "health_after": result.pop("health_after")},
        **result,
        "greedy": None if fresh is None else compare_greedy(greedy_soaked, fresh),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    report["checks"] = checks(report, args.max_rss_growth_mb)
    report["passed"] = all(c["ok"] is not False for c in report["checks"].values())
    if not report["passed"]:
        report["server_log_tail"] = log_tail(soaked_log, 15)
    return report


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The soak's options, and the rest (passed to ``prefixcache serve``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model to serve (and for the fresh greedy server)")
    p.add_argument("--url", default=None, help="soak this running server instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="the --url server's pid, for its RSS")
    p.add_argument("--clients", type=int, default=48, help="concurrent good clients")
    p.add_argument("--duration-s", type=float, default=300.0, help="seconds of load")
    p.add_argument("--disconnect-fraction", type=float, default=0.2, help="streams closed mid-way")
    p.add_argument("--slow-fraction", type=float, default=0.1, help="streams read slowly")
    p.add_argument("--plain-fraction", type=float, default=0.2, help="non-streaming requests")
    p.add_argument("--max-tokens", type=int, default=48, help="max_tokens is drawn from [1, this]")
    p.add_argument("--system-words", type=int, default=250, help="words per shared system prompt")
    p.add_argument("--bad-interval-s", type=float, default=1.0, help="seconds between bad inputs")
    p.add_argument("--skip-bad", action="append", default=[], metavar="NAME", help="leave out a bad input")
    p.add_argument("--bad-timeout-s", type=float, default=60.0, help="client time-out per bad input")
    p.add_argument("--monitor-interval-s", type=float, default=5.0, help="seconds between /metrics samples")
    p.add_argument("--trace", default=None, metavar="PATH", help="write every request's outcome (JSON lines)")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="client time-out per request")
    p.add_argument("--drain-timeout-s", type=float, default=60.0, help="seconds to wait for the server to idle")
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0, help="RSS growth limit, MiB")
    p.add_argument("--keep-going", action="store_true", help="don't stop the soak when /health answers 503")
    p.add_argument("--no-greedy-check", action="store_true", help="skip the fresh-server greedy comparison")
    p.add_argument("--soak-seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temp folder)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    p.add_argument("--report", default=None, metavar="PAGE",
                   help=f"also put the report's table into PAGE's '{SECTION}' section (e.g. docs/benchmarks.md), under "
                        "the machine, date, commit and command")
    args, rest = p.parse_known_args(argv)
    if args.pid is not None and not args.url:
        p.error("--pid goes with --url (a server this script starts is measured by itself)")
    return args, [a for a in rest if a != "--"]


def main(argv: list[str] | None = None) -> int:
    args, flags = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers
    try:
        report = asyncio.run(run(args, flags))
    except KeyboardInterrupt:
        print("soak: interrupted; servers stopped", file=sys.stderr)
        return 130
    except RuntimeError as e:  # a server that won't start
        print(f"soak: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    if args.report:
        from prefixcache.bench.report_page import report_section

        command = shlex.join([".venv/bin/python", "tools/soak.py", *(sys.argv[1:] if argv is None else argv)])
        report_section(args.report, SECTION, soak_markdown(report), command)
        print(f"soak: --report: {SECTION} written into {args.report}", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
