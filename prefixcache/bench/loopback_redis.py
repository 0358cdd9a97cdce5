"""A real ``redis-server`` on a free loopback port: the Redis of the bench's restart and cluster runs
(when no ``--kv-redis-url`` is given) and of the tests' ``redis_server`` fixture.

No persistence (``--save ""``, ``--appendonly no``), ``allkeys-lru`` when full, bound to 127.0.0.1
only. The caller finds the binary (``shutil.which("redis-server")``) so that it can say what is
missing in its own terms (a skipped bench phase, a failed test).
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


class LoopbackRedis:
    """A ``redis-server`` this process started and owns; ``url``, ``port``, ``client``, ``stop()``.

    Args:
        workdir: the server's working directory (``--dir``; nothing is saved there).
        binary: the ``redis-server`` executable.
        start_timeout_s: seconds to wait for the server's first ``PING`` reply.

    Raises:
        RuntimeError: the server exited or did not answer within ``start_timeout_s`` (it is stopped).
    """

    def __init__(self, workdir: Path, binary: str, start_timeout_s: float = 20.0) -> None:
        import redis

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port: int = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                self.client.ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Stops the server (idempotent; a test also uses it for a Redis that goes down mid-run)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
