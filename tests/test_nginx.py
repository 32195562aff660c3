"""Two surge nodes behind the real nginx (ops/nginx): balancing, prefix affinity, HTTP/2 with
TLS, WebSocket, a drain that loses nothing, a kill -9 that fails only its own requests, and
Retry-After passed on (429, and a 503 no node could take)."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.nginx import RENDER, NginxProcess
from tests.server import ServerProcess, descendants
from tests.test_tracing import Receiver

pytestmark = pytest.mark.slow
# A long drain: on a loaded 2-core machine the streams it waits for take minutes.
NODE_ARGS = ("--drain-timeout-s", "600", "--max-num-seqs", "16")


class Cluster:
    def __init__(self, folder: Path) -> None:
        self.traces = Receiver()  # both nodes export their spans here
        starting = [self.node(), self.node()]
        self.nodes = {f"127.0.0.1:{n.port}": n.wait_ready() for n in starting}
        self.nginx = NginxProcess(list(self.nodes), folder)
        self.client = openai.OpenAI(base_url=f"{self.nginx.url}/v1", api_key="none",
                                    max_retries=0)  # nginx, not the client, must cope
        self.model = self.client.models.list().data[0].id

    def node(self, port: int | None = None) -> ServerProcess:
        return ServerProcess(*NODE_ARGS, "--otlp-traces-endpoint", self.traces.url,
                             dtype="bfloat16", kv_cache_memory="64MiB", port=port)

    def chat(self, text: str, max_tokens: int = 8, **headers: str) -> tuple[str, str]:
        """One chat answer through nginx: (its text, the node that answered)."""
        raw = self.client.chat.completions.with_raw_response.create(
            model=self.model, messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens, temperature=0, extra_headers=headers)
        return raw.parse().choices[0].message.content or "", raw.headers["x-surge-upstream"]

    def stop(self) -> None:
        self.nginx.stop()
        for node in self.nodes.values():
            node.stop()
        self.traces.http.shutdown()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("nginx"))
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("version", ["1.22.1", "1.25.1"])
def test_http2_as_the_nginx_version_takes_it(version: str, tmp_path: Path) -> None:
    """`http2 on;` from nginx 1.25.1, which deprecates `listen ... http2`; the listen form
    before it. (The tests below load what render.py picks for the installed nginx.)"""
    snippet = subprocess.run(
        [sys.executable, str(RENDER), "--node", "127.0.0.1:1", "--cert", "c.pem", "--key",
         "k.pem", "--https-listen", "8443", "--nginx-version", version],
        check=True, capture_output=True, text=True).stdout
    directive = version == "1.25.1"
    assert bool(re.search(r"^ *http2 on;", snippet, re.M)) == directive
    assert ("listen 8443 ssl http2;" in snippet) != directive
    assert ("listen 8443 ssl;" in snippet) == directive


def test_requests_spread_over_both_nodes(cluster: Cluster) -> None:
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: cluster.chat(f"Count to {i}", 24), range(8)))
    assert {node for _, node in answers} == set(cluster.nodes), answers


def test_a_conversation_sticks_to_its_node(cluster: Cluster) -> None:
    """A conversation (X-Session-Id) or a shared prefix (X-Prefix-Key) stays on one node."""
    homes: dict[tuple[str, str], set[str]] = {}
    for header in ("X-Session-Id", "X-Prefix-Key"):
        for key in [f"key-{i}" for i in range(6)]:
            for turn in range(3):
                _, node = cluster.chat(f"Turn {turn}", 2, **{header: key})
                homes.setdefault((header, key), set()).add(node)
    assert all(len(nodes) == 1 for nodes in homes.values()), homes
    # Consistent hashing still spreads the keys over the nodes. The ring's points come from
    # the nodes' random ports, so six keys all fell on one node in about 1 run in 30; in 30
    # keys, about 1 in 10^9.
    spread = {cluster.chat("Hi", 1, **{"X-Session-Id": f"spread-{i}"})[1] for i in range(30)}
    assert spread == set(cluster.nodes), spread


def test_one_trace_through_nginx_and_surge(cluster: Cluster) -> None:
    """nginx passes the caller's traceparent on: surge's span joins the caller's trace."""
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    cluster.chat("Hello", 2, traceparent=f"00-{trace_id}-{parent}-01")
    deadline = time.monotonic() + 30
    while not (spans := [s for s in cluster.traces.spans if s.trace_id.hex() == trace_id]):
        assert time.monotonic() < deadline, "no span of the trace arrived"
        time.sleep(0.2)
    (request,) = [s for s in spans if s.name == "surge chat"]
    assert request.parent_span_id.hex() == parent


def test_http2_client_streams_through_tls(cluster: Cluster) -> None:
    body = {"model": cluster.model, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 12, "stream": True, "temperature": 0}
    trusted = ssl.create_default_context(cafile=str(cluster.nginx.cert))
    with httpx.Client(http2=True, verify=trusted, timeout=120) as client, \
            client.stream("POST", f"{cluster.nginx.tls_url}/v1/chat/completions",
                          json=body) as r:
        assert r.status_code == 200 and r.http_version == "HTTP/2"
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)


def test_websocket_through_nginx(cluster: Cluster) -> None:
    import asyncio

    import aiohttp

    async def main() -> list[dict]:
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(f"{cluster.nginx.url}/v1/stream") as ws:
            await ws.send_json({"type": "request", "id": "a", "endpoint": "completions",
                                "body": {"prompt": "One, two,", "max_tokens": 6,
                                         "ignore_eos": True}})
            seen = []
            while not seen or seen[-1]["type"] == "delta":
                seen.append(await ws.receive_json(timeout=60))
            return seen

    seen = asyncio.run(main())
    assert seen[-1]["type"] == "done" and seen[-1]["finish_reason"] == "length", seen
    assert any(m["type"] == "delta" for m in seen)


def _stream(cluster: Cluster, i: int, max_tokens: int, progress: list[int]) -> dict:
    """A streamed completion read to its end: its node, chunks, and how it ended."""
    body = {"model": cluster.model, "prompt": f"Count from {i}:", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    out: dict = {"node": None, "chunks": 0, "done": False, "error": None, "finish": None}
    try:
        with httpx.stream("POST", f"{cluster.nginx.url}/v1/completions", json=body,
                          timeout=httpx.Timeout(120, read=30)) as r:
            out["node"], out["status"] = r.headers.get("x-surge-upstream"), r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    out["chunks"] += 1
                    choices = json.loads(line.removeprefix("data: ")).get("choices")
                    out["finish"] = choices[0]["finish_reason"] if choices else "error"
                    progress[i] += 1
    except httpx.HTTPError as e:
        out["error"] = type(e).__name__
    out["ended"] = time.monotonic()
    return out


def _health(node: ServerProcess) -> int:
    try:
        return httpx.get(f"{node.url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _tried(upstreams: str) -> list[str]:
    """The nodes tried, from nginx's $upstream_addr ("A, B" for a retry, "A : B" for an
    internal redirect): the last one answered."""
    return re.split(r", | : ", upstreams)


def _when(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_drained_node_loses_no_request(cluster: Cluster) -> None:
    """SIGTERM one node while streams run on both and new requests keep coming: the streams on
    it finish, and the new ones go to the other node (nginx sends a draining 503 on)."""
    name, node = sorted(cluster.nodes.items())[0]
    progress = [0] * 8
    with ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(_stream, cluster, i, 24, progress) for i in range(8)]
        _when(lambda: min(progress) >= 2)
        node.proc.send_signal(signal.SIGTERM)
        _when(lambda: _health(node) == 503)  # draining: new requests are refused there
        direct = httpx.post(f"{node.url}/v1/completions", timeout=30,
                            json={"model": cluster.model, "prompt": "Hi", "max_tokens": 2})
        assert (direct.status_code, direct.headers.get("retry-after")) == (503, "1"), direct
        late = [pool.submit(cluster.chat, f"Late {i}", 4) for i in range(8)]
        results = [s.result() for s in streams]
        late_nodes = [f.result()[1] for f in late]  # raises on any failed request
    assert all(r["done"] and r["finish"] == "length" for r in results), results
    assert name in {r["node"] for r in results}  # the drained node had streams to finish
    assert all(_tried(n)[-1] != name for n in late_nodes), late_nodes
    assert node.proc.wait(60) == 0
    cluster.nodes[name] = cluster.node(node.port).wait_ready()  # back, for the next test


def _complete(cluster: Cluster, body: dict, headers: dict[str, str]) -> dict:
    """A non-streamed completion through nginx: its status, node, body and when it ended."""
    r = httpx.post(f"{cluster.nginx.url}/v1/completions", json=body, headers=headers,
                   timeout=120)
    return {"status": r.status_code, "node": r.headers.get("x-surge-upstream"),
            "retry_after": r.headers.get("retry-after"), "body": r.json(),
            "ended": time.monotonic()}


def _timed_get(url: str) -> dict:
    started = time.monotonic()
    r = httpx.get(url, timeout=30)
    return {"status": r.status_code, "node": _tried(r.headers["x-surge-upstream"])[-1],
            "took": time.monotonic() - started}


def _key_homed_on(cluster: Cluster, name: str) -> str:
    """An X-Prefix-Key whose consistent hash picks the node `name`."""
    for key in [f"home-{i}" for i in range(32)]:
        if cluster.chat("Hi", 1, **{"X-Prefix-Key": key})[1] == name:
            return key
    raise AssertionError(f"no key of 32 hashed to {name}")


def test_killed_node_fails_only_its_own_requests(cluster: Cluster) -> None:
    """kill -9 a node mid-request: at once (no hang), its streams end with an error and its
    non-streamed requests get the JSON 502; the other node's finish; new requests, those
    whose prefix key hashed to the dead node too, are answered by the survivor within
    seconds."""
    name, node = sorted(cluster.nodes.items())[1]
    key = _key_homed_on(cluster, name)
    body = {"model": cluster.model, "prompt": "Count:", "max_tokens": 64, "ignore_eos": True}
    progress = [0] * 8
    with ThreadPoolExecutor(10) as pool:
        pinned = [pool.submit(_complete, cluster, body, {"X-Prefix-Key": key}) for _ in range(2)]
        streams = [pool.submit(_stream, cluster, i, 64, progress) for i in range(8)]
        _when(lambda: min(progress) >= 2)
        victims = descendants(node.proc.pid) | {node.proc.pid}
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        node.proc.wait(10)
        # nginx's own answer time, apart from the model's: /health costs the node nothing.
        probes = [_timed_get(f"{cluster.nginx.url}/health") for _ in range(5)]
        probed = time.monotonic()
        after = [cluster.chat(f"After {i}", 2, **({"X-Prefix-Key": key} if i % 2 else {}))
                 for i in range(6)]
        results = [s.result(timeout=180) for s in streams]
        gone = [p.result(timeout=180) for p in pinned]
    mine = [r for r in results if r["node"] == name]
    others = [r for r in results if r["node"] != name]
    assert mine and others, results
    assert all(r["done"] and r["finish"] == "length" for r in others), others
    assert all(not r["done"] and r["error"] for r in mine), mine
    assert all(r["ended"] - killed < 5 for r in mine), mine
    for r in gone:  # nginx's @surge_gone: an OpenAI-style error naming the node
        assert (r["status"], r["node"]) == (502, name), r
        assert r["body"]["error"]["code"] == 502 and r["body"]["error"]["message"], r
        assert r["ended"] - killed < 5, r
    assert all(_tried(n)[-1] != name for _, n in after), after
    # The dead node is out within seconds: every probe answered by the survivor, at once.
    assert all(p["status"] == 200 and p["node"] != name and p["took"] < 1 for p in probes), \
        probes
    assert probed - killed < 5, probed - killed
    del cluster.nodes[name]


def test_retry_after_reaches_the_client(cluster: Cluster) -> None:
    """A refusal's Retry-After (here the queue bound's 429) passes through nginx."""
    (node,) = cluster.nodes.values()
    subprocess.run([sys.executable, "-m", "surge.cli", "admin", "set", "max_queued_requests=1",
                    "--port", str(node.port)], check=True, capture_output=True)
    body = {"model": cluster.model, "prompt": "Hi", "max_tokens": 24, "ignore_eos": True}
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda _: httpx.post(f"{cluster.nginx.url}/v1/completions",
                                                     json=body, timeout=300), range(32)))
    refused = [r for r in answers if r.status_code == 429]
    assert refused and all(float(r.headers["retry-after"]) > 0 for r in refused), answers
    assert refused[0].json()["error"]["message"]
    assert any(r.status_code == 200 for r in answers)


def test_a_503_reaches_the_client_when_no_node_can_take_it(cluster: Cluster) -> None:
    """The survivor draining, the other node dead: a new request is refused by the one and
    cannot reach the other, and the client gets a 503 with Retry-After (the node's own, or
    nginx's @surge_busy when the dead node was tried last), never a 502; the drain loses
    nothing."""
    ((name, node),) = cluster.nodes.items()
    progress = [0]
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_stream, cluster, 0, 48, progress)
        _when(lambda: progress[0] >= 1)
        node.proc.send_signal(signal.SIGTERM)
        _when(lambda: _health(node) == 503)
        body = {"model": cluster.model, "prompt": "Hi", "max_tokens": 2}
        refused = [_complete(cluster, body, {}) for _ in range(4)]
        result = stream.result(timeout=300)
    for r in refused:
        assert r["status"] == 503 and float(r["retry_after"]) >= 1, r
        assert r["body"]["error"]["type"] == "service_unavailable", r
        assert name in _tried(r["node"]), r  # the draining node refused it
    assert result["done"] and result["finish"] == "length", result
    assert node.proc.wait(60) == 0
