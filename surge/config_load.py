"""Loading the configuration: defaults < TOML file < SURGE_* variables < flags, one --flag per
field (surge.config holds the typed sections), and memory sizes such as kv_cache_memory."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import tomllib
import typing
from functools import cache
from typing import Any, Literal

import msgspec
from msgspec import Meta

from surge.config import SECTIONS, TABLES, ConfigError, SurgeConfig
from surge.config_frontend import pools_problem, tenants_problem


@cache
def _options() -> dict[str, tuple[str, Any]]:
    """Every option name (unique across sections) -> (section, annotated type); read once
    (load_config, section_of for every row of `surge admin get`)."""
    options: dict[str, tuple[str, Any]] = {}
    for section, struct in SECTIONS.items():
        for name, hint in typing.get_type_hints(struct, include_extras=True).items():
            assert name not in options, f"option {name} is defined twice"
            options[name] = (section, hint)
    return options


def _description(hint: Any) -> str:
    for meta in getattr(hint, "__metadata__", ()):
        if isinstance(meta, Meta) and meta.description:
            return meta.description
    return ""


def _is_bool(hint: Any) -> bool:
    return typing.get_args(hint)[0] is bool if hasattr(hint, "__metadata__") else hint is bool


def _choices(hint: Any) -> tuple[str, ...] | None:
    """A Literal field's values as a flag spells them (Literal[8, 16]: "8", "16")."""
    base = typing.get_args(hint)[0] if hasattr(hint, "__metadata__") else hint
    if typing.get_origin(base) is not Literal:
        return None
    return tuple(str(value) for value in typing.get_args(base))


def _defaults() -> dict[str, Any]:
    return {f.name: f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
            for struct in SECTIONS.values() for f in msgspec.structs.fields(struct)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one --flag per config field; unset flags stay None so lower layers show through."""
    parser.add_argument("--config", default=None, help="TOML file (also SURGE_CONFIG)")
    defaults = _defaults()
    for name, (section, hint) in _options().items():
        flag = "--" + name.replace("_", "-")
        default = defaults[name]
        shown = "unset" if default is None else (str(default).lower()
                                                 if isinstance(default, bool) else default)
        description = _description(hint)
        if "(default:" not in description:
            description += f" (default: {shown})"
        help_text = f"{description} [{section}.{name}, SURGE_{name.upper()}]"
        if _is_bool(hint):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            parser.add_argument(flag, default=None, choices=_choices(hint), help=help_text)


def load_config(
    flags: dict[str, Any] | None = None, env: typing.Mapping[str, str] | None = None
) -> SurgeConfig:
    """Build the config from defaults, the TOML file, SURGE_* variables and flags (flags win)."""
    flags = flags or {}
    env = os.environ if env is None else env
    merged: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    origin: dict[str, str] = {}  # "section.name" (or a table's "section"): where it was set
    path = flags.get("config") or env.get("SURGE_CONFIG")
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from e
        for section, values in data.items():
            if section in TABLES and isinstance(values, dict):
                merged[section] = values
                origin[section] = path
                continue
            if section in _options() and not isinstance(values, dict):
                raise ConfigError(f"{path}: {section} is an option of [{_options()[section][0]}]"
                                  f"; write it under that section (the file has no top-level "
                                  f"options)")
            if section not in merged or not isinstance(values, dict):
                raise ConfigError(f"{path}: unknown section [{section}]; known: "
                                  f"{', '.join([*SECTIONS, *TABLES])}")
            merged[section].update(values)
            origin.update({f"{section}.{name}": path for name in values})
    options = _options()
    for name, (source, value) in overrides(flags, env).items():
        section = options[name][0]
        merged[section][name] = value
        origin[f"{section}.{name}"] = source
    try:
        cfg = msgspec.convert(merged, SurgeConfig, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid configuration: {e}{_nearest(str(e))}"
                          f"{_set_by(origin, str(e))}") from e
    if problem := oversized(cfg):
        raise ConfigError(problem + _set_by(origin, problem))
    if problem := cfg.speculative.problem() or tenants_problem(cfg.tenants, cfg.batch) or \
            pools_problem(cfg.pools, cfg.model.data_parallel_size):
        raise ConfigError(problem)
    return cfg


# msgspec's words for a key a section does not have.
_UNKNOWN = re.compile(r"unknown field `([^`]+)` - at `\$\.(\w+)`")


def _nearest(problem: str) -> str:
    """For an unknown key of a section: the section's key nearest its spelling, if one is."""
    found = _UNKNOWN.search(problem)
    struct = SECTIONS.get(found[2]) if found else None
    near = difflib.get_close_matches(found[1], struct.__struct_fields__, n=1) \
        if found and struct else []
    return f" (did you mean {near[0]}?)" if near else ""


def overrides(flags: dict[str, Any], env: typing.Mapping[str, str]) -> dict[str, tuple[str, Any]]:
    """The options flags and SURGE_* variables set, which beat the file: name -> (the flag or
    variable that wins, its value)."""
    found: dict[str, tuple[str, Any]] = {}
    for name in _options():
        if f"SURGE_{name.upper()}" in env:
            found[name] = (f"SURGE_{name.upper()}", env[f"SURGE_{name.upper()}"])
        if flags.get(name) is not None:
            found[name] = ("--" + name.replace("_", "-"), flags[name])
    return found


def _set_by(origin: dict[str, str], problem: str) -> str:
    """Where the value a problem names was set (its flag, variable or file), as its message's
    tail: msgspec names it as `$.section.name` (an unknown one as `name` at `$.section`),
    oversized() as section.name."""
    if unknown := _UNKNOWN.search(problem):
        problem = f"`$.{unknown[2]}.{unknown[1]}`"
    found = re.search(r"`\$\.([^`]+)`", problem) or re.match(r"([\w.-]+) = ", problem)
    key = re.sub(r"\[[^]]*\]", "", found[1]) if found else ""  # a table's [...] entry
    while key and key not in origin:
        key = key.rpartition(".")[0]  # a table's entry was set with its table
    return f" (set by {origin[key]})" if key else ""


# The widest integer the processes' messages carry (msgpack's int64).
_INT_LIMIT = 2**63 - 1


def oversized(value: Any, key: str = "") -> str | None:
    """Why a configuration (a Struct, or its builtins) cannot be sent between the processes:
    the first integer past int64, by its key (None: none is)."""
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value)
    if isinstance(value, dict):
        for k, v in value.items():
            if found := oversized(v, f"{key}.{k}" if key else str(k)):
                return found
    elif isinstance(value, int) and abs(value) > _INT_LIMIT:
        return f"{key} = {value} is out of range (at most {_INT_LIMIT})"
    return None


def section_of(option: str) -> str:
    """The config section an option belongs to (KeyError: no such option)."""
    return _options()[option][0]


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(value: str, free_bytes: int) -> int:
    """'96MiB' -> bytes; '0.8' -> that fraction of free_bytes (a bare number must be in
    (0, 1])."""
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):]
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit == "" and amount != -1.0 and not 0 < amount <= 1:
        # A bare number is a fraction; 2 or 4096 are far more likely sizes missing a unit.
        size = f"{number}MiB" if amount > 0 else "512MiB"  # no size of 0 or less
        raise ConfigError(
            f"kv_cache_memory={value!r} has no unit, so it was read as a fraction of free "
            f"memory, which must be in (0, 1]; for a size add a unit (e.g. {size})")
    if amount <= 0 or unit not in _UNITS:
        raise ConfigError(
            f"kv_cache_memory={value!r}: use bytes with a unit (e.g. 512MiB, 2GiB) "
            "or a fraction of free memory in (0, 1] (e.g. 0.8)"
        )
    if unit == "":
        return int(amount * free_bytes)
    return int(amount * _UNITS[unit])
