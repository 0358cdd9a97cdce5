"""``prefixcache bench --workload memory``: each weight format's resident memory in a real ``prefixcache serve``.

For each format (``--dtype`` / ``--quantization``) this CPU runs, ``prefixcache serve`` of the model with its
default KV pool (``--kv-cache-memory`` unset: 1 GiB of blocks) starts in a process of its own on loopback,
answers one short completion (so what the first request allocates counts), and has its resident set read
(psutil's ``rss``, summed over the server and any child process it runs at that moment), then stops. Its peak
is the server process's own peak resident set over its whole life, load included: ``ru_maxrss`` of the
``wait4`` that reaps it (:class:`~prefixcache.bench.loopback_server.LoopbackServer`), a maximum the kernel keeps
per process, so no moment between samples is missed. It is not a sum: a child the server ran (a kernel build's
compiler) counts only if its own peak was larger. One process per format: what one format's load freed and the
allocator kept never counts against another. Resident memory hardly depends on the machine's load (the time
does), so a run on a shared machine gives the same numbers to a few MiB.

The KV pool's share is ``prefixcache:kv_blocks_total`` (from ``/metrics``) times a block's bytes
(:func:`~prefixcache.runner.kv_pool.kv_cache_bytes_per_block`, from the model's ``config.json``).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

# the formats measured, in the tables' order: the CPU-tier tables' columns (README, weight-formats doc)
FORMATS = (("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("bfloat16", "int4"),
           ("bfloat16", "int4-int8"))
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
MIB = 1 << 20


@dataclass
class MemoryRow:
    """One format's server.

    Attributes:
        dtype, quantization: the format (``serve --dtype / --quantization``).
        rss_bytes: resident set after one request (the server and its children), or None when not run.
        peak_bytes: the server process's peak resident set from start to exit (``ru_maxrss``: the load's
            temporaries included).
        kv_pool_bytes: the KV pool's bytes (blocks x a block's bytes).
        kv_blocks: the pool's blocks.
        skipped: why the format was not run here (the CPU can't run it), or None.
    """

    dtype: str
    quantization: str
    rss_bytes: int | None = None
    peak_bytes: int | None = None
    kv_pool_bytes: int | None = None
    kv_blocks: int | None = None
    skipped: str | None = None


def tree_rss(pid: int) -> int:
    """The resident bytes of ``pid`` and its descendants now (psutil's ``rss`` of each, summed; a process that
    ends meanwhile counts 0).

    Raises:
        psutil.NoSuchProcess: ``pid`` itself is gone.
    """
    import psutil

    root = psutil.Process(pid)
    total = root.memory_info().rss
    for child in root.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:  # it ended between the listing and the read
            pass
    return total


def kv_block_bytes(model_dir: Path, dtype: str, block_size: int) -> int:
    """A KV block's bytes for the model of ``model_dir`` (its ``config.json``) in ``dtype``."""
    from prefixcache.runner.kv_pool import kv_cache_bytes_per_block

    import torch

    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return kv_cache_bytes_per_block(cfg["num_hidden_layers"], block_size, cfg.get("num_key_value_heads", heads),
                                    head_dim, getattr(torch, dtype))


def measure_format(model: str, dtype: str, quantization: str, num_threads: int, block_size: int,
                   log_dir: Path, startup_timeout_s: float = 600.0) -> MemoryRow:
    """One format's ``prefixcache serve``: started, one completion of 8 tokens, resident set read, stopped
    (its peak read as it is reaped).

    Raises:
        RuntimeError: the server did not start or the request failed (its log's tail attached).
    """
    import httpx

    from prefixcache.bench.loopback_server import start_serve

    args = ("--dtype", dtype, "--quantization", quantization, "--num-threads", str(num_threads),
            "--block-size", str(block_size), "--log-level", "warning")
    server = start_serve(model, args, f"serve-{dtype}-{quantization}", log_dir, startup_timeout_s)
    try:
        served = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        reply = httpx.post(server.url + "/v1/completions", timeout=300,
                           json={"model": served, "prompt": "The capital of France is", "max_tokens": 8,
                                 "temperature": 0})
        if reply.status_code != 200:
            raise RuntimeError(f"{dtype}/{quantization}: the request failed ({reply.status_code}): {reply.text[:300]}")
        blocks = _gauge(httpx.get(server.url + "/metrics", timeout=30).text, "prefixcache:kv_blocks_total")
        rss = tree_rss(server.popen.pid)
    finally:
        server.stop()
    if server.peak_rss_bytes is None:
        raise RuntimeError(f"{dtype}/{quantization}: the server was reaped without its resource usage")
    return MemoryRow(dtype, quantization, rss, server.peak_rss_bytes, kv_blocks=blocks)


def _gauge(metrics_text: str, name: str) -> int:
    """The value of the first sample of ``name`` in a Prometheus text page, as an int.

    Raises:
        ValueError: no such sample.
    """
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            return int(float(line.rsplit(" ", 1)[1]))
    raise ValueError(f"/metrics has no {name!r} sample")


def run_memory_benchmark(model: str, num_threads: int = 1, block_size: int = 16,
                         formats: tuple[tuple[str, str], ...] = FORMATS,
                         log: Callable[[str], None] = print) -> dict:
    """Every format of ``formats`` this CPU runs, one server each (:func:`measure_format`).

    Returns:
        ``{"model", "num_threads", "block_size", "rows": [asdict(MemoryRow)]}``.
    """
    from prefixcache.kernels.cpu_features import format_unavailable_reason
    from prefixcache.models.loader import resolve_model_dir

    model_dir = resolve_model_dir(model)
    log_dir = Path(tempfile.mkdtemp(prefix="prefixcache-memory-"))
    rows = []
    for dtype, quantization in formats:
        reason = format_unavailable_reason(dtype, quantization)
        if reason is not None:
            rows.append(MemoryRow(dtype, quantization, skipped=reason.split(":")[0]))
            log(f"memory: {dtype} / {quantization}: skipped ({rows[-1].skipped})")
            continue
        row = measure_format(model, dtype, quantization, num_threads, block_size, log_dir)
        row.kv_pool_bytes = row.kv_blocks * kv_block_bytes(model_dir, dtype, block_size)
        log(f"memory: {dtype} / {quantization}: resident {row.rss_bytes / MIB:,.0f} MiB "
            f"(peak {row.peak_bytes / MIB:,.0f}, KV pool {row.kv_pool_bytes / MIB:,.0f})")
        rows.append(row)
    return {"model": model, "num_threads": num_threads, "block_size": block_size, "rows": [asdict(r) for r in rows]}


def memory_markdown(result: dict) -> str:
    """The table of :func:`run_memory_benchmark`'s result: one row per format, MiB."""
    lines = [f"`prefixcache serve {result['model']}` per weight format, its default KV pool (1 GiB), "
             f"`--num-threads {result['num_threads']}`, `--block-size {result['block_size']}`; the resident set "
             "after one 8-token completion (the server and its children), and the server process's peak from start "
             "to exit (`ru_maxrss`: the load's temporaries), one server process per format.", "",
             "| `--dtype` / `--quantization` | resident | peak | of which the KV pool | the rest |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        fmt = f"{r['dtype']} / {r['quantization']}"
        if r["skipped"] is not None:
            lines.append(f"| {fmt} | not run: {r['skipped']} | | | |")
            continue
        rss, pool = r["rss_bytes"], r["kv_pool_bytes"]
        lines.append(f"| {fmt} | {rss / MIB:,.0f} MiB | {r['peak_bytes'] / MIB:,.0f} MiB | {pool / MIB:,.0f} MiB "
                     f"({r['kv_blocks']:,} blocks) | {(rss - pool) / MIB:,.0f} MiB |")
    return "\n".join(lines) + "\n"


def write_memory_outputs(result: dict, out_dir: str | Path) -> list[Path]:
    """``memory.json`` and ``memory.md`` into ``out_dir`` (created); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "memory.json", out / "memory.md"]
    paths[0].write_text(json.dumps(result, indent=2))
    paths[1].write_text(memory_markdown(result))
    return paths
