"""OpenAI request bodies to engine requests: decode, check, build prompts, set sampling."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import msgspec
from jinja2 import TemplateError

from server import tools
from server.engine_client import EngineClient
from server.errors import ApiError
from server.openai_types import (
    COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ImagePart,
    TextPart,
    TokenizeRequest,
)
from server.structured import Grammars, constraint_of
from server.tokenizer import Tokenizer
from surge.protocol import EngineRequest, SamplingParams

T = TypeVar("T")
Body = CompletionRequest | ChatCompletionRequest
# Prompts longer than this many characters are tokenized off the event loop.
_INLINE_TOKENIZE_CHARS = 4096
_AT = re.compile(r"`\$\.([^`]*)`")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])")
_MISSING_FIELD = re.compile(r"missing required field `([^`]*)`")


class RequestTranslator:
    """The one place a request parameter turns into prompts, checks and SamplingParams."""

    def __init__(self, tokenizer: Tokenizer, engine: EngineClient, model_name: str,
                 max_model_len: int, max_prompt_tokens: int, max_choices: int) -> None:
        self.tokenizer = tokenizer
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_prompt_tokens = max_prompt_tokens
        self.max_choices = max_choices
        self.grammars = Grammars(tokenizer)

    def decode_body(self, raw: bytes, kind: type[T]) -> T:
        if not self.engine.ready.done():
            raise ApiError(503, "the model is still loading; retry shortly")
        try:
            return _decoded(raw, kind)
        except msgspec.ValidationError as e:
            # "at `$.a.b`", or for a dict's key "at `key` in `$.a`"
            at = _AT.search(str(e))
            path = at.group(1) if at else ""
            unknown = _UNKNOWN_FIELD.search(str(e))
            missing = _MISSING_FIELD.search(str(e))
            param = path.split("[")[0].split(".")[0] or (unknown and unknown.group(1)) or (
                missing and missing.group(1))
            hint = "; surge does not implement this field, so it is refused rather than " \
                   "ignored (the README's API section lists what is)" if unknown else ""
            raise ApiError(400, f"invalid request: {e}{hint}", param=param or None) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            # msgspec calls a high surrogate without its low half "truncated" input.
            why = "a string holds a UTF-16 surrogate (\\ud800-\\udbff) without its pair" \
                if "truncated" in str(e) and _LONE_SURROGATE.search(raw) else e
            raise ApiError(400, f"request body is not valid JSON: {why}") from None
        except RecursionError:  # msgspec's limit on nesting, e.g. in a field it skips
            raise ApiError(400, "request body is nested too deeply") from None

    async def prepare(self, body: Body) -> tuple[list[list[int]], int | None, int | None]:
        """A request body's prompts (token ids), max_tokens and logprobs count."""
        self.check_model(body.model)  # before any tokenizing is spent on it
        self._check_choices(body)
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options is only for streamed requests (stream: true)",
                           param="stream_options")
        if isinstance(body, CompletionRequest):
            if body.best_of is not None and body.best_of != body.n:
                raise ApiError(400, f"best_of ({body.best_of}) other than n ({body.n}) is not "
                                    f"supported: surge does not rank candidates",
                               param="best_of")
            if body.max_tokens == 0 and not body.echo:
                raise ApiError(400, "max_tokens 0 is for echo (the prompt alone, with its "
                                    "logprobs); give at least 1", param="max_tokens")
            max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
            # max_tokens 0: one token is computed (the prompt's logprobs come with the first),
            # and not shown (server.responses.echoed).
            max_tokens = max(max_tokens, 1)
            return await self._completion_prompts(body.prompt), max_tokens, body.logprobs
        if body.top_logprobs and not body.logprobs:  # 0 asks for nothing, as vLLM takes it
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return ([await self._chat_prompt(body)],
                body.max_completion_tokens or body.max_tokens,
                logprobs)

    async def grammar(self, body: Body) -> str | None:
        """The compiled grammar of the body's constraint (None: free text)."""
        c = constraint_of(body, self.tokenizer.tool_format)
        return None if c is None else await self.grammars.compile(c)

    async def tokenize(self, body: TokenizeRequest) -> list[int]:
        """The token ids of a /tokenize body's prompt or messages."""
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt (a string) or messages (a chat), not both "
                                "or neither", param="prompt")
        if body.messages is not None:
            return await self._chat_prompt(ChatCompletionRequest(messages=body.messages),
                                           body.add_generation_prompt, bounded=False)
        assert body.prompt is not None
        return await self._tokenize(body.prompt, body.add_special_tokens)

    def detokenize(self, body: DetokenizeRequest) -> str:
        """The text of a /detokenize body's token ids."""
        self.check_model(body.model)
        self.check_token_ids(body.tokens, "tokens")
        return self.tokenizer.hf.decode(body.tokens)

    def engine_requests(self, body: Body, rid: str, prompts: list[list[int]],
                        max_tokens: int | None, logprobs: int | None, tenant: str,
                        grammar: str | None = None) -> list[EngineRequest]:
        """One request per choice, n per prompt in order (seeds seed, seed+1, ...)."""
        requests: list[EngineRequest] = []
        for i, prompt in enumerate(prompts):
            params = self._sampling(body, len(prompt), max_tokens, logprobs)
            for j in range(body.n):
                index = i * body.n + j
                seeded = params if body.seed is None else msgspec.structs.replace(
                    params, seed=_int64(body.seed + j))
                requests.append(EngineRequest(
                    request_id=rid if len(prompts) * body.n == 1 else f"{rid}-{index}",
                    prompt_token_ids=prompt, sampling=seeded, arrival_time=time.time(),
                    tenant=tenant, priority=body.priority, timeout_s=body.timeout,
                    grammar=grammar))
        return requests

    def _check_choices(self, body: Body) -> None:
        """Each choice (prompt x n) is an engine request: bound the fan-out of one body."""
        prompt = body.prompt if isinstance(body, CompletionRequest) else None
        many = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts = len(prompt) if many else 1
        if prompts * body.n > self.max_choices:
            raise ApiError(400, f"this request asks for {prompts * body.n} choices ({prompts} "
                                f"prompts x n={body.n}); this server allows at most "
                                f"{self.max_choices} per request (max_choices)",
                           param="prompt" if prompts > 1 else "n")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    async def _off_loop_if_long(self, size: int, fn: Callable[[Any], list[int]],
                                arg: Any) -> list[int]:
        if size <= _INLINE_TOKENIZE_CHARS:
            return fn(arg)
        return await asyncio.get_running_loop().run_in_executor(None, fn, arg)

    async def _tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return await self._off_loop_if_long(
            len(text), partial(self.tokenizer.encode, add_special_tokens=add_special_tokens),
            text)

    async def _chat_prompt(self, body: ChatCompletionRequest, add_generation_prompt: bool = True,
                           bounded: bool = True) -> list[int]:
        """bounded: a chat past any context window is refused untokenized (not for /tokenize,
        which counts whatever it is given)."""
        for i, m in enumerate(body.messages):
            # Only an assistant turn may come without text (OpenAI: one that called tools).
            if m.content is None and m.role != "assistant":
                raise ApiError(400, f"messages[{i}] ({m.role}) needs a content",
                               param="messages")
            for j, part in enumerate([] if isinstance(m.content, str) else m.content or []):
                if not isinstance(part, TextPart):
                    kind = "image_url" if isinstance(part, ImagePart) else "input_audio"
                    raise ApiError(400, f"messages[{i}].content[{j}] is an {kind} part; this "
                                        f"model reads text only", param="messages")
        tools.check(body)
        messages, tool_defs = tools.chat_messages(body, self.tokenizer.template_takes_tools)
        size = sum(len(m["content"]) for m in messages) + len(str(tool_defs or ""))
        if bounded:
            self._check_length(size, "messages")
        try:
            return await self._off_loop_if_long(
                size, lambda m: self.tokenizer.apply_chat_template(m, tool_defs,
                                                                   add_generation_prompt),
                messages)
        except (ValueError, TemplateError) as e:
            raise ApiError(400, f"the model's chat template refused these messages: {e}",
                           param="messages") from None

    def _check_length(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing it, a text too long for the context window in any
        tokenization (seconds of a thread for a few MB)."""
        if chars > self.tokenizer.longest_token * self.max_model_len:
            raise ApiError(400, f"the {param} has {chars} characters, more than this model's "
                                f"context window of {self.max_model_len} tokens can hold (no "
                                f"token is longer than {self.tokenizer.longest_token}); "
                                f"shorten it", param=param, code="context_length_exceeded")

    async def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        for text in [prompt] if isinstance(prompt, str) else prompt or []:
            if isinstance(text, str):
                self._check_length(len(text), "prompt")
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
        self.check_token_ids([t for p in prompts for t in p], "prompt")
        return prompts

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in ids):
            raise ApiError(400, f"{param} holds a token id outside the vocabulary (size "
                                f"{vocab})", param=param)

    def _sampling(self, body: Body, prompt_len: int, max_tokens: int | None,
                  logprobs: int | None) -> SamplingParams:
        if prompt_len == 0:
            raise ApiError(400, "the prompt is empty", param="prompt")
        limit = self.max_prompt_tokens
        if limit and prompt_len > limit:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this server accepts at "
                                f"most {limit} (max_prompt_tokens)", param="prompt")
        room = self.max_model_len - prompt_len
        if room < 1:  # no token could follow: the prompt is what is too long
            raise ApiError(
                400, f"the prompt has {prompt_len} tokens, and this model's context window is "
                     f"{self.max_model_len}: it leaves no room for a token to generate; "
                     f"shorten the prompt",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded")
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
        self.check_token_ids(stops, "stop_token_ids")
        if not body.ignore_eos:
            stops += self.tokenizer.eos_token_ids
        bias: dict[int, float] = {}
        for key, value in (body.logit_bias or {}).items():
            # The length first: int() of thousands of digits is slow, and refused past 4300.
            if not (key.isascii() and key.isdigit() and len(key) <= 12) \
                    or int(key) >= self.tokenizer.vocab_size:
                raise ApiError(400, f"logit_bias: {key!r} is not a token id of this model",
                               param="logit_bias")
            bias[int(key)] = value
        defaults = self.tokenizer.sampling_defaults
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_given(body.temperature, defaults.get("temperature", 1.0)),
            top_p=_given(body.top_p, defaults.get("top_p", 1.0)),
            top_k=max(int(_given(body.top_k, defaults.get("top_k", 0))), 0), min_p=body.min_p,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, logit_bias=bias,
            min_tokens=body.min_tokens, logprobs=logprobs, seed=body.seed, stop_token_ids=stops,
            prompt_logprobs=logprobs if isinstance(body, CompletionRequest) and body.echo
            else None)


def _decoded(raw: bytes, kind: type[T]) -> T:
    """The body as kind. A top-level null is the field's default, as OpenAI reads it (the
    openai client sends `presence_penalty: null` for None), and a field surge does not
    implement sent as null is not given: decoded again without them only where the first
    reading refused the body, so a plain body is read once."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError:
        fields = msgspec.json.decode(raw)
        if not isinstance(fields, dict) or None not in fields.values():
            raise
        return msgspec.convert({k: v for k, v in fields.items() if v is not None}, kind)


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def stop_strings(body: Body) -> list[str]:
    """The body's stop strings (matched in the frontend, on the detokenized text)."""
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def _int64(value: int) -> int:
    """Wrap into a signed 64-bit integer (seed + j may step past the top)."""
    return (value + 2**63) % 2**64 - 2**63
