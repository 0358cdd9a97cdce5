"""``prefixcache cluster``: N ``prefixcache serve`` replicas behind the SGLang model gateway.

``prefixcache cluster [MODEL] --replicas 2 --router-policy cache_aware [serve flags]`` starts N
replicas on free loopback ports (each with the same serve flags), then the gateway
(``sglang-router``: ``python -m sglang_router.launch_router --worker-urls ... --policy ...``) on
``--host``/``--port``, and returns when the gateway lists every replica as healthy. What the
gateway asks a replica is written in :mod:`~prefixcache.entrypoints.openai.router_probes`.

Processes (invariants):

- every process this module starts is in :attr:`Cluster.processes` from the moment it exists, and
  :meth:`Cluster.stop` ends all of them (SIGTERM, then SIGKILL after ``stop_timeout_s``): on a
  normal exit, on Ctrl-C or SIGTERM, and on a failed start (a replica that exits or isn't healthy
  in time, a gateway that doesn't register them);
- each child runs in its own session (a terminal's Ctrl-C reaches only the launcher, which stops
  the gateway first, then the replicas) and, on Linux, gets SIGTERM if the launcher dies
  (``PR_SET_PDEATHSIG``), so even a killed launcher leaves no orphans;
- each child's output is forwarded to the launcher's stderr line by line, prefixed
  ``[replica-K]`` or ``[gateway]``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

# manual: the gateway routes by the X-SMG-Routing-Key request header (sticky per key), never by the
# body, so OpenAI's prompt_cache_key reaches it only when the client copies it into that header
POLICIES = ("cache_aware", "round_robin", "random", "manual")
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
LOOPBACK = "127.0.0.1"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PR_SET_PDEATHSIG = 1
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the directory holding this prefixcache package


class ClusterStartError(RuntimeError):
    """The cluster could not start (everything it had started is stopped by then)."""


@dataclass(frozen=True)
class ClusterOptions:
    """What :class:`Cluster` starts.

    Attributes:
        num_replicas: ``prefixcache serve`` processes, >= 1.
        policy: the gateway's routing policy, one of :data:`POLICIES`.
        serve_args: every replica's ``serve`` arguments (model and flags; not ``--host``/``--port``).
        host: the gateway's address.
        port: the gateway's port (0: a free one).
        router_args: more ``sglang_router.launch_router`` flags (they come last, so they win).
        startup_timeout_s: how long replicas (model load) and the gateway (registration) may take.
        stop_timeout_s: after SIGTERM, how long a process may take to exit before SIGKILL.
        health_check_interval_s: the gateway's health-check period (it stops routing to a replica
            that fails ``/health`` once). Besides, one failed request opens a replica's circuit
            breaker for 5 s, so the gateway retries that request on another replica at once.
    """

    num_replicas: int
    policy: str = "cache_aware"
    serve_args: tuple[str, ...] = ()
    host: str = LOOPBACK
    port: int = 0
    router_args: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 40.0
    health_check_interval_s: int = 2

    def validate(self) -> None:
        """Raises ValueError naming the flag of a bad value."""
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ValueError(f"--replicas must be an integer >= 1, got {self.num_replicas!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"--router-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"--startup-timeout must be > 0 seconds, got {self.startup_timeout_s!r}")
        if importlib.util.find_spec("sglang_router") is None:
            raise ValueError("the SGLang model gateway is not installed: pip install 'prefixcache[cluster]' "
                             "(sglang-router)")
        for flag in ("--host", "--port"):
            if any(a == flag or a.startswith(flag + "=") for a in self.serve_args):
                raise ValueError(f"{flag} of the replicas is chosen by the cluster (--host/--port are the gateway's)")


@dataclass
class Process:
    """One started child: its name (``replica-0``, ``gateway``), process and log forwarder."""

    name: str
    popen: subprocess.Popen
    forwarder: threading.Thread
    url: str  # where it serves HTTP


@dataclass
class Cluster:
    """N replicas and the gateway in front of them; a context manager (``with`` stops everything).

    Args:
        options: what to start.
        log: where the children's prefixed lines and the launcher's own lines go (stderr).
    """

    options: ClusterOptions
    log: IO[str] = field(default_factory=lambda: sys.stderr)
    processes: list[Process] = field(default_factory=list)
    url: str = ""  # the gateway, http://HOST:PORT, once started
    _log_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def replicas(self) -> list[Process]:
        return [p for p in self.processes if p.name.startswith("replica-")]

    @property
    def gateway(self) -> Process | None:
        return next((p for p in self.processes if p.name == "gateway"), None)

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def say(self, line: str) -> None:
        """Writes one line to the log (whole lines, never interleaved with a child's)."""
        with self._log_lock:
            self.log.write(line.rstrip("\n") + "\n")
            self.log.flush()

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Starts the replicas, waits for their ``/health``, starts the gateway and waits until it
        lists every replica as healthy.

        Raises:
            ValueError: bad options, or a gateway ``--host``/``--port`` that can't be bound (nothing
                started).
            ClusterStartError: a process exited or wasn't ready in time (everything stopped).
        """
        self.options.validate()
        if self.options.port:  # a busy gateway port fails now, not after the replicas load
            from prefixcache.entrypoints.openai.launcher import bind_socket

            bind_socket(self.options.host, self.options.port).close()
        deadline = time.monotonic() + self.options.startup_timeout_s
        try:
            for k in range(self.options.num_replicas):
                port = free_port()
                argv = [sys.executable, "-m", "prefixcache", "serve", *self.options.serve_args,
                        "--host", LOOPBACK, "--port", str(port)]
                self._spawn(f"replica-{k}", argv, f"http://{LOOPBACK}:{port}")
            for replica in self.replicas:
                self._wait(replica, deadline, lambda p: _http_status(p.url + "/health") == 200, "healthy")
            self._start_gateway(deadline)
        except BaseException:
            self.stop()
            raise

    def _start_gateway(self, deadline: float) -> None:
        o = self.options
        port = o.port or free_port()
        host = f"[{o.host}]" if ":" in o.host else o.host
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", o.host, "--port", str(port),
                "--worker-urls", *[r.url for r in self.replicas], "--policy", o.policy,
                "--prometheus-host", LOOPBACK, "--prometheus-port", str(free_port()),
                "--health-check-interval-secs", str(o.health_check_interval_s), "--health-failure-threshold", "1",
                # one failed request opens a replica's circuit for 5 s, so the gateway's retry goes elsewhere
                "--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "5",
                "--shutdown-grace-period-secs", str(max(1, int(o.stop_timeout_s))), "--log-level", "warn",
                *o.router_args]
        gateway = self._spawn("gateway", argv, f"http://{host}:{port}")
        want = {r.url for r in self.replicas}
        self._wait(gateway, deadline, lambda p: healthy_workers(p.url) == want, "routing to every replica")
        self.url = gateway.url

    def _spawn(self, name: str, argv: list[str], url: str) -> Process:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "PYTHONPATH": package_pythonpath()}
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True, preexec_fn=_die_with_parent())
        forwarder = threading.Thread(target=self._forward, args=(name, popen.stdout), daemon=True,
                                     name=f"cluster-log-{name}")
        process = Process(name, popen, forwarder, url)
        self.processes.append(process)
        forwarder.start()
        return process

    def _forward(self, name: str, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            self.say(f"[{name}] " + _ANSI.sub("", raw.decode("utf-8", "replace")))
        stream.close()

    def _wait(self, process: Process, deadline: float, ready: Callable[[Process], bool], what: str) -> None:
        while not ready(process):
            if process.popen.poll() is not None:
                raise ClusterStartError(f"{process.name} exited with status {process.popen.returncode} before "
                                        f"{what} (its log lines above, prefixed [{process.name}])")
            if time.monotonic() > deadline:
                raise ClusterStartError(f"{process.name} not {what} within --startup-timeout "
                                        f"{self.options.startup_timeout_s:g} s")
            time.sleep(0.2)

    def switch_policy(self, policy: str) -> None:
        """Restarts the gateway with ``policy`` (same replicas; a new port when ``port`` is 0),
        for comparing policies on the same replicas.

        Raises:
            ValueError: an unknown policy.
            ClusterStartError: the new gateway did not register the replicas (all stopped).
        """
        self.options = dataclasses.replace(self.options, policy=policy)
        self.options.validate()
        old = self.gateway
        if old is not None:
            _signal(old.popen, signal.SIGTERM)
            old.popen.wait(timeout=self.options.stop_timeout_s)
            old.forwarder.join(timeout=5)
            self.processes.remove(old)
        try:
            self._start_gateway(time.monotonic() + self.options.startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    # ------------------------------------------------------------------ run and stop
    def exited(self) -> list[Process]:
        """The started processes that have exited."""
        return [p for p in self.processes if p.popen.poll() is not None]

    def stop(self) -> None:
        """Stops every started process: the gateway first, then the replicas (SIGTERM, then
        SIGKILL after ``stop_timeout_s``). Idempotent."""
        for group in ([p for p in self.processes if p.name == "gateway"], self.replicas):
            for p in group:
                _signal(p.popen, signal.SIGTERM)
            deadline = time.monotonic() + self.options.stop_timeout_s
            for p in group:
                try:
                    p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.say(f"prefixcache cluster: {p.name} did not stop in {self.options.stop_timeout_s:g} s; killed")
                    _signal(p.popen, signal.SIGKILL)
                    p.popen.wait()
        for p in self.processes:
            p.forwarder.join(timeout=5)


def _signal(popen: subprocess.Popen, sig: int) -> None:
    """Signals the child's process group (its own session), so helpers it started go too."""
    if popen.poll() is not None:
        return
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM the child when the launcher dies (None elsewhere).
    libc's ``prctl`` is looked up here, in the parent: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def package_pythonpath() -> str:
    """``PYTHONPATH`` for a child process that must run this very prefixcache: the directory holding this
    package first (a checkout on ``sys.path``, not only an installed one), then the inherited ``PYTHONPATH``."""
    return os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` now (the OS's pick; another process could take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _http_status(url: str, timeout_s: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


def healthy_workers(gateway_url: str, timeout_s: float = 2.0) -> set[str]:
    """The worker URLs the gateway lists as healthy (``GET /workers``; empty set if it can't say)."""
    try:
        with urllib.request.urlopen(gateway_url + "/workers", timeout=timeout_s) as response:
            workers = json.load(response).get("workers", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {w.get("url") for w in workers if isinstance(w, dict) and w.get("is_healthy")}


# ---------------------------------------------------------------------------- CLI
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """``serve``'s flags (given to every replica; ``--host``/``--port`` are the gateway's) plus the
    cluster's own."""
    from prefixcache.entrypoints.cli.serve import add_cli_args as add_serve_args

    add_serve_args(parser)
    c = parser.add_argument_group("cluster")
    c.add_argument("--replicas", type=int, default=2, help="prefixcache serve processes (default: %(default)s)")
    c.add_argument("--router-policy", default="cache_aware", choices=POLICIES,
                   help="the gateway's routing policy; manual: requests carrying the same "
                        f"{ROUTING_KEY_HEADER} header land on the same replica (with the OpenAI SDK send "
                        f"extra_headers={{\"{ROUTING_KEY_HEADER}\": prompt_cache_key}}) (default: %(default)s)")
    c.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="one more sglang_router.launch_router argument, e.g. --router-arg=--cache-threshold "
                        "--router-arg=0.5 (repeatable)")
    c.add_argument("--startup-timeout", type=float, default=300.0, metavar="S",
                   help="seconds the replicas and the gateway may take to be ready (default: %(default)s)")


def serve_argv(args: argparse.Namespace) -> list[str]:
    """The ``serve`` arguments that reproduce the serve flags in ``args`` (all but ``--host`` and
    ``--port``): the model, then each flag whose value is not its default."""
    from prefixcache.entrypoints.cli.main import CLIParser
    from prefixcache.entrypoints.cli.serve import add_cli_args as add_serve_args

    serve = CLIParser(add_help=False)
    add_serve_args(serve)
    argv: list[str] = []
    for action in serve._actions:
        value = getattr(args, action.dest)
        if not action.option_strings:  # the model
            argv.insert(0, str(value))
        elif action.dest not in ("host", "port") and value != action.default:
            argv += _flag_argv(action, value)
    return argv


def _flag_argv(action: argparse.Action, value: object) -> list[str]:
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else next(s for s in action.option_strings if s.startswith("--no-"))]
    if action.nargs == 0:  # store_true / store_false
        return [flag]
    if isinstance(value, list) and action.nargs is None:  # append
        return [x for item in value for x in (flag, str(item))]
    if isinstance(value, list):  # nargs="*"
        return [flag, *map(str, value)]
    return [flag, str(value)]


def run_cli(args: argparse.Namespace) -> int:
    """Starts the cluster and runs until Ctrl-C / SIGTERM (0) or until the gateway or every
    replica exits (1); stops everything it started in every case.

    Raises:
        ValueError: a bad flag (nothing started).
    """
    from prefixcache.entrypoints.cli.serve import check_serve_args

    replicas = args.replicas if isinstance(args.replicas, int) and args.replicas > 1 else 1
    settings = check_serve_args(args, replicas=replicas)  # a bad serve flag fails here, once, not in N replicas
    events = settings.config.kv_events_config
    if args.replicas > 1 and events is not None and events.enable_kv_cache_events:
        raise ValueError("--kv-events-config: every replica would bind the same endpoints; start the replicas "
                         "with `prefixcache serve`, each with its own endpoints, and the gateway yourself")
    options = ClusterOptions(args.replicas, args.router_policy, tuple(serve_argv(args)), args.host, args.port,
                             tuple(args.router_arg), args.startup_timeout)
    options.validate()
    cluster = Cluster(options)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        cluster.start()
        cluster.say(f"prefixcache cluster: gateway on {cluster.url} ({options.policy}) -> "
                    f"{', '.join(r.url for r in cluster.replicas)} (Ctrl-C to stop)")
        return _watch(cluster)
    except ClusterStartError as e:
        cluster.say(f"prefixcache cluster: error: {e}")
        return 1
    except KeyboardInterrupt:
        cluster.say("prefixcache cluster: stopping")
        return 0
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _watch(cluster: Cluster, poll_s: float = 0.5) -> int:
    """Waits while the gateway and at least one replica run; says when a replica exits (the
    gateway routes around it). Returns 1 when it stops waiting."""
    reported: set[str] = set()
    while True:
        exited = cluster.exited()
        for p in exited:
            if p.name not in reported:
                reported.add(p.name)
                cluster.say(f"prefixcache cluster: {p.name} exited with status {p.popen.returncode}")
        names = {p.name for p in exited}
        if "gateway" in names or all(r.name in names for r in cluster.replicas):
            return 1
        time.sleep(poll_s)

