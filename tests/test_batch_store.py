"""The Batch API's store and line parsing, on a real SQLite file: state changes only from the
states expected, a line answered once, retention, and each kind of bad line."""

from __future__ import annotations

import json
import time

import pytest

from server.batch_lines import FileError, read_lines
from server.batch_store import BatchStore, StateDirBusy

CHAT = "/v1/chat/completions"


def batch(batch_id: str, status: str = "validating") -> dict:
    return {"id": batch_id, "status": status, "request_counts": None, "metadata": None}


def test_update_applies_only_from_expected_states_with_its_events(tmp_path):
    store = BatchStore(str(tmp_path), 86400)
    store.add_batch("t", batch("b1", "in_progress"))
    cancelled = store.update("b1", ("validating", "in_progress"), status="cancelling")
    assert cancelled is not None and cancelled["status"] == "cancelling"
    # The feeder's counts after a cancel do not bring the batch back.
    assert store.update("b1", ("in_progress",), request_counts={"total": 1}) is None
    ended = store.update("b1", ("cancelling",), lambda b: [("evt_1", "http://x", "t",
                                                            json.dumps(b))],
                         status="cancelled")
    assert ended is not None and store.batch("t", "b1")["status"] == "cancelled"
    assert store.batch("other", "b1") is None
    assert [r["event_id"] for r in store.due(time.time(), 10)] == ["evt_1"]
    # A second end (a restart that finalizes again) queues no second event.
    store.update("b1", ("cancelled",), lambda b: [("evt_1", "http://x", "t", "{}")])
    assert len(store.due(time.time(), 10)) == 1


def test_a_line_is_recorded_once_and_pending_skips_lines_in_flight(tmp_path):
    store = BatchStore(str(tmp_path), 86400)
    store.add_lines("b", [(1, "a", "pending", "{}", None), (2, "b", "pending", "{}", None)])
    assert [x[0] for x in store.pending("b", {1}, 5)] == [2]
    store.finish_line("b", 1, "done", "first")
    store.finish_line("b", 1, "failed", "second")
    assert list(store.results("b", "done")) == ["first"]
    assert store.counts("b") == {"done": 1, "pending": 1}
    store.add_lines("b", [(1, "a", "pending", "{}", None)])  # validated again: kept as done
    assert store.counts("b") == {"done": 1, "pending": 1}


def test_retention_removes_ended_batches_and_old_files_not_in_use(tmp_path):
    store = BatchStore(str(tmp_path), 86400)
    store.add_batch("t", {**batch("old", "in_progress"), "input_file_id": "file-1"})
    store.add_batch("t", {**batch("running", "in_progress"), "input_file_id": "file-2"})
    store.update("old", ("in_progress",), status="completed")
    store.add_lines("old", [(1, "a", "done", None, "{}")])
    for file_id in ("file-1", "file-2"):
        store.path(file_id).write_text("x")
        store.add_file("t", file_id, "batch", "in.jsonl", 1)
    assert store.remove_old(time.time() + 1) == 2
    assert store.batch("t", "old") is None and store.counts("old") == {}
    assert store.batch("t", "running") is not None
    assert store.file("t", "file-1") is None and not store.path("file-1").exists()
    # The running batch's input outlives the retention period until the batch ends.
    assert store.file("t", "file-2") is not None and store.path("file-2").exists()
    store.update("running", ("in_progress",), status="cancelled")
    assert store.remove_old(time.time() + 1) == 2
    assert store.file("t", "file-2") is None and not store.path("file-2").exists()


def test_bad_lines_each_get_a_reason(tmp_path):
    good = {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"messages": []}}
    lines = ["{oops", "[1, 2]", json.dumps({**good, "custom_id": ""}),
             json.dumps({**good, "custom_id": 123}),
             json.dumps({**good, "custom_id": "m", "method": "GET"}),
             json.dumps({**good, "custom_id": "u", "url": "/v1/completions"}),
             json.dumps({**good, "custom_id": "x", "extra": 1}),
             json.dumps({**good, "custom_id": "b", "body": "text"}), "", json.dumps(good)]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows = read_lines(path, "batch_1", CHAT, 100)
    codes = [json.loads(r[4])["error"]["code"] if r[2] == "failed" else "ok" for r in rows]
    assert codes == ["invalid_json", "invalid_json", "missing_custom_id", "invalid_custom_id",
                     "invalid_method", "invalid_url", "invalid_request", "invalid_body", "ok"]
    assert [r[0] for r in rows][-1] == 10  # numbered as in the file, blank lines too
    with pytest.raises(FileError, match="more than 3 lines") as e:
        read_lines(path, "batch_1", CHAT, 3)
    assert (e.value.code, e.value.line) == ("too_many_lines", 4)
    # A custom_id twice fails the whole file, as OpenAI's validation does, a bad line's too.
    path.write_text("\n".join([json.dumps(good), json.dumps({**good, "custom_id": "x"}),
                               json.dumps({**good, "method": "GET"})]) + "\n")
    with pytest.raises(FileError, match="'a' of line 3 is used by line 1") as e:
        read_lines(path, "batch_1", CHAT, 100)
    assert (e.value.code, e.value.param, e.value.line) == ("duplicate_custom_id", "custom_id", 3)


def test_one_server_per_state_dir(tmp_path):
    store = BatchStore(str(tmp_path), 86400)
    with pytest.raises(StateDirBusy, match="--state-dir"):
        BatchStore(str(tmp_path), 86400)
    store.close()
    BatchStore(str(tmp_path), 86400).close()  # free again once the holder is gone


def test_files_expire_at_their_own_time_or_the_retentions_and_old_stores_gain_the_columns(
        tmp_path):
    import sqlite3

    # A state directory from before the expiry columns: opened, it gains them.
    old = sqlite3.connect(tmp_path / "batches.sqlite3")
    old.executescript(
        "CREATE TABLE files (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL,"
        " filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);"
        "CREATE TABLE batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,"
        " tenant TEXT NOT NULL, status TEXT NOT NULL, ended_at REAL, data TEXT NOT NULL);"
        "INSERT INTO files VALUES ('file-old', 't', 'batch', 'a.jsonl', 1, 1000);")
    old.commit()
    old.close()
    store = BatchStore(str(tmp_path), 86400)
    assert store.file("t", "file-old")["expires_at"] == 1000 + 86400  # the retention's
    for file_id, expires_s in (("file-short", 3600), ("file-long", 10 * 86400)):
        store.path(file_id).write_text("x")
        made = store.add_file("t", file_id, "batch", "in.jsonl", 1, expires_s)
        assert made["expires_at"] == made["created_at"] + min(expires_s, 86400)
    store.add_batch("t", {**batch("b"), "input_file_id": "file-x"}, output_expires_s=7200)
    assert store.output_expires_s("b") == 7200
    # An hour on: the short file is gone, unless a running batch reads it.
    store.add_batch("t", {**batch("reads", "in_progress"), "input_file_id": "file-short"})
    store.db.execute("UPDATE files SET expires_at = 0 WHERE id = 'file-short'")
    assert store.remove_old(0) == 0 and store.file("t", "file-short") is not None
    store.update("reads", ("in_progress",), status="completed")
    assert store.remove_old(0) == 1
    assert store.file("t", "file-short") is None and not store.path("file-short").exists()
    assert store.file("t", "file-long") is not None
