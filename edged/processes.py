"""What every child process of the daemon (the engine core, the front-end workers) sets up first."""
from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

from edged.log import setup_logging

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def child_setup(name: str, log_level: str) -> None:
    """Log lines name the process; the child dies with the supervisor (never an orphan holding the
    GPU or the port); Ctrl-C reaches the whole process group, but only the supervisor acts on it."""
    setup_logging(log_level, name)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(PR_SET_NAME, f"edged-{name}".encode()[:15])  # what ps, top and psutil show
    except (OSError, AttributeError):  # not Linux: the control pipe's EOF still ends the child
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def process_table(run_dir: str) -> list[tuple[str, int]]:
    """(role, pid) of every process of the daemon: each writes run_dir/proc/ROLE with its pid."""
    out = []
    for f in sorted(Path(run_dir, "proc").glob("*")):
        try:
            out.append((f.name, int(f.read_text())))
        except (OSError, ValueError):
            continue
    return out


def register_process(run_dir: str, role: str) -> None:
    path = Path(run_dir, "proc")
    path.mkdir(exist_ok=True)
    tmp = path / f".{role}.tmp"
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, path / role)
