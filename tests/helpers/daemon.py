"""Start `edged serve` as a real process on a loopback port and wait until it is ready."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from edged.bench.local_daemon import free_port


@dataclass
class DaemonProcess:
    proc: subprocess.Popen
    port: int
    state_dir: Path
    config_path: Path | None
    lines: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"

    @property
    def ca_file(self) -> str:
        return str(self.state_dir / "tls" / "cert.pem")

    def log_text(self) -> str:
        return "".join(self.lines)

    def wait_for_log(self, needle: str, timeout: float = 60.0, start: int = 0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(needle in line for line in self.lines[start:]):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# The supervisor's line, once every worker serves ("engine core ready" and "worker ready" come before it).
SUPERVISOR_READY = "edged.daemon: ready "


def start_daemon(tmp: Path, config_text: str | None = None, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, ready_timeout: float = 240.0) -> DaemonProcess:
    port = free_port()
    state_dir = tmp / "state"
    config_path = None
    args = [sys.executable, "-m", "edged.cli", "serve", "--listen", f"127.0.0.1:{port}",
            "--state-dir", str(state_dir)]
    if config_text is not None:
        config_path = tmp / "config.yaml"
        config_path.write_text(config_text)
        args += ["--config", str(config_path)]
    args += extra_args or []
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    d = DaemonProcess(proc, port, state_dir, config_path)

    def pump() -> None:
        for line in proc.stdout:
            d.lines.append(line)

    threading.Thread(target=pump, daemon=True).start()
    if not d.wait_for_log(SUPERVISOR_READY, ready_timeout):
        d.stop(signal.SIGKILL)
        raise RuntimeError("edged did not become ready:\n" + d.log_text()[-4000:])
    return d


def write_config(path: Path, text: str) -> None:
    """Replace the file in one step (a reader sees the old file or the new one, never half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class NotifySocket:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET: `env` for start_daemon, then read
    what the daemon reports, one datagram (a list of `KEY=value` lines) at a time."""

    def __init__(self) -> None:
        import tempfile

        self._dir = tempfile.TemporaryDirectory(prefix="sdn")  # short: sun_path holds 108 bytes
        self.path = os.path.join(self._dir.name, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)

    @property
    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.path}

    def drain(self) -> list[list[str]]:
        """Every datagram already received."""
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                out.append(self.sock.recv(65536).decode().split("\n"))
        except BlockingIOError:
            return out
        finally:
            self.sock.setblocking(True)

    def wait_for(self, line: str, timeout: float = 60.0, seen: list[list[str]] | None = None) -> list[str]:
        """The next datagram holding `line` (e.g. "READY=1"); those before it are appended to `seen`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                fields = self.sock.recv(65536).decode().split("\n")
            except socket.timeout:
                break
            if line in fields:
                return fields
            if seen is not None:
                seen.append(fields)
        raise AssertionError(f"no {line} within {timeout}s; saw {seen}")

    def close(self) -> None:
        self.sock.close()
        self._dir.cleanup()


def status_of(fields: list[str]) -> str | None:
    """The STATUS= text of a notification, if it has one."""
    return next((f[len("STATUS="):] for f in fields if f.startswith("STATUS=")), None)
