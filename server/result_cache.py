"""The exact-match result cache: a deterministic request (temperature 0, or a seed) whose model,
endpoint, tenant and normalised body match an earlier one's gets that answer again, without the
engine. What is kept is the answer's pieces, so a hit goes through the same rendering as a fresh
answer: streamed or not, whichever way the first one was asked for."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

import msgspec

from server.cache_store import MemoryStore, RedisStore, Store
from server.generate import Piece
from server.openai_types import COMPLETION_MAX_TOKENS, ChatCompletionRequest
from server.translate import Body, stop_strings
from surge import metrics
from surge.config import ModelConfig, ResultCacheConfig

log = logging.getLogger("surge.result_cache")

# Fields that never change what the model writes: how it is delivered, who asked, when it runs.
IGNORED = ("model", "stream", "stream_options", "user", "priority", "timeout", "cache")
_PREFIX = "surge:rc:"
_sorted_json = msgspec.json.Encoder(order="sorted")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Piece])


def model_scope(name: str, fingerprint: str, model: ModelConfig) -> str:
    """What, besides the body, decides an answer: the served model, its weights, and how they
    are loaded (quantization, dtype, tokenizer)."""
    return "|".join((name, fingerprint, model.quantization, str(model.quant_group_size),
                     str(model.quant_activation_bits), str(model.quantize_lm_head), model.dtype,
                     model.tokenizer or ""))


def normalised(body: Body, defaults: Mapping[str, float]) -> dict[str, Any]:
    """The body's fields that decide its output, each in one spelling (defaults filled in)."""
    fields = msgspec.to_builtins(body)
    for name in IGNORED:
        del fields[name]
    fields["stop"] = stop_strings(body)
    for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0)):
        if fields[name] is None:
            fields[name] = defaults.get(name, default)
    fields["top_k"] = max(int(fields["top_k"]), 0)
    if isinstance(body, ChatCompletionRequest):  # the same limit under either name
        fields["max_tokens"] = fields.pop("max_completion_tokens") or fields["max_tokens"]
        fields["parallel_tool_calls"] = body.many_tool_calls
    elif fields["max_tokens"] is None:  # 0 (echo alone) stays 0
        fields["max_tokens"] = COMPLETION_MAX_TOKENS
    return _unsigned_zeros(fields)


def _unsigned_zeros(value: Any) -> Any:
    """-0.0 as 0.0 wherever it is (a temperature, a logit_bias entry): one key, as one output."""
    if isinstance(value, float):
        return value + 0.0
    if isinstance(value, dict):
        return {k: _unsigned_zeros(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unsigned_zeros(v) for v in value]
    return value


def cache_key(scope: str, endpoint: str, tenant: str | None, body: Body,
              defaults: Mapping[str, float]) -> str:
    """tenant None: an entry shared by every tenant."""
    text = _sorted_json.encode([scope, endpoint, tenant, normalised(body, defaults)])
    return _PREFIX + hashlib.sha256(text).hexdigest()


def deterministic(body: Body, defaults: Mapping[str, float]) -> bool:
    temperature = defaults.get("temperature", 1.0) if body.temperature is None \
        else body.temperature
    return temperature == 0 or body.seed is not None


def allowed(body: Body, headers: Mapping[str, str]) -> bool:
    """Whether the client lets the cache take part: `"cache": false` in the body, or
    Cache-Control: no-cache, no-store or max-age=0, say no (neither read nor written)."""
    directives = {d.replace(" ", "").lower() for d in headers.get("Cache-Control", "").split(",")}
    return body.cache and not directives & {"no-cache", "no-store", "max-age=0"}


class ResultCache:
    def __init__(self, store: Store, scope: str, shared: bool,
                 defaults: Mapping[str, float]) -> None:
        self.store = store
        self.scope = scope
        self.shared = shared
        self.defaults = defaults  # the model's sampling defaults, as the translator applies

    @classmethod
    def of(cls, cfg: ResultCacheConfig, scope: str,
           defaults: Mapping[str, float]) -> ResultCache | None:
        """The configured cache (None: off)."""
        if cfg.result_cache == "off":
            return None
        store: Store = (MemoryStore(cfg.result_cache_max_bytes, cfg.result_cache_ttl_s)
                        if cfg.result_cache == "memory" else
                        RedisStore(cfg.result_cache, cfg.result_cache_ttl_s,
                                   cfg.result_cache_timeout_s, cfg.result_cache_retry_s))
        log.info("result cache: %s, entries per %s", cfg.result_cache.split("@")[-1],
                 "server" if cfg.result_cache_shared else "tenant")
        return cls(store, scope, cfg.result_cache_shared, defaults)

    def key(self, endpoint: str, tenant: str, body: Body,
            headers: Mapping[str, str]) -> str | None:
        """The request's entry (None: the cache must neither answer nor keep it)."""
        if not (allowed(body, headers) and deterministic(body, self.defaults)):
            return None
        return cache_key(self.scope, endpoint, None if self.shared else tenant, body,
                         self.defaults)

    async def get(self, key: str) -> list[Piece] | None:
        raw = await self.store.get(key)
        pieces = None
        if raw is not None:
            try:
                pieces = _decoder.decode(raw)
            except msgspec.DecodeError:  # written by another surge version: recompute
                metrics.result_cache_errors.labels("decode").inc()
        (metrics.result_cache_hits if pieces is not None else metrics.result_cache_misses).inc()
        return pieces

    async def recorded(self, pieces: AsyncIterator[Piece], key: str,
                       choices: int) -> AsyncIterator[Piece]:
        """The pieces as they come; kept under key once every choice has finished normally
        (an error, or a client that left, keeps nothing)."""
        kept: list[Piece] = []
        async with aclosing(pieces) as stream:
            async for piece in stream:
                kept.append(piece)
                yield piece
        reasons = [p.finish_reason for p in kept if p.finish_reason is not None]
        if len(reasons) == choices and set(reasons) <= {"stop", "length"}:
            value = _encoder.encode(kept)
            if await self.store.put(key, value):
                metrics.result_cache_stored_bytes.inc(len(value))


async def replay(pieces: list[Piece]) -> AsyncIterator[Piece]:
    for piece in pieces:
        yield piece
