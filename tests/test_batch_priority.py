"""Batch lines enter the scheduler at --batch-priority: on a server running one sequence at a
time, they queue labelled with it, and an interactive request overtakes the queued lines."""

from __future__ import annotations

import sqlite3
import time

import openai
import pytest

from tests.server import ServerProcess
from tests.test_batch import chat_line, run_batch, wait_done


@pytest.mark.slow
def test_interactive_requests_overtake_queued_batch_lines(tmp_path):
    server = ServerProcess("--state-dir", str(tmp_path), "--max-num-seqs", "1",
                           "--batch-max-in-flight", "4").wait_ready()
    try:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        lines = [chat_line(f"b{i}", f"Tell a story about {i}.", max_tokens=12)
                 for i in range(6)]
        batch_id = run_batch(c, lines).id
        deadline = time.monotonic() + 60
        waiting = {"model_name": "SmolLM2-135M-Instruct", "priority": "100",
                   "tenant": "default", "replica": "0"}
        while server.metric("surge_waiting_requests", **waiting) < 3:
            assert time.monotonic() < deadline, "no batch line waited at priority 100"
            time.sleep(0.05)

        def done() -> int:
            with sqlite3.connect(tmp_path / "batches.sqlite3") as db:
                return db.execute("SELECT count(*) FROM lines WHERE state = 'done'").fetchone()[0]

        before = done()
        answer = c.chat.completions.create(model=None,  # type: ignore[call-overload]
                                           **chat_line("i", "Hi")["body"])
        overtaken = done() - before
        assert answer.choices[0].message.content
        # Behind the 3 queued lines (first come, first served) it would have waited for them.
        assert overtaken <= 1, f"{overtaken} batch lines finished before the interactive one"
        c.batches.cancel(batch_id)  # the rest is not this test's business
        assert wait_done(c, batch_id).status == "cancelled"
    finally:
        server.stop()
