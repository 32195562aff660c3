"""Configuration layers: defaults < TOML < SURGE_* < flags, with clear errors."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from surge.config import ConfigError, TenantConfig
from surge.config_load import add_arguments, load_config, parse_memory


def _flags(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args(argv))


def test_precedence(tmp_path):
    toml = tmp_path / "surge.toml"
    toml.write_text('[server]\nport = 9000\nhost = "0.0.0.0"\n[scheduler]\nmax_num_seqs = 7\n')
    env = {"SURGE_PORT": "9100", "SURGE_BLOCK_SIZE": "32"}
    cfg = load_config(_flags(["--config", str(toml), "--port", "9200"]), env)
    assert cfg.server.port == 9200  # flag beats env beats file
    assert cfg.server.host == "0.0.0.0"  # file beats default
    assert cfg.scheduler.max_num_seqs == 7
    assert cfg.scheduler.block_size == 32  # env beats default
    assert cfg.model.model == "default"


def test_env_config_path_and_bool_flags(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[server]\nlog_json = true\n")
    assert load_config(_flags([]), {"SURGE_CONFIG": str(toml)}).server.log_json is True
    assert load_config(_flags(["--no-log-json"]), {"SURGE_CONFIG": str(toml)}).server.log_json \
        is False


@pytest.mark.parametrize(("argv", "env", "text", "message"), [
    (["--port", "70000"], {}, None, "port"),
    ([], {"SURGE_DTYPE": "int3"}, None, "dtype"),
    # Each names where the value was set: a flag, a variable, the file.
    ([], {"SURGE_MAX_NUM_SEQS": "many"}, None, r"max_num_seqs.*\(set by SURGE_MAX_NUM_SEQS\)"),
    (["--max-num-seqs", "many"], {"SURGE_MAX_NUM_SEQS": "8"}, None,
     r"max_num_seqs.*\(set by --max-num-seqs\)"),
    ([], {}, "[scheduler]\nmax_num_seqs = -3\n", r"max_num_seqs.*\(set by .*bad\.toml\)"),
    ([], {}, "[tenants.alpha]\nweight = -1\n",
     r"tenants\[\.\.\.\]\.weight.*\(set by .*bad\.toml\)"),
    ([], {"SURGE_MAX_NUM_SEQS": str(2**64)}, None,
     r"max_num_seqs = \d+ is out of range .*\(set by SURGE_MAX_NUM_SEQS\)"),
    ([], {}, "[nonsense]\nx = 1\n", "unknown section"),
    ([], {}, "[server]\nprot = 1\n", "prot"),
    ([], {}, "[server\n", "cannot read"),
    ([], {"SURGE_QUANT_ACTIVATION_BITS": "4"}, None, "quant_activation_bits"),
    ([], {}, "[model]\nquant_activation_bits = 12\n", "quant_activation_bits"),
    # A secret that cannot sign would stop no event until the first one is sent.
    ([], {}, '[tenants.alpha]\nwebhook_secret = "whsec_not base64!"\n',
     r"tenants\.alpha\.webhook_secret: the base64 after whsec_ is malformed"),
    ([], {}, '[tenants.alpha]\nwebhook_secret = "whsec_"\n', r"tenants\.alpha\.webhook_secret"),
    ([], {}, '[tenants.alpha]\nwebhook_urls = "https://a.example/x ftp://b.example/y"\n',
     r"tenants\.alpha\.webhook_urls: 'ftp://b\.example/y' is not an http\(s\) URL"),
    # Batch lines must stay less urgent than a tenant's own requests.
    ([], {}, "[tenants.bulk]\npriority = 100\n",
     r"tenants\.bulk\.priority=100 is not below batch_priority=100"),
    (["--batch-priority", "5"], {}, "[tenants.bulk]\npriority = 10\n",
     r"tenants\.bulk\.priority=10 is not below batch_priority=5"),
    ([], {}, "[tenants.vip]\npriority = 0\nmin_priority = 1\n",
     r"tenants\.vip\.min_priority=1 is above its priority=0"),
    ([], {}, "port = 9000\n", r"port is an option of \[server\]; write it under that section"),
    # A misspelt key: the nearest one, and the file.
    ([], {}, "[scheduler]\nmax_num_seq = 4\n",
     r"unknown field `max_num_seq` - at `\$\.scheduler` \(did you mean max_num_seqs\?\) "
     r"\(set by .*bad\.toml\)"),
    # Requests of no named tenant run at the default tenant's priority (0).
    (["--batch-priority", "0"], {}, None,
     r"tenants\.\(default\)\.priority=0 is not below batch_priority=0"),
])
def test_bad_values_are_refused_with_the_name(tmp_path, argv, env, text, message):
    if text is not None:
        path = tmp_path / "bad.toml"
        path.write_text(text)
        argv = [*argv, "--config", str(path)]
    with pytest.raises(ConfigError, match=message):
        load_config(_flags(argv), env)


def test_parse_memory():
    assert parse_memory("96MiB", 0) == 96 * 2**20
    assert parse_memory("2 GiB", 0) == 2 * 2**30
    assert parse_memory("1.5GB", 0) == 1_500_000_000
    assert parse_memory("0.5", 1000) == 500
    assert parse_memory("1", 1000) == 1000
    assert parse_memory("4096B", 0) == 4096
    for bad in ["", "-1GiB", "lots", "3 parsecs"]:
        with pytest.raises(ConfigError, match="kv_cache_memory"):
            parse_memory(bad, 1000)
    # A bare number is a fraction; one outside (0, 1] is refused, saying how it was read.
    for bad in ["0", "1.5", "4096", "-0.5"]:
        with pytest.raises(ConfigError, match=r"read as a fraction .* \(0, 1\]") as e:
            parse_memory(bad, 1000)
        assert "e.g. 0MiB" not in str(e.value) and "e.g. -" not in str(e.value)


def test_flags_refuse_values_outside_their_choices(capsys):
    with pytest.raises(SystemExit):
        _flags(["--dtype", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_a_number_choice_is_read_from_a_flag_the_environment_and_toml(tmp_path, capsys):
    """--quant-activation-bits is Literal[8, 16]: a flag or variable spells it as text."""
    flags = _flags(["--quant-activation-bits", "8"])
    assert load_config(flags, {}).model.quant_activation_bits == 8
    env = {"SURGE_QUANT_ACTIVATION_BITS": "8"}
    assert load_config(_flags([]), env).model.quant_activation_bits == 8
    path = tmp_path / "surge.toml"
    path.write_text("[model]\nquant_activation_bits = 8\n")
    assert load_config(_flags(["--config", str(path)]), {}).model.quant_activation_bits == 8
    assert load_config(_flags([]), {}).model.quant_activation_bits == 16
    with pytest.raises(SystemExit):
        _flags(["--quant-activation-bits", "4"])
    assert "--quant-activation-bits: invalid choice: '4'" in capsys.readouterr().err


def test_the_example_config_loads_with_its_commented_tables_switched_on(tmp_path):
    """systemd/surge.toml, as shipped and with the commented `key = value` lines of its
    tenant, overload and batch tables switched on, is a valid configuration."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "systemd" / "surge.toml").read_text()
    keys = ("# [tenants.", "# degrade", "# priority", "# weight", "# max_concurrent",
            "# tokens_per_min", "# ttft_slo_s", "# max_queue_drain_s", "# webhook_",
            "# state_dir", "# batch_")
    on = "\n".join(line[2:] if line.startswith(keys) else line for line in text.splitlines())
    for name, body in (("shipped.toml", text), ("on.toml", on)):
        (tmp_path / name).write_text(body)
        cfg = load_config({"config": str(tmp_path / name)}, {})
    assert cfg.tenants["batch"].degrade == "cap-then-refuse"
    assert cfg.overload.ttft_slo_s == 2.0
    assert cfg.tenants["batch"].webhook_urls and cfg.batch.state_dir == "/var/lib/surge"


def test_live_tenant_edits_are_checked_as_the_file_is():
    from scheduler.admin import updated

    cfg = load_config({}, {})
    assert "batch_priority=100" in updated(cfg, {"tenants.bulk.priority": "100"})
    assert "webhook_secret" in updated(cfg, {"tenants.bulk.webhook_secret": "whsec_%%"})
    assert "webhook_urls" in updated(cfg, {"tenants.bulk.webhook_urls": "hook.example"})
    # A refusal names the key and the value as given, and what was expected.
    assert updated(cfg, {"max_num_seqs": "2.5"}) == "max_num_seqs='2.5': expected `int`"
    assert updated(cfg, {"tenants.bulk.priority": "x"}) == \
        "tenants.bulk.priority='x': expected `int`"
    # Past int64 the scheduler could not send its answer (it died, and surge with it).
    assert "out of range" in updated(cfg, {"max_num_seqs": str(10**20)})
    assert "tenants.bulk.max_concurrent" in updated(cfg,
                                                   {"tenants.bulk.max_concurrent": str(10**20)})
    edited = updated(cfg, {"tenants.bulk.priority": "99"})
    assert not isinstance(edited, str) and edited.tenants["bulk"].priority == 99


def test_none_unsets_a_value_that_may_be_unset():
    from scheduler.admin import updated

    cfg = updated(load_config({}, {}), {"tenants.vip.min_priority": "-5"})
    assert not isinstance(cfg, str) and cfg.tenants["vip"].min_priority == -5
    unset = updated(cfg, {"tenants.vip.min_priority": "none"})
    assert not isinstance(unset, str) and unset.tenants["vip"].min_priority is None
    assert updated(cfg, {"max_num_seqs": "null"}).startswith("max_num_seqs='null'")


def test_a_live_edit_of_a_tenant_without_a_table_keeps_what_it_inherited():
    """guest had [tenants.default]'s limits; raising its weight must not lift them."""
    from scheduler.admin import updated

    cfg = load_config({}, {})
    cfg = updated(cfg, {"tenants.default.max_concurrent": "2",
                        "tenants.default.tokens_per_min": "3000",
                        "tenants.default.webhook_urls": "https://hooks.example/default"})
    assert not isinstance(cfg, str)
    edited = updated(cfg, {"tenants.guest.weight": "2"})
    assert not isinstance(edited, str)
    guest = edited.tenants["guest"]
    assert (guest.weight, guest.max_concurrent, guest.tokens_per_min) == (2, 2, 3000)
    assert edited.tenants["default"] == cfg.tenants["default"]
    assert guest.webhook_urls == ""  # a tenant's events go only to receivers it names


def test_a_reload_builds_each_table_whole_as_the_file_does(tmp_path):
    """A reload hands every table over whole: a tenant listed after [tenants.default] gets
    nothing of default's it did not get at start (min_priority, here)."""
    from scheduler.admin import updated
    from surge.config_live import flatten

    path = tmp_path / "surge.toml"
    path.write_text("[tenants.default]\npriority = 5\nmin_priority = -100\n"
                    "[tenants.acme]\npriority = 0\n")
    cfg = load_config({"config": str(path)}, {})
    assert cfg.tenants["acme"].min_priority is None
    reloaded = updated(cfg, flatten(cfg), whole=True)
    assert not isinstance(reloaded, str), reloaded
    assert reloaded.tenants == cfg.tenants


def test_a_reload_takes_the_live_values_and_names_the_others():
    from surge.config_live import restart_only, with_live

    running = load_config({}, {})
    scheduler = msgspec.structs.replace(running.scheduler, max_num_seqs=5, block_size=32,
                                        kv_cache_memory="2GiB")
    new = msgspec.structs.replace(running, scheduler=scheduler, tenants={
        "vip": TenantConfig(weight=3)})
    assert restart_only(running, new) == ["block_size", "kv_cache_memory"]
    kept = with_live(running, new)
    assert kept.scheduler.max_num_seqs == 5 and kept.tenants["vip"].weight == 3
    # A worker restarted after the reload sizes its KV cache as the running scheduler did.
    assert (kept.scheduler.block_size, kept.scheduler.kv_cache_memory) == (16, "1GiB")
