"""Fail closed on reload, and keys that match only as sent.

A config file that disappears, empties, becomes unreadable or invalid while the daemon runs
changes nothing (auth stays on, one warning says why); a reload that opens access is a warning;
a 10 MB file is refused before it is read, off the event loop; /metrics takes only Bearer keys.
The first half runs against one real daemon over HTTP/3; the rest is the config and daemon code
in-process.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from edged import daemon as daemon_module
from edged.config import (
    MAX_CONFIG_BYTES,
    Config,
    ConfigError,
    apply_overrides,
    check_config,
    hash_api_key,
    load_config,
    parse_config,
    read_config_text,
    reload_config,
)
from edged.server.auth import bearer_key, lookup
from edged.server.h3_client import H3Client
from helpers.daemon import DaemonProcess, start_daemon

KEY = "ops-secret"
POLL_S = 0.3  # the daemon's config_poll_s here: each look at the file costs the test this long
AUTH_ON = f"""
server:
  config_poll_s: {POLL_S}
auth:
  enabled: true
  metrics_requires_key: true
  keys:
    - name: ops
      sha256: {hash_api_key(KEY)}
"""
CONFIG_POLL_S_MARGIN = 3 * POLL_S  # long enough for the watcher to look again
AUTH_OFF = AUTH_ON.replace("enabled: true", "enabled: false").replace("metrics_requires_key: true",
                                                                       "metrics_requires_key: false")


# ------------------------------------------------------------------------ one daemon, auth on


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("auth"), AUTH_ON)
    yield d
    assert d.stop() == 0, d.log_text()[-3000:]


async def status(d: DaemonProcess, path: str = "/v1/models", authorization: str | None = None) -> int:
    headers = {"authorization": authorization} if authorization is not None else {}
    async with H3Client("127.0.0.1", d.port, ca_file=d.ca_file) as c:
        return (await c.request("GET", path, headers)).status


def statuses(d: DaemonProcess, *auths: str | None, path: str = "/v1/models") -> list[int]:
    async def main() -> list[int]:
        return [await status(d, path, a) for a in auths]
    return asyncio.run(main())


def replace(path: Path, text: str) -> None:
    """Write atomically, as editors and config management do (the watcher never sees half a file)."""
    if path.is_dir():
        path.rmdir()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def restore(d: DaemonProcess, text: str = AUTH_ON) -> None:
    """Put a valid config back and wait until every process has applied it ("config reloaded" comes earlier, when
    the supervisor has read it and the workers may still serve the previous config)."""
    assert d.config_path is not None
    mark = len(d.lines)
    replace(d.config_path, text)
    assert d.wait_for_log("config applied", 30, start=mark), d.log_text()[-2000:]


def unreadable(path: Path) -> None:
    """Unreadable: no permission (root reads anyway, so there a directory takes the file's place)."""
    if os.geteuid() == 0:
        path.unlink()
        path.mkdir()
    else:
        path.chmod(0)


EVENTS = [
    ("moved away", lambda p: p.rename(p.with_suffix(".moved")), "file not found"),
    ("truncated", lambda p: p.write_bytes(b""), "the file is empty"),
    ("unreadable", unreadable, "not a regular file" if os.geteuid() == 0 else "Permission denied"),
    ("invalid YAML", lambda p: replace(p, "auth:\n  enabled: [false\n"), "YAML syntax error"),
]


def test_a_config_file_that_goes_away_empties_or_breaks_keeps_auth_on(daemon: DaemonProcess) -> None:
    assert daemon.config_path is not None
    assert statuses(daemon, None, f"Bearer {KEY}") == [401, 200]
    for name, event, why in EVENTS:
        mark = len(daemon.lines)
        event(daemon.config_path)
        assert daemon.wait_for_log("config reload rejected, keeping the running config", 30, start=mark), name
        time.sleep(CONFIG_POLL_S_MARGIN)  # a second look by the watcher must not apply anything either
        assert statuses(daemon, None, f"Bearer {KEY}") == [401, 200], name
        assert statuses(daemon, None, path="/metrics") == [401], name
        rejected = [line for line in daemon.lines[mark:] if "reload rejected" in line]
        assert len(rejected) == 1 and why in rejected[0] and "WARNING" in rejected[0], (name, rejected)
        moved = daemon.config_path.with_suffix(".moved")
        if moved.exists():
            moved.unlink()
        if daemon.config_path.exists() and not daemon.config_path.is_dir():
            daemon.config_path.chmod(0o644)
        restore(daemon)
        assert statuses(daemon, None, f"Bearer {KEY}") == [401, 200], name



def test_a_reload_that_opens_access_is_a_warning_naming_the_keys(daemon: DaemonProcess) -> None:
    mark = len(daemon.lines)
    restore(daemon, AUTH_OFF)
    line = next(line for line in daemon.lines[mark:] if "widens access" in line)
    assert "WARNING" in line and "auth.enabled: true -> false" in line
    assert "auth.metrics_requires_key: true -> false" in line
    assert statuses(daemon, None) == [200]
    mark = len(daemon.lines)
    restore(daemon, AUTH_ON)
    assert statuses(daemon, None) == [401]
    assert not any("widens access" in line for line in daemon.lines[mark:])  # closing it again is no warning


def test_a_reload_naming_a_model_file_that_does_not_exist_is_rejected(daemon: DaemonProcess) -> None:
    assert daemon.config_path is not None
    mark = len(daemon.lines)
    replace(daemon.config_path, AUTH_ON + "model:\n  path: /nonexistent/model.gguf\n")
    assert daemon.wait_for_log("config reload rejected", 30, start=mark)
    assert any("model.path: no such file or directory: /nonexistent/model.gguf" in line
               for line in daemon.lines[mark:])
    restore(daemon)


def test_a_10_mb_config_on_sighup_is_refused_at_once_and_health_stays_fast(daemon: DaemonProcess) -> None:
    assert daemon.config_path is not None
    mark = len(daemon.lines)
    with daemon.config_path.open("w") as f:
        f.write(AUTH_ON)
        line = "# " + "x" * 98 + "\n"
        f.write(line * (10 * 1024 * 1024 // len(line)))

    async def main() -> list[float]:
        async with H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) as c:
            daemon.proc.send_signal(signal.SIGHUP)
            times = []
            for _ in range(10):  # while the reload runs, and after
                start = time.monotonic()
                r = await c.request("GET", "/healthz", timeout=10)
                times.append(time.monotonic() - start)
                assert r.status == 200
                await asyncio.sleep(0.1)
            return times

    times = asyncio.run(main())
    assert max(times) < 1.0, times
    assert daemon.wait_for_log("file is too large", 30, start=mark)
    assert statuses(daemon, None, f"Bearer {KEY}") == [401, 200]
    restore(daemon)


def test_metrics_with_a_required_key_takes_only_bearer(daemon: DaemonProcess) -> None:
    got = statuses(daemon, f"Basic {KEY}", f"Token {KEY}", KEY, f"Bearer {KEY}", f"bearer  {KEY}",
                   path="/metrics")
    assert got == [401, 401, 401, 200, 200]


def test_keys_are_compared_exactly(daemon: DaemonProcess) -> None:
    # Non-ASCII whitespace around a key makes a different key (the header carries them as latin-1).
    odd = [f"Bearer \xa0{KEY}", f"Bearer {KEY}\xa0", f"Bearer \x0b{KEY}", f"Bearer {KEY}\x0b",
           f"Basic {KEY}", f"Token {KEY}"]
    assert statuses(daemon, *odd) == [401] * len(odd)
    assert statuses(daemon, *odd, path="/metrics") == [401] * len(odd)
    assert statuses(daemon, f"Bearer {KEY}") == [200]


def test_edged_chat_takes_the_key_from_the_environment_and_hints_at_it_when_refused(daemon: DaemonProcess) -> None:
    def chat(env_key: str | None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "EDGED_API_KEY"}
        if env_key is not None:
            env["EDGED_API_KEY"] = env_key
        return subprocess.run([sys.executable, "-m", "edged.cli", "chat", "Hi", "--max-tokens", "3", "--port",
                               str(daemon.port), "--ca-file", daemon.ca_file, "--no-0rtt"],
                              capture_output=True, text=True, timeout=120, env=env)

    ok = chat(KEY)
    assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
    for refused in (chat(None), chat("wrong")):
        assert refused.returncode == 1 and "(HTTP 401)" in refused.stderr
        assert "--api-key KEY or in $EDGED_API_KEY" in refused.stderr


def test_a_missing_config_file_at_start_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    out = subprocess.run([sys.executable, "-m", "edged.cli", "serve", "--config", str(missing),
                          "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert f"cannot start: config file {missing} not found" in out.stderr


# ------------------------------------------------------------------------ config code, in-process


def test_reload_fails_closed_and_logs_one_warning_each(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(AUTH_ON)
    running = load_config(path)
    cases = {
        "file not found": lambda: path.unlink(),
        "the file is empty": lambda: path.write_text(""),
        "the file is empty (no settings)": lambda: path.write_text("# all commented out\n"),
        "not UTF-8": lambda: path.write_bytes(b"auth:\n  enabled: \xff\n"),
        "YAML syntax error": lambda: path.write_text("auth: {enabled: false\n"),
        "auth.keys: auth is enabled but no keys": lambda: path.write_text("auth:\n  enabled: true\n"),
        "not a regular file": lambda: (path.unlink(), path.mkdir()),
    }
    for why, event in cases.items():
        if path.is_dir():
            path.rmdir()
        path.write_text(AUTH_ON)
        event()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="edged.config"), pytest.raises(ConfigError):
            reload_config(running, path)
        assert [(r.levelno, why in r.getMessage()) for r in caplog.records] == [(logging.WARNING, True)], why
    path.rmdir()
    path.write_text("{}\n")  # the defaults, said explicitly
    assert reload_config(running, path)[0].auth.enabled is False


def test_at_start_an_empty_or_commented_file_still_means_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("# nothing set\n")
    assert load_config(path, missing_ok=False) == Config()


def test_the_size_limit_is_checked_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = tmp_path / "big.yaml"
    with big.open("wb") as f:
        f.truncate(10 * 1024 * 1024)
    with pytest.raises(ConfigError) as e:
        read_config_text(big)
    assert "file is too large: 10485760 bytes, the limit is 1048576 bytes (1024 KiB)" in str(e.value)
    ok = tmp_path / "ok.yaml"
    ok.write_bytes(b"#" * (MAX_CONFIG_BYTES - 1) + b"\n")
    assert load_config(ok) == Config()
    # The decision comes from the file's size alone: a small file said to be large is never read...
    real_fstat = os.fstat

    def fstat_saying(size: int):
        return lambda fd: os.stat_result((*real_fstat(fd)[:6], size, *real_fstat(fd)[7:]))

    monkeypatch.setattr(os, "fstat", fstat_saying(10 * 1024 * 1024))
    with pytest.raises(ConfigError, match="file is too large: 10485760 bytes"):
        read_config_text(ok)
    # ...and a file that grows after the check is still cut at the limit.
    monkeypatch.setattr(os, "fstat", fstat_saying(10))
    with pytest.raises(ConfigError, match="too large"):
        read_config_text(big)


def test_a_fifo_in_place_of_the_config_does_not_block(tmp_path: Path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    done = threading.Event()

    def read() -> None:
        with pytest.raises(ConfigError, match="not a regular file"):
            read_config_text(fifo)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(5)


def test_startup_file_keys_must_name_existing_files(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("model:\n  path: missing.gguf\n")
    with pytest.raises(ConfigError) as e:
        reload_config(Config(), path)
    assert e.value.errors == [("model.path", f"no such file or directory: {tmp_path / 'missing.gguf'}")]
    assert check_config(path) == (False, [f"model.path: no such file or directory: {tmp_path / 'missing.gguf'}"])
    (tmp_path / "missing.gguf").write_bytes(b"GGUF")
    new, diff = reload_config(Config(), path)
    assert diff.restart_required == ["model.path"] and new.model.path is None  # applies after a restart


def test_access_widening_is_logged_for_metrics_too(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(AUTH_ON.replace("metrics_requires_key: true", "metrics_requires_key: false")
                    + "  metrics_loopback_only: false\n")
    running = parse_config(yaml.safe_load(AUTH_ON))
    with caplog.at_level(logging.WARNING, logger="edged.config"):
        reload_config(running, path)
    assert "config reload widens access: auth.metrics_requires_key: true -> false, " \
           "auth.metrics_loopback_only: true -> false" in caplog.text


def test_each_change_is_read_once_and_off_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGHUP after an edit reads the file; the watcher then sees nothing new. Reading happens
    on a worker thread."""
    path = tmp_path / "config.yaml"
    poll = "server:\n  config_poll_s: 0.05\n"
    path.write_text(poll + "logging:\n  level: info\n")
    calls: list[str] = []

    def counting_reload(*args: object) -> object:
        calls.append(threading.current_thread().name)
        return reload_config(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(daemon_module, "reload_config", counting_reload)
    monkeypatch.setattr(daemon_module, "setup_logging", lambda level: None)  # leave pytest's logging alone

    async def main() -> None:
        d = daemon_module.Daemon(apply_overrides(load_config(path)), str(path), {}, str(tmp_path))
        watcher = asyncio.create_task(d._watch_config())
        path.write_text(poll + "logging:\n  level: warning\n")
        await d._reload_once("SIGHUP")
        await asyncio.sleep(0.5)  # ten polls
        assert d.config.logging.level == "warning"
        path.write_text(poll + "logging:\n  level: error\n")  # an edit without a signal: the watcher reads it
        os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
        await asyncio.sleep(0.5)
        watcher.cancel()
        assert d.config.logging.level == "error"

    asyncio.run(main())
    assert len(calls) == 2
    assert threading.main_thread().name not in calls


def test_config_poll_0_leaves_edits_to_sighup_and_a_reload_can_turn_polling_back_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("server:\n  config_poll_s: 0\nlogging:\n  level: info\n")
    monkeypatch.setattr(daemon_module, "CONFIG_POLL_IDLE_S", 0.05)
    monkeypatch.setattr(daemon_module, "setup_logging", lambda level: None)

    def edit(text: str) -> None:
        path.write_text(text)
        os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))

    async def main() -> None:
        d = daemon_module.Daemon(apply_overrides(load_config(path)), str(path), {}, str(tmp_path))
        watcher = asyncio.create_task(d._watch_config())
        edit("server:\n  config_poll_s: 0\nlogging:\n  level: warning\n")
        await asyncio.sleep(0.3)
        assert d.config.logging.level == "info"  # not polled
        edit("server:\n  config_poll_s: 0.05\nlogging:\n  level: warning\n")
        await d._reload_once("SIGHUP")
        assert d.config.logging.level == "warning"
        edit("server:\n  config_poll_s: 0.05\nlogging:\n  level: error\n")
        await asyncio.sleep(0.3)
        watcher.cancel()
        assert d.config.logging.level == "error"  # polled again, at the reloaded interval

    asyncio.run(main())


def test_bearer_parsing() -> None:
    assert bearer_key("Bearer k") == bearer_key("bearer   k \t") == bearer_key(" BEARER k") == "k"
    assert bearer_key("Bearer \xa0k") == "\xa0k" and bearer_key("Bearer k\x0b") == "k\x0b"
    for header in (None, "", "Bearer", "Bearer ", "Basic k", "Token k", "k", "Bearerk"):
        assert bearer_key(header) is None, header
    keys = {hash_api_key("k"): "ops"}
    assert lookup("Bearer k", keys) == "ops" and lookup("Bearer \xa0k", keys) is None
    utf8 = "clé".encode().decode("latin-1")  # how a UTF-8 key arrives in a header
    assert lookup(f"Bearer {utf8}", {hash_api_key("clé"): "ok"}) == "ok"


