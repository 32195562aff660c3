"""The HTTP API: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from jinja2 import TemplateError

from server.auth import auth_middleware
from server.engine_client import EngineClient
from server.errors import ApiError, error_body, error_middleware
from server.generate import Piece, generate, merge, submit
from server.openai_types import ChatCompletionRequest, CompletionRequest
from server.responses import TokenText, chat_logprobs, completion_logprobs, merge_logprobs, usage
from server.tokenizer import Tokenizer
from server.websocket import stream_socket
from surge import metrics
from surge.config import ServerConfig
from surge.keys import KeyStore
from surge.protocol import EngineRequest, SamplingParams

log = logging.getLogger("surge.frontend")
T = TypeVar("T")
Body = CompletionRequest | ChatCompletionRequest
_json = msgspec.json.Encoder()
# Prompts longer than this many characters are tokenized off the event loop.
_INLINE_TOKENIZE_CHARS = 4096


class Frontend:
    def __init__(self, tokenizer: Tokenizer, engine: EngineClient, model_name: str,
                 max_model_len: int, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.token_text = TokenText(tokenizer.hf)
        self.created = int(time.time())
        self.draining = False  # SIGTERM: finish what is in flight, take nothing new
        self.in_flight = 0

    # ---- request parsing ----

    async def read_body(self, request: web.Request) -> bytes:
        try:
            return await asyncio.wait_for(request.read(), self.cfg.body_timeout_s)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within "
                                f"{self.cfg.body_timeout_s:g}s") from None

    def decode_body(self, raw: bytes, kind: type[T]) -> T:
        if not self.engine.ready.done():
            raise ApiError(503, "the model is still loading; retry shortly")
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.ValidationError as e:
            param = str(e).rpartition("at `$.")[2].rstrip("`") if "at `$." in str(e) else None
            raise ApiError(400, f"invalid request: {e}",
                           param=param.split("[")[0].split(".")[0] if param else None) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    async def _off_loop_if_long(self, size: int, fn: Callable[[Any], list[int]],
                                arg: Any) -> list[int]:
        if size <= _INLINE_TOKENIZE_CHARS:
            return fn(arg)
        return await asyncio.get_running_loop().run_in_executor(None, fn, arg)

    async def _tokenize(self, text: str) -> list[int]:
        return await self._off_loop_if_long(len(text), self.tokenizer.encode, text)

    async def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role if m.role != "developer" else "system",
                     "content": m.content if isinstance(m.content, str)
                     else "".join(p.text for p in m.content or [])}
                    for m in body.messages]
        size = sum(len(m["content"]) for m in messages)
        try:
            return await self._off_loop_if_long(size, self.tokenizer.apply_chat_template,
                                                messages)
        except (ValueError, TemplateError) as e:
            raise ApiError(400, f"the model's chat template refused these messages: {e}",
                           param="messages") from None

    async def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [await self._tokenize(prompt)]
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif all(isinstance(p, str) for p in prompt):
            prompts = [await self._tokenize(p) for p in prompt]
        elif all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise ApiError(400, "prompt must be a string, a list of token ids, or a list of "
                                "either (not a mix)", param="prompt")
        self._check_token_ids([t for p in prompts for t in p], "prompt")
        return prompts

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in ids):
            raise ApiError(400, f"{param} holds a token id outside the vocabulary (size "
                                f"{vocab})", param=param)

    def _sampling(self, body: Body, prompt_len: int, max_tokens: int | None,
                  logprobs: int | None) -> SamplingParams:
        if prompt_len == 0:
            raise ApiError(400, "the prompt is empty", param="prompt")
        limit = self.cfg.max_prompt_tokens
        if limit and prompt_len > limit:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this server accepts at "
                                f"most {limit} (max_prompt_tokens)", param="prompt")
        room = self.max_model_len - prompt_len
        ready = self.engine.ready.result()
        capacity = ready.num_blocks * ready.block_size
        if max_tokens is None:  # as much as the context window and the KV cache allow
            max_tokens = max(1, min(room, capacity - prompt_len))
        if max_tokens > room:
            raise ApiError(
                400, f"this model's context window is {self.max_model_len} tokens, but the "
                     f"prompt has {prompt_len} tokens and max_tokens is {max_tokens} "
                     f"({prompt_len + max_tokens} in all); shorten the prompt or lower max_tokens",
                param="max_tokens")
        if prompt_len + max_tokens > capacity:
            raise ApiError(
                400, f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds "
                     f"the KV cache ({capacity} tokens)", param="max_tokens")
        if body.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens ({body.min_tokens}) is more than max_tokens "
                                f"({max_tokens})", param="min_tokens")
        stops = list(body.stop_token_ids or [])
        self._check_token_ids(stops, "stop_token_ids")
        if not body.ignore_eos:
            stops += self.tokenizer.eos_token_ids
        bias: dict[int, float] = {}
        for key, value in (body.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) >= self.tokenizer.vocab_size:
                raise ApiError(400, f"logit_bias: {key!r} is not a token id of this model",
                               param="logit_bias")
            bias[int(key)] = value
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p, top_k=max(body.top_k, 0), min_p=body.min_p,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, logit_bias=bias,
            min_tokens=body.min_tokens, logprobs=logprobs, seed=body.seed, stop_token_ids=stops)

    # ---- endpoints ----

    async def prepare(self, body: Body) -> tuple[list[list[int]], int | None, int | None]:
        """A request body's prompts (token ids), max_tokens and logprobs count."""
        self._check_model(body.model)  # before any tokenizing is spent on it
        if isinstance(body, CompletionRequest):
            if body.echo and body.logprobs is not None:
                raise ApiError(400, "echo together with logprobs is not supported (prompt "
                                    "logprobs are not computed)", param="echo")
            return await self._completion_prompts(body.prompt), body.max_tokens, body.logprobs
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return ([await self._chat_prompt(body)], body.max_completion_tokens or body.max_tokens,
                logprobs)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = self.decode_body(await self.read_body(request), CompletionRequest)
        return await self._respond(request, body, "completion", *await self.prepare(body))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = self.decode_body(await self.read_body(request), ChatCompletionRequest)
        return await self._respond(request, body, "chat", *await self.prepare(body))

    async def run(self, body: Body, rid: str, prompts: list[list[int]],
                  max_tokens: int | None, logprobs: int | None, tenant: str
                  ) -> AsyncIterator[Piece]:
        """Submit every choice (n per prompt, seeds seed, seed+1, ...) and wait until the
        scheduler has taken them all (or raise its refusal); their pieces merged."""
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        requests: list[tuple[int, EngineRequest]] = []
        for i, prompt in enumerate(prompts):
            params = self._sampling(body, len(prompt), max_tokens, logprobs)
            for j in range(body.n):
                index = i * body.n + j
                seeded = params if body.seed is None else msgspec.structs.replace(
                    params, seed=_int64(body.seed + j))
                requests.append((index, EngineRequest(
                    request_id=rid if len(prompts) * body.n == 1 else f"{rid}-{index}",
                    prompt_token_ids=prompt, sampling=seeded, arrival_time=time.time(),
                    tenant=tenant, priority=body.priority, timeout_s=body.timeout)))
        taken = await asyncio.gather(*(submit(self.engine, r) for _, r in requests),
                                     return_exceptions=True)
        if refused := [e for e in taken if isinstance(e, BaseException)]:
            for _, r in requests:
                self.engine.abort(r.request_id)
            raise refused[0]
        streams = [generate(self.engine, stream, self.tokenizer.hf, r.request_id, index,
                            r.prompt_token_ids, r.sampling, stop)
                   for (index, r), stream in zip(requests, taken, strict=True)
                   if not isinstance(stream, BaseException)]
        return _logged(merge(streams), rid, sum(len(p) for p in prompts), tenant)

    async def _respond(self, request: web.Request, body: Body, kind: str,
                       prompts: list[list[int]], max_tokens: int | None,
                       logprobs: int | None) -> web.StreamResponse:
        chat = kind == "chat"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        pieces = await self.run(body, rid, prompts, max_tokens, logprobs, request["tenant"])
        n = len(prompts) * body.n
        echo = [""] * n
        if not chat and body.echo:
            echo = [self.tokenizer.hf.decode(prompts[i // body.n]) for i in range(n)]
        offsets = [len(e) for e in echo]
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}

        def choice(piece: Piece) -> dict:
            lp = None
            if piece.logprobs:
                lp = (chat_logprobs(piece, self.token_text) if chat else
                      completion_logprobs(piece, self.token_text, offsets[piece.index]))
            offsets[piece.index] += len(piece.text)
            if chat:
                delta = {"content": piece.text} if piece.text else {}
                return {"index": piece.index, "delta": delta, "logprobs": lp,
                        "finish_reason": piece.finish_reason}
            return {"index": piece.index, "text": piece.text, "logprobs": lp,
                    "finish_reason": piece.finish_reason}

        prompt_tokens = sum(len(p) for p in prompts)
        if body.stream:
            first = [Piece(i, echo[i], 0) for i in range(n) if echo[i]]
            opening = [{**head, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                   "content": ""},
                                             "logprobs": None, "finish_reason": None}]}
                       for i in range(n)] if chat else []
            return await self._sse(request, rid, pieces, head, choice, opening, first,
                                   prompt_tokens, body)
        texts: list[list[str]] = [[e] for e in echo]
        reasons: list[str | None] = [None] * n
        counts = [0] * n
        lps: list[list[dict]] = [[] for _ in range(n)]
        async with aclosing(pieces) as stream:
            async for piece in stream:
                c = choice(piece)
                texts[piece.index].append(piece.text)
                counts[piece.index] += piece.num_tokens
                reasons[piece.index] = piece.finish_reason or reasons[piece.index]
                if c["logprobs"]:
                    lps[piece.index].append(c["logprobs"])
        choices = []
        for i in range(n):
            text = "".join(texts[i])
            out = ({"message": {"role": "assistant", "content": text}} if chat
                   else {"text": text})
            choices.append({"index": i, **out, "logprobs": merge_logprobs(lps[i]),
                            "finish_reason": reasons[i]})
        return self._json({**head, "object": "chat.completion" if chat else "text_completion",
                           "choices": choices, "usage": usage(prompt_tokens, sum(counts))})

    async def models(self, request: web.Request) -> web.Response:
        return self._json({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "surge", "max_model_len": self.max_model_len}]})

    async def stats(self, request: web.Request) -> web.Response:
        """The scheduler's latest running totals (sent about once a second while it works)."""
        stats = self.engine.stats
        return self._json({} if stats is None else msgspec.to_builtins(stats))

    async def prometheus(self, request: web.Request) -> web.Response:
        body, content_type = metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.engine.ready.done():
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ok"})

    # ---- response helpers ----

    async def _sse(self, request: web.Request, rid: str, pieces: AsyncIterator[Piece],
                   head: dict, choice: Callable[[Piece], dict], opening: list[dict],
                   first: list[Piece], prompt_tokens: int, body: Body) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache",
                                               "X-Request-Id": rid})
        generated = 0
        try:
            await response.prepare(request)
            for chunk in opening:
                await response.write(_event(chunk))
            for piece in first:
                await response.write(_event({**head, "choices": [choice(piece)]}))
            async with aclosing(pieces) as stream:
                async for piece in stream:
                    generated += piece.num_tokens
                    await response.write(_event({**head, "choices": [choice(piece)]}))
            if body.stream_options and body.stream_options.include_usage:
                await response.write(_event({**head, "choices": [],
                                             "usage": usage(prompt_tokens, generated)}))
        except ApiError as e:
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
    def _json(payload: dict) -> web.Response:
        return web.Response(body=_json.encode(payload), content_type="application/json")


async def _logged(pieces: AsyncIterator[Piece], rid: str, prompt_tokens: int, tenant: str
                  ) -> AsyncIterator[Piece]:
    """One log line per finished request: id, outcome, token counts, timings (no text)."""
    started = time.monotonic()
    first: float | None = None
    last = started
    generated = 0
    reasons: list[str] = []
    outcome = "cancelled"
    try:
        async with aclosing(pieces) as stream:
            async for piece in stream:
                now = time.monotonic()
                if first is None:
                    first = now
                    metrics.ttft.observe(now - started)
                else:
                    metrics.itl.observe(now - last)
                last = now
                generated += piece.num_tokens
                if piece.finish_reason:
                    reasons.append(piece.finish_reason)
                yield piece
        outcome = "ok"
        metrics.e2e.observe(time.monotonic() - started)
        metrics.prompt_tokens.inc(prompt_tokens)
        metrics.generated_tokens.inc(generated)
    except ApiError as e:
        outcome = f"error {e.status}"
        raise
    finally:
        log.info("request %s", outcome, extra={
            "request_id": rid, "tenant": tenant, "finish_reason": ",".join(reasons) or None,
            "prompt_tokens": prompt_tokens, "completion_tokens": generated,
            "ttft_ms": round((first - started) * 1000, 1) if first else None,
            "duration_ms": round((time.monotonic() - started) * 1000, 1)})


def _int64(value: int) -> int:
    """Wrap into a signed 64-bit integer (seed + j may step past the top)."""
    return (value + 2**63) % 2**64 - 2**63


def _event(payload: dict) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def _work_middleware(frontend: Frontend) -> Any:
    """Counts requests in flight (for the drain) and turns new work away while draining."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.path.startswith("/v1/") or request.path == "/v1/models":
            return await handler(request)
        if frontend.draining:
            raise ApiError(503, "surge is shutting down; send this request to another server")
        frontend.in_flight += 1
        try:
            return await handler(request)
        finally:
            frontend.in_flight -= 1

    return middleware


def build_app(frontend: Frontend) -> web.Application:
    max_body_bytes = frontend.cfg.max_body_bytes
    keys = KeyStore(frontend.cfg.api_keys_file) if frontend.cfg.api_keys_file else None
    app = web.Application(middlewares=[error_middleware, auth_middleware(keys),
                                       _work_middleware(frontend)],
                          client_max_size=max_body_bytes)
    app["max_body_bytes"] = max_body_bytes
    app.router.add_get("/health", frontend.health)
    app.router.add_get("/v1/models", frontend.models)
    app.router.add_get("/stats", frontend.stats)
    app.router.add_get("/metrics", frontend.prometheus)
    app.router.add_post("/v1/completions", frontend.completions)
    app.router.add_post("/v1/chat/completions", frontend.chat_completions)
    app.router.add_get("/v1/stream", lambda request: stream_socket(frontend, request))
    return app
