"""The private runtime directory and the addresses of every channel between processes.

`surge admin` signals the pid recorded there and writes to the paths recorded there, so a
directory is trusted only if it could not have been planted by another user: see supervisor_pid.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
import time

import msgspec
from msgspec import Struct

from shm.ring import SHM_DIR
from surge.process import title

log = logging.getLogger("surge.runtime")
_PREFIX = "surge-"
_ID = re.compile(r"[0-9a-f]{16}")


class Untrusted(LookupError):
    """A runtime dir (or a file in it) that surge must not act on, and why."""


def _base() -> str:
    return os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()


def _record(runtime_dir: str, name: str, text: str) -> None:
    with open(os.path.join(runtime_dir, name), "w") as f:
        f.write(text)


class Channels(Struct, frozen=True):
    runtime_dir: str
    requests: str  # frontend -> scheduler (ZeroMQ)
    outputs: str  # scheduler -> frontend (ZeroMQ)
    results: str  # workers -> scheduler (ZeroMQ)
    plan_ring: str  # scheduler -> workers (shared-memory ring name)
    admin: str  # surge admin -> scheduler (ZeroMQ request/reply; the dir is 0700)
    # Data parallelism: which engine replica these requests/results/admin/plan_ring are of,
    # and how many there are (outputs is one socket that every scheduler sends to).
    replica: int = 0
    replicas: int = 1

    @classmethod
    def create(cls) -> Channels:
        sweep_stale()
        runtime_dir = tempfile.mkdtemp(prefix=_PREFIX, dir=_base())  # mode 0700
        _record(runtime_dir, "pid", str(os.getpid()))
        # Segment names come from this id, which only the owner can read, never from a
        # directory name that anyone can choose: the sweep can then remove them literally.
        run_id = secrets.token_hex(8)
        _record(runtime_dir, "id", run_id)
        return cls(
            runtime_dir=runtime_dir,
            requests=f"ipc://{runtime_dir}/requests",
            outputs=f"ipc://{runtime_dir}/outputs",
            results=f"ipc://{runtime_dir}/results",
            plan_ring=f"{_PREFIX}{run_id}-plan",
            admin=f"ipc://{runtime_dir}/admin",
        )

    def for_replica(self, replica: int, replicas: int) -> Channels:
        """Replica's own channels; replica 0 keeps the plain names (as with one engine)."""
        tail = f"-{replica}" if replica else ""
        return msgspec.structs.replace(
            self, requests=f"ipc://{self.runtime_dir}/requests{tail}",
            results=f"ipc://{self.runtime_dir}/results{tail}",
            admin=f"ipc://{self.runtime_dir}/admin{tail}",
            plan_ring=self.plan_ring.split("-plan")[0] + f"-plan{replica or ''}",
            replica=replica, replicas=replicas)

    def name(self, kind: str, rank: int | None = None) -> str:
        """A process's name: "scheduler", "worker 0" with one replica; "scheduler 1",
        "worker 1.0" (replica.rank) with several."""
        if self.replicas == 1:
            return kind if rank is None else f"{kind} {rank}"
        return f"{kind} {self.replica}" if rank is None else f"{kind} {self.replica}.{rank}"

    def describe(self, host: str, port: int, config: str | None,
                 api_keys_file: str | None = None,
                 overrides: dict[str, str] | None = None) -> None:
        """overrides: the options a flag or a SURGE_* variable set (name -> which), over the
        config file's."""
        _record(self.runtime_dir, "port", str(port))
        _record(self.runtime_dir, "overrides", msgspec.json.encode(overrides or {}).decode())
        _record(self.runtime_dir, "url",
                f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}")
        if config:
            _record(self.runtime_dir, "config", os.path.abspath(config))
        if api_keys_file:
            _record(self.runtime_dir, "api_keys_file", os.path.abspath(api_keys_file))
        _record(self.runtime_dir, "replicas", str(self.replicas))

    def remove(self) -> None:
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


def _owner(runtime_dir: str) -> int:
    """The uid owning runtime_dir, if it is a real directory of the caller or root that only
    its owner can enter (so nobody else can have put anything in it)."""
    try:
        st = os.lstat(runtime_dir)
    except OSError as e:
        raise Untrusted(f"not trusting {runtime_dir}: {e.strerror}") from None
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        reason = "it is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        reason = "it is not a directory"
    elif st.st_uid not in (me, 0):
        reason = f"it belongs to uid {st.st_uid}, not to you (uid {me}) or root"
    elif st.st_mode & 0o077:
        reason = f"its mode is {st.st_mode & 0o777:o}, not 700"
    else:
        return st.st_uid
    raise Untrusted(f"not trusting {runtime_dir}: {reason}")


def recorded(runtime_dir: str, name: str) -> str | None:
    """What the server recorded as `name` in its runtime dir (None if nothing), read only from
    a regular file of the directory's owner."""
    owner = _owner(runtime_dir)
    path = os.path.join(runtime_dir, name)
    try:
        # O_NONBLOCK: a FIFO would block the open; it is refused below instead.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink
        raise Untrusted(f"not trusting {path}: {e.strerror}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != owner:
            raise Untrusted(f"not trusting {path}: not a regular file of uid {owner}")
        return f.read()


def record_reload(runtime_dir: str, ok: bool, message: str) -> None:
    """A reload's outcome, for `surge admin reload` to wait for (written whole, then renamed
    into place, so a reader never sees half of it)."""
    _record(runtime_dir, "reload.new", msgspec.json.encode(
        {"at": time.time_ns(), "ok": ok, "message": message}).decode())
    os.replace(os.path.join(runtime_dir, "reload.new"), os.path.join(runtime_dir, "reload"))


def admin_addresses(runtime_dir: str) -> list[str]:
    """Every replica's admin socket, replica 0 first."""
    text = recorded(runtime_dir, "replicas") or "1"
    count = int(text) if text.isdigit() else 1
    return [f"ipc://{runtime_dir}/admin{f'-{i}' if i else ''}" for i in range(max(count, 1))]


def _pid(runtime_dir: str) -> int:
    text = recorded(runtime_dir, "pid")
    if text is None or not text.isdigit():
        raise Untrusted(f"not trusting {runtime_dir}: it records no pid")
    return int(text)


def _process(pid: int) -> tuple[int, str] | None:
    """(real uid, title) of a running process, None if there is no such process (Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            name = f.read().split(b"\0")[0].decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    return uid, name


def supervisor_pid(runtime_dir: str) -> int:
    """The pid of the live surge supervisor whose runtime dir this is; Untrusted says why not
    (the dir may be someone else's, stale, or its pid reused by another process)."""
    owner = _owner(runtime_dir)
    pid = _pid(runtime_dir)
    try:
        found = _process(pid)
    except OSError as e:  # /proc mounted with hidepid, say
        raise Untrusted(f"not trusting {runtime_dir}: cannot read /proc/{pid}: {e.strerror}"
                        ) from None
    if found is None:
        reason = f"its pid {pid} is not running"
    elif found[0] != owner:
        reason = f"its pid {pid} runs as uid {found[0]}, not as the directory's owner ({owner})"
    elif found[1] != title("supervisor"):
        reason = f"its pid {pid} is {found[1]!r}, not a surge supervisor"
    else:
        return pid
    raise Untrusted(f"not trusting {runtime_dir}: {reason}")


def _candidates() -> list[str]:
    try:
        # A plain file named surge-* (a test's log, say) is no candidate; a symlink may be a
        # planted one, which the checks then refuse by name.
        return sorted(e.path for e in os.scandir(_base()) if e.name.startswith(_PREFIX) and
                      (e.is_symlink() or e.is_dir(follow_symlinks=False)))
    except OSError:
        return []


def find_server(port: int | None, runtime_dir: str | None = None) -> str:
    """runtime_dir if given, else the runtime dir of the running surge on `port` (or of the
    only one running); either way only one that passes supervisor_pid."""
    if runtime_dir:
        supervisor_pid(runtime_dir)
        return runtime_dir
    found, refused = [], []
    for candidate in _candidates():
        try:
            supervisor_pid(candidate)
            server_port = recorded(candidate, "port")
        except Untrusted as e:
            refused.append(str(e))
            continue
        if port is None or str(port) == server_port:
            found.append(candidate)
    if len(found) != 1:
        where = f"on port {port}" if port else "at all"
        why = ""
        if refused and not found:
            more = f"; {len(refused) - 1} more refused" if len(refused) > 1 else ""
            why = f" ({refused[0]}{more})"
        raise LookupError(f"{len(found)} running surge servers {where} under {_base()}{why}; "
                          f"name one with --port or --runtime-dir")
    return found[0]


def _unlink_segments(run_id: str) -> None:
    prefix = f"{_PREFIX}{run_id}-"
    for name in os.listdir(SHM_DIR):
        if not name.startswith(prefix):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.lstat(path).st_uid != os.geteuid():
                log.warning("sweep: leaving %s alone: it is not ours", path)
                continue
            os.unlink(path)
        except OSError as e:
            log.warning("sweep: could not remove %s: %s", path, e.strerror)


def sweep_stale() -> None:
    """Remove what a surge killed with SIGKILL left behind: runtime dirs of this user whose
    supervisor has exited, and their shared-memory segments. Anything that fails the checks or
    cannot be removed is left with a warning; this never raises."""
    for runtime_dir in _candidates():
        try:
            if _process(_pid(runtime_dir)) is not None:
                continue  # alive, or its pid reused: not known to be stale
            run_id = recorded(runtime_dir, "id") or ""
            if _ID.fullmatch(run_id):
                _unlink_segments(run_id)
            shutil.rmtree(runtime_dir)
        except Untrusted as e:
            log.warning("sweep: %s", e)
        except OSError as e:
            log.warning("sweep: leaving %s: %s", runtime_dir, e)
