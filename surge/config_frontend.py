"""The frontend's own features' configuration sections (the result cache, the Batch API);
surge/config.py gathers them into SurgeConfig."""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING, Annotated

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


def tenants_problem(tenants: dict[str, TenantConfig], batch: BatchConfig) -> str | None:
    """What makes the tenants unusable with the Batch API, if anything (checked at start and
    on set): a webhook secret that signs nothing, or a tenant whose own requests would be
    less urgent than its batch lines."""
    from surge.config import TenantConfig  # surge.config imports this module

    # Requests of no named tenant (no API keys, or a key without a table) run as the default.
    for name, tenant in {"(default)": TenantConfig(), **tenants}.items():
        if tenant.webhook_secret:
            try:
                webhook_key(tenant.webhook_secret)
            except ValueError as e:
                return f"tenants.{name}.webhook_secret: {e}"
        if tenant.priority >= batch.batch_priority:
            return (f"tenants.{name}.priority={tenant.priority} is not below "
                    f"batch_priority={batch.batch_priority}: batch lines must be less urgent "
                    f"than every tenant's own requests; lower the tenant's priority or raise "
                    f"--batch-priority")
    return None
