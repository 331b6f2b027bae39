"""CPU use of a process and all its descendants over an interval (psutil), one entry per process.

The daemon is a supervisor, an engine core and front-end workers: which of them is saturated says
where the bottleneck is, so each process gets its own number, in % of one core (100 = one core
busy for the whole interval; user + system time of the process itself, its threads included).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

INTERPRETERS = ("python", "pypy")  # process names that say nothing: label by command line instead


@dataclass(slots=True)
class ProcessCpu:
    pid: int
    label: str  # short, for a column header: the process name, or what its command line runs
    cmdline: str
    cpu_s: float  # CPU seconds within the interval
    cpu_pct: float  # % of one core over the interval


def short_label(name: str, args: list[str]) -> str:
    """A short label: the process name when it was set to say something ("edged-worker-3"), else what the
    interpreter runs: "edged.cli serve" for `python -m edged.cli serve ...`, "spawn child" for a
    multiprocessing child, else the script's file name."""
    if name and not name.lower().startswith(INTERPRETERS):
        return name
    rest = args[1:]
    if "-m" in rest and rest.index("-m") + 1 < len(rest):
        i = rest.index("-m")
        words = [rest[i + 1]] + [a for a in rest[i + 2: i + 3] if not a.startswith("-")]
        return " ".join(words)
    joined = " ".join(rest)
    if "multiprocessing" in joined:
        return "resource tracker" if "resource_tracker" in joined else "spawn child"
    script = next((a for a in rest if not a.startswith("-")), "")
    return os.path.basename(script) or name or "?"


def _snapshot(p: Any) -> tuple[float, float, str, str] | None:
    """(CPU seconds so far, create time, label, command line); None for a process that is gone."""
    import psutil

    try:
        t = p.cpu_times()
        args = p.cmdline()
        return t.user + t.system, p.create_time(), short_label(p.name(), args), " ".join(args)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


class TreeCpu:
    """`start()` then `stop()`: each process of the tree rooted at `pid` with its CPU use in between.
    A process that started within the interval counts from zero; one that ended within it is left out
    (its last CPU times are gone with it)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self._t0 = 0.0
        self._before: dict[int, tuple[float, float]] = {}  # pid -> (CPU seconds, create time)

    def processes(self) -> list[Any]:
        import psutil

        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def start(self) -> None:
        self._before = {p.pid: (snap[0], snap[1]) for p in self.processes() if (snap := _snapshot(p))}
        self._t0 = time.perf_counter()

    def stop(self, wall_s: float | None = None) -> list[ProcessCpu]:
        """`wall_s`: divide by this instead of the time since start(), e.g. a benchmark phase's own
        duration, when start() and stop() also enclose idle moments around it."""
        wall = max(wall_s if wall_s is not None else time.perf_counter() - self._t0, 1e-9)
        out = []
        for p in self.processes():
            if (snap := _snapshot(p)) is None:
                continue
            cpu, created, label, cmdline = snap
            before_cpu, before_created = self._before.get(p.pid, (0.0, created))
            # the same pid with another start time is a new process (the pid was reused)
            used = max(0.0, cpu - (before_cpu if before_created == created else 0.0))
            out.append(ProcessCpu(p.pid, label, cmdline, round(used, 3), round(100 * used / wall, 1)))
        return out
