"""The live parameters: what `surge admin get/set` and a reload change while serving, their
values as shown, and what a tenant without a table of its own inherits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec import Struct

from surge.config import SECTIONS, TABLES, SurgeConfig
from surge.config_frontend import RoutingConfig
from surge.config_overload import OverloadConfig

# The entry whose values a name without a table of its own has ([tenants.default]), but for
# its webhooks: a tenant's batch events go only to receivers it names itself.
INHERITED = {"tenants": "default"}
_OWN_FIELDS = frozenset({"webhook_urls", "webhook_secret", "webhook_from_metadata"})


def inherited(table: str, entries: Mapping[str, Any]) -> dict[str, Any]:
    """The values a new [table.NAME] starts from: its default entry's that are not each
    entry's own (nothing where the table has no default entry)."""
    default = entries.get(INHERITED.get(table, ""))
    if default is None:
        return {}
    values = msgspec.to_builtins(default) if isinstance(default, Struct) else dict(default)
    return {k: v for k, v in values.items() if k not in _OWN_FIELDS}


# What can change while serving, by section; the rest (block_size, kv_cache_memory, the draft
# model) shapes memory or what the workers load. Every field of a tenant or a pool is live too,
# as tenants.NAME.FIELD and pools.NAME.FIELD.
LIVE: dict[str, tuple[str, ...]] = {
    "scheduler": ("max_num_seqs", "max_num_batched_tokens", "batch_wait_ms", "prefix_cache",
                  "async_scheduling", "length_bucketing", "policy", "priority_preemption",
                  "priority_aging_s", "interactive_step_ms", "max_queued_requests",
                  "max_queued_tokens"),
    "speculative": ("speculative_method", "num_speculative_tokens", "ngram_max", "ngram_min",
                    "speculative_max_batch", "speculative_min_acceptance"),
    "overload": tuple(OverloadConfig.__struct_fields__),
    "routing": tuple(RoutingConfig.__struct_fields__),
}
LIVE_SECTION = {name: section for section, names in LIVE.items() for name in names}


def with_live(cfg: SurgeConfig, new: SurgeConfig) -> SurgeConfig:
    """cfg with new's live parameters (a reload's) and its own others, which only a restart
    applies (a worker restarted later must size its KV cache as the running scheduler did)."""
    sections = {section: msgspec.structs.replace(
        getattr(cfg, section), **{name: getattr(getattr(new, section), name) for name in names})
        for section, names in LIVE.items()}
    return msgspec.structs.replace(cfg, **sections, **{t: getattr(new, t) for t in TABLES})


def restart_only(old: SurgeConfig, new: SurgeConfig) -> list[str]:
    """The options new gives another value than old and that only a restart applies."""
    return [name for section in SECTIONS
            for name, value in msgspec.structs.asdict(getattr(new, section)).items()
            if name not in LIVE_SECTION and value != getattr(getattr(old, section), name)]


def live_values(cfg: SurgeConfig) -> dict[str, Any]:
    values: dict[str, Any] = {name: getattr(getattr(cfg, section), name)
                              for name, section in LIVE_SECTION.items()}
    for table in TABLES:
        for name, entry in getattr(cfg, table).items():
            for field, value in msgspec.to_builtins(entry).items():
                values[f"{table}.{name}.{field}"] = value
    return values


# Fields whose values get, set, reloads and the logs never show (only whether one is set).
SECRET_FIELDS = frozenset({"webhook_secret"})


def is_secret(key: str) -> bool:
    """Whether a live parameter's name (tenants.NAME.FIELD) is a secret's."""
    return key.rpartition(".")[2] in SECRET_FIELDS


def shown(values: dict[str, Any]) -> dict[str, Any]:
    """Live values as get, set and the logs show them: a secret as "<redacted>" when set."""
    return {k: "<redacted>" if v and is_secret(k) else v for k, v in values.items()}


def flatten(cfg: SurgeConfig) -> dict[str, str]:
    """Every live value as the text `set` takes (what a reload hands over; an unset one, as
    a tenant's min_priority may be, is left out)."""
    return {k: str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in live_values(cfg).items() if v is not None}
