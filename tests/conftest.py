"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--regen-golden", action="store_true", default=False,
        help="recompute golden token ids with transformers and rewrite tests/engine/golden/*.json",
    )


@pytest.fixture(scope="session", autouse=True)
def _threads():
    # CI has 2 cores; fixed threads keep fp32 results reproducible run to run.
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2():
    """The default model (SmolLM2-135M-Instruct, fp32), fetched by `prefixcache fetch` in setup."""
    from prefixcache.models.loader import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def make_llm(smollm2):
    """Builds an LLM on the already loaded default model; engine options as keywords."""
    from prefixcache.llm import LLM

    def make(**options):
        options.setdefault("num_threads", 2)
        return LLM("smollm2-135m", loaded=smollm2, **options)

    return make


def pytest_collection_modifyitems(config, items):
    """Every test that loads the real default model (the ``smollm2`` fixture, directly or through
    another fixture) is ``slow``: ``pytest -m "not slow"`` is the fast subset (tiny models, the
    cache, the scheduler, layers)."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


class RedisServer:
    """A real ``redis-server`` this test started on a free loopback port (no persistence)."""

    def __init__(self, workdir) -> None:
        import shutil
        import socket
        import subprocess
        import time

        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: scripts/setup.sh installs it (apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        import redis

        self.client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    pytest.fail(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)

    def stop(self) -> None:
        """Stops the server (a tier that is down mid-run)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on loopback for this test; ``.url``, ``.client``, ``.stop()``."""
    server = RedisServer(tmp_path)
    yield server
    server.stop()
