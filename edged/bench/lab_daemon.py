"""`python -m edged.bench.lab_daemon serve ...`: `edged serve` with the knobs `edged bench network`
varies that the daemon has no config key for, read from the environment:

    EDGED_BENCH_QUIC_CC=reno|cubic|reno-floor  the server's QuicConfiguration.congestion_control_algorithm
                                       (reno-floor, the daemon's default: edged/server/quic_congestion.py)
    EDGED_BENCH_QUIC_INITIAL_RTT_MS=N  the server's QuicConfiguration.initial_rtt (the probe timeout
                                       before the first RTT sample)
    EDGED_BENCH_STEP_MS=N              every engine step takes at least N ms (it sleeps the rest)

The step floor paces a tiny random-weight model like a GPU serving a real one (8 streams at 20 ms
a step: 50 tokens/s each) and leaves the CPU idle between steps, so that on a small machine the
inter-token gaps measure the network path, not a busy core.

The overrides are installed at import, at module level: the daemon's engine core and workers are
started with multiprocessing "spawn", which imports the parent's main module (this one) in each
child, so the processes that run QUIC and the engine get them too.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from typing import Any

CC_ENV = "EDGED_BENCH_QUIC_CC"
INITIAL_RTT_ENV = "EDGED_BENCH_QUIC_INITIAL_RTT_MS"
STEP_MS_ENV = "EDGED_BENCH_STEP_MS"
CORE_PROCESS = "edged-core"  # the supervisor's name for the engine core process (multiprocessing sets it before
# importing this module in the child)


def install_quic_override(cc: str | None, initial_rtt_ms: str | None) -> None:
    """Server configurations only; a client's are left as made."""
    from aioquic.quic.configuration import QuicConfiguration

    from edged.server import quic_congestion  # noqa: F401  (registers reno-floor)

    made = QuicConfiguration.__init__

    def init(self: QuicConfiguration, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        if not self.is_client:
            if cc:
                self.congestion_control_algorithm = cc
            if initial_rtt_ms:
                self.initial_rtt = float(initial_rtt_ms) / 1000.0

    QuicConfiguration.__init__ = init  # type: ignore[method-assign]


def install_step_floor(step_ms: float) -> None:
    from edged.engine.llm_engine import LLMEngine

    floor_s = step_ms / 1000.0
    for name in ("step", "step_overlapped"):
        run = getattr(LLMEngine, name)

        def paced(self: LLMEngine, _run: Any = run) -> Any:
            t = time.perf_counter()
            out = _run(self)
            rest = floor_s - (time.perf_counter() - t)
            if rest > 0:
                time.sleep(rest)
            return out

        setattr(LLMEngine, name, paced)


def install_overrides() -> None:
    if os.environ.get(CC_ENV) or os.environ.get(INITIAL_RTT_ENV):
        install_quic_override(os.environ.get(CC_ENV), os.environ.get(INITIAL_RTT_ENV))
    step_ms = float(os.environ.get(STEP_MS_ENV) or 0)
    # The engine runs in the core process only; importing it (and torch) in the workers would slow their start.
    if step_ms > 0 and multiprocessing.current_process().name == CORE_PROCESS:
        install_step_floor(step_ms)


install_overrides()

if __name__ == "__main__":
    from edged.cli import main

    sys.exit(main())
