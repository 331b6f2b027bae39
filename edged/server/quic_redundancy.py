"""Small 1-RTT datagrams sent twice: token streams that do not wait for loss recovery.

A streamed token is a few dozen bytes; an engine step's tokens for every stream of a connection fit
in one datagram. When that datagram is lost, every stream in it waits for QUIC's loss recovery: the
loss is detected only after a later packet is acknowledged (a round trip or more) and the data is
sent again, so one random loss costs the streams a gap of one to two round trips, whatever the
congestion controller. Sending such a datagram twice (a second copy `delay_s` later) makes a stall
need both copies lost: 0.09% of steps instead of 3% at 3% random loss. The receiver discards the
copy it does not need (RFC 9000 12.3: a packet number is processed once), and the sender's loss
recovery sees one packet, acknowledged when either copy arrives.

Only short-header (1-RTT) datagrams of at most `max_bytes` are copied, and only while the connection
is application-limited (`light()`: less than half its congestion window in flight, as a token stream
is): handshake packets and bulk data that fills the window (a long completion, the chat page) go
once, so the copies never double a sender that the congestion controller is pacing. The cost is the
copies' bytes and one more send per datagram of a token stream: about twice its upstream packets.
`server.quic.duplicate_datagram_bytes` sets max_bytes (0: off); `edged bench network` measures it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class DuplicatingTransport:
    """A datagram transport that sends each small 1-RTT datagram twice, `delay_s` apart; everything
    else is the wrapped transport's (the listener shares one among all connections)."""

    def __init__(self, transport: asyncio.DatagramTransport, max_bytes: int, delay_s: float,
                 loop: asyncio.AbstractEventLoop, light: Callable[[], bool] = lambda: True) -> None:
        self._transport = transport
        self._light = light
        self.max_bytes = max_bytes
        self.delay_s = delay_s
        self._loop = loop
        self.copies_sent = 0

    def sendto(self, data: bytes, addr: Any = None) -> None:
        self._transport.sendto(data, addr)
        if len(data) <= self.max_bytes and data and not data[0] & 0x80 and self._light():  # short header: 1-RTT
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
