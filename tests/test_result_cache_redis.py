"""The Redis result cache end to end: two real surge instances sharing a real Redis server,
which is killed, hung and brought back while they serve."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
import redis

from tests.redis_server import RedisServer
from tests.server import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
OUTAGE = "result cache: Redis at"
RETRY_S = 0.5


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def servers(store):
    args = ("--result-cache", store.url, "--result-cache-ttl-s", "600",
            "--result-cache-retry-s", str(RETRY_S), "--metrics-auth", "public",
            "--kv-cache-memory", "64MiB")
    started = [ServerProcess(*args), ServerProcess(*args)]  # both load at once
    for server in started:
        server.wait_ready()
    yield started
    for server in started:
        assert server.stop() == 0, server.output()


def _ask(server: ServerProcess, content: str) -> tuple[str | None, Any, float]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    started = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=8)
    # The prefix cache's share of the prompt differs between two engine answers of one body.
    body = raw.parse().model_dump(exclude={"id": True, "created": True,
                                           "usage": {"prompt_tokens_details": True}})
    return raw.headers.get("x-surge-cache"), body, time.perf_counter() - started


def _warnings(server: ServerProcess) -> list[str]:
    return [line for line in server.output().splitlines() if OUTAGE in line and " W " in line]


def test_instances_share_hits_through_redis(servers, store):
    a, b = servers
    first = _ask(a, "What is the capital of France?")
    on_b = _ask(b, "What is the capital of France?")
    assert (first[0], on_b[0]) == ("miss", "hit")
    assert on_b[1] == first[1] and on_b[1]["usage"]["completion_tokens"] > 0
    assert _ask(a, "What is the capital of France?")[0] == "hit"
    client = redis.Redis(port=store.port)
    keys = client.keys("surge:rc:*")
    assert len(keys) == 1
    assert 0 < client.pttl(keys[0]) <= 600_000  # the TTL is Redis's own
    assert b.metric("surge_result_cache_hits_total") == 1
    assert a.metric("surge_result_cache_stored_bytes_total") > 0


def test_a_redis_outage_costs_only_the_cache(servers, store):
    a, b = servers
    expected = _ask(a, "Name three primary colours.")
    assert expected[0] == "miss"
    errors = a.metric("surge_result_cache_errors_total", operation="get")
    store.kill()
    for _ in range(3):  # each after the retry interval: Redis is tried and fails again
        time.sleep(RETRY_S + 0.1)
        cache, answer, _ = _ask(a, "Name three primary colours.")
        assert (cache, answer) == ("miss", expected[1])  # answered by the engine
    assert a.metric("surge_result_cache_errors_total", operation="get") == errors + 3
    assert len(_warnings(a)) == 1, _warnings(a)  # one per outage

    store.start()  # empty: nothing was saved
    time.sleep(RETRY_S + 0.1)
    assert _ask(a, "Name three primary colours.")[0] == "miss"
    assert _ask(b, "Name three primary colours.")[0] == "hit"
    assert "answers again" in a.output()

    store.pause(True)  # hung: every call times out
    try:
        time.sleep(RETRY_S + 0.1)
        cache, answer, _ = _ask(a, "Name three primary colours.")
        assert (cache, answer) == ("miss", expected[1])
    finally:
        store.pause(False)
    assert len(_warnings(a)) == 2, _warnings(a)  # the kill, then the hang
    assert "TimeoutError" in _warnings(a)[1]  # result_cache_timeout_s, not a hang
    time.sleep(RETRY_S + 0.1)
    assert _ask(a, "Name three primary colours.")[0] == "hit"
    # b saw no outage: its connection the restart dropped was replaced, not counted.
    assert _warnings(b) == []
    assert b.metric("surge_result_cache_errors_total", operation="get") == 0
