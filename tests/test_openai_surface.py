"""Every OpenAI parameter honoured or refused clearly, WebSocket streaming, cancellation, and a
wall of bad input, against the real server (fuzzing: tests/test_hostile.py)."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import socket
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

from tests.prompts import CHAT, RAW
from tests.server import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--body-timeout-s", "2", "--max-prompt-tokens", "2000").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _stats(server) -> dict:
    with urllib.request.urlopen(f"{server.url}/stats") as r:
        return json.load(r)


# ---- sampling parameters ----

def test_stop_string_across_tokens(client):
    args = dict(model=MODEL, prompt=RAW[0], temperature=0, max_tokens=30)
    full = client.completions.create(**args).choices[0].text
    # A stop string starting in the middle of a word, so it spans a token boundary.
    stop = full[len(full) // 2 - 2 : len(full) // 2 + 3]
    assert stop.strip() and stop in full
    r = client.completions.create(**args, stop=[stop, "never-appears"])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 30  # generation stopped early in the engine too
    chunks = [c.choices[0].text for c in client.completions.create(**args, stop=stop,
                                                                   stream=True) if c.choices]
    assert "".join(chunks) == full[: full.index(stop)]


@pytest.mark.parametrize("prompt", ["北京是中国的首都，上海是", "Emoji story: 🐱🐶🐭🐹🐰"])
def test_stop_string_with_multibyte_text(client, prompt):
    args = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=40)
    full = client.completions.create(**args).choices[0].text
    wide = [c for c in full if ord(c) > 0x2000]
    assert len(wide) > 1, full
    stop = wide[len(wide) // 2]
    streamed = "".join(c.choices[0].text for c in
                       client.completions.create(**args, stop=stop, stream=True) if c.choices)
    assert streamed == full[: full.index(stop)]
    assert "\ufffd" not in streamed


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(client):
    args = dict(model=MODEL, prompt=RAW[0] * 12, max_tokens=2, temperature=0)
    client.completions.create(**args)
    again = client.completions.create(**args).usage
    assert 0 < again.prompt_tokens_details.cached_tokens < again.prompt_tokens
    streamed = [c for c in client.completions.create(
        **args, stream=True, stream_options={"include_usage": True})][-1].usage
    assert streamed.prompt_tokens_details.cached_tokens == again.prompt_tokens_details.cached_tokens
    # n choices of one prompt: its tokens and the cache's share of them counted once.
    both = client.completions.create(**args, n=2).usage
    assert both.prompt_tokens == again.prompt_tokens
    assert both.prompt_tokens_details.cached_tokens == again.prompt_tokens_details.cached_tokens


def test_n_choices_with_seed(client):
    args = dict(model=MODEL, prompt="My favourite animal is", max_tokens=12, n=3, seed=7,
                temperature=1.0)
    a = client.completions.create(**args)
    b = client.completions.create(**args)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.completion_tokens == 36
    chat = client.chat.completions.create(model=MODEL, messages=CHAT[0], n=2, temperature=0,
                                          max_tokens=20)
    assert [c.message.content for c in chat.choices] == ["The capital of France is Paris."] * 2


def test_logprobs_match_the_reference(client, tokenizer, reference):
    prompt = tokenizer.encode(RAW[0])
    want = reference.greedy(prompt, 8)
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    ref = reference.log_probs(prompt + want)
    for i, token in enumerate(want):
        expected = ref[len(prompt) - 1 + i]
        assert lp.token_logprobs[i] == pytest.approx(expected[token].item(), abs=1e-3)
        top = expected.topk(3)
        assert list(lp.top_logprobs[i].values()) == pytest.approx(top.values.tolist(),
                                                                   abs=1e-3)
    assert lp.tokens == [tokenizer.hf.decode([t]) for t in want]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT[0], temperature=0,
                                          max_tokens=5, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-5)


def test_echo_with_logprobs_scores_the_prompt(client, tokenizer, reference):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0): the prompt alone, each
    token's logprob after the first (the first has none), streamed or not."""
    prompt = tokenizer.encode(RAW[0])
    ref = reference.log_probs(prompt)
    args = dict(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    r = client.completions.create(**args)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == tokenizer.hf.decode(prompt) and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(prompt)
    assert lp.tokens == [tokenizer.hf.decode([t]) for t in prompt] and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(
        [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))], abs=1e-3)
    assert all(len(top) in (2, 3) for top in lp.top_logprobs[1:])  # the top 2 and the token
    # With tokens generated after it, streamed: the prompt and its logprobs come first.
    chunks = [c.choices[0] for c in client.completions.create(
        **{**args, "max_tokens": 4, "temperature": 0, "stream": True})]
    tokens = [t for c in chunks for t in c.logprobs.tokens]
    values = [v for c in chunks for v in c.logprobs.token_logprobs]
    assert "".join(c.text for c in chunks).startswith(choice.text)
    assert tokens[: len(prompt)] == lp.tokens and len(tokens) == len(prompt) + 4
    assert values[0] is None and values[1 : len(prompt)] == pytest.approx(lp.token_logprobs[1:])
    # n choices of one prompt: each carries the prompt and its logprobs.
    for c in client.completions.create(**{**args, "n": 2}).choices:
        assert c.text == choice.text and c.logprobs.token_logprobs[0] is None
        assert c.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-3)
    # echo and max_tokens 0 without logprobs: the prompt alone.
    bare = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0)
    assert bare.choices[0].text == choice.text and bare.usage.completion_tokens == 0


def test_logprobs_of_tokens_that_split_characters(client):
    """Emoji and CJK come in byte pieces: each token and candidate carries its own bytes
    (chat), distinct candidates stay distinct, and completion offsets point into the text."""
    prompt = "Emoji party: 🎉🎉🎉🎉 日本語のテキスト 日本語"
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                  logprobs=5, extra_body={"ignore_eos": True})
    lp, text = r.choices[0].logprobs, r.choices[0].text
    keys = [k for top in lp.top_logprobs for k in top]
    assert all("\ufffd" not in k for k in lp.tokens + keys)
    assert any("\\x" in k for k in keys)  # byte pieces among the candidates, shown escaped
    assert all(len(top) >= 5 for top in lp.top_logprobs)  # none lost to a shared key
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=12, logprobs=True, top_logprobs=5)
    content = chat.choices[0].logprobs.content
    pieces = bytes(b for c in content for b in c.bytes)
    assert pieces.decode("utf-8", "replace") == chat.choices[0].message.content
    assert all(bytes(t.bytes).decode("utf-8", "backslashreplace") == t.token
               for c in content for t in c.top_logprobs)
    # Streamed, a token that completes no character is no chunk (it was an empty one).
    stream = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = [(c.choices[0].text, c.choices[0].finish_reason) for c in stream if c.choices]
    assert all(t or reason for t, reason in chunks), chunks
    assert "".join(t for t, _ in chunks) == text and len(chunks) < 12


def test_filters_penalties_bias_and_min_tokens(client, tokenizer):
    base = dict(model=MODEL, prompt=RAW[2], max_tokens=10)
    greedy = client.completions.create(**base, temperature=0).choices[0].text
    # top_k=1 at temperature 1 is greedy; so is a tiny top_p.
    assert client.completions.create(**base, temperature=1, seed=1,
                                     extra_body={"top_k": 1}).choices[0].text == greedy
    assert client.completions.create(**base, temperature=1, seed=2,
                                     top_p=1e-6).choices[0].text == greedy
    banned = tokenizer.encode(" 6")[0]
    biased = client.completions.create(**base, temperature=0,
                                       logit_bias={str(banned): -100}).choices[0].text
    assert " 6" in greedy and " 6" not in biased
    penalized = client.completions.create(**base, temperature=0, frequency_penalty=2.0,
                                          presence_penalty=2.0).choices[0].text
    assert penalized != greedy
    short = client.chat.completions.create(model=MODEL, messages=CHAT[0], temperature=0,
                                           max_tokens=40, extra_body={"min_tokens": 12})
    assert short.usage.completion_tokens >= 12
    assert short.choices[0].message.content.startswith("The capital of France is Paris.")


def test_extreme_seed_and_min_tokens_before_stop_strings(client):
    r = client.completions.create(model=MODEL, prompt=RAW[0], max_tokens=4, n=2,
                                  seed=2**63 - 1)
    assert len(r.choices) == 2
    full = client.completions.create(model=MODEL, prompt=RAW[0], temperature=0,
                                     max_tokens=20).choices[0].text
    early = full.split()[1]  # a word within the first few tokens
    held = client.completions.create(model=MODEL, prompt=RAW[0], temperature=0, max_tokens=20,
                                     stop=[early], extra_body={"min_tokens": 15})
    assert held.usage.completion_tokens >= 15


def test_retrieve_a_model(client):
    """OpenAI's GET /v1/models/{model}: the served model as the list shows it; any other
    name, slashes and all, is model_not_found."""
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model == client.models.list().data[0]
    for name in ("gpt-4", "org/other-model"):
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(name)
        assert e.value.body["code"] == "model_not_found", e.value.body


def test_echo_and_priority(client):
    r = client.completions.create(model=MODEL, prompt=RAW[0], temperature=0, max_tokens=5,
                                  echo=True, extra_body={"priority": -5})
    plain = client.completions.create(model=MODEL, prompt=RAW[0], temperature=0, max_tokens=5)
    assert r.choices[0].text == RAW[0] + plain.choices[0].text


# ---- WebSocket ----

def test_websocket_multiplexing_cancel_and_errors(server):
    async def main() -> dict[str, list[dict]]:
        seen: dict[str, list[dict]] = {}
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(f"{server.url}/v1/stream") as ws:
            await ws.send_json({"type": "request", "id": "a", "endpoint": "completions",
                                "body": {"prompt": RAW[0], "max_tokens": 12,
                                         "temperature": 0}})
            await ws.send_json({"type": "request", "id": "b", "endpoint": "chat.completions",
                                "body": {"messages": CHAT[0], "max_tokens": 30,
                                         "temperature": 0}})
            await ws.send_json({"type": "request", "id": "long", "endpoint": "completions",
                                "body": {"prompt": "Count:", "max_tokens": 2000,
                                         "ignore_eos": True}})
            await ws.send_str("{not json")
            await ws.send_json({"type": "request", "id": "extra", "endpoint": "completions",
                                "body": {"prompt": "x"}, "priority": 1})  # not an envelope key
            await ws.send_json({"type": "request", "id": "bad", "endpoint": "completions",
                                "body": {"prompt": "x", "temperature": -3}})
            await ws.send_json({"type": "request", "id": "nomodel", "endpoint": "completions",
                                "body": {"prompt": "x", "model": "gpt-4"}})
            done = 0
            async for msg in ws:
                m = json.loads(msg.data)
                seen.setdefault(m.get("id") or "?", []).append(m)
                if m["id"] == "long" and m["type"] == "delta" and len(seen["long"]) == 3:
                    await ws.send_json({"type": "cancel", "id": "long"})
                if m["type"] in ("done", "error") and \
                        m["id"] in ("a", "b", "long", "bad", "nomodel"):
                    done += 1
                    if done == 5:
                        break
        return seen

    def counts() -> dict[tuple[str, str], float]:
        return {(endpoint, status): server.metric("surge_requests_total",
                                                   endpoint=f"/v1/stream {endpoint}",
                                                   status=status)
                for endpoint, status in [("completions", "200"), ("completions", "499"),
                                         ("completions", "400"), ("completions", "404"),
                                         ("chat.completions", "200")]}

    before = counts()
    seen = asyncio.run(asyncio.wait_for(main(), 120))
    # Each request on the socket counts as its own, by its outcome (the cancel as 499).
    deadline = time.monotonic() + 10
    while (grown := {k: v - before[k] for k, v in counts().items()}) != dict.fromkeys(before, 1) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert grown == dict.fromkeys(before, 1)
    assert seen["?"][0]["type"] == "error"  # the malformed message; the socket lived on
    # Refused, not run, and its error names it.
    assert [m["type"] for m in seen["extra"]] == ["error"]
    assert "priority" in seen["extra"][0]["error"]["message"]
    assert seen["bad"][-1]["type"] == "error" and seen["bad"][-1]["error"]["param"]
    # The HTTP answer's code too (404 model_not_found), not only its message.
    assert seen["nomodel"][-1]["error"]["code"] == "model_not_found"
    text_b = "".join(m["text"] for m in seen["b"] if m["type"] == "delta")
    assert text_b == "The capital of France is Paris."
    assert seen["b"][-1]["finish_reason"] == "stop"
    assert seen["a"][-1]["usage"]["completion_tokens"] == 12
    cancelled = seen["long"][-1]
    assert (cancelled["type"], cancelled["finish_reason"]) == ("done", "cancelled")
    # What it used before the cancel: its prompt, and at least the three deltas seen.
    deltas = sum(m["type"] == "delta" for m in seen["long"])
    assert cancelled["usage"]["prompt_tokens"] > 0, cancelled
    assert cancelled["usage"]["completion_tokens"] >= deltas >= 3, cancelled


# ---- cancellation ----

def test_dropped_streams_are_aborted_and_blocks_freed(server):
    async def main() -> float:
        async with aiohttp.ClientSession() as session:
            async def one() -> None:
                async with session.post(f"{server.url}/v1/completions", json={
                        "prompt": "Count:", "max_tokens": 2000, "ignore_eos": True,
                        "stream": True}) as r:
                    chunks = 0
                    async for line in r.content:
                        chunks += line.startswith(b"data: ")
                        if chunks == 3:
                            return  # leaves the stream unread: the connection is closed
            await asyncio.gather(*[one() for _ in range(16)])
        return time.time()

    closed = asyncio.run(main())
    deadline = closed + 10
    while time.time() < deadline:
        stats = _stats(server)
        if stats["time"] > closed and stats["running"] == 0 and stats["waiting"] == 0:
            break
        time.sleep(0.05)
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0, stats
    print(f"\n  16 dropped streams: scheduler empty {stats['time'] - closed:.2f}s after close")
    assert stats["time"] - closed <= 2.0
    # Each is still counted once, as nginx's 499 "client closed request".
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    dropped = re.search(r'surge_requests_total\{endpoint="/v1/completions",status="499"\} '
                        r'(\S+)', text)
    assert dropped and float(dropped.group(1)) >= 16, text[:2000]


# ---- the bad-input wall ----

@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"prompt": "hi", "logprobs": 9}, "logprobs"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # 0 is for echo
    ({"prompt": "hi", "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ({"prompt": "hi", "stop_token_ids": [10**7]}, "stop_token_ids"),
    ({"prompt": "hi", "seed": "x"}, "seed"),
    ({"prompt": "hi " * 2500}, "prompt"),
    ({"prompt": "hi", "logit_bias": {"²": 1}}, "logit_bias"),
    ({"prompt": "hi", "priority": 10**23}, "priority"),
    ({"prompt": "hi", "top_k": 10**20}, "top_k"),  # past int64: it was a 500
    # Fields surge does not implement are refused by name, never ignored.
    ({"prompt": "hi", "tools": [{"type": "function"}]}, "tools"),
    ({"prompt": "hi", "response_format": {"type": "json_object"}, "min_tokens": 2},
     "min_tokens"),
    ({"prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "hi", "stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),  # no stream
    ({"prompt": "hi", "stop": ["a", ""]}, "stop"),  # would match nowhere
    # Per-request lists are bounded; numbers out of range are the client's fault.
    ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"1" * 5000: 1}}, "logit_bias"),
    ({"prompt": "hi", "stop_token_ids": [1] * 257}, "stop_token_ids"),
    ({"prompt": "hi", "timeout": 1e-300}, "timeout"),
])
def test_bad_parameters(server, body, param):
    code, payload = server.post("/v1/completions", body)
    assert code == 400, payload
    assert payload["error"]["param"] == param, payload


@pytest.mark.parametrize("field", ["stop", "not_a_field"])
def test_deeply_nested_json_is_a_400(server, field):
    depth = 100_000
    body = b'{"prompt": "hi", "' + field.encode() + b'": ' + b"[" * depth + b"]" * depth + b"}"
    code, payload = server.post("/v1/completions", body)
    assert code == 400, payload
    assert payload["error"]["message"]


def test_a_text_past_any_window_is_refused_before_it_is_tokenized(server):
    """A few MB of prompt cost seconds of a thread to tokenize: past what the window could
    hold in any tokenization, it is refused on its length."""
    for path, body in (("/v1/completions", {"prompt": "a" * 700_000}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "a" * 700_000}]})):
        code, payload = server.post(path, body)
        assert code == 400 and payload["error"]["code"] == "context_length_exceeded", payload
        assert "700000 characters" in payload["error"]["message"], payload


def test_chat_bad_parameters(server):
    code, payload = server.post("/v1/chat/completions",
                          {"messages": CHAT[0], "top_logprobs": 2})
    assert code == 400 and payload["error"]["param"] == "top_logprobs"
    # 0 asks for no alternatives: clients that always send it are not refused (as vLLM).
    code, payload = server.post("/v1/chat/completions",
                                {"messages": CHAT[0], "top_logprobs": 0, "max_tokens": 1})
    assert code == 200 and payload["choices"][0]["logprobs"] is None, payload
    code, payload = server.post("/v1/chat/completions",
                          {"messages": [{**CHAT[0][0], "tool_calls": []}]})
    assert code == 400 and "tool_calls" in payload["error"]["message"], payload
    code, payload = server.post("/v1/chat/completions",
                          {"messages": [{"role": "user", "content": [{"type": "image"}]}]})
    assert code == 400
    code, payload = server.post("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": []}]})
    assert code == 400 and payload["error"]["param"] == "messages", payload
    # A conversation replayed from OpenAI's answers: its assistant turns carry refusal null.
    code, payload = server.post("/v1/chat/completions", {"max_tokens": 2, "messages": [
        *CHAT[0], {"role": "assistant", "content": "Paris.", "refusal": None},
        {"role": "user", "content": "And of Spain?"}]})
    assert code == 200, payload
    code, payload = server.post("/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "assistant", "content": None, "refusal": "I can't."}]})
    assert code == 400 and payload["error"]["param"] == "messages", payload
    # An agent loop appending `message.model_dump()` (of parse(), too): every field OpenAI's
    # answer has, null or empty, and the client's own parse of the content and arguments.
    dumped = {"role": "assistant", "content": '{"a": 1}', "refusal": None, "annotations": [],
              "audio": None, "function_call": None, "parsed": {"a": 1},
              "tool_calls": [{"id": "call_1", "type": "function", "function": {
                  "name": "f", "arguments": "{}", "parsed_arguments": {}}}]}
    tools = [{"type": "function", "function": {"name": "f"}}]
    for turn in (dumped, {**dumped, "annotations": None}):
        code, payload = server.post("/v1/chat/completions", {"max_tokens": 2, "tools": tools,
            "messages": [*CHAT[0], turn, {"role": "tool", "tool_call_id": "call_1",
                                          "content": "done"}]})
        assert code == 200, payload
    # What those fields would carry has no place in a chat template: refused, not dropped.
    for field, value in (("annotations", [{"type": "url_citation"}]),
                         ("function_call", {"name": "f", "arguments": "{}"}),
                         ("audio", {"id": "a1"})):
        code, payload = server.post("/v1/chat/completions", {"max_tokens": 2, "messages": [
            *CHAT[0], {**dumped, "tool_calls": None, field: value}]})
        assert code == 400 and field in payload["error"]["message"], (field, payload)


def test_a_top_level_null_is_the_fields_default(server):
    """The openai client sends None as null: n, the penalties, stream, logprobs... null are
    their defaults, as OpenAI reads them; a required field null is still a 400."""
    base = {"messages": CHAT[0], "max_tokens": 3, "temperature": 0}
    _, want = server.post("/v1/chat/completions", base)
    nulls = dict.fromkeys(("n", "presence_penalty", "frequency_penalty", "stream", "logprobs",
                           "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "cache"))
    code, payload = server.post("/v1/chat/completions", {**base, **nulls})
    assert code == 200 and payload["choices"] == want["choices"], payload
    code, payload = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                    "echo": None, "n": None})
    assert code == 200 and len(payload["choices"]) == 1, payload
    code, payload = server.post("/v1/chat/completions", {**base, "messages": None})
    assert code == 400 and payload["error"]["param"] == "messages", payload
    code, payload = server.post("/v1/chat/completions", {**base, "n": None, "top_p": "x"})
    assert code == 400 and payload["error"]["param"] == "top_p", payload
    # A field surge does not implement, null, is not given (a value is refused by name), and
    # stream_options' fields read null as vLLM's do.
    unimplemented = dict.fromkeys(("suffix", "service_tier", "store", "metadata", "best_of",
                                   "reasoning_effort", "functions", "function_call"))
    code, payload = server.post("/v1/chat/completions", {**base, **unimplemented})
    assert code == 200 and payload["choices"] == want["choices"], payload
    code, payload = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                    "suffix": None, "store": None})
    assert code == 200, payload
    code, payload = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                    "suffix": "x", "store": None})
    assert code == 400 and "suffix" in payload["error"]["message"], payload
    request = urllib.request.Request(f"{server.url}/v1/completions", data=json.dumps({
        "prompt": "hi", "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": None, "continuous_usage_stats": None}}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        events = r.read().decode()
    assert r.status == 200 and '"usage"' not in events and events.endswith("[DONE]\n\n")


def test_body_too_large(server):
    code, payload = server.post("/v1/completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}')
    assert code == 413 and "bytes" in payload["error"]["message"]


def test_a_declared_length_over_the_limit_is_refused_at_once(server):
    """A Content-Length past the limit is a 413 before any body arrives (this server's body
    timeout, 2 s, would answer 408 otherwise)."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 999999999\r\n\r\n{}")
        s.settimeout(10)
        reply = s.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 413"), reply
    head, body = reply.split("\r\n\r\n", 1)
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert "Connection: close" in head  # the body it declared is unread: nothing can follow


def test_a_body_its_content_encoding_does_not_decode_is_a_400(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    gzipped = {"Content-Encoding": "gzip"}
    code, payload = server.post("/v1/completions", body, headers=gzipped)  # sent plain
    assert code == 400 and "could not be read" in payload["error"]["message"], payload
    code, payload = server.post("/v1/completions", gzip.compress(body), headers=gzipped)
    assert code == 200 and payload["usage"]["completion_tokens"] == 2, payload
    # One it does not know would pass its bytes on undecoded.
    code, payload = server.post("/v1/completions", body, headers={"Content-Encoding": "zstdx"})
    assert code == 415 and "zstdx" in payload["error"]["message"], payload
    # br and zstd only where their modules are installed (the venv has neither), never a 400
    # that asks the client to install something on the server.
    from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
    for encoding, decoded in (("br", HAS_BROTLI), ("zstd", HAS_ZSTD)):
        code, payload = server.post("/v1/completions", body,
                                    headers={"Content-Encoding": encoding})
        assert decoded or (code == 415 and encoding in payload["error"]["message"]
                           and encoding not in payload["error"]["message"].split("as ")[1]), \
            payload
    # The broken gzip's 400 closed its connection: no traceback of aiohttp reading the rest.
    assert "Unhandled exception" not in server.output()


def test_a_completion_s_max_tokens_null_is_its_default(server):
    """null is "not given" (OpenAI: defaults to 16), not "as long as the context allows"."""
    for extra in ({}, {"max_tokens": None}):
        code, payload = server.post("/v1/completions", {"prompt": "hi", "ignore_eos": True,
                                                        **extra})
        assert code == 200 and payload["usage"]["completion_tokens"] == 16, (extra, payload)
        assert payload["choices"][0]["finish_reason"] == "length"


def test_a_json_endpoint_takes_json_and_no_query(server):
    """A body that is not declared JSON is refused (a web page may send text/plain or a
    form to another site without asking it), as is a query string the endpoint would
    ignore; no Content-Type at all is read as JSON, as other servers do."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        code, payload = server.post("/v1/completions", body, headers={"Content-Type": kind})
        assert code == 415 and kind in payload["error"]["message"], (kind, payload)
    code, payload = server.post("/v1/chat/completions?max_tokens=9", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert code == 400 and payload["error"]["param"] == "max_tokens", payload
    for headers in ({"Content-Type": "application/json; charset=utf-8"},
                    {"Content-Type": "application/vnd.api+json"}):
        assert server.post("/v1/completions", body, headers=headers)[0] == 200, headers
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        s.settimeout(60)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    assert reply.split()[1] == b"200", reply


def test_a_request_that_is_not_http_gets_the_json_error_body(server):
    """aiohttp's parser refuses it before any route runs; the 400 still carries the body every
    other error has, and the connection closes."""
    for raw in (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
                b"this is not a request line\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(raw)
            s.settimeout(10)
            reply = b""
            while chunk := s.recv(4096):  # the server closes: the whole reply, then EOF
                reply += chunk
        head, body = reply.decode().split("\r\n\r\n", 1)
        assert head.split()[1] == "400", reply  # HTTP/1.0: the request's version is unknown
        assert "application/json" in head
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and "not valid HTTP" in error["message"]
    # Each is one access line, not an error with aiohttp's traceback.
    assert "Error handling request" not in server.output()
    assert server.output().count("malformed request 400") >= 2


def test_an_overlong_line_is_told_a_target_or_a_header_in_each_parsers_quoting():
    """The C parser quotes a target alone as bytes or a bytearray, the pure-Python one with its
    method, older aiohttp as text; a header's name or value is none of those."""
    from server.errors import _is_target

    for line in (b"/v1/models?x", bytearray(b"/v1?x"), "GET /v1/models?x", "http://h/x",
                 b"POST https://h/v1", "Status line is too long"):
        assert _is_target(line), line
    for line in (b"X-Big: xxx", "x" * 50, bytearray(b"Cookie"), "Header value is too long"):
        assert not _is_target(line), line


def test_an_overlong_request_target_or_header_gets_414_or_431(server):
    """Past aiohttp's 8,190-byte lines: RFC 9110's 414 and RFC 6585's 431, with the error body."""
    long = "x" * 9000
    for raw, status in ((f"GET /v1/models?{long} HTTP/1.1\r\nHost: x\r\n\r\n", "414"),
                        (f"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: {long}\r\n\r\n", "431")):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(raw.encode())
            s.settimeout(10)
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
        head, body = reply.decode().split("\r\n\r\n", 1)
        assert head.split()[1] == status, reply
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and "8190 bytes" in error["message"]


def test_slow_body_is_timed_out(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        s.settimeout(10)
        started = time.monotonic()
        reply = s.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert time.monotonic() - started < 5


def test_healthy_and_correct_after_the_wall(client, server):
    with urllib.request.urlopen(f"{server.url}/health") as r:
        assert r.status == 200
    r = client.chat.completions.create(model=MODEL, messages=CHAT[0], temperature=0,
                                       max_tokens=30)
    assert r.choices[0].message.content == "The capital of France is Paris."


def test_websocket_instant_cancel_and_refused_fields(server):
    async def main() -> list[dict]:
        got = []
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(f"{server.url}/v1/stream") as ws:
            body = {"prompt": "Count:", "max_tokens": 500, "ignore_eos": True}
            await ws.send_json({"type": "request", "id": "x", "endpoint": "completions",
                                "body": body})
            await ws.send_json({"type": "cancel", "id": "x"})
            await ws.send_json({"type": "request", "id": "e", "endpoint": "completions",
                                "body": {"prompt": "hi", "echo": True}})
            await ws.send_json({"type": "request", "id": "l", "endpoint": "completions",
                                "body": {"prompt": "hi", "logprobs": 0}})
            # A frame refused whole still names its id; an id past 256 characters is refused.
            await ws.send_json({"type": "request", "id": "k", "endpoint": "completions",
                                "body": {"prompt": "hi"}, "extra": 1})
            await ws.send_json({"type": "request", "id": "i" * 257, "endpoint": "completions",
                                "body": {"prompt": "hi"}})
            async for msg in ws:
                m = json.loads(msg.data)
                got.append(m)
                if len([g for g in got if g["type"] in ("done", "error")]) == 5:
                    break
            # The id is free again: a new request with it runs to the end.
            await ws.send_json({"type": "request", "id": "x", "endpoint": "completions",
                                "body": {"prompt": "hi", "max_tokens": 2}})
            async for msg in ws:
                m = json.loads(msg.data)
                got.append(m)
                if m["type"] in ("done", "error"):
                    break
        return got

    def counts() -> list[float]:
        return [server.metric("surge_requests_total", endpoint="/v1/stream completions",
                              status=status) for status in ("499", "400", "200")]

    before = counts()
    got = asyncio.run(asyncio.wait_for(main(), 60))
    # The cancelled one counts once as 499, whether or not its task had started.
    deadline = time.monotonic() + 10
    while (grown := [a - b for a, b in zip(counts(), before, strict=True)]) != [1, 2, 1] \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert grown == [1, 2, 1]
    ends = [(m["id"], m["type"], m.get("finish_reason")) for m in got
            if m["type"] in ("done", "error")]
    assert ("x", "done", "cancelled") in ends and ("e", "error", None) in ends
    assert ("l", "error", None) in ends  # logprobs 0 is refused like its HTTP twin
    assert ("k", "error", None) in ends and (None, "error", None) in ends
    assert ends[-1] == ("x", "done", "length")


def _headed(server, body: dict, **headers: str) -> tuple[int, dict, dict]:
    """POST /v1/completions: status, headers, body."""
    req = urllib.request.Request(f"{server.url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.load(e)


def test_a_clients_x_request_id_is_the_requests_id(server):
    """As vLLM: the client's X-Request-Id names the request (answer id, logs, header), every
    answer carries one, errors too; one surge cannot take is replaced; two requests may share
    one (the engine's ids are each request's own)."""
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    status, headers, answer = _headed(server, body, **{"X-Request-Id": "gw-42.a"})
    assert status == 200 and headers["X-Request-Id"] == "gw-42.a" and \
        answer["id"] == "cmpl-gw-42.a", (headers, answer)
    status, headers, answer = _headed(server, body)
    assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"])
    assert answer["id"] == f"cmpl-{headers['X-Request-Id']}"
    status, headers, answer = _headed(server, {**body, "top_p": 7}, **{"X-Request-Id": "gw-43"})
    assert status == 400 and headers["X-Request-Id"] == "gw-43", answer
    status, headers, answer = _headed(server, body, **{"X-Request-Id": "x" * 257})
    assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"]), answer
    log = server.output()
    assert re.search(r"POST /v1/completions 400 .*request_id=gw-43", log), log[-2000:]
    assert re.search(r"request ok .*request_id=cmpl-gw-42\.a", log), log[-2000:]

    async def twice() -> list[tuple[int, str]]:
        async with aiohttp.ClientSession() as session:
            async def post(prompt: str) -> tuple[int, str]:
                async with session.post(f"{server.url}/v1/completions", json={
                        "prompt": prompt, "max_tokens": 24, "ignore_eos": True,
                        "temperature": 0}, headers={"X-Request-Id": "same"}) as r:
                    return r.status, (await r.json())["choices"][0]["text"]
            return await asyncio.gather(post("Count to ten:"), post("Name a colour:"))

    alone = [_headed(server, {"prompt": p, "max_tokens": 24, "ignore_eos": True,
                              "temperature": 0})[2]["choices"][0]["text"]
             for p in ("Count to ten:", "Name a colour:")]
    assert asyncio.run(twice()) == [(200, alone[0]), (200, alone[1])]
