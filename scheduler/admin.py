"""Live parameters: `surge admin get/set/stats` (and reloads) answered between two steps."""

from __future__ import annotations

from typing import Any

import msgspec

from surge.config import SchedulerConfig, TenantConfig
from surge.protocol import AdminReply, AdminRequest

# What can change while serving; the rest (block_size, kv_cache_memory) shapes memory. Every
# field of a tenant is live too, as tenants.NAME.FIELD.
LIVE = ("max_num_seqs", "max_num_batched_tokens", "batch_wait_ms", "prefix_cache",
        "async_scheduling", "length_bucketing", "policy", "priority_preemption",
        "priority_aging_s", "interactive_step_ms", "max_queued_requests", "max_queued_tokens")

Tenants = dict[str, TenantConfig]


def live_values(cfg: SchedulerConfig, tenants: Tenants) -> dict[str, Any]:
    values: dict[str, Any] = {name: getattr(cfg, name) for name in LIVE}
    for name, tenant in tenants.items():
        for field, value in msgspec.to_builtins(tenant).items():
            values[f"tenants.{name}.{field}"] = value
    return values


def flatten(cfg: SchedulerConfig, tenants: Tenants) -> dict[str, str]:
    """Every live value as the text `set` takes (what a reload hands over)."""
    return {k: str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in live_values(cfg, tenants).items()}


def updated(cfg: SchedulerConfig, tenants: Tenants, values: dict[str, str]
            ) -> tuple[SchedulerConfig, Tenants] | str:
    """The configuration with values applied, or why not (then nothing changes)."""
    own: dict[str, str] = {}
    per_tenant: dict[str, dict[str, str]] = {}
    for key, value in values.items():
        section, _, rest = key.partition(".")
        name, _, field = rest.rpartition(".")
        if section == "tenants" and name and field:
            if field not in TenantConfig.__struct_fields__:
                return (f"{key}: a tenant has no {field!r}; its fields: "
                        f"{', '.join(TenantConfig.__struct_fields__)}")
            per_tenant.setdefault(name, {})[field] = value
        elif key in LIVE:
            own[key] = value
        else:
            known = key in SchedulerConfig.__struct_fields__
            return (f"{key} {'needs a restart' if known else 'is not a parameter'}; "
                    f"live parameters: {', '.join(LIVE)}, tenants.NAME.FIELD")
    try:
        new_cfg = msgspec.convert({**msgspec.to_builtins(cfg), **own}, SchedulerConfig,
                                  strict=False)
        new_tenants = dict(tenants)
        for name, fields in per_tenant.items():
            base = msgspec.to_builtins(tenants.get(name) or TenantConfig())
            new_tenants[name] = msgspec.convert({**base, **fields}, TenantConfig, strict=False)
    except msgspec.ValidationError as e:
        return f"invalid value: {e}"
    return new_cfg, new_tenants


def handle(request: AdminRequest, cfg: SchedulerConfig, tenants: Tenants,
           stats: dict[str, Any]) -> tuple[AdminReply, SchedulerConfig, Tenants]:
    """The reply, and the configuration from now on."""
    if request.command == "get":
        return AdminReply(True, "live parameters", live_values(cfg, tenants)), cfg, tenants
    if request.command == "stats":
        return AdminReply(True, "engine stats", stats), cfg, tenants
    if request.command == "set":
        new = updated(cfg, tenants, request.values)
        if isinstance(new, str):
            return AdminReply(False, new, live_values(cfg, tenants)), cfg, tenants
        return AdminReply(True, "applied at this step boundary", live_values(*new)), *new
    return AdminReply(False, f"unknown command {request.command!r}"), cfg, tenants
