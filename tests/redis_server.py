"""A real Redis server (Debian's redis-server) on a free port in a folder of its own, for tests
and benchmarks; stopped, killed and started again on the same port at will."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from tests.server import free_port


class RedisServer:
    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout: float = 30) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             self.folder, "--save", "", "--appendonly", "no", "--logfile",
             os.path.join(self.folder, "redis.log")], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start (exit {self.proc.poll()})")
            time.sleep(0.05)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """As a crash would: no goodbye to the clients."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def pause(self, paused: bool) -> None:
        """A hung server: connections open, nothing answered."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(10)
