"""The webhook delivery loop on a real store and a real receiver: one event that cannot be
sent is retried and logged by its id, and the other tenants' events still go out."""

from __future__ import annotations

import asyncio
import logging
import time

import openai

from server.batch_store import BatchStore
from server.webhooks import Webhooks
from surge.config import BatchConfig, TenantConfig
from tests.test_batch import SECRET
from tests.webhook_receiver import Receiver


def test_one_failing_delivery_never_stops_the_others(tmp_path, caplog):
    receiver = Receiver()
    store = BatchStore(str(tmp_path))
    # Built directly, not loaded: the load refuses such a secret, this is the loop's own guard.
    tenants = {"good": TenantConfig(webhook_secret=SECRET),
               "bad": TenantConfig(webhook_secret="whsec_not base64!")}
    webhooks = Webhooks(store, tenants, BatchConfig(webhook_backoff_s=60))
    store.db.executemany("INSERT INTO outbox (event_id, url, tenant, payload, next_at, state) "
                         "VALUES (?, ?, ?, ?, 0, 'pending')",
                         [("evt_bad", receiver.url, "bad", '{"id": "evt_bad"}'),
                          ("evt_good", receiver.url, "good", '{"id": "evt_good"}')])

    async def deliver_a_while() -> None:
        task = asyncio.create_task(webhooks.run())
        deadline = time.monotonic() + 10
        while not receiver.of("evt_good") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not task.done(), "the delivery loop ended"
        task.cancel()

    try:
        with caplog.at_level(logging.ERROR, logger="surge.webhooks"):
            asyncio.run(deliver_a_while())
        [(payload, headers, status)] = receiver.of("evt_good")
        assert status == 200
        client = openai.OpenAI(api_key="none", base_url="http://127.0.0.1:9")
        assert client.webhooks.unwrap(payload, headers, secret=SECRET).id == "evt_good"
        assert receiver.of("evt_bad") == []
        rows = {r["event_id"]: r for r in store.db.execute("SELECT * FROM outbox")}
        assert rows["evt_good"]["state"] == "delivered"
        # The bad one is an attempt that failed: retried after the backoff, given up in time.
        assert rows["evt_bad"]["state"] == "pending" and rows["evt_bad"]["attempts"] == 1
        assert rows["evt_bad"]["next_at"] > time.time() + 30
        assert any("evt_bad" in r.getMessage() for r in caplog.records)
    finally:
        store.close()
        receiver.close()
