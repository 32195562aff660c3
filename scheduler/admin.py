"""Live parameters: `surge admin get/set/stats` (and reloads) answered between two steps."""

from __future__ import annotations

from typing import Any

import msgspec

from surge.config import SchedulerConfig
from surge.protocol import AdminReply, AdminRequest

# What can change while serving; the rest (block_size, kv_cache_memory) shapes memory.
LIVE = ("max_num_seqs", "max_num_batched_tokens", "batch_wait_ms", "prefix_cache",
        "async_scheduling", "length_bucketing")


def live_values(cfg: SchedulerConfig) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in LIVE}


def updated(cfg: SchedulerConfig, values: dict[str, str]) -> SchedulerConfig | str:
    """cfg with values applied, or why not (then nothing changes)."""
    for name in values:
        if name not in LIVE:
            known = name in SchedulerConfig.__struct_fields__
            return (f"{name} {'needs a restart' if known else 'is not a parameter'}; "
                    f"live parameters: {', '.join(LIVE)}")
    try:
        return msgspec.convert({**msgspec.to_builtins(cfg), **values}, SchedulerConfig,
                               strict=False)
    except msgspec.ValidationError as e:
        return f"invalid value: {e}"


def handle(request: AdminRequest, cfg: SchedulerConfig, stats: dict[str, Any]
           ) -> tuple[AdminReply, SchedulerConfig]:
    """The reply, and the configuration from now on."""
    if request.command == "get":
        return AdminReply(True, "live parameters", live_values(cfg)), cfg
    if request.command == "stats":
        return AdminReply(True, "engine stats", stats), cfg
    if request.command == "set":
        new = updated(cfg, request.values)
        if isinstance(new, str):
            return AdminReply(False, new, live_values(cfg)), cfg
        return AdminReply(True, "applied at this step boundary", live_values(new)), new
    return AdminReply(False, f"unknown command {request.command!r}"), cfg
