"""What a client without a key, or without a request, can get from the server: /metrics and
/stats only with the metrics key or an admin tenant's key; connections closed when request
headers are late or a keep-alive connection idles; a bound on open connections; and none of
it cutting a request that is being answered."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import select
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import ExitStack, closing

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from server.auth import auth_middleware
from server.connections import connection_limit
from server.context_keys import TENANT
from server.errors import error_middleware
from surge.config import ServerConfig
from surge.keys import KeyStore
from tests.server import ServerProcess

METRICS_KEY = "scrape-key-0123456789abcdef"
HEADER_S, KEEPALIVE_S, MAX_CONNECTIONS = 1.0, 3.0, 6
# What Prometheus sends with `authorization: {type: Bearer, credentials: ...}`.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("guards")
    store = KeyStore(str(root / "keys.json"))
    keys = {tenant: store.add(tenant)[1] for tenant in ("admin", "alice")}
    return {"root": root, "keys": keys, "env": {**os.environ, "XDG_RUNTIME_DIR": str(root)}}


@pytest.fixture(scope="module")
def server(env):
    server = ServerProcess(
        "--api-keys-file", str(env["root"] / "keys.json"), "--header-timeout-s", str(HEADER_S),
        "--keepalive-timeout-s", str(KEEPALIVE_S), "--max-connections", str(MAX_CONNECTIONS),
        "--max-num-seqs", "1",
        env={"SURGE_METRICS_KEY": METRICS_KEY, "XDG_RUNTIME_DIR": str(env["root"])})
    yield server.wait_ready()
    server.stop()


def _get(url: str, key: str | None = None, **headers: str) -> tuple[int, bytes]:
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=60)


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response (status, body) read off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def _health(sock: socket.socket) -> tuple[int, bytes]:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: surge\r\n\r\n")
    return _read_response(sock)


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (waits for it, up to the socket's timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _hang_up(sock: socket.socket) -> None:
    """Closes our side and waits for the server's: by then it no longer counts the connection
    (a plain close is seen a moment later, and the next connection may still be refused)."""
    sock.shutdown(socket.SHUT_WR)
    assert _closed(sock)


@pytest.mark.slow
def test_metrics_and_stats_need_the_metrics_key_or_an_admin_key(server, env):
    keys = env["keys"]
    for path in ("/metrics", "/stats"):
        url = server.url + path
        for key, status, code in ((None, 401, "missing_api_key"),
                                  ("sk-surge-00000000-wrong", 401, "invalid_api_key"),
                                  (METRICS_KEY + "x", 401, "invalid_api_key"),
                                  (keys["alice"], 403, "not_admin_tenant")):
            got, body = _get(url, key)
            error = json.loads(body)["error"]
            assert (got, error["code"]) == (status, code), (path, key, body)
            assert error["type"] == ("authentication_error" if status == 401
                                     else "permission_error")
            assert "alice" not in body.decode()
        assert _get(url, keys["admin"])[0] == 200
        assert _get(url, METRICS_KEY)[0] == 200
    # A Prometheus scrape: bearer authorization, its Accept header, text it can parse.
    status, body = _get(server.url + "/metrics", METRICS_KEY, Accept=PROMETHEUS_ACCEPT)
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert status == 200 and {"surge_requests", "surge_open_connections"} <= names
    # The scrape key opens nothing else; /health needs no key at all.
    assert _get(server.url + "/v1/models", METRICS_KEY)[0] == 401
    assert _get(server.url + "/health")[0] == 200


@pytest.mark.slow
def test_admin_stats_needs_no_metrics_key(server, env):
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(f"{server.url}/v1/completions", data=body, headers={
        "Authorization": f"Bearer {env['keys']['alice']}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200
    out = subprocess.run([sys.executable, "-m", "surge.cli", "admin", "stats", "--port",
                          str(server.port)], capture_output=True, text=True, env=env["env"],
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.search(r"TTFT +p50 \d+\.\d+ s", out.stdout), out.stdout


@pytest.mark.slow
def test_late_request_headers_get_408_and_the_connection_closes(server):
    with closing(_connect(server)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: surge\r\n")
        # Sending the rest a byte at a time does not buy more time (slowloris).
        for byte in b"X-Slow: " + b"a" * 1000:
            if select.select([sock], [], [], 0.1)[0]:
                break
            sock.sendall(bytes([byte]))
        status, body = _read_response(sock)
        assert status == 408 and json.loads(body)["error"]["code"] == "header_timeout"
        assert _closed(sock)
    with closing(_connect(server)) as sock:  # nothing sent at all: closed without a word
        assert _closed(sock)


@pytest.mark.slow
def test_idle_keepalive_connection_is_closed(server):
    with closing(_connect(server)) as sock:
        assert _health(sock)[0] == 200
        assert _health(sock)[0] == 200  # kept alive for a next request...
        assert _closed(sock)  # ...but not forever


@pytest.mark.slow
def test_connections_over_the_limit_are_refused_with_503(server):
    with ExitStack() as stack:
        accepted: list[socket.socket] = []
        for _ in range(MAX_CONNECTIONS + 1):
            sock = stack.enter_context(closing(_connect(server)))
            status, body = _health(sock)
            if status != 200:
                break
            accepted.append(sock)
        assert len(accepted) == MAX_CONNECTIONS
        error = json.loads(body)["error"]
        assert status == 503 and error["code"] == "too_many_connections"
        assert str(MAX_CONNECTIONS) in error["message"] and _closed(sock)
        # The connections already open still work.
        assert _health(accepted[0]) == (200, b'{"status": "ok"}')
        _hang_up(accepted.pop())
        with closing(_connect(server)) as sock:  # room again
            assert _health(sock)[0] == 200
            accepted.append(sock)
            # The next tests need the whole limit back.
            for kept in accepted:
                _hang_up(kept)
    assert "refused 1 connections over the limit of 6" in server.output()


@pytest.mark.slow
def test_answers_in_progress_outlive_the_timeouts(server, env):
    """A stream queued behind another request (max_num_seqs=1) is silent longer than both
    timeouts, and the WebSocket holding that other request stays open: both finish."""

    async def main() -> tuple[list[dict], list[str]]:
        auth = {"Authorization": f"Bearer {env['keys']['alice']}"}
        async with aiohttp.ClientSession(headers=auth) as session, \
                session.ws_connect(f"{server.url}/v1/stream") as ws:
            await ws.send_json({"type": "request", "id": "long", "endpoint": "completions",
                                "body": {"prompt": "Hi", "max_tokens": 4000,
                                         "ignore_eos": True}})
            assert (await ws.receive_json())["type"] == "delta"

            async def stream() -> list[str]:
                body = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "stream": True}
                async with session.post(f"{server.url}/v1/completions", json=body) as r:
                    assert r.status == 200
                    return [line.decode().strip() async for line in r.content
                            if line.strip()]

            queued = asyncio.ensure_future(stream())
            await asyncio.sleep(HEADER_S + KEEPALIVE_S + 1)
            assert not queued.done()
            await ws.send_json({"type": "cancel", "id": "long"})
            messages = [await ws.receive_json()]
            while messages[-1]["type"] == "delta":
                messages.append(await ws.receive_json())
            events = await queued
            await ws.send_json({"type": "request", "id": "after", "endpoint": "completions",
                                "body": {"prompt": "Hi", "max_tokens": 2}})
            messages.append(await ws.receive_json())
            while messages[-1]["type"] == "delta":
                messages.append(await ws.receive_json())
            return messages, events

    messages, events = asyncio.run(main())
    assert [m["type"] for m in messages if m["type"] != "delta"] == ["done", "done"]
    assert messages[-1]["id"] == "after"
    done = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert events[-1] == "data: [DONE]" and done[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in done)


def _operator_app(cfg: ServerConfig, keys: KeyStore | None) -> web.Application:
    """The real auth and error middlewares in front of stand-in endpoints."""

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"tenant": request[TENANT]})

    app = web.Application(middlewares=[error_middleware, auth_middleware(keys, cfg)])
    for path in ("/metrics", "/stats", "/v1/models"):
        app.router.add_get(path, ok)
    return app


def _statuses(cfg: ServerConfig, keys: KeyStore | None, key: str | None) -> list[int]:
    """Statuses of /metrics, /stats and /v1/models for a request with `key`."""

    async def main() -> list[int]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with TestClient(TestServer(_operator_app(cfg, keys))) as client:
            return [(await client.get(path, headers=headers)).status
                    for path in ("/metrics", "/stats", "/v1/models")]

    return asyncio.run(main())


def test_metrics_auth_settings(tmp_path):
    store = KeyStore(str(tmp_path / "keys.json"))
    admin, alice = store.add("admin")[1], store.add("alice")[1]
    # Without keys nothing changes; public opens the operator endpoints, not the API.
    assert _statuses(ServerConfig(), None, None) == [200, 200, 200]
    assert _statuses(ServerConfig(metrics_auth="public"), store, None) == [200, 200, 401]
    # A metrics key alone guards them too, and opens only them.
    alone = ServerConfig(metrics_key=METRICS_KEY)
    assert _statuses(alone, None, None) == [401, 401, 200]
    assert _statuses(alone, None, METRICS_KEY) == [200, 200, 200]
    assert _statuses(alone, None, METRICS_KEY[:-1]) == [401, 401, 200]
    # The admin tenant is configurable; "" leaves only the metrics key.
    assert _statuses(ServerConfig(admin_tenant="alice"), store, alice) == [200, 200, 200]
    assert _statuses(ServerConfig(admin_tenant="alice"), store, admin) == [403, 403, 200]
    assert _statuses(ServerConfig(admin_tenant=""), store, admin) == [403, 403, 200]
    assert _statuses(ServerConfig(admin_tenant=""), store, admin + "x") == [401, 401, 401]


def test_default_connection_limit_follows_the_open_file_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        assert connection_limit(0) == 1024 - 256
        assert connection_limit(50) == 50
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(100_000, hard), hard))
        assert connection_limit(0) == min(4096, min(100_000, hard) - 256)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
