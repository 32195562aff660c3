"""What every child process does first: name itself, die with its parent, own its signals."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from types import FrameType

from surge.config import SurgeConfig
from surge.log import setup_logging

_PR_SET_PDEATHSIG = 1


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def title(name: str) -> str:
    """What ps shows for a surge process (`surge admin` checks the supervisor's)."""
    return f"surge: {name}"


def child_setup(name: str, cfg: SurgeConfig, *, raise_on_sigterm: bool = True,
                own_group: bool = True) -> None:
    """Call at the top of each child's entry point. SIGINT is the supervisor's to handle."""
    import setproctitle

    setproctitle.setproctitle(title(name))
    if own_group:
        # An operator (or a test) can signal this process's group alone; a terminal's Ctrl-C
        # reaches only the supervisor, which stops everyone in order.
        os.setpgid(0, 0)
    if sys.platform == "linux":
        # If the supervisor is killed outright, the children still get SIGTERM: no orphans.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if raise_on_sigterm:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    setup_logging(cfg.server.log_level, cfg.server.log_json, name)
