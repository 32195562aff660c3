"""The in-memory result cache end to end: the real server, the official client, two tenants."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from surge.keys import KeyStore
from tests.server import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
HITS = "surge_result_cache_hits_total"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("result-cache")
    store = KeyStore(str(root / "keys.json"))
    return {"path": str(root / "keys.json"),
            **{name: store.add(name)[1] for name in ("alice", "bob")}}


@pytest.fixture(scope="module")
def server(keys):
    srv = ServerProcess("--result-cache", "memory", "--api-keys-file", keys["path"],
                        "--metrics-auth", "public").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def alice(server, keys) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=keys["alice"], max_retries=0)


@pytest.fixture(scope="module")
def bob(server, keys) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=keys["bob"], max_retries=0)


def _chat(client: openai.OpenAI, content: str, **fields: Any) -> tuple[str | None, Any, float]:
    """What the cache did, the answer (streams: its chunks), and the seconds it took."""
    started = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}],
        **{"temperature": 0, "max_tokens": 8, **fields})
    answer = raw.parse()
    if fields.get("stream"):
        answer = list(answer)
    return raw.headers.get("x-surge-cache"), answer, time.perf_counter() - started


def _complete(client: openai.OpenAI, prompt: str, **fields: Any) -> tuple[str | None, Any]:
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, **{"temperature": 0, "max_tokens": 8, **fields})
    return raw.headers.get("x-surge-cache"), raw.parse()


def _same(a: Any, b: Any) -> dict:
    """The answer without what differs between any two answers (its id and time)."""
    fields = a.model_dump(exclude={"id", "created"})
    assert fields == b.model_dump(exclude={"id", "created"})
    return fields


def test_a_repeated_chat_request_is_a_fast_hit_with_the_same_body_and_usage(server, alice):
    hits = server.metric(HITS)
    first = _chat(alice, "What is the capital of France?")
    second = _chat(alice, "What is the capital of France?")
    assert (first[0], second[0]) == ("miss", "hit")
    body = _same(first[1], second[1])
    assert body["usage"]["completion_tokens"] > 0 and body["choices"][0]["message"]["content"]
    assert second[2] < min(first[2] / 3, 0.5), (first[2], second[2])
    assert server.metric(HITS) == hits + 1


def test_a_repeated_completion_is_a_hit_logprobs_and_all(alice):
    first = _complete(alice, "The capital of France is", logprobs=2)
    second = _complete(alice, "The capital of France is", logprobs=2)
    assert (first[0], second[0]) == ("miss", "hit")
    body = _same(first[1], second[1])
    assert len(body["choices"][0]["logprobs"]["top_logprobs"]) == body["usage"][
        "completion_tokens"] > 0


def _sse(server: ServerProcess, key: str, path: str, body: dict,
         headers: dict[str, str] | None = None) -> tuple[str | None, list]:
    """A streamed answer read off the wire: what the cache did, and each event (chunks without
    their id and time; the closing [DONE] as it is)."""
    request = urllib.request.Request(
        f"{server.url}{path}", data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}",
                 **(headers or {})})
    with urllib.request.urlopen(request, timeout=120) as r:
        events = [e.removeprefix("data: ") for e in r.read().decode().split("\n\n") if e]
        cache = r.headers.get("x-surge-cache")
    chunks = [e if e == "[DONE]" else json.loads(e) for e in events]
    for chunk in chunks[:-1]:
        assert chunk.pop("id").startswith(("chatcmpl-", "cmpl-")) and chunk.pop("created")
    return cache, chunks


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}]}),
    ("/v1/completions", {"prompt": "Les chats et les chiens", "n": 2, "echo": True}),
    # The prompt's logprobs are kept with the answer and replayed in its first chunk.
    ("/v1/completions", {"prompt": "Les chats et les chiens", "echo": True, "logprobs": 1}),
])
@pytest.mark.parametrize("options", [None, {"include_usage": True},
                                     {"include_usage": True, "continuous_usage_stats": True}])
def test_a_streamed_hit_has_the_same_sse_shape(server, keys, path, body, options):
    body = {**body, "temperature": 0, "max_tokens": 12, "stream_options": options}
    first = _sse(server, keys["alice"], path, body)
    second = _sse(server, keys["alice"], path, body)
    assert first[0] in ("miss", "hit") and second[0] == "hit"  # the options share one entry
    assert first[1] == second[1]
    chunks = second[1]
    assert chunks[-1] == "[DONE]" and len(chunks) > 4
    assert ("usage" in chunks[-2]) == (options is not None)
    assert sum(c["choices"][0]["finish_reason"] is not None
               for c in chunks[:-1] if c["choices"]) == body.get("n", 1)


def test_streamed_and_plain_requests_answer_each_other(alice):
    plain = _chat(alice, "Tell me a fact about the moon.")
    streamed = _chat(alice, "Tell me a fact about the moon.", stream=True,
                     stream_options={"include_usage": True})
    assert (plain[0], streamed[0]) == ("miss", "hit")
    text = "".join(c.choices[0].delta.content or "" for c in streamed[1] if c.choices)
    assert text == plain[1].choices[0].message.content
    assert streamed[1][-1].usage == plain[1].usage


def test_cache_false_and_no_cache_skip_the_cache(server, alice):
    assert _chat(alice, "Name three primary colours.")[0] == "miss"
    hits = server.metric(HITS)
    assert _chat(alice, "Name three primary colours.", extra_body={"cache": False})[0] == \
        "bypass"
    for directive in ("no-cache", "max-age=0, no-store"):
        assert _chat(alice, "Name three primary colours.",
                     extra_headers={"Cache-Control": directive})[0] == "bypass"
    assert server.metric(HITS) == hits
    assert _chat(alice, "Name three primary colours.")[0] == "hit"


def test_sampled_requests_are_cached_only_with_a_seed(alice):
    for _ in range(2):
        assert _chat(alice, "Say something.", temperature=1.0)[0] == "bypass"
    seeded = [_chat(alice, "Say something.", temperature=1.0, seed=7) for _ in range(2)]
    assert [s[0] for s in seeded] == ["miss", "hit"]
    _same(seeded[0][1], seeded[1][1])
    assert _chat(alice, "Say something.", temperature=1.0, seed=8)[0] == "miss"


def test_tenants_do_not_share_entries(alice, bob):
    assert _chat(alice, "What is two plus two?")[0] == "miss"
    assert _chat(alice, "What is two plus two?")[0] == "hit"
    assert _chat(bob, "What is two plus two?")[0] == "miss"
    assert _chat(bob, "What is two plus two?")[0] == "hit"


def test_an_output_changing_field_misses_and_the_rest_do_not(alice):
    assert _complete(alice, "1, 2, 3, 4, 5,")[0] == "miss"
    for changed in ({"max_tokens": 23}, {"stop": [","]}, {"presence_penalty": 0.5},
                    {"n": 2}):
        assert _complete(alice, "1, 2, 3, 4, 5,", **changed)[0] == "miss", changed
    assert _complete(alice, "1, 2, 3, 4, 5, 6,")[0] == "miss"
    # Who asks and how it is delivered do not change the answer.
    assert _complete(alice, "1, 2, 3, 4, 5,", user="someone",
                     extra_body={"priority": 3, "timeout": 30})[0] == "hit"


def test_a_kept_answer_does_not_pass_the_tenants_priority_floor(alice):
    assert _chat(alice, "Name a colour.")[0] == "miss"
    assert _chat(alice, "Name a colour.", extra_body={"priority": 2})[0] == "hit"
    # More urgent than alice's operator allows (her priority, 0): refused as the engine would.
    with pytest.raises(openai.BadRequestError, match="min_priority"):
        _chat(alice, "Name a colour.", extra_body={"priority": -1})


def test_an_answer_the_client_left_is_not_kept(server, keys):
    body = {"prompt": "Count to one hundred:", "max_tokens": 40, "ignore_eos": True,
            "temperature": 0, "stream": True}
    stored = server.metric("surge_result_cache_stored_bytes_total")
    aborted = server.metric("surge_request_success_total", model_name=MODEL,
                            finished_reason="abort")
    request = urllib.request.Request(
        f"{server.url}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {keys['alice']}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["x-surge-cache"] == "miss"
        r.readline()  # the first chunk, then the client leaves
    deadline = time.monotonic() + 30
    while server.metric("surge_request_success_total", model_name=MODEL,
                        finished_reason="abort") == aborted and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.metric("surge_request_success_total", model_name=MODEL,
                         finished_reason="abort") == aborted + 1
    assert server.metric("surge_result_cache_stored_bytes_total") == stored


def test_a_wrong_cache_field_is_refused_by_name(server, keys):
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps({"prompt": "Hi", "cache": "no"}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {keys['bob']}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 400
    assert json.load(e.value)["error"]["param"] == "cache"


def test_metrics_count_misses_and_bytes(server):
    assert server.metric("surge_result_cache_misses_total") >= 8
    stored = server.metric("surge_result_cache_stored_bytes_total")
    assert stored > 0
    assert 0 < server.metric("surge_result_cache_bytes") <= stored
    assert server.metric("surge_result_cache_errors_total", operation="get") == 0
