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

from server.engine_client import EngineClient
from server.errors import ApiError, error_body, error_middleware
from server.generate import Piece, generate, merge
from server.openai_types import ChatCompletionRequest, CompletionRequest
from server.tokenizer import Tokenizer
from surge.protocol import SamplingParams

log = logging.getLogger("surge.frontend")
T = TypeVar("T")
_json = msgspec.json.Encoder()
# Prompts longer than this many characters are tokenized off the event loop.
_INLINE_TOKENIZE_CHARS = 4096


class Frontend:
    def __init__(self, tokenizer: Tokenizer, engine: EngineClient, model_name: str,
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.created = int(time.time())

    # ---- request parsing ----

    async def _body(self, request: web.Request, kind: type[T]) -> T:
        if not self.engine.ready.done():
            raise ApiError(503, "the model is still loading; retry shortly")
        raw = await request.read()
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.ValidationError as e:
            param = str(e).rpartition("at `$.")[2].rstrip("`") if "at `$." in str(e) else None
            raise ApiError(400, f"invalid request: {e}", param=param) from None
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

    async def _chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        size = sum(len(m["content"]) for m in messages)
        try:
            return await self._off_loop_if_long(size, self.tokenizer.apply_chat_template,
                                                messages)
        except (ValueError, TemplateError) as e:
            raise ApiError(400, f"the model's chat template refused these messages: {e}",
                           param="messages") from None

    def _sampling(self, body: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                  max_tokens: int | None) -> SamplingParams:
        if prompt_len == 0:
            raise ApiError(400, "the prompt is empty", param="prompt")
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
        vocab = self.tokenizer.vocab_size
        for t in body.stop_token_ids or []:
            if t >= vocab:
                raise ApiError(400, f"stop_token_ids: {t} is not a token id (vocabulary: "
                                    f"{vocab})", param="stop_token_ids")
        stops = list(body.stop_token_ids or [])
        if not body.ignore_eos:
            stops += self.tokenizer.eos_token_ids
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            seed=body.seed,
            stop_token_ids=stops,
        )

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
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for p in prompts for t in p):
            raise ApiError(400, f"prompt holds a token id outside the vocabulary (size {vocab})",
                           param="prompt")
        return prompts

    # ---- endpoints ----

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, CompletionRequest)
        self._check_model(body.model)
        prompts = await self._completion_prompts(body.prompt)
        params = [self._sampling(body, len(p), body.max_tokens) for p in prompts]
        rid = f"cmpl-{uuid.uuid4().hex}"
        pieces = self._pieces(rid, prompts, params)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}

        def chunk(piece: Piece) -> dict:
            return {**head, "choices": [{"index": piece.index, "text": piece.text,
                                         "logprobs": None,
                                         "finish_reason": piece.finish_reason}]}

        if body.stream:
            return await self._sse(request, rid, pieces, chunk, None, prompts, body)
        texts, reasons, counts = await self._collect(pieces, len(prompts))
        choices = [{"index": i, "text": texts[i], "logprobs": None, "finish_reason": reasons[i]}
                   for i in range(len(prompts))]
        return self._json({**head, "choices": choices, "usage": _usage(prompts, counts)})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, ChatCompletionRequest)
        self._check_model(body.model)
        messages = [{"role": m.role if m.role != "developer" else "system",
                     "content": m.content if isinstance(m.content, str)
                     else "".join(p.text for p in m.content or [])}
                    for m in body.messages]
        prompt = await self._chat_prompt(messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = [self._sampling(body, len(prompt), max_tokens)]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        pieces = self._pieces(rid, [prompt], params)
        head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}

        def chunk(piece: Piece) -> dict:
            delta = {"content": piece.text} if piece.text else {}
            return {**head, "choices": [{"index": piece.index, "delta": delta, "logprobs": None,
                                         "finish_reason": piece.finish_reason}]}

        if body.stream:
            first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
            return await self._sse(request, rid, pieces, chunk, first, [prompt], body)
        texts, reasons, counts = await self._collect(pieces, 1)
        return self._json({
            **head, "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": texts[0]},
                         "logprobs": None, "finish_reason": reasons[0]}],
            "usage": _usage([prompt], counts)})

    async def models(self, request: web.Request) -> web.Response:
        return self._json({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "surge", "max_model_len": self.max_model_len}]})

    async def stats(self, request: web.Request) -> web.Response:
        """The scheduler's latest running totals (sent about once a second while it works)."""
        stats = self.engine.stats
        return self._json({} if stats is None else msgspec.to_builtins(stats))

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.ready.done():
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ok"})

    # ---- response helpers ----

    def _pieces(self, rid: str, prompts: list[list[int]], params: list[SamplingParams]
                ) -> AsyncIterator[Piece]:
        suffix = len(prompts) > 1
        return merge([generate(self.engine, self.tokenizer.hf,
                               f"{rid}-{i}" if suffix else rid, i, p, sp)
                      for i, (p, sp) in enumerate(zip(prompts, params, strict=True))])

    @staticmethod
    async def _collect(pieces: AsyncIterator[Piece], n: int
                       ) -> tuple[list[str], list[str | None], list[int]]:
        texts: list[list[str]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        counts = [0] * n
        async with aclosing(pieces) as stream:
            async for piece in stream:
                texts[piece.index].append(piece.text)
                counts[piece.index] += piece.num_tokens
                reasons[piece.index] = piece.finish_reason or reasons[piece.index]
        return ["".join(t) for t in texts], reasons, counts

    async def _sse(self, request: web.Request, rid: str, pieces: AsyncIterator[Piece],
                   chunk: Any, first: dict | None, prompts: list[list[int]],
                   body: CompletionRequest | ChatCompletionRequest) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache",
                                               "X-Request-Id": rid})
        await response.prepare(request)
        counts = [0] * len(prompts)
        if first is not None:
            await response.write(_event(first))
        try:
            async with aclosing(pieces) as stream:
                async for piece in stream:
                    counts[piece.index] += piece.num_tokens
                    await response.write(_event(chunk(piece)))
        except ApiError as e:
            await response.write(_event(error_body(e.status, e.message)))
        except ConnectionResetError:
            return response  # the client left; aclosing() has aborted its request
        else:
            if body.stream_options and body.stream_options.include_usage:
                last = chunk(Piece(0, "", 0))
                last["choices"] = []
                last["usage"] = _usage(prompts, counts)
                await response.write(_event(last))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    def _json(payload: dict) -> web.Response:
        return web.Response(body=_json.encode(payload), content_type="application/json")


def _event(payload: dict) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def _usage(prompts: list[list[int]], counts: list[int]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": sum(counts),
            "total_tokens": prompt_tokens + sum(counts)}


def build_app(frontend: Frontend, max_body_bytes: int) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    app["max_body_bytes"] = max_body_bytes
    app.router.add_get("/health", frontend.health)
    app.router.add_get("/v1/models", frontend.models)
    app.router.add_get("/stats", frontend.stats)
    app.router.add_post("/v1/completions", frontend.completions)
    app.router.add_post("/v1/chat/completions", frontend.chat_completions)
    return app
