"""Limits on client connections that aiohttp does not enforce: a bound on open connections
and a deadline for request headers. (aiohttp closes idle keep-alive connections itself.)"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import msgspec
from aiohttp import web

from server.errors import ProtocolErrors, error_body
from surge import metrics

log = logging.getLogger("surge.frontend")

# File descriptors the frontend needs besides its clients (ZeroMQ, the tokenizer, logs).
_FD_RESERVE = 256
_DEFAULT_MAX = 4096
# A refused client gets this long to read the 503 before its socket is closed: closing with
# its request still unread would reset the connection and lose the answer.
_REFUSAL_GRACE_S = 1.0
_REFUSAL_LOG_EVERY_S = 10.0


def connection_limit(configured: int) -> int:
    """max_connections, or with 0 the default that the open-file limit leaves room for."""
    if configured:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _DEFAULT_MAX
    return max(1, min(_DEFAULT_MAX, soft - _FD_RESERVE))


def _raw_response(status: int, reason: str, message: str, code: str | None = None) -> bytes:
    """A complete HTTP/1.1 answer with an OpenAI error body, for a connection aiohttp never
    sees or has not parsed a request on."""
    body = msgspec.json.encode(error_body(status, message, code=code))
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class _Refused(asyncio.Protocol):
    """A connection over the limit: answered 503, then closed."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.closer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        transport.write(self.answer)
        if transport.can_write_eof():
            transport.write_eof()
        self.closer = asyncio.get_running_loop().call_later(_REFUSAL_GRACE_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read, only drained so the close does not reset the answer

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closer is not None:
            self.closer.cancel()


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, with a deadline for request headers: from the
    connection's start, and from the first byte of each later request."""

    def __init__(self, guard: ConnectionGuard, inner: Any) -> None:
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a request is being answered (headers complete)
        self.begun = False  # bytes of the next request have arrived
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.guard.open[self.inner] = self
        metrics.open_connections.set(len(self.guard.open))
        self._arm()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy and data:
            self.begun = True
            if self.deadline is None:
                self._arm()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.open.pop(self.inner, None)
        metrics.open_connections.set(len(self.guard.open))
        self.inner.connection_lost(exc)

    def request_started(self) -> None:
        self.busy, self.begun = True, False
        self._disarm()

    def request_finished(self) -> None:
        self.busy = False

    def _arm(self) -> None:
        self.deadline = asyncio.get_running_loop().call_later(self.guard.header_timeout_s,
                                                              self._expire)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expire(self) -> None:
        self.deadline = None
        if self.busy or self.transport is None or self.transport.is_closing():
            return
        timeout = self.guard.header_timeout_s
        log.debug("closing a connection from %s: no complete request headers within %gs",
                  self.transport.get_extra_info("peername"), timeout)
        if self.begun:
            self.transport.write(_raw_response(
                408, "Request Timeout", f"the request headers did not arrive within "
                                        f"{timeout:g}s (header_timeout_s)", "header_timeout"))
        self.transport.close()


class ConnectionGuard:
    """The protocol factory for the listening socket, in front of aiohttp's."""

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open: dict[Any, _Guarded] = {}  # by aiohttp's protocol, as requests know it
        self.refused = 0  # since the last log line about refusals
        self.refusal_logged = -_REFUSAL_LOG_EVERY_S
        self.refusal = _raw_response(
            503, "Service Unavailable", f"surge has {max_connections} connections open, its "
                                        "limit (max_connections); retry shortly",
            "too_many_connections")

    async def listen(self, server: web.Server, host: str, port: int) -> asyncio.AbstractServer:
        """Serve aiohttp's `server` on host:port through this guard."""
        return await asyncio.get_running_loop().create_server(
            lambda: self._protocol(server), host, port, backlog=128)

    def _protocol(self, server: web.Server) -> asyncio.Protocol:
        if len(self.open) >= self.max_connections:
            self._note_refusal()
            return _Refused(self.refusal)
        handler = server()
        # aiohttp builds its handler with the server's settings and has no hook for the
        # class; this one only answers its own errors differently (errors.ProtocolErrors).
        handler.__class__ = ProtocolErrors
        return _Guarded(self, handler)

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        """Tells a connection when its request is being answered, so that no deadline runs
        while it streams or holds a WebSocket."""

        @web.middleware
        async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
            connection = self.open.get(request.protocol)
            if connection is None:  # the client left before its request started
                return await handler(request)
            connection.request_started()
            try:
                return await handler(request)
            finally:
                connection.request_finished()

        return middleware

    def _note_refusal(self) -> None:
        metrics.refused_connections.inc()
        self.refused += 1
        now = time.monotonic()
        if now - self.refusal_logged >= _REFUSAL_LOG_EVERY_S:
            log.warning("refused %d connections over the limit of %d (max_connections)",
                        self.refused, self.max_connections)
            self.refused, self.refusal_logged = 0, now
