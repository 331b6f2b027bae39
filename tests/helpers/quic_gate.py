"""Hold a QUIC client's outgoing datagrams: its handshake stays incomplete at the server until released.

With a session ticket, the client's first flight (Initial + 0-RTT requests) goes out; installing
the gate right after keeps its Finished (and everything else) from the server. What the server
answers meanwhile it answered from 0-RTT data, before the handshake completed.
"""
from __future__ import annotations

from typing import Any

from edged.server.h3_client import H3Client


class DatagramGate:
    """Wraps the client protocol's transport; `release()` sends what was held and stops holding."""

    def __init__(self, client: H3Client) -> None:
        protocol = client._protocol
        assert protocol is not None, "connect first"
        self._protocol = protocol
        self._inner: Any = protocol._transport
        self.held: list[bytes] = []
        protocol._transport = self

    def sendto(self, data: bytes, addr: Any = None) -> None:
        self.held.append(data)

    def release(self) -> None:
        self._protocol._transport = self._inner
        for data in self.held:
            self._inner.sendto(data)
        self.held.clear()
        self._protocol.transmit()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
