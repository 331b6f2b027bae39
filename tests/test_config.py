"""config.yaml schema: defaults, validation messages, command-line overrides, live-reload diff."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import yaml

from edged import config as cfgmod
from edged.config import (
    MiB,
    Config,
    ConfigError,
    apply_overrides,
    check_config,
    diff_config,
    hash_api_key,
    load_config,
    parse_config,
    reload_config,
    run_check_config,
    to_dict,
)

REPO = Path(__file__).resolve().parents[1]
KEY_HASH = hash_api_key("test")  # 9f86d081...


@pytest.fixture(autouse=True)
def _state_env(monkeypatch, tmp_path):
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))


def errors_of(mapping) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as e:
        parse_config(mapping, "test.yaml")
    return e.value.errors


def one_error(mapping) -> tuple[str, str]:
    errs = errors_of(mapping)
    assert len(errs) == 1, errs
    return errs[0]


# ---------------------------------------------------------------------------------- defaults


def test_absent_empty_and_comment_only_files_give_defaults(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    comments = tmp_path / "comments.yaml"
    comments.write_text("# nothing here\n\n")
    default = Config()
    assert load_config(None) == default
    assert load_config(empty) == default
    assert load_config(comments) == default
    assert load_config(tmp_path / "missing.yaml") == default
    assert parse_config({}) == default == parse_config(None)


def test_missing_file_is_an_error_when_asked(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "missing.yaml", missing_ok=False)
    assert e.value.messages() == ["file not found"]


def test_default_values():
    c = Config()
    assert (c.server.listen, c.server.host, c.server.port) == ("0.0.0.0:4433", "0.0.0.0", 4433)
    assert c.server.certfile is None and c.server.keyfile is None
    assert c.server.max_body_bytes == 1 * MiB and c.server.drain_timeout_s == 30
    assert (c.model.path, c.model.quant, c.model.dtype, c.model.kv_cache_dtype, c.model.device) == (
        None, "auto", "auto", "auto", "auto")
    assert (c.model.gpu_memory_fraction, c.model.block_size, c.model.max_num_seqs,
            c.model.max_batch_tokens, c.model.cuda_graphs) == (0.85, 16, 64, 2048, True)
    assert (c.limits.max_tokens_default, c.limits.max_tokens_limit, c.limits.max_prompt_tokens) == (256, 4096, None)
    assert {n: (t.weight, t.ttft_target_ms, t.max_queue) for n, t in c.tiers.items()} == {
        "gold": (8, 500, 64), "silver": (4, 2000, 128), "bronze": (1, 10000, 256)}
    assert (c.scheduler.default_tier, c.scheduler.batch_cap) == ("silver", None)
    assert (c.cache.enabled, c.cache.max_bytes, c.cache.ttl_s, c.cache.prefix_cache, c.cache.host_spill_bytes) == (
        True, 256 * MiB, 86400, True, 0)
    assert (c.auth.enabled, c.auth.keys) == (False, [])
    assert c.logging.level == "info"


def test_state_dir_default(monkeypatch):
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/edged:/var/lib/other")
    assert Config().server.state_dir == "/var/lib/edged"
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setattr(cfgmod.os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_STATE_HOME", "/home/u/.state")
    assert Config().server.state_dir == "/home/u/.state/edged"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", "/home/u")
    assert Config().server.state_dir == "/home/u/.local/state/edged"
    monkeypatch.setattr(cfgmod.os, "geteuid", lambda: 0)
    assert Config().server.state_dir == "/var/lib/edged"
    # null in the file means the same automatic default
    assert parse_config({"server": {"state_dir": None}}).server.state_dir == "/var/lib/edged"


def test_round_trip_through_plain_data():
    c = parse_config({"auth": {"keys": [{"name": "a", "sha256": KEY_HASH, "tier": "gold"}]}})
    assert parse_config(to_dict(c)) == c


# --------------------------------------------------------------------------- shipped config.yaml


def _key_paths(data, prefix="") -> set[str]:
    out = set()
    for k, v in data.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        out.add(path)
        if isinstance(v, dict):
            out |= _key_paths(v, path)
    return out


def _leaf_count(data) -> int:
    return sum(_leaf_count(v) if isinstance(v, dict) else 1 for v in data.values())


def test_shipped_config_yaml_is_exactly_the_defaults():
    assert load_config(REPO / "config.yaml") == Config()


def test_shipped_config_yaml_lists_every_key():
    shipped = yaml.safe_load((REPO / "config.yaml").read_text())
    assert _key_paths(shipped) == _key_paths(to_dict(Config()))


def test_shipped_config_yaml_comments_every_key():
    lines = (REPO / "config.yaml").read_text().splitlines()
    leaves = [i for i, line in enumerate(lines) if re.match(r"\s*\w+: *[^#\s]", line)]
    assert len(leaves) == _leaf_count(to_dict(Config()))
    uncommented = [lines[i] for i in leaves if "#" not in lines[i] and not lines[i - 1].lstrip().startswith("#")]
    assert uncommented == []


# ---------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("mapping, key, reason", [
    ({"tiers": {"gold": {"ttft_target_ms": -5}}, "scheduler": {"default_tier": "gold"}}, "tiers.gold.ttft_target_ms", "must be a positive number, got -5"),
    ({"model": {"max_num_seqs": 0}}, "model.max_num_seqs", "must be a positive integer, got 0"),
    ({"server": {"drain_timeout_s": -1}}, "server.drain_timeout_s", "must be a non-negative number, got -1"),
    ({"model": {"gpu_memory_fraction": 1.5}}, "model.gpu_memory_fraction", "must be > 0 and <= 1, got 1.5"),
    # unknown keys, with and without a suggestion
    ({"server": {"lisen": "0.0.0.0:1"}}, "server.lisen", "unknown key (did you mean 'listen'?)"),
    ({"modle": {}}, "modle", "unknown key (did you mean 'model'?)"),
    ({"tiers": {"gold": {"wieght": 2}}, "scheduler": {"default_tier": "gold"}}, "tiers.gold.wieght", "unknown key (did you mean 'weight'?)"),
    ({"cache": {"zzz": 1}}, "cache.zzz", "unknown key; known keys: enabled, max_bytes, ttl_s, prefix_cache, host_spill_bytes"),
    # wrong types
    ({"model": {"cuda_graphs": "yes"}}, "model.cuda_graphs", "must be true or false, got 'yes'"),
    ({"model": {"max_num_seqs": 1.5}}, "model.max_num_seqs", "must be an integer, got 1.5"),
    ({"model": {"max_num_seqs": True}}, "model.max_num_seqs", "must be an integer, got true"),
    ({"server": {"listen": 4433}}, "server.listen", "must be a string, got 4433"),
    ({"server": {"request_timeout_s": "10s"}}, "server.request_timeout_s", "must be a number, got '10s'"),
    ({"server": 5}, "server", "must be a mapping of keys, got 5"),
    ({"tiers": ["gold"]}, "tiers", "must be a mapping, got list"),
    ({"auth": {"keys": {"name": "a"}}}, "auth.keys", "must be a list, got dict"),
    ({"server": {"listen": None}}, "server.listen", "must be a string, got null"),
    # choices
    ({"model": {"quant": "w3"}}, "model.quant", "must be one of auto, none, w8, w4; got 'w3'"),
    ({"model": {"block_size": 12}}, "model.block_size", "must be one of 8, 16, 32, 64, 128; got 12"),
    ({"model": {"device": "gpu"}}, "model.device", "must be one of auto, cpu, cuda, cuda:N; got 'gpu'"),
    ({"logging": {"level": "loud"}}, "logging.level", "must be one of debug, info, warning, error, critical; got 'loud'"),
    # listen addresses
    ({"server": {"listen": "localhost"}}, "server.listen", "must be HOST:PORT, e.g. 0.0.0.0:4433 or [::]:4433, got 'localhost'"),
    ({"server": {"listen": "::1:4433"}}, "server.listen", "IPv6 addresses need brackets, e.g. [::1]:4433, got '::1:4433'"),
    ({"server": {"listen": "[nope]:4433"}}, "server.listen", "'nope' in brackets is not an IPv6 address, got '[nope]:4433'"),
    ({"server": {"listen": "0.0.0.0:70000"}}, "server.listen", "port must be 0..65535, got '0.0.0.0:70000'"),
    ({"server": {"listen": "bad host:1"}}, "server.listen", "host must be an IP address or a host name, e.g. 0.0.0.0:4433, got 'bad host:1'"),
    # sizes
    ({"cache": {"max_bytes": "lots"}}, "cache.max_bytes", "must be a byte count like 268435456 or 256MiB, got 'lots'"),
    ({"cache": {"max_bytes": -1}}, "cache.max_bytes", "must be a non-negative integer, got -1"),
    # tiers referenced by name
    ({"scheduler": {"default_tier": "platinum"}}, "scheduler.default_tier", "unknown tier 'platinum' (tiers: bronze, gold, silver)"),
    ({"auth": {"keys": [{"name": "a", "sha256": KEY_HASH, "tier": "platinum"}]}}, "auth.keys[0].tier",
     "unknown tier 'platinum' (tiers: bronze, gold, silver)"),
    ({"tiers": {"gold tier": {}}, "scheduler": {"default_tier": "gold tier"}}, "tiers.gold tier",
     "names are 1-32 letters, digits, '_' or '-'; got 'gold tier'"),
    # api keys
    ({"auth": {"keys": [{"name": "a", "sha256": "hunter2"}]}}, "auth.keys[0].sha256",
     "must be the sha256 hex digest of the key (64 hex characters), never the key itself; make one with: printf %s KEY | sha256sum"),
    ({"auth": {"keys": [{"name": "a"}]}}, "auth.keys[0].sha256", "is required"),
    ({"auth": {"keys": [{"sha256": KEY_HASH}]}}, "auth.keys[0].name", "is required"),
    ({"auth": {"keys": [{"name": "a", "sha256": KEY_HASH}, {"name": "a", "sha256": "0" * 64}]}}, "auth.keys[1].name",
     "duplicate key name 'a'"),
    ({"auth": {"keys": [{"name": "a", "sha256": KEY_HASH}, {"name": "b", "sha256": KEY_HASH.upper()}]}}, "auth.keys[1].sha256",
     "duplicate: the same key is listed twice"),
    ({"auth": {"keys": [{"name": "a", "sha256": KEY_HASH, "burst": 5}]}}, "auth.keys[0].burst", "needs rate_limit_rps"),
    ({"auth": {"enabled": True}}, "auth.keys", "auth is enabled but no keys are configured: every request would be refused"),
    # rules across keys
    ({"limits": {"max_tokens_default": 5000}}, "limits.max_tokens_default", "must be <= limits.max_tokens_limit (4096), got 5000"),
    ({"tiers": {"silver": {"max_tokens": 9000}}}, "tiers.silver.max_tokens", "must be <= limits.max_tokens_limit (4096), got 9000"),
    ({"tiers": {"silver": {"batch_window_ms": {"min": 10, "initial": 5}}}}, "tiers.silver.batch_window_ms",
     "needs min <= initial <= max, got 10.0, 5.0, 50.0"),
    ({"scheduler": {"step_token_budget": 4096}}, "scheduler.step_token_budget", "must be <= model.max_batch_tokens (2048), got 4096"),
    ({"model": {"max_batch_tokens": 32}}, "model.max_batch_tokens",
     "must be >= model.max_num_seqs (64): every running sequence decodes one token per step; got 32"),
    ({"model": {"max_model_len": 1024}, "limits": {"max_prompt_tokens": 1024}}, "limits.max_prompt_tokens",
     "must be < model.max_model_len (1024), got 1024"),
    ({"scheduler": {"preemption": "swap"}}, "scheduler.preemption", "'swap' needs cache.host_spill_bytes > 0 (host memory to swap to)"),
    ({"server": {"certfile": "/etc/edged/cert.pem"}}, "server.keyfile",
     "certfile and keyfile go together: set both, or neither for a self-signed certificate"),
])
def test_validation_error(mapping, key, reason):
    assert one_error(mapping) == (key, reason)


def test_tiers_replace_the_built_in_set():
    assert errors_of({"tiers": {}}) == [("tiers", "at least one tier is required"),
                                        ("scheduler.default_tier", "unknown tier 'silver' (tiers: none defined)")]
    assert errors_of({"tiers": {"gold": {}}}) == [("scheduler.default_tier", "unknown tier 'silver' (tiers: gold)")]


def test_all_errors_are_reported_at_once():
    errs = errors_of({"server": {"listen": "x", "max_body_bytes": 0}, "model": {"quant": "q"}, "bogus": 1})
    assert [k for k, _ in errs] == ["bogus", "server.listen", "server.max_body_bytes", "model.quant"]


def test_error_message_names_file_and_each_problem():
    with pytest.raises(ConfigError) as e:
        parse_config({"tiers": {"gold": {"ttft_target_ms": -5}}, "scheduler": {"default_tier": "gold"}}, "/etc/edged/config.yaml")
    assert str(e.value) == ("/etc/edged/config.yaml: invalid config:\n"
                            "  tiers.gold.ttft_target_ms: must be a positive number, got -5")
    assert e.value.messages() == ["tiers.gold.ttft_target_ms: must be a positive number, got -5"]


def test_top_level_must_be_a_mapping():
    assert one_error(["server"]) == ("", "the config must be a mapping of sections, got list")


def test_yaml_syntax_error_has_line_number(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("server:\n  listen: '0.0.0.0:1'\n   max_body_bytes: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    (key, reason), = e.value.errors
    assert key == "" and reason.startswith("YAML syntax error at line 3, column 4: ")
    assert e.value.source == str(p)


def test_yaml_duplicate_key_is_an_error(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("server:\n  listen: '0.0.0.0:1'\n  listen: '0.0.0.0:2'\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.messages() == ["YAML syntax error at line 3, column 3: duplicate key 'listen' (first at line 2)"]


def test_yaml_anchors_and_merge_keys_work(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("tiers:\n  silver: &base\n    weight: 2\n    max_queue: 10\n"
                 "  bronze:\n    <<: *base\n    weight: 1\n")
    c = load_config(p)
    assert (c.tiers["bronze"].weight, c.tiers["bronze"].max_queue) == (1.0, 10)


# -------------------------------------------------------------------------------- accepted forms


def test_accepted_forms(tmp_path):
    c = parse_config({
        "server": {"listen": "[::1]:8443", "max_body_bytes": "2MiB"},
        "cache": {"max_bytes": "1.5 GiB", "host_spill_bytes": "512k"},
        "model": {"device": "cuda:1", "gpu_memory_fraction": 1},
        "logging": {"level": "DEBUG"},
        "tiers": {"gold": {"ttft_target_ms": 250}},  # replaces the built-in tiers
        "scheduler": {"default_tier": "gold"},
        "auth": {"enabled": True, "keys": [{"name": "a", "sha256": KEY_HASH.upper(), "rate_limit_rps": 2}]},
    })
    assert (c.server.host, c.server.port) == ("::1", 8443)
    assert c.server.max_body_bytes == 2 * MiB
    assert (c.cache.max_bytes, c.cache.host_spill_bytes) == (1536 * MiB, 512 * 1024)
    assert c.model.gpu_memory_fraction == 1.0 and isinstance(c.model.gpu_memory_fraction, float)
    assert c.logging.level == "debug"
    assert list(c.tiers) == ["gold"]
    gold = c.tiers["gold"]  # keys not given take the field defaults
    assert (gold.weight, gold.ttft_target_ms, gold.max_queue, gold.batch_window_ms) == (1.0, 250.0, 128, cfgmod.BatchWindow())
    key = c.auth.keys[0]
    assert (key.sha256, key.tier, key.rate_limit_rps, key.burst) == (KEY_HASH, None, 2.0, None)


def test_null_section_and_null_tier_take_defaults():
    c = parse_config({"server": None, "tiers": {"gold": None}, "scheduler": {"default_tier": "gold"}})
    assert c.server == Config().server and c.tiers == {"gold": cfgmod.TierConfig()}


def test_paths_are_expanded_and_relative_to_the_config_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/op")
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: models/llama.gguf\n  tokenizer: ~/tok.json\n  chat_template: /abs/t.jinja\n")
    c = load_config(p)
    assert c.model.path == str(tmp_path / "models/llama.gguf")
    assert c.model.tokenizer == "/home/op/tok.json"
    assert c.model.chat_template == "/abs/t.jinja"


def test_hash_api_key():
    assert hash_api_key("test") == "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


def test_warnings_for_open_api():
    assert cfgmod.warnings(Config()) == [
        "auth.enabled is false and server.listen is 0.0.0.0:4433: anyone who can reach this port can use the API"]
    open_metrics = parse_config({"server": {"listen": "127.0.0.1:4433"}, "auth": {
        "enabled": True, "metrics_loopback_only": False, "keys": [{"name": "a", "sha256": "0" * 64}]}})
    assert cfgmod.warnings(open_metrics) == ["/metrics is open to every address without a key (auth.metrics_*)"]
    assert cfgmod.warnings(parse_config({"server": {"listen": "127.0.0.1:4433"}})) == []
    assert cfgmod.warnings(parse_config({"server": {"listen": "[::1]:4433"}})) == []


# ---------------------------------------------------------------------------------- overrides


def test_overrides_win_over_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = parse_config({"server": {"listen": "0.0.0.0:1"}, "logging": {"level": "error"}})
    c = apply_overrides(base, listen="[::]:9000", state_dir="/srv/edged", model="m.gguf", log_level="DEBUG")
    assert (c.server.listen, c.server.state_dir, c.model.path, c.logging.level) == (
        "[::]:9000", "/srv/edged", str(tmp_path / "m.gguf"), "debug")
    assert base.server.listen == "0.0.0.0:1"  # the original is left alone
    assert apply_overrides(base) == base


def test_bad_override_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        apply_overrides(Config(), listen="nowhere")
    assert e.value.source == "command line"
    assert e.value.errors[0][0] == "server.listen"


# -------------------------------------------------------------------------------- live reload


def test_diff_splits_live_and_restart_keys():
    old = Config()
    new = parse_config({
        "tiers": {"gold": {"weight": 9}, "silver": {}, "bronze": {}, "platinum": {}},
        "cache": {"ttl_s": 60},
        "auth": {"keys": [{"name": "a", "sha256": KEY_HASH}]},
        "limits": {"max_tokens_limit": 8192},
        "logging": {"level": "debug"},
        "scheduler": {"batch_cap": 16},
        "server": {"listen": "[::]:4433", "drain_timeout_s": 10},
        "model": {"path": "/m.gguf", "block_size": 32},
    })
    d = diff_config(old, new)
    assert "tiers.gold.weight" in d.live and "tiers.platinum" in d.live
    assert {"cache.ttl_s", "auth.keys", "limits.max_tokens_limit", "logging.level", "scheduler.batch_cap",
            "server.drain_timeout_s"} <= set(d.live)
    assert sorted(d.restart_required) == ["model.block_size", "model.path", "server.listen"]
    assert not any(k.startswith(("model.", "server.listen")) for k in d.live)


def test_diff_of_equal_configs_is_empty():
    d = diff_config(Config(), Config())
    assert not d and d.live == [] and d.restart_required == []
    removed = diff_config(Config(), parse_config({"tiers": {"gold": {}}, "scheduler": {"default_tier": "gold"}}))
    assert {"tiers.silver", "tiers.bronze", "scheduler.default_tier"} <= set(removed.live)


def test_reload_applies_live_keys_and_keeps_restart_keys(tmp_path, caplog):
    p = tmp_path / "c.yaml"
    old = apply_overrides(Config(), log_level="warning")
    p.write_text("server:\n  listen: '[::]:5000'\ncache:\n  ttl_s: 60\nlogging:\n  level: error\n")
    with caplog.at_level(logging.INFO, logger="edged.config"):
        new, diff = reload_config(old, p, {"log_level": "warning"})
    assert new.cache.ttl_s == 60
    assert new.server.listen == old.server.listen  # needs a restart: the running value stays
    assert new.logging.level == "warning"  # the command line still wins
    assert diff.restart_required == ["server.listen"] and diff.live == ["cache.ttl_s"]
    assert "config key server.listen changed; it takes effect after a restart" in caplog.text


def test_reload_with_invalid_file_raises_and_logs(tmp_path, caplog):
    p = tmp_path / "c.yaml"
    p.write_text("tiers:\n  silver:\n    ttft_target_ms: -5\n")
    with caplog.at_level(logging.WARNING, logger="edged.config"), pytest.raises(ConfigError):
        reload_config(Config(), p)
    assert "tiers.silver.ttft_target_ms: must be a positive number, got -5" in caplog.text
    assert [r.levelno for r in caplog.records] == [logging.WARNING]  # one line per rejected reload


# ------------------------------------------------------------------------------- check-config


def test_check_config(tmp_path, capsys):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("server:\n  listen: '127.0.0.1:4433'\n")
    bad.write_text("model:\n  quant: w3\n")
    assert check_config(good) == (True, [])
    assert check_config(bad) == (False, ["model.quant: must be one of auto, none, w8, w4; got 'w3'"])
    assert check_config(REPO / "config.yaml")[0] is True

    assert run_check_config(str(good)) == 0
    assert capsys.readouterr().out == f"{good}: OK\n"
    assert run_check_config(str(bad)) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"{bad}: model.quant: must be one of auto, none, w8, w4; got 'w3'\n"
    assert run_check_config(str(tmp_path / "none.yaml")) == 1
