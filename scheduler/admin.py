"""Live parameters: `surge admin get/set/stats` (and reloads) answered between two steps."""

from __future__ import annotations

import msgspec

from surge.config import (
    LIVE,
    LIVE_SECTION,
    SpeculativeConfig,
    SurgeConfig,
    TenantConfig,
    live_values,
)
from surge.config_frontend import tenants_problem
from surge.protocol import AdminReply, AdminRequest, EngineStats


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
        elif key in LIVE_SECTION:
            own[LIVE_SECTION[key]][key] = value
        else:
            known = any(key in getattr(cfg, s).__struct_fields__ for s in ("scheduler", "model",
                                                                            "speculative"))
            return (f"{key} {'needs a restart' if known else 'is not a parameter'}; "
                    f"live parameters: {', '.join(LIVE_SECTION)}, tenants.NAME.FIELD")
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
    if problem := speculative.problem() or tenants_problem(new_tenants, cfg.batch):
        return problem
    return msgspec.structs.replace(cfg, **sections, tenants=new_tenants)


def handle(request: AdminRequest, cfg: SurgeConfig, stats: EngineStats,
           facts: dict[str, str]) -> tuple[AdminReply, SurgeConfig]:
    """The reply, and the configuration from now on. facts: what the engine chose at start
    (the kernel backend), shown by get beside the live parameters."""
    if request.command == "get":
        return AdminReply(True, "live parameters", {**live_values(cfg), **facts}), cfg
    if request.command == "stats":
        return AdminReply(True, "engine stats", msgspec.structs.asdict(stats)), cfg
    if request.command == "set":
        new = updated(cfg, request.values)
        if isinstance(new, str):
            return AdminReply(False, new, live_values(cfg)), cfg
        return AdminReply(True, "applied at this step boundary", live_values(new)), new
    return AdminReply(False, f"unknown command {request.command!r}"), cfg
