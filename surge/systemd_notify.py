"""systemd's notify protocol (sd_notify): READY=1, STATUS=..., WATCHDOG=1, STOPPING=1.

A datagram to $NOTIFY_SOCKET; a no-op when surge does not run under a Type=notify unit.
"""

from __future__ import annotations

import os
import socket


def notify(*fields: str) -> bool:
    """Send `KEY=VALUE` fields to systemd; False when there is no notify socket."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall("\n".join(fields).encode())
    return True


def watchdog_interval() -> float | None:
    """How often to send WATCHDOG=1 (half of WatchdogSec), or None without a watchdog."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec or os.environ.get("WATCHDOG_PID", str(os.getpid())) != str(os.getpid()):
        return None
    return int(usec) / 2e6
