"""sd_notify over $NOTIFY_SOCKET without libsystemd, and the watchdog that pings only while the engine lives.

Protocol (sd_notify(3)): one AF_UNIX datagram of newline-separated `KEY=VALUE` lines to the path in
$NOTIFY_SOCKET ("@name" is an abstract socket). Without $NOTIFY_SOCKET every call is a no-op, so the
daemon calls these unconditionally.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable

log = logging.getLogger("edged.systemd")


def _address(value: str | None) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    log.warning("NOTIFY_SOCKET=%r is not a path or an abstract socket; not notifying systemd", value)
    return None


class Notifier:
    """Tells systemd about the service's state. Thread-safe; never raises (a lost datagram is logged)."""

    def __init__(self, socket_path: str | None = None) -> None:
        """socket_path: the notify socket; None reads $NOTIFY_SOCKET."""
        self._address = _address(os.environ.get("NOTIFY_SOCKET") if socket_path is None else socket_path)
        self._sock: socket.socket | None = None
        if self._address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.settimeout(0.5)  # systemd drains the socket at once; never stall the loop for long

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *lines: str) -> bool:
        """Send `KEY=VALUE` lines as one message; True if it was sent."""
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(lines).encode(), self._address)
        except OSError as e:
            log.warning("sd_notify %s failed: %s", lines[0].split("=")[0] if lines else "", e)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Start-up (or a reload) finished: the model is loaded and a warm-up step ran."""
        return self.notify("READY=1", *_status(status))

    def reloading(self, status: str | None = "Reloading configuration") -> bool:
        """A reload started; call ready() when it is done. MONOTONIC_USEC is what systemd >= 253
        requires for Type=notify-reload (and accepts on older versions)."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}", *_status(status))

    def stopping(self, status: str | None = "Draining requests") -> bool:
        return self.notify("STOPPING=1", *_status(status))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        """Free-form one-line status shown by `systemctl status`."""
        return self.notify(*_status(text))

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for more time to start or stop (e.g. a slow model load): the current start/stop
        timeout becomes at least `seconds` from now."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status(text: str | None) -> tuple[str, ...]:
    return () if text is None else ("STATUS=" + " ".join(text.splitlines()),)


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half of WatchdogSec=), or None when systemd expects none."""
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 2e6


class Heartbeat:
    """Liveness of the engine loop: it calls beat() every iteration, idle ones included (wait for work
    with a timeout); is_alive() is true while the last beat is younger than max_age seconds."""

    __slots__ = ("max_age", "_last")

    def __init__(self, max_age: float = 20.0) -> None:
        self.max_age = max_age
        self._last = time.monotonic()

    def beat(self) -> None:
        self._last = time.monotonic()

    @property
    def age(self) -> float:
        return time.monotonic() - self._last

    def is_alive(self) -> bool:
        return self.age < self.max_age


class Watchdog:
    """Pings the systemd watchdog while is_alive() says the engine makes progress, so a hung engine
    gets the service restarted. Run as `asyncio.create_task(Watchdog(notifier, hb.is_alive).run())`."""

    def __init__(self, notifier: Notifier, is_alive: Callable[[], bool], interval: float | None = None) -> None:
        """interval: seconds between checks; None takes watchdog_interval() (no watchdog: run() returns)."""
        self.notifier = notifier
        self.is_alive = is_alive
        self.interval = watchdog_interval() if interval is None else interval
        self._stalled = False

    def tick(self) -> bool:
        """One check: ping if alive. Returns whether it pinged."""
        try:
            alive = bool(self.is_alive())
        except Exception:
            log.exception("watchdog liveness check failed")
            alive = False
        if alive != (not self._stalled):
            self._stalled = not alive
            if alive:
                log.warning("engine loop is alive again; watchdog pings resume")
            else:
                log.error("engine loop made no progress; withholding watchdog pings (systemd will restart edged)")
        return alive and self.notifier.watchdog()

    async def run(self) -> None:
        if not self.interval or not self.notifier.enabled:
            return
        while True:
            self.tick()
            await asyncio.sleep(self.interval)
