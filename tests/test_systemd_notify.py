"""sd_notify over a real AF_UNIX datagram socket, the watchdog interval, and the liveness-gated watchdog."""
from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time

import pytest

from edged.systemd import Heartbeat, Notifier, Watchdog, watchdog_interval


@pytest.fixture
def notify_socket(monkeypatch):
    """A bound datagram socket standing in for systemd; $NOTIFY_SOCKET points at it."""
    with tempfile.TemporaryDirectory(prefix="sdn") as d:  # short path: sun_path holds 108 bytes
        path = os.path.join(d, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        yield sock
        sock.close()


def recv(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def pending(sock: socket.socket) -> list[list[str]]:
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096).decode().split("\n"))
    except BlockingIOError:
        return out
    finally:
        sock.settimeout(2)


def test_messages(notify_socket):
    n = Notifier()
    assert n.enabled
    assert n.ready("Serving on 0.0.0.0:4433")
    assert recv(notify_socket) == ["READY=1", "STATUS=Serving on 0.0.0.0:4433"]
    assert n.ready()
    assert recv(notify_socket) == ["READY=1"]
    assert n.stopping()
    assert recv(notify_socket) == ["STOPPING=1", "STATUS=Draining requests"]
    assert n.watchdog()
    assert recv(notify_socket) == ["WATCHDOG=1"]
    assert n.status("loading model\nstep 2")  # one line: a newline would start a new field
    assert recv(notify_socket) == ["STATUS=loading model step 2"]
    assert n.extend_timeout(90)
    assert recv(notify_socket) == ["EXTEND_TIMEOUT_USEC=90000000"]
    n.close()
    assert not n.enabled and not n.watchdog()


def test_reloading_carries_monotonic_usec(notify_socket):
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert Notifier().reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    fields = recv(notify_socket)
    assert fields[0] == "RELOADING=1" and fields[2] == "STATUS=Reloading configuration"
    key, _, usec = fields[1].partition("=")
    assert key == "MONOTONIC_USEC" and before <= int(usec) <= after


def test_abstract_socket(monkeypatch):
    name = f"edged-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert Notifier().ready()
        assert recv(sock) == ["READY=1"]


def test_explicit_path_overrides_environment(notify_socket, monkeypatch):
    path = notify_socket.getsockname()
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not Notifier().enabled
    assert Notifier(path).watchdog()
    assert recv(notify_socket) == ["WATCHDOG=1"]


@pytest.mark.parametrize("value", [None, "", "relative/path", "vsock:2:1234"])
def test_no_socket_means_no_op(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    else:
        monkeypatch.setenv("NOTIFY_SOCKET", value)
    n = Notifier()
    assert not n.enabled
    assert not n.ready("x") and not n.reloading() and not n.stopping() and not n.watchdog() and not n.status("x")


def test_send_failure_is_logged_not_raised(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    n = Notifier()
    assert n.enabled and n.ready() is False
    assert "sd_notify READY failed" in caplog.text


@pytest.mark.parametrize("env, expected", [
    ({"WATCHDOG_USEC": "30000000"}, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "OWN"}, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({}, None),
])
def test_watchdog_interval(monkeypatch, env, expected):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, str(os.getpid()) if v == "OWN" else v)
    assert watchdog_interval() == expected


def test_watchdog_pings_only_while_alive(notify_socket, caplog):
    alive = [True]
    wd = Watchdog(Notifier(), lambda: alive[0], interval=1)
    assert wd.tick()
    assert recv(notify_socket) == ["WATCHDOG=1"]
    alive[0] = False
    assert not wd.tick() and not wd.tick()
    assert pending(notify_socket) == []
    assert "withholding watchdog pings" in caplog.text
    alive[0] = True
    assert wd.tick()
    assert recv(notify_socket) == ["WATCHDOG=1"]


def test_watchdog_treats_a_failing_check_as_dead(notify_socket):
    def broken() -> bool:
        raise RuntimeError("engine gone")

    assert not Watchdog(Notifier(), broken, interval=1).tick()
    assert pending(notify_socket) == []


def test_watchdog_task_follows_the_engine_heartbeat(notify_socket):
    hb = Heartbeat(max_age=0.5)

    async def scenario() -> tuple[int, int]:
        task = asyncio.create_task(Watchdog(Notifier(), hb.is_alive, interval=0.02).run())
        for _ in range(10):  # the engine loop beats: pings flow
            hb.beat()
            await asyncio.sleep(0.02)
        alive_pings = len(pending(notify_socket))
        await asyncio.sleep(0.6)  # engine stalls; the heartbeat ages past max_age
        pending(notify_socket)
        await asyncio.sleep(0.3)
        stalled_pings = len(pending(notify_socket))
        task.cancel()
        return alive_pings, stalled_pings

    alive_pings, stalled_pings = asyncio.run(scenario())
    assert alive_pings >= 3
    assert stalled_pings == 0


def test_watchdog_task_returns_without_a_watchdog(monkeypatch, notify_socket):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    wd = Watchdog(Notifier(), lambda: True)
    assert wd.interval is None
    asyncio.run(asyncio.wait_for(wd.run(), 1))  # returns at once
    assert pending(notify_socket) == []


def test_heartbeat():
    hb = Heartbeat(max_age=0.05)
    assert hb.is_alive()
    time.sleep(0.08)
    assert not hb.is_alive() and hb.age >= 0.05
    hb.beat()
    assert hb.is_alive()
