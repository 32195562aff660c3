"""The result cache's parts without a server: the memory store (LRU by bytes, TTL) and the key
(fields that do not change the output never change it; fields that do always do)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.cache_store import MemoryStore
from server.openai_types import ChatCompletionRequest, CompletionRequest
from server.result_cache import IGNORED, allowed, cache_key, deterministic

SCOPE = "SmolLM2|0123456789abcdef|none|32|False|float32|"
DEFAULTS: dict[str, float] = {}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _fill(store: MemoryStore, *entries: tuple[str, int]) -> None:
    for key, size in entries:
        assert await store.put(key, key.encode() * size)


def test_memory_store_evicts_least_recently_used_by_bytes():
    store = MemoryStore(max_bytes=100, ttl_s=60)

    async def scenario() -> None:
        await _fill(store, ("a", 40), ("b", 40))
        assert await store.get("a") == b"a" * 40  # a is now the most recently used
        await _fill(store, ("c", 40))  # 120 bytes: b, the least recently used, goes
        assert await store.get("b") is None
        assert await store.get("a") == b"a" * 40 and await store.get("c") == b"c" * 40
        assert store.bytes == 80
        await _fill(store, ("d", 100))  # exactly the bound: everything else goes
        assert [k for k in ("a", "c", "d") if await store.get(k)] == ["d"]
        assert store.bytes == 100
        assert not await store.put("e", b"e" * 101)  # never fits: not kept, nothing lost
        assert await store.get("d") == b"d" * 100 and store.bytes == 100
        await _fill(store, ("d", 10))  # replacing an entry frees its old bytes
        assert store.bytes == 10

    _run(scenario())


def test_memory_store_entries_expire_after_ttl():
    clock = Clock()
    store = MemoryStore(max_bytes=1000, ttl_s=10, clock=clock)

    async def scenario() -> None:
        await _fill(store, ("a", 5))
        clock.now = 9.9
        await _fill(store, ("b", 5))
        assert await store.get("a") == b"aaaaa"  # a read does not extend the life
        clock.now = 10.0
        assert await store.get("a") is None and store.bytes == 5
        assert await store.get("b") == b"bbbbb"
        clock.now = 19.9
        assert await store.get("b") is None and store.bytes == 0

    _run(scenario())


# ---- the key ----

PROMPT = st.text(min_size=1, max_size=20)
# Each output-changing field with values no two of which mean the same.
OUTPUT_FIELDS: dict[str, st.SearchStrategy] = {
    "prompt": PROMPT,
    "max_tokens": st.integers(1, 512),
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.5]),
    "seed": st.integers(-(2**40), 2**40),
    "top_p": st.sampled_from([0.1, 0.5, 0.9, 1.0]),
    "top_k": st.integers(0, 100),
    "n": st.integers(1, 4),
    "stop": st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=4),
    "presence_penalty": st.sampled_from([-1.0, 0.0, 0.5]),
    "frequency_penalty": st.sampled_from([-1.0, 0.0, 0.5]),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "2", "3"]),
                                  st.sampled_from([-5.0, 5.0]), min_size=1),
    "min_tokens": st.integers(0, 5),
    "ignore_eos": st.booleans(),
    "echo": st.booleans(),
    "logprobs": st.integers(0, 5),
    "repetition_penalty": st.sampled_from([1.0, 1.1, 2.0]),
    "stop_token_ids": st.lists(st.integers(0, 100), min_size=1, max_size=3),
}
# What a field left out means (the model's defaults here: none, so OpenAI's).
UNSET: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
IGNORED_FIELDS: dict[str, st.SearchStrategy] = {
    "model": st.sampled_from([None, "SmolLM2-135M-Instruct"]),
    "stream": st.booleans(),
    "stream_options": st.sampled_from([None, {"include_usage": True},
                                       {"include_usage": True, "continuous_usage_stats": True}]),
    "user": st.none() | st.text(max_size=10),
    "priority": st.none() | st.integers(-5, 5),
    "timeout": st.none() | st.floats(0.001, 100),
    "cache": st.booleans(),
}


def _body(fields: dict[str, Any]) -> CompletionRequest:
    return msgspec.convert(fields, CompletionRequest)


def _key(fields: dict[str, Any], tenant: str | None = "t") -> str:
    return cache_key(SCOPE, "completion", tenant, _body(fields), DEFAULTS)


def test_every_ignored_field_is_covered():
    assert set(IGNORED_FIELDS) == set(IGNORED)
    assert set(OUTPUT_FIELDS) | set(IGNORED) <= set(CompletionRequest.__struct_fields__)


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({"prompt": PROMPT},
                             optional={k: v for k, v in OUTPUT_FIELDS.items() if k != "prompt"}),
       st.fixed_dictionaries({}, optional=IGNORED_FIELDS))
def test_fields_that_do_not_change_the_output_never_change_the_key(base, ignored):
    assert _key(base) == _key({**base, **ignored})


@settings(max_examples=300, deadline=None)
@given(st.data(), st.fixed_dictionaries({"prompt": PROMPT},
                                        optional={k: v for k, v in OUTPUT_FIELDS.items()
                                                  if k != "prompt"}))
def test_fields_that_change_the_output_always_change_the_key(data, base):
    name = data.draw(st.sampled_from(sorted(OUTPUT_FIELDS)))
    old = base.get(name, UNSET.get(name, getattr(CompletionRequest(prompt=""), name)))
    new = data.draw(OUTPUT_FIELDS[name].filter(lambda v: v != old))
    assert _key(base) != _key({**base, name: new})


def test_tenant_scope_and_endpoint_are_part_of_the_key():
    fields = {"prompt": "Hi", "temperature": 0}
    keys = {_key(fields, "a"), _key(fields, "b"), _key(fields, None),
            cache_key(SCOPE.replace("0123", "4567"), "completion", "a", _body(fields), {}),
            cache_key(SCOPE.replace("float32", "bfloat16"), "completion", "a", _body(fields),
                      {})}
    assert len(keys) == 5


@pytest.mark.parametrize("same", [
    ({"stop": "x"}, {"stop": ["x"]}),
    ({}, {"temperature": 1.0, "top_p": 1.0, "top_k": 0}),  # the defaults, spelled out
    ({"top_k": -1}, {"top_k": 0}),  # both: off
    ({}, {"max_tokens": 16}),  # absent (or null): OpenAI's default
    ({"max_tokens": None}, {"max_tokens": 16}),
    ({"temperature": -0.0}, {"temperature": 0}),  # equal numbers, one output
    ({"temperature": -0.0, "presence_penalty": -0.0}, {"temperature": 0.0}),
    ({"logit_bias": {"5": -0.0}}, {"logit_bias": {"5": 0}}),
])
def test_spellings_of_one_request_share_a_key(same):
    base = {"prompt": "Hi", "seed": 3}
    assert _key({**base, **same[0]}) == _key({**base, **same[1]})


def test_chat_max_tokens_under_either_name_share_a_key():
    def key(**fields: Any) -> str:
        body = msgspec.convert({"messages": [{"role": "user", "content": "Hi"}],
                                "temperature": 0, **fields}, ChatCompletionRequest)
        return cache_key(SCOPE, "chat", "t", body, DEFAULTS)

    assert key(max_tokens=7) == key(max_completion_tokens=7) != key(max_tokens=8)
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert key(tools=tools) == key(tools=tools, parallel_tool_calls=True) != key(
        tools=tools, parallel_tool_calls=False)


def test_only_greedy_or_seeded_requests_are_deterministic():
    assert deterministic(_body({"prompt": "x", "temperature": 0}), {})
    assert deterministic(_body({"prompt": "x", "temperature": 0.7, "seed": 1}), {})
    assert not deterministic(_body({"prompt": "x", "temperature": 0.7}), {})
    assert not deterministic(_body({"prompt": "x"}), {})  # the default temperature is 1
    assert deterministic(_body({"prompt": "x"}), {"temperature": 0.0})  # the model's default


def test_the_client_can_keep_a_request_out_of_the_cache():
    body = _body({"prompt": "x", "temperature": 0})
    assert allowed(body, {}) and allowed(body, {"Cache-Control": "max-age=60"})
    for value in ("no-cache", "no-store", "max-age=0", "private, Max-Age = 0", "No-Cache"):
        assert not allowed(body, {"Cache-Control": value}), value
    assert not allowed(_body({"prompt": "x", "temperature": 0, "cache": False}), {})
