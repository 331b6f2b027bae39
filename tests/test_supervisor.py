"""The supervisor's own decisions, without child processes: the shared UDP port, the worker count,
and when the systemd watchdog may be pinged."""
from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest

import edged.daemon as daemon_module
from edged.config import Config, auto_workers
from edged.daemon import Child, Daemon, bind_udp


def test_workers_auto_leaves_the_engine_core_a_core_and_caps_at_eight() -> None:
    assert [auto_workers("auto", n) for n in (1, 2, 3, 9, 16, 64)] == [1, 1, 2, 8, 8, 8]
    assert auto_workers("3", 16) == 3


def test_the_workers_sockets_share_one_port_and_port_0_picks_one_for_all() -> None:
    socks = bind_udp("127.0.0.1", 0, 3)
    try:
        ports = {s.getsockname()[1] for s in socks}
        assert len(ports) == 1 and ports != {0}
        assert all(s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for s in socks)
        with pytest.raises(OSError):  # a socket outside the group cannot take the port
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
                other.bind(("127.0.0.1", ports.pop()))
    finally:
        for s in socks:
            s.close()


def test_a_port_in_use_is_a_clear_error() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        with pytest.raises(OSError, match=r"cannot listen on udp 127\.0\.0\.1:\d+"):
            bind_udp("127.0.0.1", taken.getsockname()[1], 2)


def test_a_port_held_by_another_daemons_socket_group_is_refused_not_shared() -> None:
    first = bind_udp("127.0.0.1", 0, 2)  # another edged: an SO_REUSEPORT group that a second one could join
    port = first[0].getsockname()[1]
    try:
        with pytest.raises(OSError, match=r"cannot listen on udp 127\.0\.0\.1:\d+: address already in use"):
            bind_udp("127.0.0.1", port, 2)
    finally:
        for s in first:
            s.close()
    again = bind_udp("127.0.0.1", port, 2)  # once it is gone, the port is free
    for s in again:
        s.close()


def test_an_ipv6_port_in_use_is_named_in_brackets() -> None:
    first = bind_udp("::1", 0, 1)
    try:
        with pytest.raises(OSError, match=r"cannot listen on udp \[::\]:\d+: address already in use"):
            bind_udp("::", first[0].getsockname()[1], 1)  # the wildcard overlaps the loopback holder
    finally:
        first[0].close()


def child(name: str, beat_age_s: float, alive: bool = True) -> Child:
    proc = SimpleNamespace(is_alive=lambda: alive)
    return Child(name, proc, None, None, last_beat=time.monotonic() - beat_age_s)  # type: ignore[arg-type]


def test_the_watchdog_is_fed_only_while_every_process_sends_heartbeats(tmp_path) -> None:
    d = Daemon(Config(), None, {}, str(tmp_path))
    d.core = child("core", 0.1)
    d.workers = {"w0": child("w0", 0.2), "w1": child("w1", 0.3)}
    assert d.all_alive()
    d.workers["w1"] = child("w1", daemon_module.STALL_S + 1)  # a stalled worker (or a core whose engine hangs)
    assert not d.all_alive()
    d.workers["w1"] = child("w1", 0.1, alive=False)  # a dead one, before its restart
    assert not d.all_alive()
    d.workers["w1"] = child("w1", 0.1)
    d.core = child("core", daemon_module.STALL_S + 1)  # the core sends heartbeats only while its engine steps
    assert not d.all_alive()
