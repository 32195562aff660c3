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
        )

    def remove(self) -> None:
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


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
