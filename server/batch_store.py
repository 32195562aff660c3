"""The Batch API's durable state: file contents on disk, files, batches, their lines and the
webhook outbox in one SQLite database (WAL) under the state directory."""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

TERMINAL = ("completed", "failed", "expired", "cancelled")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, tenant TEXT NOT NULL,
    status TEXT NOT NULL, ended_at REAL, data TEXT NOT NULL, output_expires_s INTEGER);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, state TEXT NOT NULL,
    request TEXT, result TEXT, PRIMARY KEY (batch_id, line));
CREATE INDEX IF NOT EXISTS lines_state ON lines (batch_id, state);
CREATE TABLE IF NOT EXISTS outbox (
    event_id TEXT NOT NULL, url TEXT NOT NULL, tenant TEXT NOT NULL, payload TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, next_at REAL NOT NULL, state TEXT NOT NULL,
    PRIMARY KEY (event_id, url));
"""
# Columns later versions added, for state directories an earlier one made: (table, column).
_ADDED = (("files", "expires_at INTEGER"), ("batches", "output_expires_s INTEGER"))


def default_state_dir() -> str:
    """systemd's StateDirectory= (as $STATE_DIRECTORY), else the user's XDG state folder."""
    if os.environ.get("STATE_DIRECTORY"):
        return os.environ["STATE_DIRECTORY"].split(":")[0]
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "surge")


class StateDirBusy(Exception):
    """Another server holds the state directory (two runners would run the same batches)."""


class BatchStore:
    """One connection, used from the frontend's event loop only. synchronous=NORMAL: a commit
    survives the process being killed (the WAL is in the OS's cache), not a power loss, and
    costs no fsync on the event loop per line."""

    def __init__(self, state_dir: str, retention_s: float) -> None:
        """retention_s: files are removed this long after their creation at the latest."""
        self.root = Path(state_dir)
        self.retention_s = retention_s
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.lock = open(self.root / "lock", "w")  # noqa: SIM115 (held while serving)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock.close()
            raise StateDirBusy(f"the state directory {state_dir} is in use by another surge "
                               "server; give this one its own --state-dir") from None
        self.db = sqlite3.connect(self.root / "batches.sqlite3", isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        for table, column in _ADDED:
            have = {r["name"] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if column.split()[0] not in have:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")

    def close(self) -> None:
        self.db.close()
        self.lock.close()

    def path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    # ---- files ----

    def add_file(self, tenant: str, file_id: str, purpose: str, filename: str, size: int,
                 expires_s: int | None = None) -> dict:
        """expires_s: removed this long after its creation (OpenAI's expires_after), where
        sooner than the retention period."""
        now = int(time.time())
        self.db.execute("INSERT OR REPLACE INTO files (id, tenant, purpose, filename, bytes, "
                        "created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (file_id, tenant, purpose, filename, size, now,
                         None if expires_s is None else now + expires_s))
        return self.file(tenant, file_id)  # type: ignore[return-value]

    def file(self, tenant: str, file_id: str) -> dict | None:
        row = self.db.execute("SELECT * FROM files WHERE id = ? AND tenant = ?",
                              (file_id, tenant)).fetchone()
        return None if row is None else self._file(row)

    def _file(self, row: sqlite3.Row) -> dict:
        """OpenAI's file object; expires_at: when it will be removed."""
        expires = row["created_at"] + int(self.retention_s)
        if row["expires_at"] is not None:
            expires = min(expires, row["expires_at"])
        return {"id": row["id"], "object": "file", "bytes": row["bytes"],
                "created_at": row["created_at"], "expires_at": expires,
                "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
                "status_details": None}

    def files(self, tenant: str, purpose: str | None, after: str | None, limit: int,
              ascending: bool) -> tuple[list[dict], bool]:
        """A page of the tenant's files (of one purpose where given), newest first unless
        ascending, after the file `after` (one of the tenant's); and whether more follow."""
        start = self.db.execute("SELECT rowid FROM files WHERE id = ? AND tenant = ?",
                                (after, tenant)).fetchone() if after else None
        beyond, order = (">", "ASC") if ascending else ("<", "DESC")
        rows = self.db.execute(
            f"SELECT * FROM files WHERE tenant = ? AND (? IS NULL OR purpose = ?) "
            f"AND rowid {beyond} ? ORDER BY rowid {order} LIMIT ?",
            (tenant, purpose, purpose, start[0] if start else (-1 if ascending else 2**62),
             limit + 1)).fetchall()
        return [self._file(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> None:
        self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.path(file_id).unlink(missing_ok=True)

    # ---- batches ----

    def add_batch(self, tenant: str, batch: dict, output_expires_s: int | None = None) -> None:
        """output_expires_s: its output and error files' expires_s (see add_file)."""
        self.db.execute("INSERT INTO batches (id, tenant, status, data, output_expires_s) "
                        "VALUES (?, ?, ?, ?, ?)", (batch["id"], tenant, batch["status"],
                                                   json.dumps(batch), output_expires_s))

    def output_expires_s(self, batch_id: str) -> int | None:
        return self.db.execute("SELECT output_expires_s FROM batches WHERE id = ?",
                               (batch_id,)).fetchone()[0]

    def update(self, batch_id: str, expect: tuple[str, ...],
               events: Callable[[dict], list[tuple[str, str, str, str]]] | None = None,
               **fields: object) -> dict | None:
        """Change a batch's fields if its status is one of `expect` (else None: it moved on,
        e.g. was cancelled), and queue the webhook events (event id, url, tenant, payload) of
        its new state in the same transaction, so an event exists exactly when its state does."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            row = self.db.execute("SELECT data FROM batches WHERE id = ?",
                                  (batch_id,)).fetchone()
            batch = json.loads(row[0])
            if batch["status"] not in expect:
                return None
            batch.update(fields)
            ended = time.time() if batch["status"] in TERMINAL else None
            self.db.execute("UPDATE batches SET status = ?, ended_at = ?, data = ? WHERE id = ?",
                            (batch["status"], ended, json.dumps(batch), batch_id))
            self.db.executemany("INSERT OR IGNORE INTO outbox (event_id, url, tenant, payload,"
                                " next_at, state) VALUES (?, ?, ?, ?, 0, 'pending')",
                                events(batch) if events else [])
        return batch

    def batch(self, tenant: str | None, batch_id: str) -> dict | None:
        row = self.db.execute("SELECT data, tenant FROM batches WHERE id = ?",
                              (batch_id,)).fetchone()
        if row is None or (tenant is not None and row["tenant"] != tenant):
            return None
        return json.loads(row["data"])

    def owner(self, batch_id: str) -> str:
        return self.db.execute("SELECT tenant FROM batches WHERE id = ?",
                               (batch_id,)).fetchone()[0]

    def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """A page of the tenant's batches, newest first, after the batch `after`; and whether
        more follow."""
        start = self.db.execute("SELECT seq FROM batches WHERE id = ? AND tenant = ?",
                                (after, tenant)).fetchone() if after else None
        rows = self.db.execute(
            "SELECT data FROM batches WHERE tenant = ? AND seq < ? ORDER BY seq DESC LIMIT ?",
            (tenant, start[0] if start else 2**62, limit + 1)).fetchall()
        return [json.loads(r[0]) for r in rows[:limit]], len(rows) > limit

    def active(self) -> list[dict]:
        rows = self.db.execute(f"SELECT data FROM batches WHERE status IN "
                               f"({','.join('?' * len(ACTIVE))}) ORDER BY seq", ACTIVE)
        return [json.loads(r[0]) for r in rows.fetchall()]

    def by_state(self) -> dict[str, int]:
        rows = self.db.execute("SELECT status, count(*) FROM batches GROUP BY status")
        return dict(rows.fetchall())

    def remove_old(self, before: float) -> int:
        """Forget finished batches and files older than `before`, and files past their own
        expiry, but not the input file of a batch still active; how many of each went."""
        gone = [r[0] for r in self.db.execute(
            "SELECT id FROM batches WHERE ended_at < ?", (before,)).fetchall()]
        with self.db:
            self.db.execute("BEGIN")
            for batch_id in gone:
                self.db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
                self.db.execute("DELETE FROM batches WHERE id = ?", (batch_id,))
        in_use = {b["input_file_id"] for b in self.active()}  # a long batch keeps its input
        old = [r[0] for r in self.db.execute(
            "SELECT id FROM files WHERE created_at < ? OR expires_at <= ?",
            (before, time.time())).fetchall() if r[0] not in in_use]
        for file_id in old:
            self.delete_file(file_id)
        self.db.execute("DELETE FROM outbox WHERE state != 'pending' AND next_at < ?",
                        (before,))
        return len(gone) + len(old)

    # ---- lines ----

    def add_lines(self, batch_id: str, rows: list[tuple[int, str | None, str, str | None,
                                                         str | None]]) -> None:
        """rows: (line, custom_id, state, request, result); kept if already there (a restart
        that validates again)."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR IGNORE INTO lines VALUES (?, ?, ?, ?, ?, ?)",
                                [(batch_id, *row) for row in rows])

    def pending(self, batch_id: str, skip: set[int], limit: int) -> list[tuple[int, str, str]]:
        """Up to `limit` lines still to run, in order, other than `skip`: (line, custom_id,
        request)."""
        rows = self.db.execute("SELECT line, custom_id, request FROM lines WHERE batch_id = ? "
                               "AND state = 'pending' ORDER BY line LIMIT ?",
                               (batch_id, limit + len(skip))).fetchall()
        return [(r[0], r[1], r[2]) for r in rows if r[0] not in skip][:limit]

    def finish_line(self, batch_id: str, line: int, state: str, result: str) -> None:
        """Record a line's answer; only the first one counts (a line run twice writes once)."""
        self.db.execute("UPDATE lines SET state = ?, result = ?, request = NULL WHERE "
                        "batch_id = ? AND line = ? AND state = 'pending'",
                        (state, result, batch_id, line))

    def fail_pending(self, batch_id: str, results: list[tuple[int, str]]) -> int:
        """Record (line, error line) for lines that will not run (the batch ended first);
        how many were still pending."""
        with self.db:
            self.db.execute("BEGIN")
            return self.db.executemany(
                "UPDATE lines SET state = 'failed', result = ?, request = NULL WHERE "
                "batch_id = ? AND line = ? AND state = 'pending'",
                [(result, batch_id, line) for line, result in results]).rowcount

    def outcomes(self) -> dict[str, int]:
        """The kept lines by outcome, as surge_batch_lines_total counts them: done, pending,
        failed (answered with an error), invalid (refused when read), cancelled, expired."""
        rows = self.db.execute(
            "SELECT CASE WHEN state != 'failed' THEN state"
            " WHEN json_extract(result, '$.response') IS NOT NULL THEN 'failed'"
            " WHEN json_extract(result, '$.error.code') = 'batch_cancelled' THEN 'cancelled'"
            " WHEN json_extract(result, '$.error.code') = 'batch_expired' THEN 'expired'"
            " ELSE 'invalid' END AS outcome, count(*) FROM lines GROUP BY outcome")
        return dict(rows.fetchall())

    def usage(self, batch_id: str) -> dict:
        """OpenAI's batch usage: the tokens of the lines answered (their usage summed)."""
        fields = ("prompt_tokens", "completion_tokens", "prompt_tokens_details.cached_tokens",
                  "completion_tokens_details.reasoning_tokens")
        sums = self.db.execute(
            "SELECT " + ", ".join(f"coalesce(sum(json_extract(result, '$.response.body.usage."
                                  f"{name}')), 0)" for name in fields) +
            " FROM lines WHERE batch_id = ? AND state = 'done'", (batch_id,)).fetchone()
        prompt, completion, cached, reasoning = sums
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": prompt + completion}

    def counts(self, batch_id: str | None = None) -> dict[str, int]:
        """Lines by state, of one batch or of all that are kept."""
        where, args = ("WHERE batch_id = ?", (batch_id,)) if batch_id else ("", ())
        rows = self.db.execute(f"SELECT state, count(*) FROM lines {where} GROUP BY state",
                               args).fetchall()
        return dict(rows)

    def results(self, batch_id: str, state: str) -> Iterator[str]:
        rows = self.db.execute("SELECT result FROM lines WHERE batch_id = ? AND state = ? "
                               "ORDER BY line", (batch_id, state))
        return (r[0] for r in rows)

    def pending_ids(self, batch_id: str) -> Iterator[tuple[int, str | None]]:
        rows = self.db.execute("SELECT line, custom_id FROM lines WHERE batch_id = ? "
                               "AND state = 'pending' ORDER BY line", (batch_id,))
        return ((r[0], r[1]) for r in rows)

    # ---- webhook outbox ----

    def due(self, now: float, limit: int) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM outbox WHERE state = 'pending' AND next_at <= ? "
                               "ORDER BY next_at LIMIT ?", (now, limit)).fetchall()

    def delivered(self, event_id: str, url: str, state: str, attempts: int,
                  next_at: float) -> None:
        self.db.execute("UPDATE outbox SET state = ?, attempts = ?, next_at = ? "
                        "WHERE event_id = ? AND url = ?", (state, attempts, next_at,
                                                           event_id, url))
