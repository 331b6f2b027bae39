"""QUIC congestion control for token streams: aioquic's New Reno with a floor on the window.

A stream of tokens is application-limited: one engine step of 8 streams is ~1.2 KB of SSE events
every ~20 ms. aioquic's `reno` and `cubic` shrink the window at every loss, down to 2 datagrams on
persistent congestion, so on a randomly lossy path (Wi-Fi, cellular) the sender ends up queueing
tokens behind its own window. `reno-floor` never lets the window (nor ssthresh) drop below the
initial window of 10 datagrams, the burst any new connection may send anyway. Measured with `edged
bench network` (docs/BENCHMARKS.md, "Loss and latency lab"): at 25 ms one way and 1 / 3 / 5% loss the
inter-token gap p99 is 82 / 96 / 97 ms against 85-89 / 109-125 / 202-204 for reno, and the worst
stall 101-180 ms against reno's 675 ms. The cost: below 10 datagrams a round trip it does not back off
further, which RFC 9002 (minimum window 2 datagrams) would; for an app-limited flow of this size
that is the trade edged makes. `server.quic.congestion_control: reno` restores aioquic's default.
"""
from __future__ import annotations

from typing import Any

from aioquic.quic.congestion.base import K_INITIAL_WINDOW, register_congestion_control
from aioquic.quic.congestion.reno import RenoCongestionControl

RENO_FLOOR = "reno-floor"


class RenoFloorCongestionControl(RenoCongestionControl):
    """New Reno whose congestion window and ssthresh stay >= the initial window."""

    def _floor(self) -> None:
        floor = K_INITIAL_WINDOW * self._max_datagram_size
        self.congestion_window = max(self.congestion_window, floor)
        if self.ssthresh is not None:
            self.ssthresh = max(self.ssthresh, floor)

    def on_packets_lost(self, *, now: float, packets: Any) -> None:
        super().on_packets_lost(now=now, packets=packets)
        self._floor()

    def on_persistent_congestion(self) -> None:
        super().on_persistent_congestion()
        self._floor()


register_congestion_control(RENO_FLOOR, RenoFloorCongestionControl)
