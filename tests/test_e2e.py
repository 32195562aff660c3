"""The real server, started as a subprocess, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.error
import urllib.request

import openai
import pytest

from tests.prompts import CHAT, LONG_TEXT, RAW
from tests.server import ServerProcess, descendants

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess().wait_ready()
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def aclient(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    with urllib.request.urlopen(f"{server.url}/health") as r:
        assert json.load(r) == {"status": "ok"}
    log = server.output()
    assert "surge ready on http://127.0.0.1:" in log
    # 256 MiB / (30 layers x K,V x 16 tokens x 3 heads x 64 dims x 4 bytes) = 364 blocks
    assert "KV cache: 364 blocks of 16 tokens = 5824 tokens" in log
    assert "loading weights" not in log  # a progress bar is for a terminal, not a log file


def test_only_the_workers_load_torch(server):
    """The supervisor, scheduler and frontend never import torch: it would cost each of them
    seconds of start-up (a model's load is the worker's alone) and hundreds of MB."""
    loaded = {}
    for pid in descendants(server.proc.pid) | {server.proc.pid}:
        with open(f"/proc/{pid}/comm") as f, open(f"/proc/{pid}/maps") as maps:
            loaded[f.read().strip()] = "libtorch" in maps.read()
    assert loaded.pop("surge: worker 0") is True
    assert {"surge: supervis", "surge: schedule", "surge: frontend"} <= loaded.keys()
    assert not any(loaded.values()), loaded


def test_chat_greedy_answer(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT[0], temperature=0,
                                       max_tokens=30)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 8  # seven text tokens and <|im_end|>
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_without_max_tokens_fits_a_small_kv_cache(client):
    """The test server's cache (5,824 tokens) is smaller than the context window (8,192): the
    default max_tokens is what fits, not an error."""
    r = client.chat.completions.create(model=MODEL, messages=CHAT[0], temperature=0)
    assert r.choices[0].message.content == "The capital of France is Paris."


def test_completion_matches_reference_tokens(client, tokenizer, reference):
    ids = tokenizer.encode(RAW[0])
    r = client.completions.create(model=MODEL, prompt=RAW[0], temperature=0, max_tokens=32,
                                  extra_body={"ignore_eos": True})
    want = tokenizer.hf.decode(reference.greedy(ids, 32), skip_special_tokens=True)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 32 and r.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("prompt", [RAW[1], "Write a haiku about 月 and 🌙:"])
def test_streamed_completion_equals_non_streamed(client, prompt):
    args = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=40)
    full = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 40
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it)."""
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT[0], temperature=0, max_tokens=12, stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens > 0 for c in chunks)
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 12
    assert chunks[-1].choices == [] and all(c.choices for c in chunks[:-1])
    # Asked again, the prefix cache holds the prompt's blocks: every chunk says so, the role
    # chunk too (it waits for the first token, which brings the count). null: not given.
    again = list(client.chat.completions.create(
        model=MODEL, messages=CHAT[0], temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "suffix": None}))
    cached = {c.usage.prompt_tokens_details.cached_tokens for c in again}
    assert len(cached) == 1 and cached.pop() > 0, [c.usage for c in again]
    assert again[0].choices[0].delta.role == "assistant" and again[0].usage.completion_tokens == 0


def test_streamed_chat_equals_non_streamed(client):
    args = dict(model=MODEL, messages=CHAT[2], temperature=0, max_tokens=40)
    full = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sse_framing_and_done(server):
    body = json.dumps({"prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True})
    req = urllib.request.Request(f"{server.url}/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["X-Accel-Buffering"] == "no"  # proxies pass events on unbuffered
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    assert len(events) - 2 == 3  # one chunk per token here (plain ASCII words)


def test_concurrent_requests_match_sequential(aclient, tokenizer):
    """Greedy outputs do not depend on what else is in the batch."""
    prompts = [*RAW, LONG_TEXT]
    rng = random.Random(1)
    noise = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(n))
             for n in (3, 40, 150, 400)]

    async def one(prompt: str, max_tokens: int = 24) -> str:
        r = await aclient.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                             max_tokens=max_tokens,
                                             extra_body={"ignore_eos": True})
        return r.choices[0].text

    async def main() -> tuple[list[str], list[str]]:
        alone = [await one(p) for p in prompts]
        together = await asyncio.gather(*[one(p) for p in prompts],
                                        *[one(p, rng.randrange(1, 30)) for p in noise])
        return alone, list(together[: len(prompts)])

    alone, together = asyncio.run(main())
    assert together == alone


def test_seeded_sampling_is_reproducible(client):
    args = dict(model=MODEL, prompt="Once upon a time", temperature=1.0, max_tokens=20)
    a = client.completions.create(**args, seed=42).choices[0].text
    b = client.completions.create(**args, seed=42).choices[0].text
    c = client.completions.create(**args, seed=43).choices[0].text
    assert a == b
    assert a != c


def test_batch_of_prompts(client):
    r = client.completions.create(model=MODEL, prompt=["The sky is", "Water is"],
                                  temperature=0, max_tokens=5)
    assert [c.index for c in r.choices] == [0, 1]
    single = client.completions.create(model=MODEL, prompt="Water is", temperature=0,
                                       max_tokens=5)
    assert r.choices[1].text == single.choices[0].text
    assert r.usage.completion_tokens == 10


def _post(server, path: str, body: bytes | str, method: str = "POST") -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(f"{server.url}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", '{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": ""}', 400, "prompt"),
    ("/v1/completions", '{"prompt": []}', 400, "prompt"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 100000}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": [1, "a"]}', 400, "prompt"),
    ("/v1/completions", '{"prompt": [99999999]}', 400, "prompt"),
    ("/v1/completions", '{"prompt": "hi", "model": "gpt-4"}', 404, "model"),
    ("/v1/chat/completions", '{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "robot", "content": "x"}]}', 400, None),
    ("/v1/nowhere", "{}", 404, None),
])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    code, payload = _post(server, path, body)
    assert code == status, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_context_window_error_names_both_numbers(server):
    code, payload = _post(server, "/v1/completions", '{"prompt": "hi", "max_tokens": 9000}')
    assert code == 400
    assert "8192" in payload["error"]["message"] and "9000" in payload["error"]["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", json.dumps({"prompt": [1] * 8192}), "prompt"),
    ("/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": "hi " * 9000}]}), "messages"),
])
def test_a_prompt_filling_the_context_window_is_named(server, path, body, param):
    """A prompt that leaves no room for a token is the prompt's fault (OpenAI's
    context_length_exceeded on it), not max_tokens'."""
    code, payload = _post(server, path, body)
    assert code == 400, payload
    error = payload["error"]
    assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
    assert "8192" in error["message"], error


def test_invalid_utf8_and_wrong_method(server):
    code, payload = _post(server, "/v1/completions", b'{"prompt": "\xff\xfe"}')
    assert code == 400 and payload["error"]["message"]
    code, payload = _post(server, "/v1/completions", b"", method="GET")
    assert code == 405


def test_still_healthy_after_bad_input(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT[0], temperature=0,
                                       max_tokens=30)
    assert r.choices[0].message.content == "The capital of France is Paris."


def test_surge_bench_against_surge_reports_where_server_time_went(server, tmp_path):
    from surge.cli import main

    out = tmp_path / "r.json"
    assert main(["bench", "--url", server.url, "--concurrency", "4", "--num-requests", "8",
                 "--input-len", "16", "--output-len", "16", "--no-progress",
                 "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["ok"] == 8 and result["output_tok_s"] > 0
    share = result["server"]
    assert share["steps"] >= 16 and 0 < share["forward_share"] <= 1
    assert 0 <= share["step_outside_forward_share"] < share["forward_share"]
    # The local server's live parameters come with the numbers.
    assert report["environment"]["server_live_parameters"]["max_num_seqs"] == 128
