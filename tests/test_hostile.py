"""A hostile client against the real server: the inputs that once hurt everyone else, then a
hypothesis fuzzer over whole request bodies and WebSocket frames. Throughout: no 5xx, no process
exit or worker restart, /health 200, and other requests answered as if nothing happened."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections import Counter

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.prompts import CHAT
from tests.server import ServerProcess, descendants
from tests.test_shutdown import _title

pytestmark = pytest.mark.slow
PARIS = "The capital of France is Paris."
# What the hostile client sent and what came back: kind of input -> count, and every 5xx.
TALLY: dict[str, Counter] = {"kinds": Counter(), "statuses": Counter()}
SERVER_ERRORS: list[str] = []


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--body-timeout-s", "2", "--max-prompt-tokens", "2000").wait_ready()
    srv.processes = _processes(srv)
    yield srv
    assert srv.stop() == 0, srv.output()


def _processes(server: ServerProcess) -> dict[str, int]:
    return {_title(p): p for p in descendants(server.proc.pid)}


def _send(server: ServerProcess, kind: str, path: str, data: bytes,
          content_type: str = "application/json") -> tuple[int, dict | None]:
    """POST data; the status and the JSON body. Counts the kind and flags any 5xx."""
    req = urllib.request.Request(f"{server.url}{path}", data=data,
                                 headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    TALLY["kinds"][kind] += 1
    TALLY["statuses"][status] += 1
    if status >= 500:
        SERVER_ERRORS.append(f"{kind}: {status} {body[:200]!r}")
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def _reference(server: ServerProcess) -> str:
    body = json.dumps({"messages": CHAT[0], "temperature": 0, "max_tokens": 30}).encode()
    status, payload = _send(server, "reference", "/v1/chat/completions", body)
    assert status == 200, payload
    return payload["choices"][0]["message"]["content"]


def _healthy(server: ServerProcess) -> None:
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as r:
        assert r.status == 200
    assert server.proc.poll() is None
    assert _processes(server) == server.processes, "a process of surge exited or restarted"
    assert _reference(server) == PARIS


def _j(body: dict) -> bytes:
    return json.dumps(body).encode()


HI = {"prompt": "hi", "max_tokens": 2}
# (kind, path, body, status, param): each once hurt or could hurt the server (issue 26).
CASES = [
    ("logit_bias of 20,000 entries with n 16", "/v1/completions",
     _j({**HI, "n": 16, "logit_bias": {str(i): 1 for i in range(20_000)}}), 400, "logit_bias"),
    ("stop_token_ids of 300,000 ids", "/v1/completions",
     _j({**HI, "stop_token_ids": list(range(300_000))}), 400, "stop_token_ids"),
    ("5,000 one-token prompts with n 16 (80,000 choices)", "/v1/completions",
     _j({"prompt": [[t] for t in range(1, 5001)], "n": 16, "max_tokens": 1}), 400, "prompt"),
    ("5,000-digit logit_bias key", "/v1/completions",
     _j({**HI, "logit_bias": {"1" * 5000: 1}}), 400, "logit_bias"),
    ("100,000-deep JSON", "/v1/completions",
     b'{"prompt": "hi", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("timeout 1e-300", "/v1/completions", _j({**HI, "timeout": 1e-300}), 400, "timeout"),
    ("timeout NaN", "/v1/completions", b'{"prompt": "hi", "timeout": NaN}', 400, None),
    ("max_tokens 10**30", "/v1/completions", _j({**HI, "max_tokens": 10**30}), 400,
     "max_tokens"),
    ("n of a million", "/v1/completions", _j({**HI, "n": 10**6}), 400, "n"),
    ("token id past the vocabulary", "/v1/completions",
     _j({"prompt": [10**9], "max_tokens": 2}), 400, "prompt"),
    ("negative token id", "/v1/completions", _j({"prompt": [-1], "max_tokens": 2}), 400,
     "prompt"),
    ("empty prompt list", "/v1/completions", _j({"prompt": [], "max_tokens": 2}), 400,
     "prompt"),
    ("prompt of 2,500 words (over --max-prompt-tokens)", "/v1/completions",
     _j({"prompt": "hi " * 2500}), 400, "prompt"),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("not JSON", "/v1/completions", b"prompt=hi", 400, None),
    ("a JSON list, not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("an unknown field", "/v1/completions", _j({**HI, "best_of_all": 3}), 400, "best_of_all"),
    ("no messages", "/v1/chat/completions", _j({"messages": []}), 400, "messages"),
    ("a message with an unknown role", "/v1/chat/completions",
     _j({"messages": [{"role": "root", "content": "hi"}]}), 400, None),
    ("a message without content", "/v1/chat/completions",
     _j({"messages": [{"role": "user"}]}), 400, "messages"),
    ("unknown path", "/v1/engines/x/completions", _j(HI), 404, None),
]


def test_a_lone_surrogate_is_named_as_such(server):
    """msgspec reads a high surrogate without its pair as truncated input: the 400 says what
    the client sent instead."""
    got, payload = _send(server, "lone surrogate", "/v1/completions",
                         b'{"prompt": "a\\ud800b", "max_tokens": 2}')
    assert got == 400 and "surrogate" in payload["error"]["message"], payload
    got, payload = _send(server, "pair", "/v1/completions",
                         b'{"prompt": "a\\ud83d\\ude00b", "max_tokens": 2}')
    assert got == 200, payload


def test_inputs_that_once_hurt_everyone_are_refused_alone(server):
    """Each case gets its clear 4xx while a long greedy stream runs beside them; the stream's
    text is the undisturbed one."""
    long = _j({"prompt": "Count from 1:", "max_tokens": 64, "temperature": 0,
               "ignore_eos": True})
    _, alone = _send(server, "reference", "/v1/completions", long)
    beside: list[dict] = []
    runner = threading.Thread(
        target=lambda: beside.append(_send(server, "reference", "/v1/completions", long)[1]))
    runner.start()
    for kind, path, data, status, param in CASES:
        got, payload = _send(server, kind, path, data)
        assert got == status, (kind, got, payload)
        assert payload and payload["error"]["message"], (kind, payload)
        if param is not None:
            assert payload["error"]["param"] == param, (kind, payload)
    runner.join()
    assert beside[0]["choices"][0]["text"] == alone["choices"][0]["text"]
    _healthy(server)


def test_hostile_websocket_frames_get_errors_and_the_socket_lives_on(server):
    """Bad frames each get an error message; the same socket then runs a real request."""
    frames: list[tuple[str, str | bytes]] = [
        ("not JSON", "{nope"),
        ("a binary frame", b"\x00\x01\x02"),
        ("a JSON list", "[1]"),
        ("an unknown message type", json.dumps({"type": "shout", "id": "a"})),
        ("a request without an id", json.dumps({"type": "request", "endpoint": "completions",
                                                "body": HI})),
        ("an unknown endpoint", json.dumps({"type": "request", "id": "b", "endpoint": "x",
                                            "body": HI})),
        ("a body that is not an object", json.dumps({"type": "request", "id": "c",
                                                     "endpoint": "completions", "body": 7})),
        ("logprobs 0", json.dumps({"type": "request", "id": "d", "endpoint": "completions",
                                   "body": {**HI, "logprobs": 0}})),
        ("logit_bias of 20,000 entries", json.dumps({
            "type": "request", "id": "e", "endpoint": "completions",
            "body": {**HI, "logit_bias": {str(i): 1 for i in range(20_000)}}})),
    ]

    async def main() -> tuple[list[dict], str]:
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(f"{server.url}/v1/stream") as ws:
            replies = []
            for kind, frame in frames:
                TALLY["kinds"][f"WebSocket: {kind}"] += 1
                await (ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_str(frame))
                replies.append(json.loads((await ws.receive(timeout=30)).data))
            # Cancelling what does not exist is harmless; then a real request on this socket.
            await ws.send_json({"type": "cancel", "id": "nobody"})
            await ws.send_json({"type": "request", "id": "ok", "endpoint": "chat.completions",
                                "body": {"messages": CHAT[0], "temperature": 0,
                                         "max_tokens": 30}})
            text = []
            async for msg in ws:
                m = json.loads(msg.data)
                if m.get("id") == "ok" and m["type"] == "delta":
                    text.append(m["text"])
                if m.get("id") == "ok" and m["type"] in ("done", "error"):
                    break
            return replies, "".join(text)

    replies, text = asyncio.run(asyncio.wait_for(main(), 90))
    for (kind, _), reply in zip(frames, replies, strict=True):
        assert reply["type"] == "error" and reply["error"]["message"], (kind, reply)
    assert text == PARIS
    _healthy(server)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
    | st.text(max_size=30),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8),
                                                                      children, max_size=5),
    max_leaves=10)
FIELDS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n",
          "stop", "seed", "logprobs", "top_logprobs", "echo", "logit_bias", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids",
          "ignore_eos", "stream", "stream_options", "priority", "timeout", "model", "user",
          "max_completion_tokens", "tools", "response_format"]
# A field's value: usually something plausible for it, sometimes any JSON at all.
plausible = st.one_of(st.integers(-3, 40), st.floats(-3, 3), st.just("hi"),
                      st.lists(st.integers(-5, 60_000), max_size=4),
                      st.just([{"role": "user", "content": "hi"}]), st.just({"7": 5}))
bodies = st.dictionaries(st.sampled_from(FIELDS), plausible | json_values, max_size=6)


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(bodies, st.booleans())
def test_fuzzed_whole_bodies(server, body, chat):
    """Every field at once may be wrong: any 4xx is fine, a 5xx is not."""
    body.setdefault("max_tokens", 3)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, payload = _send(server, "fuzzed body", path, json.dumps(body, allow_nan=True).encode())
    assert status < 500, (body, payload)
    if status >= 400:
        assert payload and payload["error"]["message"], payload


ws_frames = st.one_of(
    st.text(max_size=40),
    st.binary(max_size=40),
    json_values.map(json.dumps),
    st.builds(lambda i, e, b: json.dumps({"type": "request", "id": i, "endpoint": e,
                                          "body": b}),
              st.text(max_size=5) | st.integers(),
              st.sampled_from(["completions", "chat.completions", "x"]), bodies),
    st.builds(lambda i: json.dumps({"type": "cancel", "id": i}), json_values),
)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(ws_frames, min_size=1, max_size=4))
def test_fuzzed_websocket_frames(server, frames):
    """Random frames on one socket, then a marker request: no reply is a server error, the
    marker is answered, and closing the socket with requests still running is harmless."""
    end = {"type": "request", "id": "end-marker", "endpoint": "completions", "body": HI}

    async def main() -> list[dict]:
        got = []
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(f"{server.url}/v1/stream") as ws:
            for frame in frames:
                await (ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_str(frame))
            await ws.send_json(end)
            async for msg in ws:
                got.append(json.loads(msg.data))
                if got[-1].get("id") == "end-marker" and got[-1]["type"] in ("done", "error"):
                    break
        return got

    TALLY["kinds"]["fuzzed WebSocket frames"] += 1
    replies = asyncio.run(asyncio.wait_for(main(), 60))
    for reply in replies:
        if reply.get("type") == "error" and reply["error"]["type"] == "server_error":
            SERVER_ERRORS.append(f"WebSocket frames {frames!r}: {reply}")
    assert replies[-1]["type"] == "done" or "end-marker" in json.dumps(frames), replies[-1]


def test_the_wall_held(server):
    """After everything: no 5xx, no restart, healthy and correct. Prints the tally."""
    _healthy(server)
    kinds = TALLY["kinds"]
    tried = sum(1 for k in kinds if k != "reference")
    print(f"\n  hostile client: {tried} kinds of bad input "
          f"({kinds['fuzzed body']} fuzzed bodies, {kinds['fuzzed WebSocket frames']} fuzzed "
          f"frame batches), statuses {dict(sorted(TALLY['statuses'].items()))}, "
          f"5xx seen {len(SERVER_ERRORS)}, worker restarts 0")
    assert not SERVER_ERRORS, SERVER_ERRORS
