"""Small 1-RTT datagrams sent twice: token streams that do not wait for loss recovery.

A streamed token is a few dozen bytes; an engine step's tokens for every stream of a connection fit
in one datagram. When that datagram is lost, every stream in it waits for QUIC's loss recovery: the
loss is detected only after a later packet is acknowledged (a round trip or more) and the data is
sent again, so one random loss costs the streams a gap of one to two round trips, whatever the
congestion controller. Sending such a datagram twice (a second copy `delay_s` later) makes a stall
need both copies lost: 0.09% of steps instead of 3% at 3% random loss. The receiver discards the
copy it does not need (RFC 9000 12.3: a packet number is processed once), and the sender's loss
recovery sees one packet, acknowledged when either copy arrives.

Only short-header (1-RTT) datagrams of at most `max_bytes` are copied, and only when `CopyRule`
says so: while the connection is application-limited (less than half its congestion window in
flight, as a token stream is), so handshake packets and bulk data that fills the window (a long
completion, the chat page) go once and the copies never double a sender that the congestion
controller is pacing; and, by default, only for `after_loss_s` after the connection's last loss, so
a clean path carries no copies at all and a lossy one is covered from its first loss on (that one
loss still costs its streams a repair). The cost where they run is the copies' bytes and one more
send per datagram of a token stream: about twice its upstream packets.
`server.quic.duplicate_datagram_bytes` sets max_bytes (0: off), `duplicate_after_loss_s` the memory
(0: copy from the first datagram, loss or not); `edged bench network` measures both.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aioquic.quic.recovery import QuicPacketRecovery


def last_loss_at(recovery: QuicPacketRecovery) -> float:
    """When the connection's congestion controller last entered recovery (a new loss episode), on the
    event loop's clock; 0.0 if never. aioquic's reno and cubic (so reno-floor too) keep this time."""
    return getattr(recovery._cc, "_congestion_recovery_start_time", 0.0)


@dataclass(frozen=True, slots=True)
class CopyRule:
    """Whether a connection's small datagrams are sent twice now."""

    after_loss_s: float  # only this long after the connection's last loss; 0: loss or not

    def applies(self, recovery: QuicPacketRecovery, now: float) -> bool:
        """Asked for every small 1-RTT datagram: the loss test first, false on a clean connection."""
        if self.after_loss_s > 0:
            lost_at = last_loss_at(recovery)
            if lost_at <= 0 or now - lost_at > self.after_loss_s:
                return False
        # application-limited only: a sender that fills its window is the congestion controller's to pace
        return 2 * recovery.bytes_in_flight <= recovery.congestion_window


class DuplicatingTransport:
    """A datagram transport that sends each small 1-RTT datagram twice, `delay_s` apart; everything
    else is the wrapped transport's (the listener shares one among all connections)."""

    def __init__(self, transport: asyncio.DatagramTransport, max_bytes: int, delay_s: float,
                 loop: asyncio.AbstractEventLoop, copy_now: Callable[[], bool] = lambda: True) -> None:
        self._transport = transport
        self._copy_now = copy_now  # asked per datagram (CopyRule through the connection)
        self.max_bytes = max_bytes
        self.delay_s = delay_s
        self._loop = loop
        self.copies_sent = 0

    def sendto(self, data: bytes, addr: Any = None) -> None:
        self._transport.sendto(data, addr)
        if len(data) <= self.max_bytes and data and not data[0] & 0x80 and self._copy_now():  # short header: 1-RTT
            if self.delay_s > 0:
                self._loop.call_later(self.delay_s, self._copy, data, addr)
            else:
                self._copy(data, addr)

    def _copy(self, data: bytes, addr: Any) -> None:
        if not self._transport.is_closing():
            self._transport.sendto(data, addr)
            self.copies_sent += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
