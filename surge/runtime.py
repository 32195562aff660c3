"""The private runtime directory and the addresses of every channel between processes."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

from msgspec import Struct

from shm.ring import SHM_DIR

_PREFIX = "surge-"


def _base() -> str:
    return os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()


class Channels(Struct, frozen=True):
    runtime_dir: str
    requests: str  # frontend -> scheduler (ZeroMQ)
    outputs: str  # scheduler -> frontend (ZeroMQ)
    results: str  # workers -> scheduler (ZeroMQ)
    plan_ring: str  # scheduler -> workers (shared-memory ring name)
    admin: str  # surge admin -> scheduler (ZeroMQ request/reply; the dir is 0700)

    @classmethod
    def create(cls) -> Channels:
        sweep_stale()
        runtime_dir = tempfile.mkdtemp(prefix=_PREFIX, dir=_base())  # mode 0700
        with open(os.path.join(runtime_dir, "pid"), "w") as f:
            f.write(str(os.getpid()))
        tag = os.path.basename(runtime_dir)
        return cls(
            runtime_dir=runtime_dir,
            requests=f"ipc://{runtime_dir}/requests",
            outputs=f"ipc://{runtime_dir}/outputs",
            results=f"ipc://{runtime_dir}/results",
            plan_ring=f"{tag}-plan",
            admin=f"ipc://{runtime_dir}/admin",
        )

    def describe(self, host: str, port: int, config: str | None,
                 api_keys_file: str | None = None) -> None:
        with open(os.path.join(self.runtime_dir, "port"), "w") as f:
            f.write(str(port))
        with open(os.path.join(self.runtime_dir, "url"), "w") as f:
            f.write(f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}")
        if config:
            with open(os.path.join(self.runtime_dir, "config"), "w") as f:
                f.write(os.path.abspath(config))
        if api_keys_file:
            with open(os.path.join(self.runtime_dir, "api_keys_file"), "w") as f:
                f.write(os.path.abspath(api_keys_file))

    def remove(self) -> None:
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


def find_server(port: int | None) -> str:
    """The runtime dir of the running surge on `port` (or the only one running)."""
    found = []
    for runtime_dir in glob.glob(os.path.join(_base(), f"{_PREFIX}*")):
        try:
            with open(os.path.join(runtime_dir, "pid")) as f:
                pid = int(f.read())
            with open(os.path.join(runtime_dir, "port")) as f:
                server_port = int(f.read())
        except (OSError, ValueError):
            continue
        if _alive(pid) and (port is None or port == server_port):
            found.append(runtime_dir)
    if len(found) != 1:
        where = f"on port {port}" if port else "at all"
        raise LookupError(f"{len(found)} running surge servers {where} under {_base()}; "
                          f"name one with --port or --runtime-dir")
    return found[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> None:
    """Remove what a surge killed with SIGKILL left behind: runtime dirs whose owner is dead, and
    their shared-memory segments."""
    for runtime_dir in glob.glob(os.path.join(_base(), f"{_PREFIX}*")):
        try:
            with open(os.path.join(runtime_dir, "pid")) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            continue
        if _alive(pid):
            continue
        tag = os.path.basename(runtime_dir)
        for segment in glob.glob(os.path.join(SHM_DIR, f"{tag}-*")):
            os.unlink(segment)
        shutil.rmtree(runtime_dir, ignore_errors=True)
