"""Where the result cache keeps its entries: this process's memory (LRU by bytes, TTL) or a
Redis server that several surge instances share (TTL). Neither ever raises to its caller."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from surge import metrics

log = logging.getLogger("surge.result_cache")
T = TypeVar("T")


class Store(Protocol):
    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes) -> bool:
        """Whether the entry was kept."""


class MemoryStore:
    """Entries in this process, least recently used first out past max_bytes."""

    def __init__(self, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # value, expiry
        self.bytes = 0

    async def get(self, key: str) -> bytes | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        if entry[1] <= self.clock():
            self._drop(key)
            return None
        self.entries.move_to_end(key)
        return entry[0]

    async def put(self, key: str, value: bytes) -> bool:
        if key in self.entries:
            self._drop(key)
        if len(value) > self.max_bytes:
            return False  # it would push out everything else and still not fit
        self.entries[key] = (value, self.clock() + self.ttl_s)
        self.bytes += len(value)
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
        metrics.result_cache_bytes.set(self.bytes)
        return key in self.entries

    def _drop(self, key: str) -> None:
        self.bytes -= len(self.entries.pop(key)[0])
        metrics.result_cache_bytes.set(self.bytes)


class RedisStore:
    """Entries in Redis with a TTL. A failed call counts an error and answers as a miss; after
    one, Redis is left alone for retry_s (requests go to the engine without waiting on it), and
    each outage is logged once, when it starts, and once more when Redis answers again."""

    def __init__(self, url: str, ttl_s: float, timeout_s: float, retry_s: float) -> None:
        # Imported here: redis pulls in the OpenTelemetry SDK, which a server without Redis
        # (or without --otlp-traces-endpoint) should not load.
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.where = url.split("@")[-1]  # no password in the logs
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        # One retry at once: a pooled connection that a restarted Redis dropped is replaced
        # without counting an outage, and a down server costs two refused connects, no waits.
        self.client = Redis.from_url(url, socket_connect_timeout=timeout_s,
                                     socket_timeout=timeout_s, retry=Retry(NoBackoff(), 1))
        self.down = False
        self.retry_at = 0.0

    async def get(self, key: str) -> bytes | None:
        return await self._call("get", lambda: self.client.get(key))

    async def put(self, key: str, value: bytes) -> bool:
        return bool(await self._call("put", lambda: self.client.set(key, value, px=self.ttl_ms)))

    async def _call(self, operation: str, call: Callable[[], Awaitable[T]]) -> T | None:
        if self.down and time.monotonic() < self.retry_at:
            return None
        try:
            result = await asyncio.wait_for(call(), self.timeout_s)
        except Exception as e:  # noqa: BLE001 (whatever Redis does, the request goes on)
            metrics.result_cache_errors.labels(operation).inc()
            self.retry_at = time.monotonic() + self.retry_s
            if not self.down:
                self.down = True
                log.warning("result cache: Redis at %s failed (%s: %s); answering from the "
                            "engine until it is back", self.where, type(e).__name__, e)
            return None
        if self.down:
            self.down = False
            log.info("result cache: Redis at %s answers again", self.where)
        return result
