"""The unit file passes systemd-analyze verify; the supervisor speaks the notify protocol."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server import ServerProcess

UNIT = os.path.join(os.path.dirname(__file__), "..", "systemd", "surge.service")


def test_unit_verifies(tmp_path):
    # verify checks that ExecStart exists: point it at this checkout's surge.
    exe = os.path.join(os.path.dirname(sys.executable), "surge")
    text = Path(UNIT).read_text().replace("/opt/surge/.venv/bin/surge", exe)
    unit = tmp_path / "surge.service"
    unit.write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                         capture_output=True, text=True)
    problems = [line for line in (out.stdout + out.stderr).splitlines()
                if "surge.service" in line]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr


@pytest.mark.slow
def test_ready_status_and_watchdog_notifications(tmp_path):
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(120)
        server = ServerProcess(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"})
        # WATCHDOG_PID is only known once started: surge accepts the variable when unset.
        messages: list[str] = []
        try:
            while not any("READY=1" in m for m in messages):
                messages.append(sock.recv(4096).decode())
            server.wait_ready()
            while sum("WATCHDOG=1" in m for m in messages) < 2:
                messages.append(sock.recv(4096).decode())
        finally:
            assert server.stop() == 0
        messages.append(sock.recv(4096).decode())
    assert messages[0] == "STATUS=loading the model"
    assert any(m.startswith("READY=1\nSTATUS=serving on http://127.0.0.1:") for m in messages)
    assert "STOPPING=1" in messages[-1]
