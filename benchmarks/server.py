"""Measure the server with prefix caching on vs off (not a test).

N concurrent clients share a ~1000-token system prompt (English prose: this repo's README) and each
asks its own short questions, streaming, ``max_tokens`` 16. The same workload runs against two
server processes started one after the other: ``prefixcache serve`` and
``prefixcache serve --no-enable-prefix-caching``. Reported per server: requests/s, client-side
p50/p99 TTFT (time to the first streamed chunk with text), and the prefix-cache hit rate of the
measured requests (from ``/metrics``).

    python benchmarks/server.py --clients 32 --requests-per-client 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m"
ROOT = Path(__file__).resolve().parents[1]
TOPICS = [
    "block size", "hash chains", "eviction", "the demo", "chunked prefill", "preemption", "cache salts",
    "the block pool", "metrics", "GGUF files", "the chat template", "the scheduler", "CPU threads",
    "the free queue", "hit rates", "token ids",
]
ASKS = ["What does the text say about {}?", "Summarize {} in one sentence.", "Why does {} matter?",
        "Give one fact about {}."]


def system_prompt(num_tokens: int) -> str:
    """The README's prose cut to about ``num_tokens`` tokens at a sentence end."""
    from transformers import AutoTokenizer

    from prefixcache.models.fetch import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines()
             if ln and not ln.startswith(("#", "```", "|", "    ", "bash", "python"))]
    text = " ".join(lines)
    ids = tok.encode(text)[:num_tokens]
    cut = tok.decode(ids)
    return cut[: cut.rfind(".") + 1] or cut


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hit_counters(base_url: str) -> tuple[float, float]:
    text = httpx.get(base_url + "/metrics").text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values["prefixcache:prefix_cache_queries_total"], values["prefixcache:prefix_cache_hits_total"]


async def one_client(client: openai.AsyncOpenAI, system: str, questions: list[str], max_tokens: int):
    ttfts, cached = [], []
    for q in questions:
        start = time.perf_counter()
        ttft = None
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - start
            if chunk.usage is not None:
                cached.append(chunk.usage.prompt_tokens_details.cached_tokens)
        ttfts.append(ttft if ttft is not None else time.perf_counter() - start)
    return ttfts, cached


async def run_load(base_url: str, system: str, clients: int, per_client: int, max_tokens: int) -> dict:
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                  timeout=600) as client:
        # Warm-up on an unrelated prompt: first-call overheads, not the shared prefix.
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=2)
        q0, h0 = hit_counters(base_url)
        questions = [[ASKS[(c + r) % len(ASKS)].format(TOPICS[(c * per_client + r) % len(TOPICS)]) + f" (#{c}.{r})"
                      for r in range(per_client)] for c in range(clients)]
        start = time.perf_counter()
        results = await asyncio.gather(*(one_client(client, system, qs, max_tokens) for qs in questions))
        wall_s = time.perf_counter() - start
        q1, h1 = hit_counters(base_url)
    ttfts = sorted(t for r in results for t in r[0])
    n = len(ttfts)
    return {
        "requests": n,
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(n / wall_s, 2),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p99_s": round(ttfts[min(n - 1, int(0.99 * n))], 3),
        "hit_rate": round((h1 - h0) / (q1 - q0), 3) if q1 > q0 else 0.0,
        "mean_cached_tokens": round(statistics.mean(c for r in results for c in r[1]), 1),
    }


def serve(port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "prefixcache", "serve", "--port", str(port), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise RuntimeError("server did not become healthy in 120 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--serve-args", default="", help="extra `prefixcache serve` options for both runs")
    args = p.parse_args()
    system = system_prompt(args.system_tokens)
    report = {"clients": args.clients, "requests_per_client": args.requests_per_client,
              "max_tokens": args.max_tokens, "system_prompt_chars": len(system)}
    for name, flags in (("caching_on", []), ("caching_off", ["--no-enable-prefix-caching"])):
        port = free_port()
        proc = serve(port, args.serve_args.split() + flags)
        try:
            report[name] = asyncio.run(run_load(f"http://127.0.0.1:{port}", system, args.clients,
                                                args.requests_per_client, args.max_tokens))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        print(name, json.dumps(report[name]), file=sys.stderr)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
