"""A delay line between two TUN devices: every IP packet read from one is written to the other
after a fixed one-way delay, in order. `edged bench network` puts one TUN in the client's network
namespace and the other in the daemon's, so this is the whole path between them.

The kernel here has no netem, and a TCP relay would split the connection in two (each half would
retransmit over its own short round trip); a packet-level delay keeps QUIC's and TCP's loss
recovery end to end, paying the whole round trip as on a real link. It runs on a thread of its
own (the benchmark's main thread only waits on its client and daemon processes).
"""
from __future__ import annotations

import fcntl
import os
import selectors
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000  # bare IP packets, no 4-byte packet-information header
MAX_PACKET = 65536
EARLY_S = 0.0002  # a packet due within this is written now rather than after one more wake-up


def open_tun(name: str) -> int:
    """A non-blocking fd of a new TUN device `name` (it disappears when the fd closes)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class Direction:
    """Packets read from `src`, waiting to be written to `dst` at their due time."""

    src: int
    dst: int
    queue: deque[tuple[float, bytes]] = field(default_factory=deque)
    packets: int = 0


@dataclass
class DelayWire:
    """Two TUN devices, `names[0]` <-> `names[1]`, with `delay_s` added each way; start() / close()."""

    names: tuple[str, str]
    delay_s: float = 0.0  # may be changed while running; packets already queued keep their due time
    _fds: list[int] = field(default_factory=list)
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _wake_r: int = -1
    _wake_w: int = -1
    _ways: dict[int, Direction] = field(default_factory=dict)
    error: BaseException | None = None

    def open(self) -> None:
        """Create both devices (the caller then moves them into their namespaces)."""
        for name in self.names:
            self._fds.append(open_tun(name))

    def start(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        a, b = self._fds
        self._ways = {a: Direction(a, b), b: Direction(b, a)}
        self._thread = threading.Thread(target=self._run, name="delay-wire", daemon=True)
        self._thread.start()

    @property
    def packets(self) -> int:
        """Packets carried so far, both ways (dropped ones included: the loss is in the namespaces)."""
        return sum(w.packets for w in self._ways.values())

    def close(self) -> None:
        self._stop.set()
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5)
        for fd in (*self._fds, self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._fds.clear()
        self._wake_r = self._wake_w = -1

    def _run(self) -> None:
        ways = self._ways
        sel = selectors.DefaultSelector()
        for fd in ways:
            sel.register(fd, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                due = min((w.queue[0][0] for w in ways.values() if w.queue), default=None)
                timeout = None if due is None else max(0.0, due - time.monotonic())
                for key, _ in sel.select(timeout):
                    if key.fd in ways:
                        self._read(ways[key.fd])
                now = time.monotonic()
                for w in ways.values():
                    self._flush(w, now)
        except BaseException as e:  # noqa: BLE001  (surfaced by the benchmark: a dead wire is a cut link)
            self.error = e
        finally:
            sel.close()

    def _read(self, way: Direction) -> None:
        while True:
            try:
                pkt = os.read(way.src, MAX_PACKET)
            except BlockingIOError:
                return
            way.packets += 1
            delay = self.delay_s
            if delay <= 0 and not way.queue:
                self._write(way.dst, pkt)
            else:
                way.queue.append((time.monotonic() + delay, pkt))

    def _flush(self, way: Direction, now: float) -> None:
        while way.queue and way.queue[0][0] <= now + EARLY_S:
            self._write(way.dst, way.queue.popleft()[1])

    @staticmethod
    def _write(fd: int, pkt: bytes) -> None:
        try:
            os.write(fd, pkt)
        except (BlockingIOError, OSError):
            pass  # the device's queue is full or it is down: the packet is lost, as on a congested link
