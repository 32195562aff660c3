"""Tenants end to end: API keys (401), keys added and removed live, rate limits and quotas as
429 with Retry-After that the official client honours, live limits, metrics, and no accepted
request lost under a queue bound."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from surge.keys import KeyStore
from tests.server import ServerProcess

pytestmark = pytest.mark.slow

CONFIG = """
[scheduler]
max_num_seqs = 4
[tenants.batch]
priority = 10
max_concurrent = 2
[tenants.limited]
requests_per_min = 30
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    (root / "surge.toml").write_text(CONFIG)
    keys = KeyStore(str(root / "keys.json"))
    found = {name: keys.add(name)[1]
             for name in ("batch", "interactive", "limited", "admin")}
    return {"root": root, "keys": found, "env": {**os.environ, "XDG_RUNTIME_DIR": str(root)}}


@pytest.fixture(scope="module")
def server(env):
    server = ServerProcess("--config", str(env["root"] / "surge.toml"), "--api-keys-file",
                           str(env["root"] / "keys.json"),
                           env={"XDG_RUNTIME_DIR": str(env["root"])}).wait_ready()
    yield server
    server.stop()


def _client(server: ServerProcess, key: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=retries)


def _complete(client: openai.OpenAI, max_tokens: int = 2) -> str:
    return client.completions.create(model=None, prompt="Hi", max_tokens=max_tokens,
                                     temperature=0).choices[0].text


def _admin(env: dict, server: ServerProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "surge.cli", "admin", "--port",
                           str(server.port), "--json", *args], capture_output=True, text=True,
                          env=env["env"], timeout=60)


def test_keys_decide_the_tenant_and_bad_keys_get_401(server, env):
    assert _complete(_client(server, env["keys"]["interactive"]))
    for key in ("", "sk-surge-00000000-wrong", env["keys"]["batch"] + "x"):
        with pytest.raises(openai.AuthenticationError) as err:
            _complete(_client(server, key or "none"))
        assert err.value.status_code == 401
        assert "API key" in err.value.body["message"]
    req = urllib.request.Request(f"{server.url}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(req, timeout=10)
    assert http.value.code == 401 and json.loads(http.value.read())["error"]["code"] == \
        "missing_api_key"
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as r:  # no key needed
        assert r.status == 200
    # Each request's log line names its tenant.
    assert "tenant=interactive" in server.output()


def test_keys_added_and_removed_while_serving(server, env):
    added = _admin(env, server, "keys", "add", "newcomer")
    assert added.returncode == 0, added.stderr
    key = next(w for w in added.stdout.split() if w.startswith("sk-surge-"))
    assert _complete(_client(server, key))
    listed = _admin(env, server, "keys", "list")
    key_id = key.split("-")[2]
    assert key_id in listed.stdout and "newcomer" in listed.stdout
    assert _admin(env, server, "keys", "remove", key_id).returncode == 0
    with pytest.raises(openai.AuthenticationError):
        _complete(_client(server, key))


def test_rate_limit_429_with_retry_after_that_the_client_honours(server, env):
    limited = _client(server, env["keys"]["limited"])
    refused = None
    for _ in range(40):  # a bucket of 30, refilled at one every 2 s
        try:
            _complete(limited, max_tokens=1)
        except openai.RateLimitError as e:
            refused = e
            break
    assert refused is not None, "the requests_per_min bucket never ran dry"
    assert "requests_per_min" in refused.body["message"]
    retry_after = int(refused.response.headers["Retry-After"])
    assert 1 <= retry_after <= 2
    # The official client waits for Retry-After by itself and then gets served.
    started = time.monotonic()
    assert _complete(_client(server, env["keys"]["limited"], retries=3), max_tokens=1) \
        is not None
    assert time.monotonic() - started >= retry_after - 1


def test_max_concurrent_quota(server, env):
    async def main() -> list[int]:
        headers = {"Authorization": f"Bearer {env['keys']['batch']}"}
        body = {"prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True}
        async with aiohttp.ClientSession(headers=headers) as session:
            async def one() -> tuple[int, str | None]:
                async with session.post(f"{server.url}/v1/completions", json=body) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After")

            return await asyncio.gather(*(one() for _ in range(5)))

    results = asyncio.run(main())
    assert sorted(s for s, _ in results) == [200, 200, 429, 429, 429]
    assert all(retry for s, retry in results if s == 429)


def test_live_limits_and_metrics(server, env):
    out = _admin(env, server, "set", "tenants.limited.requests_per_min=6000",
                 "tenants.batch.weight=3", "max_queued_requests=500")
    assert out.returncode == 0, out.stdout + out.stderr
    values = json.loads(out.stdout)["values"]
    assert values["tenants.limited.requests_per_min"] == 6000
    bad = _admin(env, server, "set", "tenants.batch.weight=0")
    assert bad.returncode == 1 and "weight" in bad.stdout
    for bad in ("policy=lifo", "tenants.batch.colour=red"):
        assert _admin(env, server, "set", bad).returncode == 1
    for policy in ("sjf", "priority"):  # the policy is live too
        out = _admin(env, server, "set", f"policy={policy}")
        assert out.returncode == 0 and json.loads(out.stdout)["values"]["policy"] == policy
        assert _complete(_client(server, env["keys"]["interactive"]))
    deadline = time.monotonic() + 10
    while True:  # the scheduler exports its figures about once a second
        # With API keys, /metrics names tenants only to the admin tenant (or the metrics key).
        scrape = urllib.request.Request(f"{server.url}/metrics", headers={
            "Authorization": f"Bearer {env['keys']['admin']}"})
        with urllib.request.urlopen(scrape, timeout=10) as r:
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for f in text_string_to_metric_families(r.read().decode())
                       for s in f.samples}
        settled = (
            samples.get(("surge_tenant_limit", (("limit", "weight"), ("tenant", "batch")))) == 3
            and samples.get(("surge_scheduling_policy", (("policy", "priority"),))) == 1)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert samples[("surge_tenant_limit", (("limit", "weight"), ("tenant", "batch")))] == 3
    assert samples[("surge_tenant_limit", (("limit", "priority"), ("tenant", "batch")))] == 10
    assert samples[("surge_live_parameter", (("name", "max_queued_requests"),))] == 500
    assert samples[("surge_scheduling_policy", (("policy", "priority"),))] == 1
    assert samples[("surge_rejected_requests_total",
                    (("limit", "requests_per_min"), ("tenant", "limited")))] >= 1
    assert samples[("surge_rejected_requests_total",
                    (("limit", "max_concurrent"), ("tenant", "batch")))] >= 3
    assert samples[("surge_tenant_served_tokens_total", (("tenant", "interactive"),))] > 0


def test_no_accepted_request_is_lost_under_a_queue_bound(server, env):
    """A burst far over the queue bound: every request is either served or refused at once
    with Retry-After; clients that honour it all end up served."""
    assert _admin(env, server, "set", "max_queued_requests=2").returncode == 0

    async def main() -> tuple[int, list[str]]:
        headers = {"Authorization": f"Bearer {env['keys']['interactive']}"}
        refusals = 0
        texts: list[str] = []

        async def one(i: int) -> None:
            nonlocal refusals
            body = {"prompt": f"Item {i}:", "max_tokens": 8, "temperature": 0}
            while True:
                async with session.post(f"{server.url}/v1/completions", json=body) as r:
                    payload = await r.json()
                    if r.status == 429:
                        refusals += 1
                        await asyncio.sleep(float(r.headers["Retry-After"]))
                        continue
                    assert r.status == 200, payload
                    texts.append(payload["choices"][0]["text"])
                    return

        async with aiohttp.ClientSession(headers=headers) as session:
            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(24))), 300)
        return refusals, texts

    try:
        refusals, texts = asyncio.run(main())
    finally:
        _admin(env, server, "set", "max_queued_requests=1024")
    assert refusals > 0 and len(texts) == 24


def test_websocket_needs_a_key(server, env):
    async def main() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{server.url}/v1/stream") as r:
                refused = r.status
            headers = {"Authorization": f"Bearer {env['keys']['interactive']}"}
            async with session.ws_connect(f"{server.url}/v1/stream", headers=headers) as ws:
                await ws.send_json({"type": "request", "id": "a", "endpoint": "completions",
                                    "body": {"prompt": "Hi", "max_tokens": 2}})
                while (msg := await ws.receive_json())["type"] != "done":
                    pass
                return refused, msg

    refused, done = asyncio.run(main())
    assert refused == 401 and done["usage"]["completion_tokens"] == 2
