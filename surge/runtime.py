"""The private runtime directory and the addresses of every channel between processes."""

from __future__ import annotations

import os
import shutil
import tempfile

from msgspec import Struct


class Channels(Struct, frozen=True):
    runtime_dir: str
    requests: str  # frontend -> scheduler (ZeroMQ)
    outputs: str  # scheduler -> frontend (ZeroMQ)
    results: str  # workers -> scheduler (ZeroMQ)
    plan_ring: str  # scheduler -> workers (shared-memory ring name)

    @classmethod
    def create(cls) -> Channels:
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        runtime_dir = tempfile.mkdtemp(prefix="surge-", dir=base)  # mode 0700
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
