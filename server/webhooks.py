"""Batch events to webhook receivers: signed as Standard Webhooks (what the openai client's
webhooks.unwrap verifies), queued in the store's outbox and delivered at least once, with
backoff, across restarts."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from contextlib import suppress

import aiohttp

from server.batch_store import BatchStore
from server.errors import ApiError
from surge import metrics
from surge.config import BatchConfig, TenantConfig
from surge.config_frontend import is_http_url, webhook_key

log = logging.getLogger("surge.webhooks")
_MAX_BACKOFF_S = 3600.0
_AT_ONCE = 16  # deliveries in flight at a time
RESULTS = ("delivered", "retry", "given_up")  # surge_webhook_deliveries_total's


def sign(secret: str, event_id: str, timestamp: int, payload: str) -> str:
    """The webhook-signature header: HMAC-SHA256 of id.timestamp.payload, keyed by the
    secret (checked when the config was loaded)."""
    mac = hmac.new(webhook_key(secret), f"{event_id}.{timestamp}.{payload}".encode(),
                   hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def event_id(batch_id: str, kind: str) -> str:
    """Stable across restarts and re-finalizing, so a receiver can drop duplicates."""
    return "evt_" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


class Webhooks:
    def __init__(self, store: BatchStore, tenants: Callable[[], dict[str, TenantConfig]],
                 cfg: BatchConfig) -> None:
        self.store = store
        self.tenants = tenants  # the tenants' settings as they are now (surge admin set)
        self.cfg = cfg
        self.wake = asyncio.Event()
        for result in RESULTS:  # each series at 0 from the start
            metrics.webhook_deliveries.labels(result)

    def tenant(self, name: str) -> TenantConfig:
        return self.tenants().get(name) or TenantConfig()

    def check_metadata(self, tenant: str, metadata: dict[str, str] | None) -> None:
        """A webhook_url in a batch's metadata: only where the tenant's config allows it."""
        url = (metadata or {}).get("webhook_url")
        if url is None:
            return
        if not self.tenant(tenant).webhook_from_metadata:
            raise ApiError(400, "metadata.webhook_url is not allowed for this tenant "
                                "(webhook_from_metadata)", param="metadata")
        if not is_http_url(url):
            raise ApiError(400, f"metadata.webhook_url {url!r} is not an http(s) URL",
                           param="metadata")

    def events(self, tenant: str, batch: dict) -> list[tuple[str, str, str, str]]:
        """Outbox rows (event id, url, tenant, payload) for a batch that has just ended."""
        config = self.tenant(tenant)
        urls = config.webhook_urls.split()
        if url := (batch.get("metadata") or {}).get("webhook_url"):
            urls.append(url)
        if not urls:
            return []
        if not config.webhook_secret:
            log.warning("tenant %s has webhook receivers but no webhook_secret: no event sent "
                        "for batch %s", tenant, batch["id"])
            return []
        kind = f"batch.{batch['status']}"
        eid = event_id(batch["id"], kind)
        payload = json.dumps({"id": eid, "object": "event", "type": kind,
                              "created_at": int(time.time()), "data": {"id": batch["id"]}})
        return [(eid, url, tenant, payload) for url in dict.fromkeys(urls)]

    async def run(self) -> None:
        """Forever: deliver what is due, then sleep until more is (or an event is queued)."""
        timeout = aiohttp.ClientTimeout(total=self.cfg.webhook_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                due = self.store.due(time.time(), _AT_ONCE)
                await asyncio.gather(*(self._deliver(session, row) for row in due))
                if len(due) < _AT_ONCE:
                    self.wake.clear()
                    with suppress(TimeoutError):
                        await asyncio.wait_for(self.wake.wait(), 0.5)

    async def _deliver(self, session: aiohttp.ClientSession, row: sqlite3.Row) -> None:
        """One attempt; whatever goes wrong is this event's failure, never the loop's (which
        delivers every tenant's events)."""
        eid, url = row["event_id"], row["url"]
        try:
            problem = await self._post(session, row)
        except Exception as e:
            log.exception("webhook %s to %s raised", eid, url,
                          extra={"event_id": eid, "url": url})
            problem = f"{type(e).__name__}: {e}"
        try:
            self._record(row, problem)
        except Exception:
            log.exception("webhook %s to %s: its attempt was not recorded", eid, url,
                          extra={"event_id": eid, "url": url})

    async def _post(self, session: aiohttp.ClientSession, row: sqlite3.Row) -> str | None:
        """POST the event, signed; None when the receiver took it, else why not."""
        eid, payload = row["event_id"], row["payload"]
        secret = self.tenant(row["tenant"]).webhook_secret
        stamp = int(time.time())  # signed afresh each attempt: receivers refuse old stamps
        headers = {"Content-Type": "application/json", "webhook-id": eid,
                   "webhook-timestamp": str(stamp),
                   "webhook-signature": sign(secret, eid, stamp, payload)}
        try:
            async with session.post(row["url"], data=payload.encode(), headers=headers) as r:
                return None if 200 <= r.status < 300 else f"HTTP {r.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return f"{type(e).__name__}: {e}"

    def _record(self, row: sqlite3.Row, problem: str | None) -> None:
        """The attempt's outcome in the outbox: delivered, retried later, or given up."""
        eid, url = row["event_id"], row["url"]
        attempts = row["attempts"] + 1
        if problem is None:
            self.store.delivered(eid, url, "delivered", attempts, time.time())
            metrics.webhook_deliveries.labels("delivered").inc()
            log.info("webhook delivered", extra={"event_id": eid, "url": url})
            return
        if attempts >= self.cfg.webhook_max_attempts:
            self.store.delivered(eid, url, "given_up", attempts, time.time())
            metrics.webhook_deliveries.labels("given_up").inc()
            log.error("webhook %s given up after %d attempts (%s)", eid, attempts, problem,
                      extra={"event_id": eid, "url": url})
            return
        wait = min(self.cfg.webhook_backoff_s * 2 ** (attempts - 1), _MAX_BACKOFF_S)
        self.store.delivered(eid, url, "pending", attempts, time.time() + wait)
        metrics.webhook_deliveries.labels("retry").inc()
        log.warning("webhook %s failed (%s); retry in %.1fs", eid, problem, wait,
                    extra={"event_id": eid, "url": url, "attempt": attempts})
