"""`surge admin`: talk to a running server through its runtime dir (local, owner only)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tomllib

import msgspec
import zmq

from surge.protocol import AdminReply, AdminRequest, encode
from surge.runtime import find_server

_TIMEOUT_MS = 10_000


def ask(address: str, command: str, values: dict[str, str] | None = None) -> AdminReply:
    """One request to the scheduler's admin socket; it answers between two steps."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.connect(address)
        sock.send(encode(AdminRequest(command, values or {})))
        if not sock.poll(_TIMEOUT_MS):
            return AdminReply(False, f"no answer from the scheduler in {_TIMEOUT_MS // 1000}s "
                                     "(is it starting or replacing a worker?)")
        return msgspec.msgpack.decode(sock.recv(), type=AdminReply)
    finally:
        ctx.destroy(linger=0)


def _pairs(values: list[str]) -> dict[str, str]:
    pairs = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{item!r} is not KEY=VALUE")
        pairs[key.strip().replace("-", "_")] = value.strip()
    return pairs


def _persist(runtime_dir: str, values: dict[str, object]) -> str:
    """Write values into the [scheduler] section of the server's config file."""
    try:
        with open(os.path.join(runtime_dir, "config")) as f:
            path = f.read()
    except FileNotFoundError:
        raise ValueError("the server has no config file to persist to (start it with "
                         "--config FILE)") from None
    with open(path, "rb") as f:
        data = tomllib.load(f)
    data.setdefault("scheduler", {}).update(values)
    with open(path, "w") as f:
        f.write(_toml(data))
    return path


def _toml(data: dict[str, dict[str, object]]) -> str:
    lines = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            text = str(value).lower() if isinstance(value, bool) else (
                json.dumps(value) if isinstance(value, str) else str(value))
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)


def run_admin(args: argparse.Namespace) -> int:
    try:
        runtime_dir = args.runtime_dir or find_server(args.port)
        values = _pairs(args.values)
    except (LookupError, ValueError) as e:
        print(f"surge admin: {e}", file=sys.stderr)
        return 2
    if args.action in ("reload", "drain"):
        with open(os.path.join(runtime_dir, "pid")) as f:
            pid = int(f.read())
        os.kill(pid, signal.SIGHUP if args.action == "reload" else signal.SIGTERM)
        print(f"{args.action}: signalled surge (pid {pid})")
        return 0
    if args.action == "set" and not values:
        print("surge admin: set needs KEY=VALUE pairs", file=sys.stderr)
        return 2
    reply = ask(f"ipc://{runtime_dir}/admin", args.action, values)
    print(json.dumps({"ok": reply.ok, "message": reply.message, "values": reply.values},
                     indent=2))
    if reply.ok and args.persist and args.action == "set":
        try:
            print(f"written to {_persist(runtime_dir, {k: reply.values[k] for k in values})}")
        except (ValueError, OSError) as e:
            print(f"surge admin: {e}", file=sys.stderr)
            return 1
    return 0 if reply.ok else 1
