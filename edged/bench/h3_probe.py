"""One HTTP/3 request on a fresh aioquic connection, sent with the first flight, for timing a
returning client: `aioquic.asyncio.client.connect(..., wait_connected=False)` with this protocol
sends the request at once, so with a session ticket that allows early data it travels in 0-RTT
packets (QuicConfiguration.session_ticket; the next ticket arrives via session_ticket_handler),
and without one it leaves as soon as the handshake has 1-RTT keys. It records when the first
token arrives and whether the server accepted the early data.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from aioquic.asyncio import QuicConnectionProtocol
from aioquic.h3.connection import H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, QuicEvent, StreamReset


def carries_token(event: bytes) -> bool:
    """An SSE event whose chat chunk has content (the first, role-only chunk has none)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            chunk = json.loads(line[5:])
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                return True
    return False


class ProbeProtocol(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.http = H3Connection(self._quic)
        self.stream_id: int | None = None
        self.status = 0
        self.first_token = asyncio.Event()
        self.done = asyncio.Event()
        self.early_data_accepted: bool | None = None
        self.session_resumed: bool | None = None
        self.error: str | None = None
        self._buf = b""

    def send_request(self, host: str, port: int, path: str, headers: Mapping[str, str], body: bytes) -> None:
        sid = self._quic.get_next_available_stream_id()
        self.stream_id = sid
        h = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", f"{host}:{port}".encode()),
             (b":path", path.encode()), (b"content-length", str(len(body)).encode())]
        h += [(k.encode(), v.encode()) for k, v in headers.items()]
        self.http.send_headers(sid, h)
        self.http.send_data(sid, body, end_stream=True)
        self.transmit()

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
        self.first_token.set()
        self.done.set()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.early_data_accepted = event.early_data_accepted
            self.session_resumed = event.session_resumed
        elif isinstance(event, ConnectionTerminated) and not self.done.is_set():
            self._fail(f"connection closed: {event.reason_phrase or event.error_code}")
        elif isinstance(event, StreamReset) and event.stream_id == self.stream_id:
            self._fail(f"stream reset (error {event.error_code:#x})")
        for h3 in self.http.handle_event(event):
            if getattr(h3, "stream_id", None) != self.stream_id:
                continue
            if isinstance(h3, HeadersReceived):
                self.status = int(dict(h3.headers).get(b":status", b"0"))
                if self.status != 200:
                    self._fail(f"HTTP {self.status}")
            elif isinstance(h3, DataReceived):
                self._buf += h3.data.replace(b"\r\n", b"\n")
                while b"\n\n" in self._buf:
                    event, self._buf = self._buf.split(b"\n\n", 1)
                    if carries_token(event):
                        self.first_token.set()
            if getattr(h3, "stream_ended", False):
                self.first_token.set()
                self.done.set()
