"""Runs the app under uvicorn (vLLM's ``launcher.serve_http``): a socket bound before the model
loads, the request limits of :mod:`~prefixcache.entrypoints.openai.http_limits`, and a bounded shutdown.

Shutdown (SIGTERM, or a first Ctrl-C): the listening socket closes, idle connections close, and
requests in flight get up to ``timeout_graceful_shutdown_s`` to finish; then the engine is shut
down, which ends every request left with a proper answer (503 JSON, or an error event and
``data: [DONE]`` in a stream) rather than a cut connection. A second Ctrl-C skips the wait and
does the same at once.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from prefixcache.entrypoints.openai.http_limits import ReadTimeouts, TimedH11Protocol

logger = logging.getLogger("uvicorn.error")
_DRAIN_S = 1.0  # after the engine ends the last requests: time for their answers to go out
_BACKSTOP_S = 10.0  # uvicorn cancels what is still running this long after our deadline


@dataclass(frozen=True)
class HTTPOptions:
    """How the HTTP server treats connections (the ``serve`` flags of the same names).

    Attributes:
        timeout_keep_alive_s: an idle keep-alive connection is closed after this long.
        timeout_request_header_s: a request head must arrive within this long (see ReadTimeouts).
        timeout_request_body_s: a request body must arrive within this long after its head.
        timeout_graceful_shutdown_s: on shutdown, requests in flight get this long to finish.
        log_level: uvicorn's log level.
    """

    timeout_keep_alive_s: float = 5.0
    timeout_request_header_s: float = 10.0
    timeout_request_body_s: float = 60.0
    timeout_graceful_shutdown_s: float = 30.0
    log_level: str = "info"


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (listening starts when uvicorn serves it), so a busy port
    or a bad host is found before the model loads.

    Raises:
        ValueError: the address can't be bound, naming ``--host`` / ``--port``.
    """
    if not host:  # the OS reads "" as every interface: not what an empty value means
        raise ValueError("--host must not be empty (give 0.0.0.0 to listen on every interface)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as e:
        sock.close()
        raise ValueError(f"--host {host!r}: not a usable address ({e.strerror})") from e
    except OSError as e:
        sock.close()
        hint = "is another server using this port?" if e.errno == errno.EADDRINUSE else "is it an address of this machine?"
        raise ValueError(f"--host {host} --port {port}: cannot bind ({e.strerror}); {hint}") from e
    return sock


def uvicorn_config(app: FastAPI, options: HTTPOptions) -> uvicorn.Config:
    """uvicorn's config for ``app``: the timed h11 protocol, keep-alive, logs. uvicorn's own
    graceful-shutdown timeout (which cancels handlers) is only a backstop behind :class:`Server`'s."""
    timeouts = ReadTimeouts(options.timeout_request_header_s, options.timeout_request_body_s)
    return uvicorn.Config(
        app,
        http=functools.partial(TimedH11Protocol, read_timeouts=timeouts),
        timeout_keep_alive=options.timeout_keep_alive_s,
        timeout_graceful_shutdown=options.timeout_graceful_shutdown_s + _BACKSTOP_S,  # type: ignore[arg-type]
        log_level=options.log_level,
        lifespan="on",
    )


class Server(uvicorn.Server):
    """uvicorn's server with the bounded shutdown of the module docstring. The app must have been
    built by :func:`~prefixcache.entrypoints.openai.api_server.build_app` (``app.state.engine``).

    Args:
        config: from :func:`uvicorn_config`.
        timeout_graceful_shutdown_s: how long requests in flight may take to finish on shutdown.
    """

    def __init__(self, config: uvicorn.Config, timeout_graceful_shutdown_s: float) -> None:
        super().__init__(config)
        self.timeout_graceful_shutdown_s = timeout_graceful_shutdown_s
        self._ending: asyncio.Task | None = None

    def _end_requests(self) -> None:
        if self._ending is None:
            logger.info("ending the requests still in flight")
            self._ending = asyncio.ensure_future(self.config.app.state.engine.shutdown())

    async def _watch(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.timeout_graceful_shutdown_s
        while not self.force_exit and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        self._end_requests()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start-up (the app's lifespan, then the listening server), then the URL: logged
        only once the server accepts connections (uvicorn logs none for sockets it is handed)."""
        await super().startup(sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            logger.info("prefixcache serve: listening on http://%s:%d (Ctrl-C to stop)",
                        f"[{host}]" if ":" in host else host, port)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        watch = asyncio.ensure_future(self._watch())
        try:
            await super().shutdown(sockets)  # waits for connections; the watch ends them in time
        finally:
            watch.cancel()
        if self.force_exit:  # uvicorn skipped the app's shutdown: end the requests and the app here
            self._end_requests()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + _DRAIN_S
            while self.server_state.tasks and loop.time() < deadline:
                await asyncio.sleep(0.05)
            await self.lifespan.shutdown()
        if self._ending is not None:
            await self._ending


def serve_http(app: FastAPI, sock: socket.socket, options: HTTPOptions) -> None:
    """Serves ``app`` on the bound ``sock`` until SIGINT / SIGTERM (then shuts down as above); logs
    the URL once the server accepts connections (:meth:`Server.startup`).

    Raises:
        KeyboardInterrupt: re-raised by uvicorn after a Ctrl-C shutdown (its caller exits 130).
    """
    server = Server(uvicorn_config(app, options), options.timeout_graceful_shutdown_s)
    server.run(sockets=[sock])
