"""A request that crashes the worker (through the worker's test hook, SURGE_TEST_CRASH_TOKEN):
it fails alone after the second crash while a request beside it finishes unchanged, /health
reports the failed restart and recovers, and systemd's watchdog stops while it is unhealthy."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.server import ServerProcess

CRASH_TOKEN = 49000  # a token no greedy answer here produces


def _health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


class _Listener(threading.Thread):
    """Every notify message surge sends, in order."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(daemon=True)
        self.sock = sock
        self.messages: list[str] = []

    def run(self) -> None:
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except OSError:
                return

    def wait_for_ping_after(self, prefix: str) -> None:
        """Until a WATCHDOG=1 follows the last message starting with prefix."""
        for _ in range(600):
            starts = [i for i, m in enumerate(self.messages) if m.startswith(prefix)]
            if starts and any("WATCHDOG=1" in m for m in self.messages[starts[-1]:]):
                return
            time.sleep(0.05)


class _HealthPoller(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.seen: list[tuple[int, dict]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            self.seen.append(_health(self.url))


@pytest.mark.slow
def test_poison_request_fails_alone_after_two_crashes_and_health_follows(tmp_path):
    normal = {"prompt": "Count from 1:", "max_tokens": 40, "temperature": 0,
              "ignore_eos": True, "stream": True}
    poison = {"prompt": [1, 2, CRASH_TOKEN], "max_tokens": 8, "temperature": 0}
    notify_path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(notify_path)
        listener = _Listener(sock)
        listener.start()
        server = ServerProcess("--max-worker-restarts", "5", env={
            "XDG_RUNTIME_DIR": str(tmp_path), "SURGE_TEST_CRASH_TOKEN": str(CRASH_TOKEN),
            "NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "400000"}).wait_ready()
        try:
            status, undisturbed = server.post("/v1/completions", {**normal, "stream": False})
            assert status == 200
            poller = _HealthPoller(server.url)
            poller.start()
            # The normal request is decoding when the poison one arrives: they share a step.
            req = urllib.request.Request(f"{server.url}/v1/completions",
                                         data=json.dumps(normal).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as stream:
                chunks = [stream.readline()]
                status, refused = server.post("/v1/completions", poison)
                chunks += stream.readlines()
            poller.done.set()
            poller.join()
            final = _health(server.url)
            listener.wait_for_ping_after("STATUS=serving")
        finally:
            assert server.stop() == 0, server.output()
    assert status == 400, refused
    assert "crashed the engine twice" in refused["error"]["message"]
    events = [json.loads(c[6:]) for c in chunks if c.startswith(b"data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == \
        undisturbed["choices"][0]["text"]
    log = server.output()
    assert log.count("exited (code 86)") == 2, log  # two crashes, then no more
    unhealthy = [body for code, body in poller.seen if code == 503]
    assert unhealthy and unhealthy[0]["status"] == "unhealthy", poller.seen
    assert "died again after a restart" in unhealthy[0]["reason"]
    assert poller.seen[-1][0] == 200 and final == (200, {"status": "ok"})
    # systemd: STATUS says why, and no watchdog ping until the engine serves again.
    messages = listener.messages
    down = next(i for i, m in enumerate(messages) if m.startswith("STATUS=unhealthy: "))
    up = next(i for i, m in enumerate(messages) if i > down and m.startswith("STATUS=serving"))
    assert not any("WATCHDOG=1" in m for m in messages[down:up])
    assert any("WATCHDOG=1" in m for m in messages[up:])
