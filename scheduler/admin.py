"""Live parameters: `surge admin get/set/stats` (and reloads) answered between two steps."""

from __future__ import annotations

from typing import Any

import msgspec

from surge.config import SpeculativeConfig, SurgeConfig, TenantConfig
from surge.protocol import AdminReply, AdminRequest, EngineStats

# What can change while serving, by section; the rest (block_size, kv_cache_memory, the draft
# model) shapes memory or what the workers load. Every field of a tenant is live too, as
# tenants.NAME.FIELD.
LIVE: dict[str, tuple[str, ...]] = {
    "scheduler": ("max_num_seqs", "max_num_batched_tokens", "batch_wait_ms", "prefix_cache",
                  "async_scheduling", "length_bucketing", "policy", "priority_preemption",
                  "priority_aging_s", "interactive_step_ms", "max_queued_requests",
                  "max_queued_tokens"),
    "speculative": ("speculative_method", "num_speculative_tokens", "ngram_max", "ngram_min",
                    "speculative_max_batch", "speculative_min_acceptance"),
}
SECTION = {name: section for section, names in LIVE.items() for name in names}


def live_values(cfg: SurgeConfig) -> dict[str, Any]:
    values: dict[str, Any] = {name: getattr(getattr(cfg, section), name)
                              for name, section in SECTION.items()}
    for name, tenant in cfg.tenants.items():
        for field, value in msgspec.to_builtins(tenant).items():
            values[f"tenants.{name}.{field}"] = value
    return values


def flatten(cfg: SurgeConfig) -> dict[str, str]:
    """Every live value as the text `set` takes (what a reload hands over)."""
    return {k: str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in live_values(cfg).items()}


def updated(cfg: SurgeConfig, values: dict[str, str]) -> SurgeConfig | str:
    """The configuration with values applied, or why not (then nothing changes)."""
    own: dict[str, dict[str, str]] = {section: {} for section in LIVE}
    per_tenant: dict[str, dict[str, str]] = {}
    for key, value in values.items():
        section, _, rest = key.partition(".")
        name, _, field = rest.rpartition(".")
        if section == "tenants" and name and field:
            if field not in TenantConfig.__struct_fields__:
                return (f"{key}: a tenant has no {field!r}; its fields: "
                        f"{', '.join(TenantConfig.__struct_fields__)}")
            per_tenant.setdefault(name, {})[field] = value
        elif key in SECTION:
            own[SECTION[key]][key] = value
        else:
            known = any(key in getattr(cfg, s).__struct_fields__ for s in ("scheduler", "model",
                                                                            "speculative"))
            return (f"{key} {'needs a restart' if known else 'is not a parameter'}; "
                    f"live parameters: {', '.join(SECTION)}, tenants.NAME.FIELD")
    try:
        sections = {section: msgspec.convert({**msgspec.to_builtins(getattr(cfg, section)),
                                              **fields}, type(getattr(cfg, section)),
                                             strict=False)
                    for section, fields in own.items()}
        new_tenants = dict(cfg.tenants)
        for name, fields in per_tenant.items():
            base = msgspec.to_builtins(cfg.tenants.get(name) or TenantConfig())
            new_tenants[name] = msgspec.convert({**base, **fields}, TenantConfig, strict=False)
    except msgspec.ValidationError as e:
        return f"invalid value: {e}"
    speculative: SpeculativeConfig = sections["speculative"]
    if problem := speculative.problem():
        return problem
    return msgspec.structs.replace(cfg, **sections, tenants=new_tenants)


def handle(request: AdminRequest, cfg: SurgeConfig, stats: EngineStats
           ) -> tuple[AdminReply, SurgeConfig]:
    """The reply, and the configuration from now on."""
    if request.command == "get":
        return AdminReply(True, "live parameters", live_values(cfg)), cfg
    if request.command == "stats":
        return AdminReply(True, "engine stats", msgspec.structs.asdict(stats)), cfg
    if request.command == "set":
        new = updated(cfg, request.values)
        if isinstance(new, str):
            return AdminReply(False, new, live_values(cfg)), cfg
        return AdminReply(True, "applied at this step boundary", live_values(new)), new
    return AdminReply(False, f"unknown command {request.command!r}"), cfg
