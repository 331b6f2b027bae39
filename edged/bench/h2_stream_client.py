"""A minimal HTTP/2 client (asyncio + the `h2` library) for timing token streams over TLS/TCP.

One task reads the socket and hands each stream's DATA to that stream's queue the moment it
arrives, so a token's arrival time is the socket's, whichever stream the caller is awaiting (httpx
reads HTTP/2 frames from inside the stream being awaited; on the same tokens it measured within a few
ms of this client: docs/BENCHMARKS.md, issue 17, session 11). `edged bench network` times HTTP/2 with it.
"""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

WINDOW = 16 << 20  # connection and stream windows: flow control never paces a token stream


class H2StreamError(Exception):
    pass


@dataclass
class H2Response:
    """One stream's response: status and headers once they arrive, then the body's chunks."""

    stream_id: int
    headers: asyncio.Future[dict[str, str]]
    chunks: asyncio.Queue[bytes | BaseException | None] = field(default_factory=asyncio.Queue)

    async def status(self) -> int:
        return int((await self.headers)[":status"])

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (item := await self.chunks.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    async def read(self) -> bytes:
        return b"".join([c async for c in self])


class H2StreamClient:
    """`async with H2StreamClient(host, port, ssl_context) as c`: requests multiplexed on one connection
    (the TCP + TLS handshake within connect_timeout seconds)."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext, connect_timeout: float = 20.0) -> None:
        self.host, self.port, self.context, self.connect_timeout = host, port, context, connect_timeout
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.responses: dict[int, H2Response] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pump: asyncio.Task[None] | None = None

    async def __aenter__(self) -> H2StreamClient:
        self._reader, self._writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, ssl=self.context, server_hostname=self.host),
            self.connect_timeout)
        alpn = self._writer.get_extra_info("ssl_object").selected_alpn_protocol()
        if alpn != "h2":
            self._writer.close()
            raise H2StreamError(f"the server chose ALPN {alpn!r}, not h2")
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW})
        self.conn.increment_flow_control_window(WINDOW)
        self._flush()
        self._pump = asyncio.create_task(self._read_frames())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._pump is not None:
            self._pump.cancel()
        if self._writer is not None:
            self.conn.close_connection()
            self._flush()
            self._writer.close()

    def request(self, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> H2Response:
        sid = self.conn.get_next_available_stream_id()
        head = [(":method", method), (":path", path), (":scheme", "https"), (":authority", f"{self.host}:{self.port}"),
                *headers.items()]
        if body:
            head.append(("content-length", str(len(body))))
        self.conn.send_headers(sid, head, end_stream=not body)
        if body:
            self.conn.send_data(sid, body, end_stream=True)
        resp = self.responses[sid] = H2Response(sid, asyncio.get_running_loop().create_future())
        self._flush()
        return resp

    def _flush(self) -> None:
        assert self._writer is not None
        if data := self.conn.data_to_send():
            self._writer.write(data)

    async def _read_frames(self) -> None:
        assert self._reader is not None
        error: BaseException = H2StreamError("the connection closed")
        try:
            while data := await self._reader.read(1 << 16):
                for event in self.conn.receive_data(data):
                    self._dispatch(event)
                self._flush()
        except (OSError, h2.exceptions.ProtocolError) as e:
            error = H2StreamError(f"{type(e).__name__}: {e}")
        for resp in self.responses.values():  # whatever is still open ends with the connection
            if not resp.headers.done():
                resp.headers.set_exception(error)
            resp.chunks.put_nowait(error)

    def _dispatch(self, event: h2.events.Event) -> None:
        resp = self.responses.get(getattr(event, "stream_id", 0))
        if resp is None:
            return
        if isinstance(event, h2.events.ResponseReceived):
            resp.headers.set_result(dict(event.headers))
        elif isinstance(event, h2.events.DataReceived):
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            resp.chunks.put_nowait(event.data)
        elif isinstance(event, h2.events.StreamEnded):
            resp.chunks.put_nowait(None)
            del self.responses[event.stream_id]
        elif isinstance(event, h2.events.StreamReset):
            err = H2StreamError(f"stream reset by the server (error code {event.error_code})")
            if not resp.headers.done():
                resp.headers.set_exception(err)
            resp.chunks.put_nowait(err)
            del self.responses[event.stream_id]
