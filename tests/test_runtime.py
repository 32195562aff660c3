"""Which runtime dirs `surge admin` and the stale sweep act on (surge/runtime.py), and a scheduler
that survives malformed messages on its channels. Runs as root: other users are uid 65534."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import setproctitle
import zmq

from surge.process import title
from surge.protocol import AdminReply, AdminRequest, encode
from surge.runtime import Untrusted, find_server, recorded, supervisor_pid, sweep_stale

OTHER = 65534  # nobody

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


def _private_dir(parent: str, name: str, pid: int, owner: int = 0, **files: str) -> str:
    """A runtime dir as surge makes one (mode 0700), recording pid and files, owned by owner."""
    path = os.path.join(parent, name)
    os.mkdir(path, 0o700)
    for file, text in {"pid": str(pid), **files}.items():
        with open(os.path.join(path, file), "w") as f:
            f.write(text)
        os.chown(os.path.join(path, file), owner, owner)
    os.chown(path, owner, owner)
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _as_user(uid: int, work: Callable[[], None]) -> int:
    """Fork a child that becomes uid and runs work (no exec: the interpreter's files may be
    unreadable to that uid); the pid."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.setgid(uid)
            os.setuid(uid)
            work()
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    return pid


def _admin(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "surge.cli", "admin", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.server import ServerProcess

    base = str(tmp_path_factory.mktemp("base"))
    server = ServerProcess(env={"XDG_RUNTIME_DIR": base}).wait_ready()
    (name,) = os.listdir(base)
    server.runtime_dir = os.path.join(base, name)
    yield server
    assert server.stop() == 0, server.output()


@pytest.fixture
def in_base(server, monkeypatch):
    """This process looks where the server made its runtime dir."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", os.path.dirname(server.runtime_dir))
    return os.path.dirname(server.runtime_dir)


def _healthy(server) -> bool:
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as r:
        return r.status == 200


@pytest.mark.slow
def test_a_running_server_is_trusted(server, in_base):
    assert supervisor_pid(server.runtime_dir) == server.proc.pid
    assert find_server(server.port) == find_server(None) == server.runtime_dir
    assert find_server(None, server.runtime_dir) == server.runtime_dir
    assert recorded(server.runtime_dir, "port") == str(server.port)
    out = _admin("get", "--json", "--runtime-dir", server.runtime_dir)
    assert out.returncode == 0 and json.loads(out.stdout)["ok"], out.stderr


@pytest.mark.slow
def test_a_planted_dir_is_refused(server, in_base):
    keys = os.path.join(in_base, "planted-keys.json")
    # Another user's dir naming the real server's pid, a keys file and a config of their choice.
    planted = _private_dir(in_base, "surge-planted", server.proc.pid, owner=OTHER,
                           port=str(server.port), api_keys_file=keys, config=keys)
    try:
        with pytest.raises(Untrusted, match=f"{planted}: it belongs to uid {OTHER}, not to you"):
            supervisor_pid(planted)
        assert find_server(server.port) == server.runtime_dir  # the planted one is passed over
        for args in (["drain"], ["reload"], ["keys", "add", "mallory"],
                     ["set", "max_num_seqs=3", "--persist"]):
            out = _admin(*args, "--runtime-dir", planted)
            assert out.returncode == 2, (args, out)
            assert out.stderr.strip() == f"surge admin: not trusting {planted}: it belongs to " \
                                         f"uid {OTHER}, not to you (uid 0) or root", out.stderr
        assert not os.path.exists(keys)
        assert server.proc.poll() is None and _healthy(server)
    finally:
        shutil.rmtree(planted)


@pytest.mark.slow
def test_an_open_or_symlinked_dir_is_refused(server, in_base):
    link = os.path.join(in_base, "surge-link")
    os.symlink(server.runtime_dir, link)
    try:
        with pytest.raises(Untrusted, match="it is a symlink"):
            find_server(None, link)
    finally:
        os.unlink(link)
    os.chmod(server.runtime_dir, 0o755)
    try:
        with pytest.raises(Untrusted, match=f"{server.runtime_dir}: its mode is 755, not 700"):
            supervisor_pid(server.runtime_dir)
        out = _admin("drain", "--port", str(server.port))
        assert out.returncode == 2 and "its mode is 755" in out.stderr, out
    finally:
        os.chmod(server.runtime_dir, 0o700)
    assert server.proc.poll() is None


def test_recorded_files_must_be_regular_files_of_the_owner(tmp_path):
    runtime_dir = _private_dir(str(tmp_path), "surge-x", _dead_pid(), port="8000")
    assert recorded(runtime_dir, "port") == "8000" and recorded(runtime_dir, "url") is None
    os.symlink(os.path.join(runtime_dir, "port"), os.path.join(runtime_dir, "config"))
    with pytest.raises(Untrusted, match="config: Too many levels of symbolic links"):
        recorded(runtime_dir, "config")
    os.chown(os.path.join(runtime_dir, "port"), OTHER, OTHER)
    with pytest.raises(Untrusted, match="port: not a regular file of uid 0"):
        recorded(runtime_dir, "port")
    os.mkfifo(os.path.join(runtime_dir, "url"))
    with pytest.raises(Untrusted, match="url: not a regular file"):
        recorded(runtime_dir, "url")


def test_a_pid_that_is_no_surge_supervisor_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    sleeper = subprocess.Popen(["sleep", "60"])

    def impostor() -> None:
        setproctitle.setproctitle(title("supervisor"))
        time.sleep(60)

    other = _as_user(OTHER, impostor)
    try:
        expect = {
            _dead_pid(): "is not running",
            sleeper.pid: "is 'sleep', not a surge supervisor",
            # Titled right, but not the directory owner's: a reused pid, or an impostor.
            other: f"runs as uid {OTHER}, not as the directory's owner \\(0\\)",
        }
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{other}/cmdline").read_text().startswith(title("supervisor")):
            assert time.monotonic() < deadline, "the impostor did not rename itself"
            time.sleep(0.05)
        for i, (pid, reason) in enumerate(expect.items()):
            runtime_dir = _private_dir(str(tmp_path), f"surge-{i}", pid, port="8000")
            with pytest.raises(Untrusted, match=f"{runtime_dir}: its pid {pid} {reason}"):
                supervisor_pid(runtime_dir)
        with pytest.raises(LookupError, match="0 running surge servers on port 8000 .*"
                                              "\\(not trusting .*; 2 more refused\\)"):
            find_server(8000)
    finally:
        sleeper.kill()
        os.kill(other, signal.SIGKILL)
        os.waitpid(other, 0)
        sleeper.wait()


@pytest.mark.slow
def test_sweep_leaves_a_live_server_alone(server, in_base, caplog):
    segment = f"/dev/shm/surge-{recorded(server.runtime_dir, 'id')}-plan"
    assert os.path.exists(segment)
    stale_id = "0123456789abcdef"
    ours = f"/dev/shm/surge-{stale_id}-plan"
    theirs = f"/dev/shm/surge-{stale_id}-other"
    for path, owner in ((ours, 0), (theirs, OTHER)):
        Path(path).touch()
        os.chown(path, owner, owner)
    # Glob characters in names and ids: matched as patterns they would take the live segment.
    foreign = _private_dir(in_base, "surge-*", _dead_pid(), owner=OTHER, id="*")
    mine = _private_dir(in_base, "surge-?", _dead_pid(), id="*")
    stale = _private_dir(in_base, "surge-stale", _dead_pid(), id=stale_id)
    try:
        sweep_stale()
        assert os.path.exists(segment) and os.path.isdir(server.runtime_dir)
        assert os.path.isdir(foreign) and f"not trusting {foreign}: it belongs to uid" in \
            caplog.text
        assert not os.path.exists(mine)  # ours and stale, but its id names no segment
        assert not os.path.exists(stale) and not os.path.exists(ours)
        assert os.path.exists(theirs) and f"leaving {theirs} alone" in caplog.text
        assert _healthy(server)
    finally:
        shutil.rmtree(foreign)
        os.unlink(theirs)


def test_sweep_never_raises_on_what_it_cannot_remove(monkeypatch):
    # A sticky, world-writable base like /tmp; the sweep runs as the other user.
    base = tempfile.mkdtemp(prefix="sweep-")
    os.chmod(base, 0o1777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", base)
    run_id = "fedcba9876543210"
    root_segment = f"/dev/shm/surge-{run_id}-plan"
    Path(root_segment).touch()
    try:
        # Root's dir (unreadable to them), and their own stale dir holding what root put there.
        roots = _private_dir(base, "surge-root", _dead_pid())
        theirs = _private_dir(base, "surge-theirs", _dead_pid(), owner=OTHER, id=run_id)
        os.mkdir(os.path.join(theirs, "stuck"))
        Path(theirs, "stuck", "file").touch()
        _, status = os.waitpid(_as_user(OTHER, sweep_stale), 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.path.isdir(roots) and os.path.exists(os.path.join(theirs, "stuck", "file"))
        assert os.path.exists(root_segment)
    finally:
        shutil.rmtree(base)
        os.unlink(root_segment)


@pytest.mark.slow
def test_malformed_messages_on_internal_channels_are_not_fatal(server):
    ctx = zmq.Context()
    try:
        for frames in ([b"\xc1 not msgpack"], [msgspec.msgpack.encode({"command": 5})],
                       [encode(AdminRequest("get")), b"a second frame"]):
            admin = ctx.socket(zmq.REQ)
            admin.connect(f"ipc://{server.runtime_dir}/admin")
            admin.send_multipart(frames)
            assert admin.poll(10_000), "the scheduler did not answer"
            reply = msgspec.msgpack.decode(admin.recv(), type=AdminReply)
            assert not reply.ok and reply.message.startswith("malformed admin request"), reply
            admin.close(linger=0)
        requests = ctx.socket(zmq.PUSH)
        requests.connect(f"ipc://{server.runtime_dir}/requests")
        for raw in (b"\xc1", msgspec.msgpack.encode({"type": "EngineRequests"})):
            requests.send(raw)
        requests.close(linger=1000)
    finally:
        ctx.destroy(linger=0)
    body = json.dumps({"prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(f"{server.url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert json.load(r)["choices"][0]["text"]
    assert _healthy(server)
    out = _admin("get", "--json", "--runtime-dir", server.runtime_dir)
    assert out.returncode == 0 and json.loads(out.stdout)["ok"], out.stderr
    assert "malformed admin request" in server.output()


def test_each_replica_has_its_own_channels_and_names():
    from surge.runtime import Channels, admin_addresses

    base = msgspec.structs.replace(
        Channels("/run/x", "ipc:///run/x/requests", "ipc:///run/x/outputs",
                 "ipc:///run/x/results", "surge-0123456789abcdef-plan", "ipc:///run/x/admin"),
        replicas=2)
    first, second = base.for_replica(0, 2), base.for_replica(1, 2)
    assert (first.requests, first.admin, first.plan_ring) == \
        (base.requests, base.admin, base.plan_ring)  # replica 0 keeps the plain names
    assert (second.requests, second.results, second.admin, second.plan_ring) == (
        "ipc:///run/x/requests-1", "ipc:///run/x/results-1", "ipc:///run/x/admin-1",
        "surge-0123456789abcdef-plan1")  # under the run id, so the sweep finds it
    assert second.outputs == base.outputs  # one socket for every scheduler's outputs
    assert (second.name("scheduler"), second.name("worker", 0)) == ("scheduler 1", "worker 1.0")
    single = Channels("/run/y", "", "", "", "p", "")
    assert (single.name("scheduler"), single.name("worker", 2)) == ("scheduler", "worker 2")
    with tempfile.TemporaryDirectory() as root:
        os.chmod(root, 0o700)
        Path(root, "replicas").write_text("2")
        assert admin_addresses(root) == [f"ipc://{root}/admin", f"ipc://{root}/admin-1"]
