"""`edged serve --config FILE` as a child process of a benchmark: start, wait for "ready ", SIGTERM."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

READY = "edged.daemon: ready "  # the supervisor's line once the model is warmed up and every worker serves
LOG_LINES = 200  # kept for the error message when the daemon fails


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` free for UDP (HTTP/3) and TCP (the h2/http1.1 listener), outside the kernel's
    ephemeral range: a port the kernel hands out (bind to 0) can meanwhile become some client
    connection's local port, and the daemon's TCP listen on it then fails."""
    low, high = _ephemeral_range()
    candidates = [p for p in range(10000, 65000) if not low <= p <= high]
    for port in random.sample(candidates, 200):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u, \
                    socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                u.bind((host, port))
                t.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no free loopback port outside the ephemeral range")


@dataclass
class LocalDaemon:
    proc: subprocess.Popen[str]
    log: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_LINES))
    ready: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def start(cls, config_path: Path) -> LocalDaemon:
        # Its own session: a Ctrl-C in the terminal reaches the benchmark, which then stops the daemon
        # with SIGTERM as it should, and a last-resort SIGKILL can take its whole process group.
        proc = subprocess.Popen([sys.executable, "-m", "edged.cli", "serve", "--config", str(config_path)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        d = cls(proc)
        threading.Thread(target=d._pump, name="edged-log", daemon=True).start()
        return d

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # read to the end, or the daemon blocks on a full pipe
            self.log.append(line)
            if READY in line:
                self.ready.set()

    def log_tail(self, lines: int = 40) -> str:
        return "".join(list(self.log)[-lines:])

    def wait_ready(self, timeout_s: float) -> None:
        """RuntimeError, with the end of the daemon's log, if it exits or is not ready in time."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.05):
            if self.proc.poll() is not None:
                time.sleep(0.1)  # let the pump take the last lines
                raise RuntimeError(f"edged serve exited with status {self.proc.returncode} before it was "
                                   f"ready:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"edged serve was not ready within {timeout_s:g} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (the daemon drains and exits); SIGKILL to its process group if it, or a process it
        left behind, is still there after `timeout_s`. The daemon's exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        try:
            status = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._kill_group()
            return self.proc.wait()
        # The daemon is reaped, so whatever is left in its group outlived it.
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._kill_group()
        return status

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this benchmark started, nothing else
        except ProcessLookupError:
            pass
