"""OpenAI-style error bodies for every failure, whoever raised it."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler

from server.context_keys import MAX_BODY_BYTES, REQUEST_ID, TENANT
from surge import metrics

log = logging.getLogger("surge.frontend")
access = logging.getLogger("surge.access")
# A client's X-Request-Id that surge takes as the request's id (as vLLM does).
_REQUEST_ID = re.compile(r"[\x20-\x7e]{1,256}")

_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error",
          409: "invalid_request_error", 413: "invalid_request_error",
          414: "invalid_request_error", 415: "invalid_request_error",
          431: "invalid_request_error",
          429: "rate_limit_error",
          503: "service_unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    # OpenAI's 429s carry code rate_limit_exceeded, which some clients' retry logic reads.
    code = code or ("rate_limit_exceeded" if status == 429 else None)
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def draining_error() -> ApiError:
    """What a new request gets once SIGTERM has started the drain."""
    # Retry-After 1: another node (or this one's replacement) can take it now.
    return ApiError(503, "surge is shutting down; send this request to another server",
                    retry_after=1.0)


def too_large(limit: int) -> str:
    """The 413's message, for a request body and for a batch line alike."""
    return f"request body is larger than the limit of {limit} bytes (--max-body-bytes)"


# What aiohttp decodes here: br and zstd only where their modules are installed.
ENCODINGS = ("identity", "gzip", "deflate") + (("br",) if HAS_BROTLI else ()) + \
    (("zstd",) if HAS_ZSTD else ())


def unsupported_encoding(encoding: str) -> str:
    """The 415's message for a Content-Encoding surge does not decode."""
    return f"Content-Encoding {encoding!r} is not supported; send the body as " \
           f"{', '.join(ENCODINGS)}"


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param, code), status=status)


class ProtocolErrors(RequestHandler):
    """aiohttp's connection handler, whose own answers (a request it cannot parse: a bad
    request line or header) carry the error body every other error has."""

    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if isinstance(exc, ContentEncodingError):  # br or zstd, whose modules are missing
            # The request here is a stand-in without headers; aiohttp's text names it: "(br)".
            named = re.search(r"\((\w+)\)", str(exc))
            response = error_response(415, unsupported_encoding(named[1] if named else "?"))
            access.info("malformed request 415", extra={"status": 415, "peer": request.remote})
        elif status != 400:  # a fault here, not the client's: aiohttp logs it with its trace
            super().handle_error(request, status, exc, message)
            response = error_response(status, "the server could not answer this request")
        else:  # a client's bad bytes: its access line, no traceback
            if request.writer.output_size > 0:  # as aiohttp's own: too late for any answer
                raise ConnectionError("an answer was under way; the connection is broken")
            # aiohttp's message goes on to quote the bytes with a caret under them: its first
            # line says what was wrong.
            why = next((line.strip().rstrip(":") for line in (message or "").splitlines()
                        if line.strip()), "unreadable")
            if isinstance(exc, LineTooLong):
                status, what = (414, "request target") if _is_target(exc.args[0]) \
                    else (431, "header")
                why = f"a {what} longer than {exc.args[1]} bytes"
            access.info("malformed request %d", status, extra={
                "status": status, "peer": request.remote, "reason": why})
            response = error_response(status, f"the request is not valid HTTP/1.1 ({why}); "
                                              "nothing was run")
        response.force_close()
        return response


def _is_target(line: str | bytes | bytearray) -> bool:
    """Whether an over-long line aiohttp quotes (its first 100 bytes; older versions name it:
    "Status line is too long") is a request's target, alone ("/v1/...", "http://...") or with
    its method ("GET /...", the pure-Python parser's), rather than a header."""
    text = line.decode("latin-1") if isinstance(line, bytes | bytearray) else str(line)
    return re.match(r"(?:[A-Z]+ )?(?:/|https?://)|Status line", text) is not None


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every failure as an OpenAI error body; every request as one access-log line; every
    answer with its X-Request-Id."""
    started = time.monotonic()
    given = request.headers.get("X-Request-Id", "").strip()
    # One surge cannot take as it is (too long, not printable) is replaced, not refused: a
    # proxy's ids must not fail its health checks.
    request[REQUEST_ID] = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
    try:
        response = await _answer(request, handler)
    except asyncio.CancelledError:
        # aiohttp cancels the handler when its client goes (handler_cancellation): still one
        # line and one count, as nginx's 499 "client closed request".
        _account(request, 499, started)
        raise
    if not response.prepared:  # a stream sent its own as it began
        response.headers.setdefault("X-Request-Id", request[REQUEST_ID])
    _account(request, response.status, started)
    return response


def _account(request: web.Request, status: int, started: float) -> None:
    route = request.match_info.route.resource
    account(request, route.canonical if route else "unknown",
            f"{request.method} {request.path}", status, started)


def account(request: web.Request, endpoint: str, line: str, status: int, started: float,
            **fields: str) -> None:
    """A request's access line and its count in surge_requests_total (an HTTP request, or one
    request on a WebSocket: endpoint names the two apart)."""
    metrics.requests.labels(endpoint, str(status)).inc()
    access.info("%s %d", line, status, extra={
        "status": status, "duration_ms": round((time.monotonic() - started) * 1000, 1),
        "peer": request.remote, "tenant": request.get(TENANT),
        "request_id": request.get(REQUEST_ID), **fields})


async def _answer(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        response = error_response(e.status, e.message, e.param, e.code)
        if e.retry_after is not None:
            response.headers["Retry-After"] = str(max(1, math.ceil(e.retry_after)))
        return response
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = {404: f"no such path: {request.method} {request.path}",
                   405: f"method {request.method} is not allowed on {request.path}",
                   413: too_large(request.app[MAX_BODY_BYTES])}.get(e.status, e.reason)
        response = error_response(e.status, message)
        if e.status == 405 and "Allow" in e.headers:
            response.headers["Allow"] = e.headers["Allow"]
        if e.status == 413:  # its body is still unread: the connection cannot carry another
            response.force_close()
        return response
    except (web.RequestPayloadError, HttpProcessingError) as e:
        # A body aiohttp could not read, e.g. one its Content-Encoding does not decode. The
        # answer is sent here and the connection closed after it: aiohttp would otherwise
        # read on to drain the body, meet the same error, and log it with its traceback.
        reason = str(e).strip().splitlines()[-1].strip()
        response = error_response(400, f"the request body could not be read: {reason}")
        response.force_close()
        await response.prepare(request)
        await response.write_eof()
        request.protocol.force_close()
        return response
    except ConnectionResetError:
        # The client is gone (mid-body or mid-stream): nobody to answer, nothing went wrong
        # here. 499 is nginx's "client closed request"; aiohttp drops it quietly.
        return web.Response(status=499)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal server error; see the server log")
