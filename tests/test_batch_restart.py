"""Restart drills: kill -9 of the whole server mid-batch, then mid-webhook-delivery; each time
a new server on the same --state-dir carries on, losing and duplicating nothing."""

from __future__ import annotations

import json
import sqlite3
import time

import openai
import pytest

from tests.server import ServerProcess
from tests.test_batch import SECRET, chat_line, lines_of, run_batch, wait_done
from tests.webhook_receiver import Receiver

pytestmark = pytest.mark.slow


def start(root, n: int, receiver: Receiver) -> ServerProcess:
    (root / "surge.toml").write_text(f"""
[tenants.default]
webhook_urls = "{receiver.url}"
webhook_secret = "{SECRET}"
""")
    run = root / f"run{n}"  # a fresh runtime dir: the killed server's is left as it was
    run.mkdir()
    return ServerProcess("--config", str(root / "surge.toml"), "--state-dir",
                         str(root / "state"), "--batch-max-in-flight", "4",
                         "--webhook-backoff-s", "0.3",
                         env={"XDG_RUNTIME_DIR": str(run)}).wait_ready()


def done_rows(root) -> dict[str, str]:
    """custom_id -> the answer's request id, of the lines the store holds as done."""
    with sqlite3.connect(root / "state" / "batches.sqlite3") as db:
        rows = db.execute("SELECT custom_id, result FROM lines WHERE state = 'done'").fetchall()
    return {cid: json.loads(result)["response"]["request_id"] for cid, result in rows}


def test_kill_9_mid_batch_and_mid_delivery(tmp_path):
    receiver = Receiver(SECRET, failures=10**6)  # refuses everything until told otherwise
    lines = [chat_line(f"r{i}", f"Tell me about the number {i}.", max_tokens=8)
             for i in range(24)]
    server = start(tmp_path, 1, receiver)
    try:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        batch_id = run_batch(c, lines).id
        deadline = time.monotonic() + 120
        while c.batches.retrieve(batch_id).request_counts.completed < 6:
            assert time.monotonic() < deadline, "the batch made no progress"
            time.sleep(0.2)
    finally:
        server.kill_all()
    before = done_rows(tmp_path)
    assert 6 <= len(before) < len(lines), "the kill was not mid-batch"

    server = start(tmp_path, 2, receiver)
    try:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        batch = wait_done(c, batch_id)
        assert batch.status == "completed" and batch.error_file_id is None
        out = lines_of(c, batch.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
        kept = {x["custom_id"]: x["response"]["request_id"] for x in out}
        assert all(kept[cid] == rid for cid, rid in before.items()), "a done line ran again"
        assert all(x["response"]["body"]["choices"][0]["message"]["content"] for x in out)
        deadline = time.monotonic() + 60
        while len(receiver.deliveries) < 2:  # refused twice: the event waits in the outbox
            assert time.monotonic() < deadline, "no webhook delivery was tried"
            time.sleep(0.1)
    finally:
        server.kill_all()

    receiver.failures = 0
    server = start(tmp_path, 3, receiver)
    try:
        deliveries = receiver.wait_for(1)
        assert len({d[1]["webhook-id"] for d in deliveries}) == 1  # one event, retried
        assert receiver.events == [("batch.completed", batch_id, d[2]) for d in deliveries]
        event = c.webhooks.unwrap(deliveries[-1][0], deliveries[-1][1], secret=SECRET)
        assert event.type == "batch.completed" and event.data.id == batch_id
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        assert c.batches.retrieve(batch_id).output_file_id == batch.output_file_id
    finally:
        server.stop()
        receiver.close()
