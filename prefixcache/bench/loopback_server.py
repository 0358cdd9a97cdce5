"""A server process on a free loopback port for the benchmarks: started, waited for until ready, stopped.

``prefixcache serve`` (:func:`start_serve`) or any other OpenAI-style server (:func:`start_loopback_server`)
runs in a session of its own (``start_new_session``), so stopping signals its whole process group: whatever it
started goes with it. Its output goes to a log file, one per start, whose tail is attached to a failed start.
Stopping reaps it with ``wait4``, which hands back the kernel's peak resident set of the process
(:attr:`LoopbackServer.peak_rss_bytes`): Linux keeps that maximum for every process, so it needs no sampling.
It is a floor under the launcher too: the kernel carries the high-water mark of the process's image before
``exec`` (when ``subprocess`` forks rather than vforks, a copy of the launcher's resident set) into the new
program's, so a server smaller than its launcher reads as the launcher's size (a ``prefixcache serve`` with its
weights and pool is several times a bench process's).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from prefixcache.entrypoints.cli.cluster import LOOPBACK, free_port, package_pythonpath


@dataclass
class LoopbackServer:
    """A started server on loopback.

    Attributes:
        name: what logs and errors call it.
        url: ``http://127.0.0.1:<port>``.
        popen: its process (the leader of its own process group).
        log_path: its stdout and stderr.
        peak_rss_bytes: after :meth:`stop` reaped it, its peak resident set in bytes (``ru_maxrss`` of
            ``wait4``: the larger of the process's own peak and that of any child it reaped); None before,
            or when something else reaped it.
    """

    name: str
    url: str
    popen: subprocess.Popen
    log_path: Path
    peak_rss_bytes: int | None = None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to its process group, SIGKILL after ``timeout_s``; reaps it. Idempotent."""
        if self.popen is None or self.popen.returncode is not None:
            return
        _signal_group(self.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while not self._reap(os.WNOHANG):
            if time.monotonic() > deadline:
                _signal_group(self.popen.pid, signal.SIGKILL)
                self._reap(0)
                return
            time.sleep(0.05)

    def _reap(self, options: int) -> bool:
        """``wait4`` on the process: True once it is reaped (its exit status and peak resident set kept)."""
        try:
            pid, status, usage = os.wait4(self.popen.pid, options)
        except ChildProcessError:  # reaped elsewhere (a poll() meanwhile): its status is Popen's
            self.popen.wait()
            return True
        if pid == 0:
            return False
        self.popen.returncode = os.waitstatus_to_exitcode(status)
        # ru_maxrss: kibibytes on Linux, bytes on macOS (getrusage(2) on each)
        self.peak_rss_bytes = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return True


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # it exited meanwhile (its group is gone; it is still to be reaped)
        pass


def start_loopback_server(name: str, argv: list[str], port: int, log_dir: Path, startup_timeout_s: float,
                          ready_path: str = "/health", env: dict[str, str] | None = None) -> LoopbackServer:
    """Starts ``argv`` (a server that listens on ``port`` of loopback) and returns once ``GET ready_path``
    answers 200.

    Args:
        name: the server's name in logs and errors (its log file is named after it and ``port``).
        argv: the command line; it must bind :data:`LOOPBACK` and ``port``.
        log_dir: where its log goes (created).
        startup_timeout_s: how long it may take to become ready.
        ready_path: the route that answers 200 once it serves (``/health``; ``/v1/models`` for a server
            without one).
        env: variables set on top of this process's environment.

    Raises:
        RuntimeError: it exited or was not ready within ``startup_timeout_s`` (stopped; its log's tail attached).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name.replace(' ', '-').replace('.', '')}-{port}.log"  # one per start: fresh servers
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, env={**os.environ, **(env or {})})
    server = LoopbackServer(name, f"http://{LOOPBACK}:{port}", popen, log_path)
    deadline = time.monotonic() + startup_timeout_s
    while True:
        try:
            if httpx.get(server.url + ready_path, timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if popen.poll() is not None or time.monotonic() > deadline:
            server.stop()
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{name} did not start (exit {popen.returncode}); its log ends:\n{tail}")
        time.sleep(0.3)


def start_serve(model: str, serve_args: tuple[str, ...] = (), name: str = "prefixcache",
                log_dir: Path | None = None, startup_timeout_s: float = 300.0) -> LoopbackServer:
    """``prefixcache serve model *serve_args`` of this very checkout on a free loopback port, ready on ``/health``.

    Args:
        serve_args: further ``serve`` flags (``--dtype``, ``--num-threads``, ...); not ``--host``/``--port``.
        log_dir: where its log goes (default a new temporary directory).

    Raises:
        RuntimeError: it exited or was not healthy within ``startup_timeout_s`` (its log's tail attached).
    """
    port = free_port()
    argv = [sys.executable, "-m", "prefixcache", "serve", model, "--host", LOOPBACK, "--port", str(port),
            *serve_args]
    return start_loopback_server(name, argv, port, Path(log_dir or tempfile.mkdtemp(prefix="prefixcache-serve-")),
                                 startup_timeout_s, env={"PYTHONPATH": package_pythonpath()})
