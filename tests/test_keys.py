"""API keys (surge/keys.py) and `surge admin keys`: hashing, lookup, reload, the file's safety."""

from __future__ import annotations

import io
import json
import logging
import os
import string
import subprocess
import sys
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from surge.cli import main
from surge.keys import KeyStore
from surge.process import title
from surge.runtime import Channels


def _tamper(key: str) -> str:
    """The same key with its last character changed."""
    return key[:-1] + ("A" if key[-1] != "A" else "B")


def test_add_and_look_up(tmp_path):
    store = KeyStore(str(tmp_path / "keys.json"))
    alice_id, alice = store.add("alice")
    bob_id, bob = store.add("bob")
    assert alice.startswith(f"sk-surge-{alice_id}-") and alice_id != bob_id
    assert store.tenant_for(alice) == "alice" and store.tenant_for(bob) == "bob"
    for wrong in ("", "sk-surge-", "nope", _tamper(alice), _tamper(bob),
                  f"sk-surge-{alice_id}-{bob.split('-', 3)[3]}", alice + "x", alice[:-1]):
        assert store.tenant_for(wrong) is None, wrong
    assert [(e["id"], e["tenant"]) for e in store.entries()] == [(alice_id, "alice"),
                                                                 (bob_id, "bob")]
    assert set(store.entries()[0]) == {"id", "tenant", "created"}


def test_file_holds_only_hashes_and_is_private(tmp_path):
    path = tmp_path / "keys.json"
    store = KeyStore(str(path))
    _, key = store.add("alice")
    _, imported = store.add("bob", "an-imported-key-0123456789")
    data = path.read_bytes()
    assert key.encode() not in data and key.split("-", 3)[3].encode() not in data
    assert imported.encode() not in data
    assert os.stat(path).st_mode & 0o777 == 0o600
    entry = json.loads(data)["keys"][0]
    assert set(entry) == {"id", "tenant", "salt", "hash", "created"}
    assert entry["created"].endswith("+00:00")
    # Nothing but the file and its lock file is left behind (no temp files).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.json", "keys.json.lock"]


def test_remove(tmp_path):
    store = KeyStore(str(tmp_path / "keys.json"))
    key_id, key = store.add("alice")
    _, other = store.add("alice")
    assert store.remove(key_id) and not store.remove(key_id) and not store.remove("nope")
    assert store.tenant_for(key) is None and store.tenant_for(other) == "alice"


def test_other_store_sees_changes_without_restart(tmp_path):
    path = str(tmp_path / "keys.json")
    server = KeyStore(path)  # created before the file exists: no keys, every key refused
    assert server.tenant_for("sk-surge-00000000-whatever") is None and server.entries() == []
    key_id, key = KeyStore(path).add("alice")
    assert server.tenant_for(key) == "alice"
    KeyStore(path).remove(key_id)
    assert server.tenant_for(key) is None


def test_malformed_file(tmp_path, caplog):
    path = tmp_path / "keys.json"
    store = KeyStore(str(path))
    _, key = store.add("alice")
    good = path.read_bytes()
    for bad in (b"{not json", b'{"keys": [{"id": "x"}]}', b'{"keys": 3}',
                good.replace(b'"hash": "', b'"hash": "zz')):
        path.write_bytes(bad)
        with caplog.at_level(logging.ERROR, logger="surge.keys"):
            caplog.clear()
            assert store.tenant_for(key) == "alice"  # the previous keys stay
        assert any(str(path) in r.getMessage() for r in caplog.records), bad
        with pytest.raises(ValueError, match="keys.json"):
            KeyStore(str(path))
    path.write_bytes(good)
    assert store.tenant_for(key) == "alice"
    path.unlink()
    assert store.tenant_for(key) is None  # a deleted file holds no keys


def test_imported_keys(tmp_path):
    store = KeyStore(str(tmp_path / "keys.json"))
    store.add("alice")
    key_id, key = store.add("bob", "legacy-key-from-elsewhere")
    assert key == "legacy-key-from-elsewhere" and len(key_id) == 8
    assert store.tenant_for(key) == "bob" and store.tenant_for(_tamper(key)) is None
    with pytest.raises(ValueError, match="already stored"):
        store.add("carol", key)
    for bad in ("short", "has a space in the middle", "tab\tinside-0123456789"):
        with pytest.raises(ValueError):
            store.add("bob", bad)
    # A key in the generated format (moved from another server) keeps its id, so it is found.
    moved = f"sk-surge-0123abcd-{'x' * 43}"
    assert store.add("carol", moved)[0] == "0123abcd" and store.tenant_for(moved) == "carol"


def test_tenant_names(tmp_path):
    store = KeyStore(str(tmp_path / "keys.json"))
    for good in ("a", "team-1.prod_x", "Z" * 64):
        store.add(good)
    for bad in ("", "a b", "x" * 65, "a/b", "é", "a\n"):
        with pytest.raises(ValueError, match="tenant"):
            store.add(bad)
    assert len(store.entries()) == 3


def test_describe_writes_keys_file(tmp_path):
    channels = Channels(runtime_dir=str(tmp_path), requests="", outputs="", results="",
                        plan_ring="", admin="")
    channels.describe("127.0.0.1", 8000, None, api_keys_file="keys.json")
    assert (tmp_path / "api_keys_file").read_text() == os.path.abspath("keys.json")
    channels.describe("127.0.0.1", 8000, None)  # no keys file: nothing new written


def test_cli(tmp_path, capsys, monkeypatch):
    path = str(tmp_path / "keys.json")
    assert main(["admin", "keys", "list", "--keys-file", path]) == 0
    assert "no keys" in capsys.readouterr().out
    assert main(["admin", "keys", "add", "alice", "--keys-file", path]) == 0
    out = capsys.readouterr().out
    key = next(w for w in out.split() if w.startswith("sk-surge-"))
    key_id = key.split("-")[2]
    assert "cannot be shown again" in out and key_id in out
    assert KeyStore(path).tenant_for(key) == "alice"
    monkeypatch.setattr("sys.stdin", io.StringIO("a-key-read-from-stdin\n"))
    assert main(["admin", "keys", "add", "bob", "--key", "-", "--keys-file", path]) == 0
    assert "a-key-read-from-stdin" not in capsys.readouterr().out
    assert KeyStore(path).tenant_for("a-key-read-from-stdin") == "bob"
    assert main(["admin", "keys", "list", "--keys-file", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "TENANT", "CREATED"] and len(lines) == 3
    assert lines[1].split()[:2] == [key_id, "alice"] and lines[2].split()[1] == "bob"
    assert key not in "\n".join(lines)
    assert main(["admin", "keys", "remove", key_id, "--keys-file", path]) == 0
    assert KeyStore(path).tenant_for(key) is None
    assert main(["admin", "keys", "remove", key_id, "--keys-file", path]) == 1
    assert key_id in capsys.readouterr().err
    assert main(["admin", "keys", "add", "bad name", "--keys-file", path]) == 1
    for usage in (["keys"], ["keys", "add"], ["keys", "list", "x"], ["keys", "drop", "x"],
                  ["keys", "list", "--key", "k" * 20]):
        assert main(["admin", *usage, "--keys-file", path]) == 2, usage
        assert "usage" in capsys.readouterr().err


def test_cli_uses_the_servers_keys_file(tmp_path, capsys):
    runtime_dir = tmp_path / "surge-x"
    runtime_dir.mkdir(mode=0o700)
    # A process of ours titled as a supervisor, which `surge admin` checks before trusting the
    # dir (tests/test_runtime.py does the same with a real server).
    stand_in = subprocess.Popen(
        [sys.executable, "-c", "import setproctitle, sys, time; "
         "setproctitle.setproctitle(sys.argv[1]); print(flush=True); time.sleep(120)",
         title("supervisor")], stdout=subprocess.PIPE)
    try:
        stand_in.stdout.readline()  # its title is set
        (runtime_dir / "pid").write_text(str(stand_in.pid))
        # A server started without --api-keys-file has none to manage.
        assert main(["admin", "keys", "list", "--runtime-dir", str(runtime_dir)]) == 2
        assert "--api-keys-file" in capsys.readouterr().err
        path = tmp_path / "server-keys.json"
        (runtime_dir / "api_keys_file").write_text(str(path))
        assert main(["admin", "keys", "add", "alice", "--runtime-dir", str(runtime_dir)]) == 0
        assert str(path) in capsys.readouterr().out and len(KeyStore(str(path)).entries()) == 1
    finally:
        stand_in.kill()
        stand_in.wait()


_IMPORTED = st.text(string.ascii_letters + string.digits + "-_.~", min_size=16, max_size=24)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.none() | _IMPORTED,
                          st.booleans()), max_size=8),
       st.lists(_IMPORTED, max_size=3))
def test_lookup_matches_what_is_stored(ops, unknown):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "keys.json")
        reader = KeyStore(path)  # sees the writer's changes through reloads only
        writer = KeyStore(path)
        present: dict[str, str] = {}
        removed: set[str] = set()
        for tenant, imported, remove in ops:
            if imported in present:
                with pytest.raises(ValueError, match="already stored"):
                    writer.add(tenant, imported)
                continue
            key_id, key = writer.add(tenant, imported)
            removed.discard(key)  # a removed key may be imported again
            if remove:
                assert writer.remove(key_id)
                removed.add(key)
            else:
                present[key] = tenant
        for store in (reader, writer):
            for key, tenant in present.items():
                assert store.tenant_for(key) == tenant
                assert store.tenant_for(_tamper(key)) in (None, present.get(_tamper(key)))
            for key in removed | {k for k in unknown if k not in present}:
                assert store.tenant_for(key) is None


def test_single_api_key_beside_the_file(tmp_path):
    from surge.config_load import load_config
    from surge.keys import Keys

    assert Keys.of(None, None) is None
    fixed = "one-fixed-key-for-all"
    assert load_config({}, {"SURGE_API_KEY": fixed}).server.api_key == fixed
    alone = Keys.of(fixed, None)
    assert alone is not None and alone.tenant_for(fixed) == "default"
    assert alone.tenant_for(_tamper(fixed)) is None and alone.tenant_for("") is None
    _, batch_key = KeyStore(str(tmp_path / "keys.json")).add("batch")
    both = Keys.of(fixed, str(tmp_path / "keys.json"))
    assert both is not None
    assert both.tenant_for(fixed) == "default" and both.tenant_for(batch_key) == "batch"
    assert both.tenant_for(_tamper(batch_key)) is None
