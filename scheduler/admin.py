"""Live parameters: `surge admin get/set/stats` (and reloads) answered between two steps."""

from __future__ import annotations

import re

import msgspec

from surge.config import SECTIONS, TABLES, SpeculativeConfig, SurgeConfig
from surge.config_frontend import pools_problem, tenants_problem
from surge.config_live import LIVE, LIVE_SECTION, inherited, live_values, shown
from surge.config_load import oversized
from surge.protocol import AdminReply, AdminRequest, EngineStats


def updated(cfg: SurgeConfig, values: dict[str, str], whole: bool = False) -> SurgeConfig | str:
    """The configuration with values applied, or why not (then nothing changes). whole (a
    reload): the values' tenants and pools are all there are, as the file now has them."""
    own: dict[str, dict[str, str | None]] = {section: {} for section in LIVE}
    per_entry: dict[str, dict[str, dict[str, str | None]]] = {table: {} for table in TABLES}
    for key, text in values.items():
        # "none" unsets a value that may be unset (a tenant's min_priority); others refuse it.
        value = None if text.lower() in ("none", "null") else text
        section, _, rest = key.partition(".")
        name, _, field = rest.rpartition(".")
        if section in TABLES and name and field:
            fields = TABLES[section].__struct_fields__
            if field not in fields:
                return f"{key}: a {section[:-1]} has no {field!r}; its fields: {', '.join(fields)}"
            per_entry[section].setdefault(name, {})[field] = value
        elif key in LIVE_SECTION:
            own[LIVE_SECTION[key]][key] = value
        else:
            known = any(key in getattr(cfg, s).__struct_fields__ for s in SECTIONS)
            return (f"{key} {'needs a restart' if known else 'is not a parameter'}; "
                    f"live parameters: {', '.join(LIVE_SECTION)}, tenants.NAME.FIELD, "
                    f"pools.NAME.FIELD")
    try:
        sections = {section: msgspec.convert({**msgspec.to_builtins(getattr(cfg, section)),
                                              **fields}, type(getattr(cfg, section)),
                                             strict=False)
                    for section, fields in own.items()}
        tables = {}
        for table, entries in per_entry.items():
            tables[table] = {} if whole else dict(getattr(cfg, table))
            for name, fields in entries.items():
                # A tenant without a table of its own has [tenants.default]'s limits: a new
                # table starts from them, so setting one field keeps the others it had (a
                # reload's tables are whole, as the file's).
                old = tables[table].get(name)
                base = msgspec.to_builtins(old) if old is not None else \
                    {} if whole else inherited(table, tables[table])
                tables[table][name] = msgspec.convert({**base, **fields}, TABLES[table],
                                                      strict=False)
    except msgspec.ValidationError as e:
        return _invalid(str(e), values)
    speculative: SpeculativeConfig = sections["speculative"]
    if problem := oversized({**sections, **tables}) or speculative.problem() or \
            tenants_problem(tables["tenants"], cfg.batch) or \
            pools_problem(tables["pools"], cfg.model.data_parallel_size):
        return problem
    return msgspec.structs.replace(cfg, **sections, **tables)


def _invalid(message: str, values: dict[str, str]) -> str:
    """msgspec's complaint ("Expected `int` >= 1 - at `$.max_num_seqs`") about the key and
    value as they were given."""
    found = re.fullmatch(r"(.+) - at `\$\.(\w+)`", message)
    if found is None:
        return f"invalid value: {message}"
    what, field = found.groups()
    what = re.sub(r", got `\w+`$", "", what)  # every value given is text: `str`
    key = next((k for k in values if k.rpartition(".")[2] == field), field)
    return f"{key}={values.get(key, '')!r}: {what[0].lower()}{what[1:]}"


def handle(request: AdminRequest, cfg: SurgeConfig, stats: EngineStats,
           facts: dict[str, str]) -> tuple[AdminReply, SurgeConfig]:
    """The reply, and the configuration from now on. facts: what the engine chose at start
    (the kernel backend), shown by get beside the live parameters."""
    if request.command == "get":
        return AdminReply(True, "live parameters", {**shown(live_values(cfg)), **facts}), cfg
    if request.command == "stats":
        return AdminReply(True, "engine stats", msgspec.structs.asdict(stats)), cfg
    if request.command in ("set", "reload"):
        new = updated(cfg, request.values, whole=request.command == "reload")
        if isinstance(new, str):
            return AdminReply(False, new, shown(live_values(cfg))), cfg
        return AdminReply(True, "applied at this step boundary", shown(live_values(new))), new
    return AdminReply(False, f"unknown command {request.command!r}"), cfg
