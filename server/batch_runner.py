"""Runs batches: validates the input file into lines, feeds them to the engine a bounded number
at a time through the endpoints' own path, records each answer as it arrives, and writes the
output and error files when the batch ends (completed, expired or cancelled)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from contextlib import suppress
from pathlib import Path

from server.app import Frontend
from server.batch_lines import FileError, output_line, read_lines
from server.batch_store import ACTIVE, TERMINAL, BatchStore
from server.errors import ApiError, error_body, too_large
from server.openai_types import ChatCompletionRequest, CompletionRequest
from server.webhooks import Webhooks
from surge import metrics
from surge.config import BatchConfig

log = logging.getLogger("surge.batch")

ENDPOINTS = {"/v1/chat/completions": ("chat", ChatCompletionRequest),
             "/v1/completions": ("completion", CompletionRequest)}
_RETRYABLE = (429, 503)  # quotas, queue bounds, a restarting engine: the line waits, not fails
_TIDY_EVERY_S = 60.0
OUTCOMES = ("done", "failed", "invalid", "cancelled", "expired")  # surge_batch_lines_total's


class BatchRunner:
    def __init__(self, store: BatchStore, frontend: Frontend, webhooks: Webhooks,
                 cfg: BatchConfig) -> None:
        self.store = store
        self.frontend = frontend
        self.webhooks = webhooks
        self.cfg = cfg
        self.slots = asyncio.Semaphore(cfg.batch_max_in_flight)
        self.tasks: dict[str, asyncio.Task] = {}  # batch id -> the task driving it
        self.wake = asyncio.Event()
        for outcome in OUTCOMES:  # each series at 0 from the start
            metrics.batch_lines.labels(outcome)

    def stats(self) -> dict:
        """Batches by state and the kept lines: lines_failed is every way a line ends in the
        error file, lines_by_outcome splits them as surge_batch_lines_total does."""
        lines = self.store.outcomes()
        return {"by_state": self.store.by_state(), "lines_done": lines.get("done", 0),
                "lines_failed": sum(n for k, n in lines.items() if k not in ("done", "pending")),
                "lines_pending": lines.get("pending", 0), "lines_by_outcome": lines}

    async def run(self) -> None:
        """Forever: start or stop each active batch's task, expire late ones, tidy old state."""
        tidied = 0.0
        try:
            while True:
                now = time.time()
                for batch in self.store.active():
                    self._advance(batch, now)
                self._gauges()
                if now - tidied > _TIDY_EVERY_S:
                    tidied = now
                    if gone := self.store.remove_old(now - self.cfg.batch_retention_s):
                        log.info("removed %d batches and files past retention", gone)
                self.wake.clear()
                with suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), 1.0)
        finally:
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def _advance(self, batch: dict, now: float) -> None:
        batch_id, status = batch["id"], batch["status"]
        task = self.tasks.get(batch_id)
        if status == "cancelling":
            end = "cancelled"
        elif status in ("validating", "in_progress") and now >= batch["expires_at"]:
            end = "expired"
        elif task is None:
            self._start(batch_id, self._drive(batch_id))
            return
        else:
            return
        if task is None or task.get_name() != "stop":
            self._start(batch_id, self._stop(batch_id, task, end), name="stop")

    def _start(self, batch_id: str, work: object, name: str = "drive") -> None:
        task = asyncio.create_task(work, name=name)  # type: ignore[arg-type]
        self.tasks[batch_id] = task
        task.add_done_callback(lambda t: self._done(batch_id, t))

    def _done(self, batch_id: str, task: asyncio.Task) -> None:
        if self.tasks.get(batch_id) is task:
            del self.tasks[batch_id]
        if not task.cancelled() and (e := task.exception()) is not None:
            log.error("batch %s: %r", batch_id, e, exc_info=e)
        self.wake.set()

    def _gauges(self) -> None:
        counts = self.store.by_state()
        for state in ACTIVE + TERMINAL:
            metrics.batches.labels(state).set(counts.get(state, 0))

    # ---- one batch ----

    async def _drive(self, batch_id: str) -> None:
        batch = self.store.batch(None, batch_id)
        assert batch is not None
        if batch["status"] == "validating":
            batch = await self._validate(batch)
        if batch is not None and batch["status"] == "in_progress":
            await self._feed(batch)
            batch = self.store.update(batch_id, ("in_progress",), status="finalizing",
                                      finalizing_at=int(time.time()))
        if batch is not None and batch["status"] == "finalizing":
            await self._finish(batch, "completed")

    async def _stop(self, batch_id: str, task: asyncio.Task | None, end: str) -> None:
        """Cancel or expire: stop feeding (lines in flight are aborted), then end the batch."""
        if task is not None:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        batch = self.store.batch(None, batch_id)
        assert batch is not None
        if batch["status"] not in TERMINAL:
            log.info("batch %s %s", batch_id, end, extra={"batch_id": batch_id})
            await self._finish(batch, end)

    async def _validate(self, batch: dict) -> dict | None:
        """Read the input file into lines; the batch in progress (or failed), None if it was
        cancelled meanwhile."""
        path = self.store.path(batch["input_file_id"])
        try:
            rows = await asyncio.to_thread(read_lines, path, batch["id"], batch["endpoint"],
                                           self.cfg.batch_max_lines)
            if not rows:
                raise ValueError("the input file has no lines")
        except (OSError, ValueError) as e:
            message = "the input file is gone" if isinstance(e, FileNotFoundError) else str(e)
            tenant = self.store.owner(batch["id"])
            error = ({"code": e.code, "message": message, "param": e.param, "line": e.line}
                     if isinstance(e, FileError) else
                     {"code": "invalid_file", "message": message, "param": "input_file_id",
                      "line": None})
            errors = {"object": "list", "data": [error]}
            failed = self.store.update(batch["id"], ("validating",),
                                       lambda b: self.webhooks.events(tenant, b),
                                       status="failed", failed_at=int(time.time()),
                                       errors=errors)
            self.webhooks.wake.set()
            log.info("batch %s failed: %s", batch["id"], message,
                     extra={"batch_id": batch["id"]})
            return failed
        self.store.add_lines(batch["id"], rows)
        metrics.batch_lines.labels("invalid").inc(sum(1 for r in rows if r[2] == "failed"))
        started = self.store.update(batch["id"], ("validating",), status="in_progress",
                                    in_progress_at=int(time.time()),
                                    request_counts=self._counts(batch["id"]))
        log.info("batch %s in progress: %d lines", batch["id"], len(rows),
                 extra={"batch_id": batch["id"]})
        return started

    async def _feed(self, batch: dict) -> None:
        """Run the pending lines, at most batch_max_in_flight at a time over all batches;
        returns when none is left."""
        batch_id = batch["id"]
        tenant = self.store.owner(batch_id)
        in_flight: dict[int, asyncio.Task] = {}
        try:
            while True:
                if self.frontend.draining:  # lines left now run after the restart
                    await asyncio.sleep(0.5)
                    continue
                lines = self.store.pending(batch_id, set(in_flight), self.cfg.batch_max_in_flight)
                if not lines:
                    if not in_flight:
                        return
                    await asyncio.wait(list(in_flight.values()),
                                       return_when=asyncio.FIRST_COMPLETED)
                    continue
                for line, custom_id, request in lines:
                    await self.slots.acquire()
                    task = asyncio.create_task(self._line(batch, tenant, line, custom_id,
                                                          request))
                    in_flight[line] = task
                    task.add_done_callback(lambda _, n=line: (in_flight.pop(n, None),
                                                              self.slots.release()))
        finally:
            for task in in_flight.values():
                task.cancel()
            await asyncio.gather(*in_flight.values(), return_exceptions=True)

    async def _line(self, batch: dict, tenant: str, line: int, custom_id: str,
                    request: str) -> None:
        """One line, answered as its endpoint answers it; recorded once, when it ends."""
        rid = None
        while True:
            try:
                body, rid = await self._answer(batch["endpoint"], request, tenant)
                status = 200
            except ApiError as e:
                if e.status in _RETRYABLE:
                    await asyncio.sleep(min(e.retry_after or 1.0, 30.0))
                    continue
                status, body = e.status, error_body(e.status, e.message, e.param, e.code)
            except Exception:
                log.exception("batch %s line %d failed", batch["id"], line,
                              extra={"batch_id": batch["id"]})
                status, body = 500, error_body(500, "internal error; see the server log")
            break
        outcome = "done" if status == 200 else "failed"
        result = output_line(batch["id"], line, custom_id,
                             {"status_code": status, "request_id": rid, "body": body}, None)
        self.store.finish_line(batch["id"], line, outcome, json.dumps(result))
        metrics.batch_lines.labels(outcome).inc()
        # As each line ends, as OpenAI's request_counts move (progress bars read them).
        self.store.update(batch["id"], ("in_progress",), request_counts=self._counts(batch["id"]))

    async def _answer(self, endpoint: str, request: str, tenant: str) -> tuple[dict, str]:
        kind, kind_type = ENDPOINTS[endpoint]
        translator = self.frontend.translator
        raw = request.encode()
        # The endpoint's own limit (its 413), before any decoding or tokenizing of the body.
        if len(raw) > (limit := self.frontend.cfg.max_body_bytes):
            raise ApiError(413, too_large(limit), param="body")
        body = translator.decode_body(raw, kind_type)
        if body.stream:
            raise ApiError(400, "stream is not supported in a batch", param="stream")
        # A line may ask to be less urgent than the batch class, never more.
        body.priority = max(body.priority if body.priority is not None else 0,
                            self.cfg.batch_priority)
        response = await self.frontend.respond(body, kind, tenant, None,
                                               *await translator.prepare(body))
        return json.loads(response.body), response.headers["X-Request-Id"]

    async def _finish(self, batch: dict, end: str) -> None:
        """Write the output and error files, then the batch's end state and its events."""
        batch_id = batch["id"]
        tenant = self.store.owner(batch_id)
        if end != "completed":  # lines that never ran go to the error file, each once
            code = "batch_expired" if end == "expired" else "batch_cancelled"
            unrun = [(line, json.dumps(output_line(batch_id, line, custom_id, None, {
                "code": code, "message": f"the batch was {end} before this line was answered",
                "line": line}))) for line, custom_id in self.store.pending_ids(batch_id)]
            metrics.batch_lines.labels(end).inc(self.store.fail_pending(batch_id, unrun))
        output = list(self.store.results(batch_id, "done"))
        errors = list(self.store.results(batch_id, "failed"))
        ids = {}
        for kind, lines in (("output", output), ("error", errors)):
            if not lines:
                continue
            file_id = "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]
            size = await asyncio.to_thread(_write, self.store.path(file_id), lines)
            self.store.add_file(tenant, file_id, "batch_output", f"{batch_id}_{kind}.jsonl",
                                size, self.store.output_expires_s(batch_id))
            ids[f"{kind}_file_id"] = file_id
        counts = {"total": len(output) + len(errors), "completed": len(output),
                  "failed": len(errors)}
        self.store.update(batch_id, ACTIVE, lambda b: self.webhooks.events(tenant, b),
                          **ids, status=end, request_counts=counts,
                          usage=self.store.usage(batch_id),
                          **{f"{end}_at": int(time.time())})
        self.webhooks.wake.set()
        log.info("batch %s %s: %d done, %d failed", batch_id, end, len(output), len(errors),
                 extra={"batch_id": batch_id, "tenant": tenant})

    def _counts(self, batch_id: str) -> dict[str, int]:
        counts = self.store.counts(batch_id)
        return {"total": sum(counts.values()), "completed": counts.get("done", 0),
                "failed": counts.get("failed", 0)}


def _write(path: Path, lines: list[str]) -> int:
    """Write the lines to path atomically (a crash leaves the old file or the whole new one)."""
    data = "".join(line + "\n" for line in lines).encode()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(data)
