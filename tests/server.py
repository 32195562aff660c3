"""Start the real `surge serve` as a subprocess for end-to-end tests."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every process below pid (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, dtype: str = "float32",
                 kv_cache_memory: str = "256MiB", port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the server)
            "w+", prefix="surge-test-", suffix=".log")
        if "--state-dir" not in args:  # its own: servers running at once share none
            self.state = tempfile.TemporaryDirectory(prefix="surge-state-")
            args = ("--state-dir", self.state.name, *args)
        cmd = [sys.executable, "-m", "surge.cli", "serve", "--port", str(self.port),
               "--dtype", dtype, "--kv-cache-memory", kv_cache_memory, *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 180) -> ServerProcess:
        """Healthy, and past the ready line: /health answers once the scheduler has its
        workers, a moment before the supervisor has logged their start-up lines."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"surge exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200 and "surge ready on" in self.output():
                        return self
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"surge did not become ready:\n{self.output()}")

    def post(self, path: str, body: dict | bytes, timeout: float = 300,
             headers: dict[str, str] | None = None) -> tuple[int, dict]:
        """POST a JSON body (a dict, or bytes sent as they are): the status and the answer."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, headers={
            "Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0 if absent); /metrics must be open to this client."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(s.value for family in text_string_to_metric_families(text)
                   for s in family.samples if s.name == name and s.labels == labels)

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def kill_all(self) -> None:
        """SIGKILL the supervisor and every process below it at once (a machine crash, as
        far as surge's own state can tell)."""
        for pid in [*descendants(self.proc.pid), self.proc.pid]:  # children first: no SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
