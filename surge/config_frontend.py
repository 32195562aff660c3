"""The frontend's own features' configuration sections (the result cache, the Batch API);
surge/config.py gathers them into SurgeConfig."""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlsplit

from msgspec import Meta, Struct

if TYPE_CHECKING:
    from surge.config import TenantConfig


class ResultCacheConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """The frontend's exact-match result cache (server/result_cache.py)."""

    result_cache: Annotated[
        str, Meta(pattern=r"^(off|memory|rediss?://.+)$",
                  description="answer repeated deterministic requests (temperature 0 or a "
                  "seed) from a cache: off, memory (this process, LRU by bytes, TTL) or "
                  "redis://HOST:PORT/DB (shared by several surge instances, TTL)")
    ] = "off"
    result_cache_max_bytes: Annotated[
        int, Meta(ge=0, description="the memory backend's bound: least recently used entries "
                  "go first past it")
    ] = 256 * 2**20
    result_cache_ttl_s: Annotated[
        float, Meta(gt=0, description="how long an entry answers (both backends)")
    ] = 3600.0
    result_cache_shared: Annotated[
        bool, Meta(description="share entries between tenants (by default each tenant sees "
                   "only the answers computed for it)")
    ] = False
    result_cache_timeout_s: Annotated[
        float, Meta(gt=0, description="longest a Redis call may take before the request goes "
                    "to the engine instead")
    ] = 0.25
    result_cache_retry_s: Annotated[
        float, Meta(gt=0, description="after a Redis error, requests go straight to the "
                    "engine for this long before Redis is tried again")
    ] = 2.0


class BatchConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """The Files + Batches API (frontend): where its state lives and how lines are fed."""

    state_dir: Annotated[
        str | None, Meta(description="files and batch state (SQLite) live here (unset: "
                         "$STATE_DIRECTORY from systemd, else ~/.local/state/surge)")
    ] = None
    batch_priority: Annotated[
        int, Meta(description="scheduler priority of batch lines (lower is more urgent); "
                  "must be above every tenant's priority, so batches yield")
    ] = 100
    batch_max_in_flight: Annotated[
        int, Meta(ge=1, description="batch lines submitted to the scheduler at once, all "
                  "batches together")
    ] = 8
    batch_max_file_bytes: Annotated[
        int, Meta(ge=1024, description="largest file upload")
    ] = 100 * 2**20
    batch_max_lines: Annotated[int, Meta(ge=1, description="most lines in one batch")] = 50_000
    batch_retention_s: Annotated[
        float, Meta(gt=0, description="files, and batches once finished, are removed after "
                    "this long")
    ] = 30 * 86400.0
    webhook_max_attempts: Annotated[
        int, Meta(ge=1, description="deliveries of one event before it is given up")
    ] = 12
    webhook_backoff_s: Annotated[
        float, Meta(gt=0, description="wait before the first retry of an event; doubles "
                    "after each failure, up to an hour")
    ] = 1.0
    webhook_timeout_s: Annotated[
        float, Meta(gt=0, description="how long a receiver may take to answer")
    ] = 10.0


def webhook_key(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret: the base64 after whsec_, else its bytes.
    ValueError when the base64 is malformed or the key is empty."""
    if not secret.startswith("whsec_"):
        return secret.encode()
    try:
        key = base64.b64decode(secret[6:], validate=True)
    except binascii.Error as e:
        raise ValueError(f"the base64 after whsec_ is malformed ({e})") from None
    if not key:
        raise ValueError("whsec_ is followed by no key")
    return key


def is_http_url(url: str) -> bool:
    """Whether a webhook receiver's URL can be posted to: http(s), with a host."""
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def tenants_problem(tenants: dict[str, TenantConfig], batch: BatchConfig) -> str | None:
    """What makes the tenants unusable with the Batch API, if anything (checked at start and
    on set): a webhook secret that signs nothing or a receiver that is not an http(s) URL, or
    a tenant whose own requests would be less urgent than its batch lines."""
    from surge.config import TenantConfig  # surge.config imports this module

    # Requests of no named tenant (no API keys, or a key without a table) run as the default.
    for name, tenant in {"(default)": TenantConfig(), **tenants}.items():
        if tenant.webhook_secret:
            try:
                webhook_key(tenant.webhook_secret)
            except ValueError as e:
                return f"tenants.{name}.webhook_secret: {e}"
        for url in tenant.webhook_urls.split():
            if not is_http_url(url):
                return f"tenants.{name}.webhook_urls: {url!r} is not an http(s) URL"
        if tenant.priority >= batch.batch_priority:
            return (f"tenants.{name}.priority={tenant.priority} is not below "
                    f"batch_priority={batch.batch_priority}: batch lines must be less urgent "
                    f"than every tenant's own requests; lower the tenant's priority or raise "
                    f"--batch-priority")
        if tenant.min_priority is not None and tenant.min_priority > tenant.priority:
            return (f"tenants.{name}.min_priority={tenant.min_priority} is above its "
                    f"priority={tenant.priority}: its requests that give none would be refused")
    return None


class RoutingConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """How the frontend picks a data-parallel replica for each request (server/router.py);
    all live."""

    route_prefix_blocks: Annotated[
        int, Meta(ge=0, description="the prompt's first KV blocks whose hashes send a request "
                  "to the replica that holds them (0: no prefix affinity, least loaded only)")
    ] = 32
    route_balance_margin: Annotated[
        int, Meta(ge=0, description="a replica holding the prefix is passed over when it has "
                  "this many more requests in flight than the least loaded one")
    ] = 4
    route_spill_waiting: Annotated[
        int, Meta(ge=1, description="a replica pool is saturated when each of its replicas "
                  "has this many requests waiting to start; only then may a request spill to "
                  "a pool that takes its pool's overflow")
    ] = 8


class PoolConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """One [pools.NAME] table: data-parallel replicas that serve a range of priorities. A
    replica in no pool serves every request."""

    replicas: Annotated[
        str, Meta(pattern=r"^\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*$",
                  description="the pool's replicas: indices and ranges, e.g. '0-5' or '6,7'")
    ]
    min_priority: Annotated[
        int, Meta(description="the most urgent priority value it serves (lower is more urgent)")
    ] = -(2**31)
    max_priority: Annotated[
        int, Meta(description="the least urgent priority value it serves (batch lines come at "
                  "batch_priority)")
    ] = 2**31 - 1
    spill_from: Annotated[
        str, Meta(description="space-separated pools whose overflow this pool takes when all "
                  "of their replicas are saturated ('*': any pool)")
    ] = ""

    def members(self) -> list[int]:
        """The replica indices, in order."""
        found: list[int] = []
        for part in self.replicas.replace(" ", "").split(","):
            lo, _, hi = part.partition("-")
            found += range(int(lo), int(hi or lo) + 1)
        return sorted(set(found))


def pools_problem(pools: dict[str, PoolConfig], num_replicas: int) -> str | None:
    """What makes the pools unusable (checked at start and on set), if anything."""
    for name, pool in pools.items():
        if outside := [r for r in pool.members() if r >= num_replicas]:
            return (f"pools.{name}.replicas names replica {outside[0]}, but there are "
                    f"{num_replicas} (0 to {num_replicas - 1}; --data-parallel-size)")
        if pool.min_priority > pool.max_priority:
            return (f"pools.{name}: min_priority {pool.min_priority} is above max_priority "
                    f"{pool.max_priority}: it would serve nothing")
        if unknown := [p for p in pool.spill_from.split() if p != "*" and p not in pools]:
            return (f"pools.{name}.spill_from names no pool {unknown[0]!r}; "
                    f"pools: {', '.join(pools)}")
    return None
