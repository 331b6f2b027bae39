"""`python -m edged.bench.quic_cc_daemon serve ...`: `edged serve` with the server's QUIC congestion
control and initial RTT set from the environment, for `edged bench network` to compare settings
before the daemon has config keys for them.

    EDGED_BENCH_QUIC_CC=cubic|reno     QuicConfiguration.congestion_control_algorithm
    EDGED_BENCH_QUIC_INITIAL_RTT_MS=N  QuicConfiguration.initial_rtt (the PTO before the first RTT sample)

The override is installed at import, at module level: the daemon's worker processes are started
with multiprocessing "spawn", which imports the parent's main module (this one) in each child, so
the workers that run QUIC get it too. Server configurations only; a client's are left as made.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from aioquic.quic.configuration import QuicConfiguration

CC_ENV = "EDGED_BENCH_QUIC_CC"
INITIAL_RTT_ENV = "EDGED_BENCH_QUIC_INITIAL_RTT_MS"


def install_override() -> None:
    cc = os.environ.get(CC_ENV)
    initial_rtt_ms = os.environ.get(INITIAL_RTT_ENV)
    if not cc and not initial_rtt_ms:
        return
    made = QuicConfiguration.__init__
    if getattr(made, "edged_bench_override", False):
        return

    def init(self: QuicConfiguration, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        if not self.is_client:
            if cc:
                self.congestion_control_algorithm = cc
            if initial_rtt_ms:
                self.initial_rtt = float(initial_rtt_ms) / 1000.0

    init.edged_bench_override = True  # type: ignore[attr-defined]
    QuicConfiguration.__init__ = init  # type: ignore[method-assign]


install_override()

if __name__ == "__main__":
    from edged.cli import main

    sys.exit(main())
