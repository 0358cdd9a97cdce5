"""Limits on what a client may send: request body size, and how long a request may take to arrive.

- :class:`RequestBodyLimitMiddleware` (ASGI): a body over ``max_body_bytes`` gets a 413 in
  OpenAI's error format, decided while reading: a ``Content-Length`` over the limit is refused
  before any of the body is read; a chunked body is counted chunk by chunk and refused as soon as
  it passes the limit. Either way the connection is closed after the 413, so the rest of the body
  is never buffered.
- :class:`TimedH11Protocol` (uvicorn's h11 protocol plus two timers): a connection must deliver a
  complete request head within ``header_s`` of opening (or of its first byte after a previous
  response), and the whole body within ``body_s`` of the head. h11 has no such timer and
  uvicorn's keep-alive timeout only covers idle connections *between* requests, so without this a
  client that sends half a request holds its connection forever. On expiry the server answers 408
  (when it has not answered yet) and closes the connection.

Closing while the client is still sending (a 413 before a 50 MB body is read) is a lingering
close, as HTTP servers do: the server half-closes (its response and a FIN go out), then reads and
discards what still arrives for at most ``LINGER_S`` seconds before it closes. Closing at once
would make the kernel reset the connection over the unread data, and the client could lose the
413 it was sent.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import h11
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from prefixcache.entrypoints.openai.api_errors import error_body, error_json, error_response

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20  # ~4x the largest servable request: 128K tokens as JSON ids (~1 MiB) or text (~3 MiB)
LINGER_S = 2.0  # at most this long, a closed connection's late request bytes are read and dropped
logger = logging.getLogger("prefixcache.server")


class BodyTooLargeError(HTTPException):
    """A request body over the limit (an HTTPException so that FastAPI's body parsing passes it on
    instead of turning it into a 400). Answered 413 with ``Connection: close``."""

    code = "request_too_large"

    def __init__(self, message: str) -> None:
        super().__init__(413, message, headers={"connection": "close"})


class RequestBodyLimitMiddleware:
    """Refuses request bodies over ``max_body_bytes`` with a 413 (see the module docstring).

    Args:
        app: the app to protect.
        max_body_bytes: the largest body accepted, in bytes (>= 1).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self, size: str) -> str:
        return f"request body is {size} (--max-request-body-bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            message = self._too_large(f"{int(declared)} bytes; the limit is {self.max_body_bytes} bytes")
            response = error_response(413, message, None, BodyTooLargeError.code, headers={"connection": "close"})
            await response(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLargeError(self._too_large(f"over the limit of {self.max_body_bytes} bytes"))
            return message

        await self.app(scope, counted_receive, send)


@dataclass(frozen=True)
class ReadTimeouts:
    """How long a client may take to send a request.

    Attributes:
        header_s: seconds from a connection's opening (or the first byte of its next request)
            to a complete request head.
        body_s: seconds from a complete head to the end of its body.
    """

    header_s: float
    body_s: float


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with request-head and request-body deadlines (see the module
    docstring). Build it with ``functools.partial(TimedH11Protocol, read_timeouts=...)`` as
    ``uvicorn.Config(http=...)``.

    The one timer is in one of two phases: ``"header"`` while h11 waits for (a partial) request
    head, ``"body"`` while it reads a body; none while the app handles a complete request or the
    connection idles between requests (uvicorn's keep-alive timeout covers that).
    """

    def __init__(self, *args: Any, read_timeouts: ReadTimeouts, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeouts = read_timeouts
        self._read_phase: str | None = None
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = _LingeringTransport(transport, self)  # what uvicorn's cycles write to and close
        self._track_read(receiving=True)

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:  # the response is out: drop what the client still sends
            return
        super().data_received(data)
        self._track_read(receiving=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track_read(receiving=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_read_phase(None)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 can't parse (a bad request line, header or chunk), in
        OpenAI's JSON error format like every other error, then the connection is closed."""
        body = error_json(error_body(400, f"malformed HTTP request: {msg}", None, "invalid_http"))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()

    def _track_read(self, receiving: bool) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            phase = "body"
        elif state is h11.IDLE and (receiving or self.conn.trailing_data[0]):
            phase = "header"
        else:
            phase = None
        if phase != self._read_phase:
            self._set_read_phase(phase)

    def _set_read_phase(self, phase: str | None) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._read_phase = phase
        if phase is not None and self.transport is not None and not self.transport.is_closing():
            timeout_s = self.read_timeouts.header_s if phase == "header" else self.read_timeouts.body_s
            self._read_timer = self.loop.call_later(timeout_s, self._on_read_timeout, phase, timeout_s)

    def _on_read_timeout(self, phase: str, timeout_s: float) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        what = "request head" if phase == "header" else "request body"
        logger.info("closing connection from %s: %s not received within %s s", self.client, what, timeout_s)
        cycle = self.cycle
        answered = phase == "body" and cycle is not None and cycle.response_started
        if not answered:  # nothing of a response went out on this connection since the last one
            body = error_json(error_body(408, f"{what} not received within {timeout_s:g} s", None,
                                         "request_timeout"))
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()  # the app, if it waits for the body, sees a disconnect


class _LingeringTransport:
    """The connection's transport, whose ``close()`` lingers while the client may still be sending
    (see the module docstring); everything else goes to the real transport."""

    def __init__(self, transport: asyncio.Transport, protocol: TimedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        transport = self._transport
        still_sending = self._protocol.conn.their_state is h11.SEND_BODY
        if self.lingering or transport.is_closing() or not still_sending or not transport.can_write_eof():
            transport.close()
            return
        self.lingering = True
        self._protocol._set_read_phase(None)
        transport.write_eof()  # the response and a FIN go out; reading goes on
        transport.resume_reading()
        self._protocol.loop.call_later(LINGER_S, transport.close)
