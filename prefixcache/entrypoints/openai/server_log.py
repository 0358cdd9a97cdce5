"""What ``prefixcache serve`` logs: what it serves, at start, and one line per finished request.

At start (vLLM logs the same facts over its start-up): the model and its weights' fingerprint,
dtype, device and threads, the KV pool (blocks, tokens, bytes), the max model length, the block
size and the cache and scheduling policies; the URL follows once listening (the launcher).
Per request (vLLM's request stats; uvicorn's access log still gives the HTTP status): its id,
finish status, prompt / cached / completion tokens, TTFT and end-to-end latency, at info level
(``warning`` for a request the engine failed).

The lines go to the ``prefixcache`` logger; :func:`configure_logging` gives it a stderr handler in
uvicorn's format (``INFO:     ...``) at ``--log-level``.
"""

from __future__ import annotations

import logging
import sys

import torch

from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.errors import counted
from prefixcache.kernels.cpu_features import describe_cpu
from prefixcache.kernels.cpu_kernels import amx_ready
from prefixcache.outputs import RequestOutput

logger = logging.getLogger("prefixcache.serve")
request_logger = logging.getLogger("prefixcache.requests")
_HANDLER_NAME = "prefixcache-serve"


def configure_logging(level: str) -> None:
    """The ``prefixcache`` logger writes to stderr at ``level`` (``info``, ``debug``...), formatted as
    uvicorn's own lines. Calling it again only changes the level and writes to the ``sys.stderr`` of
    that moment."""
    from uvicorn.logging import DefaultFormatter

    root = logging.getLogger("prefixcache")
    root.setLevel(level.upper())
    ours = [h for h in root.handlers if h.get_name() == _HANDLER_NAME]
    for handler in ours:  # stderr may have been replaced since (a second server in one process, a test's capture)
        if isinstance(handler, logging.StreamHandler):  # not setStream: it flushes the old stream, maybe closed
            with handler.lock:
                handler.stream = sys.stderr
    if not ours:
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s", use_colors=None))
        root.addHandler(handler)
        root.propagate = False  # one line each, whatever the root logger has


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def startup_lines(engine: LLMEngine) -> list[str]:
    """The start-up summary of ``engine``, one fact group per line (no trailing newlines)."""
    c, loaded = engine.config, engine.loaded
    dtype = str(loaded.dtype).removeprefix("torch.")
    n = torch.get_num_threads()
    threads = f", {n} thread{'s' if n != 1 else ''}" if engine.device.type == "cpu" else ""
    pool_bytes = engine.num_blocks * engine.kv_cache_bytes_per_block
    caching = "on" if c.enable_prefix_caching else "off"
    policies = [f"hash {c.hash_algo}", f"eviction {c.eviction_policy}",
                f"partial-block reuse {'on' if c.enable_partial_block_reuse else 'off'}"]
    scheduling = getattr(c, "scheduling_policy", None)  # a newer EngineConfig field, where present
    tiers = [name for name, on in (("disk", c.kv_disk_dir), ("redis", c.kv_redis_url)) if on]
    return [
        f"model {c.model} ({loaded.model_dir}), weights fingerprint {loaded.fingerprint.hex()[:16]}",
        f"dtype {dtype}, quantization {loaded.quantization}"
        + (f", attention {loaded.model.attention_dtype}" if loaded.model.attention_dtype != "float" else "")
        + f", device {engine.device}{threads}"
        + (f"; {describe_cpu()}, amx: {'yes' if amx_ready() else 'no'}" if engine.device.type == "cpu" else ""),
        f"KV pool {engine.num_blocks} blocks x {c.block_size} tokens = {engine.num_blocks * c.block_size} tokens, "
        f"{_mib(pool_bytes)} ({engine.kv_cache_bytes_per_block} bytes per block); "
        f"max model len {engine.max_model_len} tokens",
        f"scheduler: up to {c.max_num_seqs} requests, {c.max_num_batched_tokens} tokens per step"
        + (f", policy {scheduling}" if scheduling else ""),
        f"prefix caching {caching} ({', '.join(policies)})"
        + (f"; KV tiers: {', '.join(tiers)}" if tiers else ""),
    ]


def log_startup(engine: LLMEngine) -> None:
    """Logs :func:`startup_lines` at info level."""
    for line in startup_lines(engine):
        logger.info("%s", line)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def request_line(out: RequestOutput, num_completion_tokens: int) -> str:
    """One finished request: ``out`` is its last sample, ``num_completion_tokens`` over all its samples."""
    return (f"request {out.request_id} {out.finish_reason or 'abort'}: prompt {counted(out.num_prompt_tokens, 'token')} "
            f"({out.num_cached_tokens} cached), completion {counted(num_completion_tokens, 'token')}, "
            f"TTFT {_ms(out.ttft_s)}, e2e {_ms(out.e2e_s)}")


class RequestLog:
    """``AsyncLLMEngine.on_finish`` hook: sums the generated tokens of a request's samples and logs
    :func:`request_line` when its last sample finishes; then calls ``then`` (the metrics) as well.

    Args:
        then: the hook it wraps, called with the same ``(out, request_done)``, first.
    """

    def __init__(self, then=None) -> None:
        self.then = then
        self._tokens: dict[str, int] = {}  # request id -> tokens of its finished samples so far

    def __call__(self, out: RequestOutput, request_done: bool = True) -> None:
        if self.then is not None:
            self.then(out, request_done)
        tokens = self._tokens.pop(out.request_id, 0) + len(out.token_ids)
        if not request_done:
            self._tokens[out.request_id] = tokens
            return
        level = logging.WARNING if out.finish_reason == "error" else logging.INFO
        request_logger.log(level, "%s", request_line(out, tokens))
