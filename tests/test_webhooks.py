"""The webhook delivery loop on a real store and a real receiver: one event that cannot be
sent is retried and logged by its id, and the other tenants' events still go out."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time

from server.batch_store import BatchStore
from server.webhooks import Webhooks, event_id
from surge.config import BatchConfig, TenantConfig
from tests.test_batch import SECRET
from tests.webhook_receiver import Receiver


def test_one_failing_delivery_never_stops_the_others(tmp_path, caplog):
    receiver = Receiver(SECRET)
    store = BatchStore(str(tmp_path), 86400)
    # Built directly, not loaded: the load refuses such a secret, this is the loop's own guard.
    tenants = {"good": TenantConfig(webhook_urls=receiver.url, webhook_secret=SECRET),
               "bad": TenantConfig(webhook_urls=receiver.url,
                                   webhook_secret="whsec_not base64!")}
    webhooks = Webhooks(store, lambda: tenants, BatchConfig(webhook_backoff_s=60))
    for tenant in ("bad", "good"):
        store.add_batch(tenant, {"id": f"batch_{tenant}", "status": "in_progress"})
        store.update(f"batch_{tenant}", ("in_progress",),
                     lambda b, t=tenant: webhooks.events(t, b), status="completed")
    bad, good = (event_id(f"batch_{t}", "batch.completed") for t in ("bad", "good"))

    def state(eid: str) -> sqlite3.Row:
        return store.db.execute("SELECT * FROM outbox WHERE event_id = ?", (eid,)).fetchone()

    async def deliver_a_while() -> None:
        task = asyncio.create_task(webhooks.run())
        deadline = time.monotonic() + 10
        while state(good)["state"] == "pending" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not task.done(), "the delivery loop ended"
        task.cancel()

    try:
        with caplog.at_level(logging.ERROR, logger="surge.webhooks"):
            asyncio.run(deliver_a_while())
        assert receiver.events == [("batch.completed", "batch_good", 200)]  # verified
        assert state(good)["state"] == "delivered" and receiver.of(bad) == []
        # The bad one is an attempt that failed: retried after the backoff, given up in time.
        assert state(bad)["state"] == "pending" and state(bad)["attempts"] == 1
        assert state(bad)["next_at"] > time.time() + 30
        assert any(bad in r.getMessage() for r in caplog.records)
    finally:
        store.close()
        receiver.close()
