"""A real server on a free loopback port (uvicorn in a thread), driven over HTTP by the tests."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.config import EngineConfig
from prefixcache.engine.async_engine import AsyncLLMEngine
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.entrypoints.openai.api_server import build_app
from prefixcache.entrypoints.openai.launcher import HTTPOptions, Server, uvicorn_config

MODEL = "smollm2-135m"


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    engine: AsyncLLMEngine
    server: uvicorn.Server
    thread: threading.Thread

    def metrics(self) -> dict[str, float]:
        """/metrics parsed with prometheus_client: sample name (+ finished_reason) → value."""
        text = httpx.get(self.base_url + "/metrics").text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name + (f"{{{s.labels['finished_reason']}}}" if "finished_reason" in s.labels else "")
                if "le" not in s.labels:
                    values[key] = s.value
        return values

    def wait_idle(self, timeout_s: float = 10.0) -> dict[str, float]:
        """Polls /metrics until no request runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (m["prefixcache:num_requests_running"] == 0 and m["prefixcache:num_requests_waiting"] == 0
                    and m["prefixcache:kv_blocks_in_use"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


def start_server(loaded, api_key: str | None = None, lora_modules: dict[str, str] | None = None,
                 app_options: dict | None = None, http_options: dict | None = None, **options) -> RunningServer:
    """Serves SmolLM2 with engine ``options``; ``app_options`` go to ``build_app`` (tenants...),
    ``http_options`` to :class:`HTTPOptions` (timeouts); uvicorn is set up as ``serve`` sets it up."""
    options = {"block_size": 16, "num_blocks": 160, "max_num_seqs": 16, "num_threads": 2, **options}
    engine = LLMEngine(EngineConfig(model=MODEL, **options), loaded=loaded)
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, MODEL, api_key=api_key, lora_modules=lora_modules, **(app_options or {}))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    http = HTTPOptions(**{"log_level": "warning", **(http_options or {})})
    server = Server(uvicorn_config(app, http), http.timeout_graceful_shutdown_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", async_engine, server, thread)


def stop_server(s: RunningServer) -> None:
    s.server.should_exit = True
    s.thread.join(timeout=30)


@pytest.fixture(scope="package")
def server(smollm2):
    # Exact full-block cached_tokens values below; partial-block reuse has its own tests
    # (tests/engine/test_eviction_and_partial.py) and is covered here by the metrics identity.
    s = start_server(smollm2, enable_partial_block_reuse=False)
    yield s
    stop_server(s)


@pytest.fixture(scope="package")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def anthropic_server(smollm2):
    """The server of the ``POST /v1/messages`` tests, one per test module so each module's pin counts
    start from an empty pin table. Partial-block reuse is off so cached counts are whole blocks; the
    pin cap is set (half the pool) so the pin counts asserted don't follow a change of its default."""
    s = start_server(smollm2, enable_partial_block_reuse=False, max_pinned_fraction=0.5)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def anthropic_client(anthropic_server):
    import anthropic

    return anthropic.Anthropic(base_url=anthropic_server.base_url, api_key="unused", max_retries=0, timeout=60)
