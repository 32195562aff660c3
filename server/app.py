"""The HTTP API: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import Any

import msgspec
from aiohttp import web

from scheduler.admission import too_urgent
from server.auth import auth_middleware
from server.breaker import Ticket
from server.connections import ConnectionGuard, connection_limit
from server.context_keys import MAX_BODY_BYTES, REQUEST_ID, TENANT
from server.engine_client import EngineClient
from server.errors import ApiError, draining_error, error_body, error_middleware
from server.generate import Piece, generate, merge, submit
from server.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.request_body import read_json
from server.request_log import Account, logged
from server.responses import (
    TokenText,
    cached_of,
    chat_logprobs,
    completion_logprobs,
    echoed,
    merge_logprobs,
    usage,
)
from server.result_cache import ResultCache, replay
from server.tokenizer import Tokenizer
from server.tools import calls_forced, tool_parsers
from server.tracing import Tracing
from server.translate import Body, RequestTranslator, T, stop_strings
from server.websocket import OpenSockets, stream_socket
from surge import __version__, metrics
from surge.config import ServerConfig
from surge.keys import Keys
from surge.replica_stats import total

log = logging.getLogger("surge.frontend")
_json = msgspec.json.Encoder()


class Frontend:
    def __init__(self, tokenizer: Tokenizer, engine: EngineClient, model_name: str,
                 max_model_len: int, cfg: ServerConfig, root: str,
                 cache: ResultCache | None = None) -> None:
        self.cfg = cfg
        self.cache = cache
        self.root = root  # the model's path, shown by /v1/models as vLLM does
        self.tokenizer = tokenizer
        self.engine = engine
        self.translator = RequestTranslator(tokenizer, engine, model_name, max_model_len,
                                            cfg.max_prompt_tokens, cfg.max_choices)
        self.token_text = TokenText(tokenizer.hf)
        self.created = int(time.time())
        self.draining = False  # SIGTERM: finish what is in flight, take nothing new
        self.in_flight = 0
        self.sockets = OpenSockets()
        self.batch_stats: Callable[[], dict] | None = None  # set when the Batch API is on
        self.connections = ConnectionGuard(connection_limit(cfg.max_connections),
                                           cfg.header_timeout_s)
        metrics.frontend_series(model_name)
        endpoint = cfg.otlp_traces_endpoint
        self.tracing = Tracing(endpoint) if endpoint else None

    # ---- endpoints ----

    async def body_of(self, request: web.Request, kind: type[T]) -> T:
        """The request's JSON body as `kind`, after request_body.read_json's checks."""
        return self.translator.decode_body(await read_json(request, self.cfg.body_timeout_s),
                                           kind)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.body_of(request, CompletionRequest)
        return await self.respond(body, "completion", request[TENANT], request,
                                  *await self.translator.prepare(body))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.body_of(request, ChatCompletionRequest)
        return await self.respond(body, "chat", request[TENANT], request,
                                  *await self.translator.prepare(body))

    async def run(self, body: Body, rid: str, prompts: list[list[int]],
                  max_tokens: int | None, logprobs: int | None, tenant: str,
                  headers: Mapping[str, str] | None = None
                  ) -> tuple[AsyncIterator[Piece], str | None]:
        """Submit the body's engine requests (one per choice) and wait until the scheduler has
        taken them all (or raise its refusal, or the circuit breaker's); their pieces merged,
        and how the degradation ladder changed them (None: not at all). headers: the HTTP
        request's, whose traceparent a trace continues."""
        self.engine.breakers.taking()  # the 503 at once, before the body's translation
        ticket = Ticket()
        # A refusal says nothing of the engine: a probe's breaker hears None.
        account = Account(rid, sum(len(p) for p in prompts), tenant, self.translator.model_name,
                          len(prompts) * body.n, ticket.finished)
        try:
            grammar = await self.translator.grammar(body)
            # The engine's ids are this request's alone, whatever id its client gave it (a
            # retry may reuse one while the aborted request's last outputs are on their way).
            requests = self.translator.engine_requests(body, f"{rid}-{uuid.uuid4().hex[:8]}",
                                                       prompts, max_tokens, logprobs, tenant,
                                                       grammar)
            if self.tracing is not None:
                account.trace = self.tracing.start(
                    "chat" if isinstance(body, ChatCompletionRequest) else "completion", rid,
                    headers, {"surge.tenant": tenant, "surge.choices": len(requests),
                              "surge.priority": requests[0].priority or 0,
                              "gen_ai.request.model": self.translator.model_name})
            taken, degraded = await submit(self.engine, requests, ticket)
        except ApiError as e:  # refused: its access line is its account
            ticket.finished(None)
            if account.trace is not None:
                account.trace.end(f"error {e.status}", [], account.prompt_tokens, 0)
            raise
        except BaseException as e:  # the client left before the engine took it, or a fault
            account.settle("cancelled" if isinstance(e, asyncio.CancelledError) else "error 500")
            raise
        if degraded:
            metrics.degraded_responses.labels(self.translator.model_name).inc()
        stop = stop_strings(body)
        streams = [generate(self.engine, stream, self.tokenizer.hf, r.request_id, index,
                            r.prompt_token_ids, r.sampling, stop)
                   for index, (r, stream) in enumerate(zip(requests, taken, strict=True))]
        # Pieces whose consumer never starts (the client gone before the answer's first
        # byte): no generator's cleanup runs, so the requests are aborted, and the request
        # accounted, as the task that asked for them ends.
        ids = [r.request_id for r in requests]

        def abandoned(task: asyncio.Task) -> None:
            if not account.settled:  # the client left, or answering failed before reading
                self.engine.abort(*ids)
                account.settle("cancelled" if task.cancelled() else "error 500")

        if (task := asyncio.current_task()) is not None:
            task.add_done_callback(abandoned)
        return logged(merge(streams), account), degraded

    async def respond(self, body: Body, kind: str, tenant: str, request: web.Request | None,
                      prompts: list[list[int]], max_tokens: int | None,
                      logprobs: int | None) -> web.StreamResponse:
        """The endpoint's answer to a prepared body; without a request (a batch line) the body
        must not stream."""
        chat = kind == "chat"
        base = request[REQUEST_ID] if request is not None else uuid.uuid4().hex
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
        n = len(prompts) * body.n
        pieces, degraded, cached = await self._cached_or_run(
            tenant, request.headers if request is not None else {}, body, kind, rid, prompts,
            max_tokens, logprobs, n)
        # A degraded request is never silently so (see scheduler/overload.py).
        headers = {"X-Request-Id": base, **({"X-Surge-Degraded": degraded} if degraded else {}),
                   **({"X-Surge-Cache": cached} if cached else {})}
        echo = [""] * n
        if not chat and body.echo:
            echo = [self.tokenizer.hf.decode(prompts[i // body.n]) for i in range(n)]
            # With logprobs the prompt comes with its logprobs, in the choice's first piece.
            scored = logprobs is not None
            if scored or body.max_tokens == 0:
                pieces = echoed(pieces, echo, [prompts[i // body.n] for i in range(n)], scored,
                                shown=body.max_tokens != 0)
            if scored:
                echo = [""] * n
        offsets = [len(e) for e in echo]
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.translator.model_name}
        # With tools, each choice's text goes through a parser that takes the calls out.
        parsers = tool_parsers(body, self.tokenizer.tool_format, n) if chat else None

        def choice(piece: Piece) -> dict:
            lp = None
            if piece.logprobs:
                lp = (chat_logprobs(piece, self.token_text) if chat else
                      completion_logprobs(piece, self.token_text, offsets[piece.index]))
            offsets[piece.index] += len(piece.text)
            if chat:
                text, calls, reason = piece.text, [], piece.finish_reason
                if parsers is not None:
                    parser = parsers[piece.index]
                    text, calls = parser.feed(piece.text, final=reason is not None)
                    # A stop string inside a call's arguments leaves them unfinished: no
                    # "tool_calls" for a client to run them by.
                    if reason == "stop" and parser.calls and not parser.cut:
                        reason = "tool_calls"
                delta: dict = {"content": text} if text else {}
                if calls:
                    delta["tool_calls"] = calls
                return {"index": piece.index, "delta": delta, "logprobs": lp,
                        "finish_reason": reason}
            return {"index": piece.index, "text": piece.text, "logprobs": lp,
                    "finish_reason": piece.finish_reason}

        prompt_tokens = sum(len(p) for p in prompts)
        if body.stream:
            assert request is not None, "a streamed answer needs its request"
            first = [Piece(i, echo[i], 0) for i in range(n) if echo[i]]
            # An answer that can only be calls has no content: null, as OpenAI's (and as the
            # non-streamed message says).
            content = None if parsers is not None and calls_forced(body) else ""
            opening = [{**head, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                   "content": content},
                                             "logprobs": None, "finish_reason": None}]}
                       for i in range(n)] if chat else []
            return await self._sse(request, rid, pieces, head, choice, opening, first,
                                   prompt_tokens, body, headers)
        texts: list[list[str]] = [[e] for e in echo]
        reasons: list[str | None] = [None] * n
        counts = [0] * n
        cached = 0
        lps: list[list[dict]] = [[] for _ in range(n)]
        async with aclosing(pieces) as stream:
            async for piece in stream:
                c = choice(piece)
                texts[piece.index].append(piece.text)
                counts[piece.index] += piece.num_tokens
                cached += cached_of(piece, body.n)
                reasons[piece.index] = c["finish_reason"] or reasons[piece.index]
                if c["logprobs"]:
                    lps[piece.index].append(c["logprobs"])
        choices = []
        for i in range(n):
            text = "".join(texts[i])
            out = ({"message": {"role": "assistant", "content": text}} if chat
                   else {"text": text})
            if parsers is not None:  # the same content as the stream gave, calls taken out
                calls = parsers[i].calls
                out["message"] = {"role": "assistant",
                                  "content": parsers[i].content or (None if calls else "")}
                if calls:
                    out["message"]["tool_calls"] = calls
            choices.append({"index": i, **out, "logprobs": merge_logprobs(lps[i]),
                            "finish_reason": reasons[i]})
        return self._json({**head, "object": "chat.completion" if chat else "text_completion",
                           "choices": choices,
                           "usage": usage(prompt_tokens, sum(counts), cached)},
                          headers)

    async def _cached_or_run(self, tenant: str, headers: Any, body: Body, kind: str, rid: str,
                             prompts: list[list[int]], max_tokens: int | None,
                             logprobs: int | None, n: int
                             ) -> tuple[AsyncIterator[Piece], str | None, str | None]:
        """The answer's pieces from the result cache, or from the engine (then kept for next
        time if it is deterministic and not degraded); the degradation, and what the cache did
        (X-Surge-Cache: hit, miss or bypass; None: no cache)."""
        cache = self.cache
        if cache is None:
            return *await self.run(body, rid, prompts, max_tokens, logprobs, tenant, headers), None
        key = cache.key(kind, tenant, body, headers)
        # A kept answer is no way round the tenant's priority floor (the scheduler's check).
        if body.priority is not None and \
                (why := too_urgent(self.engine.tenants, tenant, body.priority)) is not None:
            metrics.rejected.labels(tenant, "priority").inc()
            raise ApiError(400, why, param="priority")
        if key and (kept := await cache.get(key)):
            log.info("request cache hit", extra={"request_id": rid, "tenant": tenant})
            return replay(kept), None, "hit"
        pieces, degraded = await self.run(body, rid, prompts, max_tokens, logprobs, tenant,
                                          headers)
        if key and not degraded:
            pieces = cache.recorded(pieces, key, n)
        return pieces, degraded, "miss" if key else "bypass"

    def _model(self) -> dict:
        return {"id": self.translator.model_name, "object": "model", "created": self.created,
                "owned_by": "surge", "root": self.root, "parent": None,
                "max_model_len": self.translator.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return self._json({"object": "list", "data": [self._model()]})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's retrieve: the served model, or model_not_found."""
        self.translator.check_model(request.match_info["model"])
        return self._json(self._model())

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: the ids a prompt or a chat would be served with."""
        body = await self.body_of(request, TokenizeRequest)
        ids = await self.translator.tokenize(body)
        strs = self.tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return self._json({"count": len(ids), "max_model_len": self.translator.max_model_len,
                           "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self.body_of(request, DetokenizeRequest)
        return self._json({"prompt": self.translator.detokenize(body)})

    async def version(self, request: web.Request) -> web.Response:
        return self._json({"version": __version__})

    async def stats(self, request: web.Request) -> web.Response:
        """The scheduler's latest running totals (sent about once a second while it works)."""
        known = [msgspec.to_builtins(s) for s in self.engine.replica_stats if s is not None]
        # With several replicas: their sum, and each one's under "replicas".
        out = {} if not known else known[0] if len(self.engine.replica_stats) == 1 else \
            total(known)
        if self.batch_stats is not None:
            out["batches"] = self.batch_stats()
        return self._json(out)

    async def prometheus(self, request: web.Request) -> web.Response:
        body, content_type = metrics.exposition(self.cfg.metrics_compat)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.engine.ready.done():
            return web.json_response({"status": "starting"}, status=503)
        if problem := self.engine.problem:
            return web.json_response({"status": "unhealthy", "reason": problem}, status=503)
        if degraded := self.engine.degraded:  # other replicas serve
            return web.json_response({"status": "degraded", "reason": degraded})
        return web.json_response({"status": "ok"})

    # ---- response helpers ----

    async def _sse(self, request: web.Request, rid: str, pieces: AsyncIterator[Piece],
                   head: dict, choice: Callable[[Piece], dict], opening: list[dict],
                   first: list[Piece], prompt_tokens: int, body: Body,
                   headers: dict[str, str]) -> web.StreamResponse:
        # X-Accel-Buffering: a proxy (nginx and those that follow it) passes each event on
        # as it comes rather than in buffered lumps.
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no", **headers})
        generated = cached = 0
        options = body.stream_options
        running = options is not None and options.include_usage and options.continuous_usage_stats

        def event(chunk: dict) -> bytes:
            return _event({**chunk, "usage": usage(prompt_tokens, generated, cached)} if running
                          else chunk)

        # The role (and echo) chunks: at once, or with usage on every chunk, once the first
        # choice's first piece has said how much of the prompt the prefix cache held (the
        # pieces of other choices before it wait with them).
        preamble = [*opening, *({**head, "choices": [choice(p)]} for p in first)]
        held: list[Piece] = []

        async def flush() -> None:
            nonlocal preamble, held, generated
            for chunk in preamble:
                await response.write(event(chunk))
            for piece in held:
                generated += piece.num_tokens
                c = choice(piece)
                # Nothing to show (text held back: a character or a tool call not yet
                # complete) is no chunk, as vLLM sends none.
                if c.get("text") or c.get("delta") or c["logprobs"] or c["finish_reason"]:
                    await response.write(event({**head, "choices": [c]}))
            preamble, held = [], []

        try:
            await response.prepare(request)
            if not running:
                await flush()
            async with aclosing(pieces) as stream:
                async for piece in stream:
                    cached += cached_of(piece, body.n)
                    held.append(piece)
                    if not preamble or piece.index == 0:
                        await flush()
            await flush()
            if options and options.include_usage:
                await response.write(_event({**head, "choices": [],
                                             "usage": usage(prompt_tokens, generated,
                                                            cached)}))
        except ApiError as e:
            await flush()
            await response.write(_event(error_body(e.status, e.message)))
        except ConnectionResetError:
            return response  # the client left; aclosing() has aborted its requests
        except Exception:  # the stream has begun: the error can only be told in the stream
            log.exception("stream %s failed", rid)
            await response.write(_event(error_body(500, "internal error; see the server log")))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    def _json(payload: dict, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(body=_json.encode(payload), content_type="application/json",
                            headers=headers)


def _event(payload: dict) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def _work_middleware(frontend: Frontend) -> Any:
    """Counts requests in flight (for the drain) and turns new work away while draining."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.path.startswith("/v1/") or request.path == "/v1/models":
            return await handler(request)
        if frontend.draining:
            raise draining_error()
        if request.path == "/v1/stream":  # its requests count one by one (see websocket.py)
            return await handler(request)
        frontend.in_flight += 1
        try:
            return await handler(request)
        finally:
            frontend.in_flight -= 1

    return middleware


def build_app(frontend: Frontend) -> web.Application:
    max_body_bytes = frontend.cfg.max_body_bytes
    keys = Keys.of(frontend.cfg.api_key, frontend.cfg.api_keys_file)
    app = web.Application(middlewares=[frontend.connections.middleware(), error_middleware,
                                       auth_middleware(keys, frontend.cfg),
                                       _work_middleware(frontend)],
                          client_max_size=max_body_bytes)
    app[MAX_BODY_BYTES] = max_body_bytes
    app.router.add_get("/health", frontend.health)
    app.router.add_get("/v1/models", frontend.models)
    app.router.add_get("/v1/models/{model:.+}", frontend.model)
    app.router.add_get("/stats", frontend.stats)
    app.router.add_get("/version", frontend.version)
    app.router.add_post("/tokenize", frontend.tokenize)
    app.router.add_post("/detokenize", frontend.detokenize)
    app.router.add_get("/metrics", frontend.prometheus)
    app.router.add_post("/v1/completions", frontend.completions)
    app.router.add_post("/v1/chat/completions", frontend.chat_completions)
    app.router.add_get("/v1/stream", lambda request: stream_socket(frontend, request))
    return app
