"""WebSocket /v1/stream: many requests multiplexed on one socket, each with its own id.

Client -> server: {"type": "request", "id": ID, "endpoint": "completions" |
"chat.completions", "body": {...}} and {"type": "cancel", "id": ID}.
Server -> client: {"type": "delta", "id", "index", "text"} ... then {"type": "done", "id",
"finish_reason", "usage"}, or {"type": "error", "id", "error": {...}} for a bad request, a bad
message or a failed generation; the socket stays open. Closing it aborts all its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Protocol

import msgspec
from aiohttp import WSCloseCode, WSMsgType, web

from server.context_keys import MAX_BODY_BYTES, TENANT
from server.errors import ApiError, account, draining_error, error_body
from server.generate import Piece
from server.openai_types import ChatCompletionRequest, CompletionRequest
from server.responses import usage
from server.translate import Body, RequestTranslator

log = logging.getLogger("surge.frontend")
_KINDS = {"completions": CompletionRequest, "chat.completions": ChatCompletionRequest}
_HEARTBEAT_S = 20.0
_PATH = "/v1/stream"


class OpenSockets:
    """Every open socket and its running requests, so that a drain closes the idle ones at once
    instead of waiting out its timeout for clients that may never send again."""

    def __init__(self) -> None:
        self.jobs: dict[web.WebSocketResponse, dict[str, asyncio.Task]] = {}

    async def close_idle(self) -> None:
        await asyncio.gather(*(_going_away(ws) for ws, jobs in list(self.jobs.items())
                               if not jobs))


async def _going_away(ws: web.WebSocketResponse) -> None:
    await ws.close(code=WSCloseCode.GOING_AWAY, message=b"surge is shutting down")


class Service(Protocol):
    """What the socket needs of the frontend (server.app.Frontend is one)."""

    translator: RequestTranslator
    sockets: OpenSockets
    draining: bool
    in_flight: int  # what a drain waits for: each request on a socket counts, not the socket

    async def run(self, body: Body, rid: str, prompts: list[list[int]],
                  max_tokens: int | None, logprobs: int | None, tenant: str
                  ) -> tuple[AsyncIterator[Piece], str | None]: ...


# The longest request id a socket takes: every frame of the request repeats it.
_MAX_ID = 256


class _Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    id: Annotated[str, msgspec.Meta(max_length=_MAX_ID)] | None = None
    endpoint: str | None = None
    body: msgspec.Raw = msgspec.Raw(b"")  # kept raw: decoded later by the endpoint's type


async def stream_socket(frontend: Service, request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(heartbeat=_HEARTBEAT_S,
                               max_msg_size=request.app[MAX_BODY_BYTES])
    await ws.prepare(request)
    jobs: dict[str, asyncio.Task] = {}
    frontend.sockets.jobs[ws] = jobs
    send_lock = asyncio.Lock()

    async def send(payload: dict) -> None:
        async with send_lock:
            if not ws.closed:
                with contextlib.suppress(ConnectionResetError):  # the client is gone
                    await ws.send_str(msgspec.json.encode(payload).decode())

    async def error(rid: str | None, status: int, message: str, param: str | None = None,
                    retry_after: float | None = None, code: str | None = None) -> None:
        await send({"type": "error", "id": rid, "retry_after": retry_after,
                    "error": error_body(status, message, param, code)["error"]})

    async def serve(rid: str, endpoint: str, raw: bytes) -> None:
        frontend.in_flight += 1
        started = time.monotonic()
        status = 200
        prompt_tokens = generated = 0  # what a cancel's done frame counts
        try:
            if frontend.draining:
                raise draining_error()
            body = frontend.translator.decode_body(raw, _KINDS[endpoint])
            # `is`, not `in`: a completion's logprobs 0 equals False, and must be refused too.
            if getattr(body, "echo", False) or body.logprobs is not None and \
                    body.logprobs is not False:
                raise ApiError(400, "echo and logprobs are not available on the WebSocket; "
                                    "use the HTTP endpoint", param="logprobs")
            if getattr(body, "tools", None):  # its frames carry text, not tool calls
                raise ApiError(400, "tools are not available on the WebSocket; use the HTTP "
                                    "endpoint", param="tools")
            prompts, max_tokens, logprobs = await frontend.translator.prepare(body)
            prompt_tokens = sum(len(p) for p in prompts)
            pieces, degraded = await frontend.run(body, f"ws-{uuid.uuid4().hex}", prompts,
                                                  max_tokens, logprobs, request[TENANT])
            reasons: dict[int, str | None] = {}
            async with aclosing(pieces) as stream:
                async for piece in stream:
                    generated += piece.num_tokens
                    if piece.text:
                        await send({"type": "delta", "id": rid, "index": piece.index,
                                    "text": piece.text})
                    if piece.finish_reason:
                        reasons[piece.index] = piece.finish_reason
            done = {"type": "done", "id": rid, "finish_reason": reasons.get(0),
                    "usage": usage(prompt_tokens, generated)}
            if len(reasons) > 1:
                done["finish_reasons"] = [reasons[i] for i in sorted(reasons)]
            if degraded:
                done["degraded"] = degraded  # as the HTTP answer's X-Surge-Degraded
            await send(done)
        except ApiError as e:
            status = e.status
            await error(rid, e.status, e.message, e.param, e.retry_after, e.code)
        except asyncio.CancelledError:
            status = 499  # as an HTTP request whose client left
            await send(cancelled(rid, prompt_tokens, generated))
        except Exception:
            status = 500
            log.exception("websocket request %s failed", rid)
            await error(rid, 500, "internal error; see the server log")
        finally:
            frontend.in_flight -= 1
            accounted(rid, endpoint, status, started)

    def accounted(rid: str, endpoint: str, status: int, started: float) -> None:
        """One request on the socket: its access line and count, as an HTTP request's."""
        account(request, f"{_PATH} {endpoint}", f"WS {_PATH} {endpoint} {rid}", status,
                started, socket_request_id=rid)

    def cancelled(rid: str, prompt_tokens: int = 0, generated: int = 0) -> dict:
        """A cancel's done frame, with what the request had used (nothing, if it never ran)."""
        return {"type": "done", "id": rid, "finish_reason": "cancelled",
                "usage": usage(prompt_tokens, generated)}

    def forget(rid: str, endpoint: str, job: asyncio.Task, started: float) -> None:
        jobs.pop(rid, None)
        if job.cancelled():  # cancelled before it ever ran: its own handler never said so
            asyncio.ensure_future(send(cancelled(rid)))
            accounted(rid, endpoint, 499, started)
        if frontend.draining and not jobs:  # its last request is answered: nothing keeps it
            asyncio.ensure_future(_going_away(ws))

    try:
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                if msg.type == WSMsgType.BINARY:
                    await error(None, 400, "send JSON text messages, not binary")
                continue
            try:
                m = msgspec.json.decode(msg.data, type=_Message)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                await error(_id_of(msg.data), 400, f"message is not a valid JSON object: {e}")
                continue
            await _dispatch(m, jobs, serve, error, forget)
    finally:
        del frontend.sockets.jobs[ws]
        for job in list(jobs.values()):  # a closed socket aborts every request on it
            job.cancel()
        await asyncio.gather(*jobs.values(), return_exceptions=True)
    return ws


def _id_of(data: str) -> str | None:
    """A refused message's own id, where it has a usable one, so its error frame names it."""
    try:
        found = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    rid = found.get("id") if isinstance(found, dict) else None
    return rid if isinstance(rid, str) and len(rid) <= _MAX_ID else None


async def _dispatch(m: _Message, jobs: dict[str, asyncio.Task], serve: Any, error: Any,
                    forget: Any) -> None:
    if m.type == "cancel":
        job = jobs.get(m.id or "")
        if job is None:
            await error(m.id, 404, f"no request {m.id!r} is running on this socket")
        else:
            job.cancel()
        return
    if m.type != "request":
        await error(m.id, 400, f"unknown message type {m.type!r}; use request or cancel")
        return
    if not m.id:
        await error(None, 400, "a request needs an id")
    elif m.id in jobs:
        await error(m.id, 400, f"request id {m.id!r} is already running on this socket")
    elif m.endpoint not in _KINDS:
        await error(m.id, 400, f"endpoint must be one of {', '.join(_KINDS)}")
    elif not m.body:
        await error(m.id, 400, "a request needs a body")
    else:
        started = time.monotonic()
        job = jobs[m.id] = asyncio.create_task(serve(m.id, m.endpoint, bytes(m.body)))
        job.add_done_callback(lambda done, rid=m.id, endpoint=m.endpoint:
                              forget(rid, endpoint, done, started))
