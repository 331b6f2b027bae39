"""HTTP/1.1 and HTTP/2 over TLS/TCP, on the same port and the same router as HTTP/3.

For clients without QUIC (the `openai` SDK on httpx, curl without --http3, proxies): one asyncio
Protocol per TCP connection; TLS (the HTTP/3 certificate) with ALPN picks `h2` or `http/1.1`, and
the sans-IO `h2` / `h11` state machines (the same family as aioquic's HTTP/3) do the framing. Each
request is an `HttpRequest` (request.py), so routes, limits, auth, errors, metrics and drain are
the HTTP/3 ones; every response advertises HTTP/3 with Alt-Svc.

A connection that closes, or an HTTP/2 stream reset, cancels the handler task and so the engine
sequence. Writes wait (bounded by send_stall_timeout_s) while the transport's write buffer is over
send_high_water (HTTP/1.1 and HTTP/2) or the stream's HTTP/2 flow-control window is closed.
"""
from __future__ import annotations

import asyncio
import http
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h11

from edged.log import fields
from edged.server import openai_wire as wire
from edged.server.request import HttpRequest, merge_headers

if TYPE_CHECKING:
    from edged.server.h3_server import EdgedServer

__all__ = ["TcpListener", "serve_tcp"]

log = logging.getLogger("edged.server")

ALPN = ["h2", "http/1.1"]
MAX_HEAD_BYTES = 64 * 1024  # request line + headers (HTTP/1.1) / header list (HTTP/2)
ALT_SVC_MAX_AGE_S = 86400
DISCARD_LIMIT_FACTOR = 16  # an answered HTTP/1.1 request's body is read and dropped up to this x max_body_bytes


def _reason(status: int) -> bytes:
    """The status line's phrase ("200 OK"): h11 leaves it empty, which some HTTP/1.1 clients show as is."""
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


class TcpConnection(asyncio.Protocol):
    """One TLS connection; after the handshake its ALPN choice picks an H11Session or an H2Session."""

    def __init__(self, listener: TcpListener) -> None:
        self.listener = listener
        self.server = listener.server
        self.loop = listener.loop
        self.transport: asyncio.Transport | None = None
        self.session: H11Session | H2Session | None = None
        self.peer: str | None = None
        self.paused = False  # the transport's write buffer is over send_high_water
        self.lost = False
        self._waiters: list[asyncio.Future[None]] = []
        self._last_io = self.loop.time()
        self._idle: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TLS transport is duck-typed
        high = self.server.settings.send_high_water
        transport.set_write_buffer_limits(high=high, low=high // 2)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if peer else None
        ssl_object = transport.get_extra_info("ssl_object")
        alpn = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        self.listener.connections.add(self)
        self.session = H2Session(self) if alpn == "h2" else H11Session(self)
        self._arm_idle(self.server.settings.idle_timeout_s)

    def data_received(self, data: bytes) -> None:
        self._last_io = self.loop.time()
        try:
            assert self.session is not None
            self.session.data_received(data)
        except Exception:  # never let one connection's bug take the listener's loop callback down
            log.exception("tcp connection failed %s", fields(peer=self.peer))
            self.abort()

    def eof_received(self) -> bool:
        if self.session is not None:
            self.session.eof_received()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.listener.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self.session is not None:
            self.session.connection_lost()
        self.wake()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.wake()

    # ---- helpers for the sessions and their requests

    @property
    def alt_svc(self) -> str:
        return self.listener.alt_svc

    def write(self, data: bytes) -> None:
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def buffered(self) -> int:
        if self.transport is None or self.transport.is_closing():
            return 0
        return self.transport.get_write_buffer_size()

    def close(self) -> None:
        """Close once what is buffered went out."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        """Close now, dropping what is buffered (a stalled or broken peer)."""
        if self.transport is not None:
            self.transport.abort()

    def wake(self) -> None:
        """Something a writer may be waiting for changed (buffer drained, window opened, connection gone)."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_until(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait until `ready()` (or the connection is gone); False after `timeout` seconds."""
        deadline = self.loop.time() + timeout
        while not ready() and not self.lost:
            left = deadline - self.loop.time()
            if left <= 0:
                return False
            fut = self.loop.create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except TimeoutError:
                return ready() or self.lost
        return True

    def _arm_idle(self, delay: float) -> None:
        self._idle = self.loop.call_later(max(0.05, delay), self._idle_check)

    def _idle_check(self) -> None:
        """A connection with no request in flight and no bytes in for idle_timeout_s is closed
        (QUIC's idle timeout, for TCP)."""
        self._idle = None
        if self.lost or self.session is None:
            return
        idle_s = self.server.settings.idle_timeout_s
        quiet = self.loop.time() - self._last_io
        if self.session.active():  # a request waiting for its first token is not idle
            self._arm_idle(idle_s)
            return
        if quiet < idle_s:
            self._arm_idle(idle_s - quiet)
            return
        log.debug("tcp connection idle %s", fields(peer=self.peer, idle_s=round(quiet, 1)))
        self.session.close()

    def requests(self) -> list[HttpRequest]:
        return self.session.requests() if self.session is not None else []

    def unsent(self) -> bool:
        return self.buffered() > 0 or (self.session is not None and self.session.unsent())


# ------------------------------------------------------------------ HTTP/1.1 (h11)

class H11Request(HttpRequest):
    """A request on an HTTP/1.1 connection (one at a time; a streamed body is chunked)."""

    http_version = "h1"

    def __init__(self, session: H11Session, method: str, target: str, headers: dict[str, str]) -> None:
        conn = session.conn
        super().__init__(conn.server, conn.loop, method, target, headers)
        self.session = session

    def _peer_address(self) -> str | None:
        return self.session.conn.peer

    def _send_headers(self, status: int, headers: list[tuple[str, str]], end_stream: bool) -> None:
        s = self.session
        out = s.h11.send(h11.Response(status_code=status, headers=[*headers, ("alt-svc", s.conn.alt_svc)],
                                      reason=_reason(status)))
        if end_stream:
            out += s.h11.send(h11.EndOfMessage())
        s.conn.write(out)
        if end_stream:
            s.response_done()

    def _send_data(self, data: bytes, end_stream: bool) -> None:
        s = self.session
        out = s.h11.send(h11.Data(data=data)) if data else b""
        if end_stream:
            out += s.h11.send(h11.EndOfMessage())
        s.conn.write(out)
        if end_stream:
            s.response_done()

    def _reset(self) -> None:
        # HTTP/1.1 cannot end one response abnormally and keep the connection: the client sees the
        # connection go before the last chunk.
        self.session.conn.abort()

    def _stop_reading(self) -> None:
        self.session.discarding = True  # the rest of the body is read and dropped (keeps the connection)

    def _backlog(self) -> int:
        return self.session.conn.buffered()

    def _backlogged(self) -> bool:
        return self.session.conn.paused

    async def _wait_writable(self, timeout: float) -> bool:
        conn = self.session.conn
        return await conn.wait_until(lambda: not conn.paused, timeout)


class H11Session:
    """HTTP/1.1 with keep-alive: one request/response cycle at a time (pipelined requests wait)."""

    def __init__(self, conn: TcpConnection) -> None:
        self.conn = conn
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.current: H11Request | None = None
        self.discarding = False
        self._discarded = 0
        self._head_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        self.h11.receive_data(data)
        self._process()

    def eof_received(self) -> None:
        self.h11.receive_data(b"")
        self._process()

    def _process(self) -> None:
        while not self.conn.lost:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as e:
                self._bad_request(e)
                return
            if event is h11.NEED_DATA:
                if self.h11.their_state is h11.IDLE and self.h11.trailing_data[0] and self._head_timer is None:
                    self._head_timer = self.conn.loop.call_later(self.conn.server.settings.body_timeout_s,
                                                                 self._head_timed_out)
                return
            if event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._on_request(event)
            elif isinstance(event, h11.Data):
                self._on_data(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                if self.current is not None:
                    self.current.on_end()
                self._next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                self.conn.close()
                return

    def _on_request(self, event: h11.Request) -> None:
        self._cancel_head_timer()
        headers, _ = merge_headers(event.headers)
        req = H11Request(self, event.method.decode("latin-1"), event.target.decode("latin-1"), headers)
        self.current, self.discarding, self._discarded = req, False, 0
        req.on_headers(stream_ended=False)
        if not req.closed and self.h11.they_are_waiting_for_100_continue:
            self.conn.write(self.h11.send(h11.InformationalResponse(status_code=100, headers=[], reason=_reason(100))))

    def _on_data(self, data: bytes) -> None:
        req = self.current
        if req is None:
            return
        if self.discarding or req.closed:
            self._discarded += len(data)
            # Reading the rest keeps the connection (and lets the client read its 413: closing with
            # unread bytes would reset the connection under it), up to a point.
            if self._discarded > DISCARD_LIMIT_FACTOR * req.settings.max_body_bytes:
                self.conn.close()
            return
        req.on_data(data, stream_ended=False)

    def response_done(self) -> None:
        """The response's last byte is queued: start the next cycle once the request is read too."""
        self.conn.loop.call_soon(self._after_response)

    def _after_response(self) -> None:
        if self.h11.our_state in (h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self.conn.close()
            return
        if self._next_cycle():
            self._process()  # a pipelined request may be buffered already

    def _next_cycle(self) -> bool:
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            self.current = None
            return True
        if self.h11.our_state is h11.MUST_CLOSE and self.h11.their_state is h11.DONE:
            self.conn.close()
        return False

    def _bad_request(self, e: h11.RemoteProtocolError) -> None:
        """Unparseable HTTP/1.1: answer it (the same JSON error as any other) and close."""
        log.info("bad http/1.1 request %s", fields(peer=self.conn.peer, error=str(e)))
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE) and (self.current is None or
                                                                   not self.current.headers_sent):
            req = self.current if self.current is not None else H11Request(self, "", "/", {})
            status = e.error_status_hint if 400 <= e.error_status_hint < 500 else 400
            req._reject(wire.WireError(status, f"Malformed HTTP/1.1 request: {e}.", code="invalid_request"))
        self.conn.close()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.h11.their_state is h11.IDLE and not self.conn.lost:
            log.info("request headers timed out %s", fields(peer=self.conn.peer,
                                                           buffered=len(self.h11.trailing_data[0])))
            self.conn.abort()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self) -> None:
        self._cancel_head_timer()
        if self.current is not None:
            self.current.cancel("connection_lost")

    def active(self) -> bool:
        return self.current is not None and not self.current.closed

    def requests(self) -> list[HttpRequest]:
        return [self.current] if self.current is not None else []

    def unsent(self) -> bool:
        return False  # h11 writes straight to the transport

    def close(self) -> None:
        self.conn.close()


# ------------------------------------------------------------------ HTTP/2 (h2)

@dataclass
class _Outbound:
    """Response bytes of one stream that its flow-control window has not let out yet."""

    data: bytearray = field(default_factory=bytearray)
    end: bool = False


class H2Request(HttpRequest):
    """A request on one HTTP/2 stream."""

    http_version = "h2"

    def __init__(self, session: H2Session, stream_id: int, method: str, target: str,
                 headers: dict[str, str]) -> None:
        conn = session.conn
        super().__init__(conn.server, conn.loop, method, target, headers)
        self.session = session
        self.stream_id = stream_id

    def _peer_address(self) -> str | None:
        return self.session.conn.peer

    def _send_headers(self, status: int, headers: list[tuple[str, str]], end_stream: bool) -> None:
        s = self.session
        h = [(b":status", str(status).encode())]
        h += [(k.encode("latin-1"), v.encode("latin-1", "replace")) for k, v in headers]
        h.append((b"alt-svc", s.conn.alt_svc.encode()))
        s.h2.send_headers(self.stream_id, h, end_stream=end_stream)

    def _send_data(self, data: bytes, end_stream: bool) -> None:
        self.session.send_data(self.stream_id, data, end_stream)

    def _flush(self) -> None:
        self.session.transmit()

    def _reset(self) -> None:
        self.session.reset(self.stream_id)

    def _forget(self) -> None:
        self.session.forget(self)

    def _backlog(self) -> int:
        out = self.session.outbound.get(self.stream_id)
        return (len(out.data) if out is not None else 0) + self.session.conn.buffered()

    def _backlogged(self) -> bool:
        out = self.session.outbound.get(self.stream_id)
        return (out is not None and bool(out.data)) or self.session.conn.paused

    async def _wait_writable(self, timeout: float) -> bool:
        return await self.session.conn.wait_until(lambda: self.closed or not self._backlogged(), timeout)


class H2Session:
    """HTTP/2: many concurrent streams, each an H2Request; SETTINGS_MAX_CONCURRENT_STREAMS is
    max_concurrent_streams, as QUIC's MAX_STREAMS is for HTTP/3."""

    def __init__(self, conn: TcpConnection) -> None:
        self.conn = conn
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        codes = h2.settings.SettingCodes
        self.h2.local_settings = h2.settings.Settings(client=False, initial_values={
            codes.MAX_CONCURRENT_STREAMS: max(1, conn.server.settings.max_concurrent_streams),
            codes.MAX_HEADER_LIST_SIZE: MAX_HEAD_BYTES,
        })
        self.h2.initiate_connection()
        self.streams: dict[int, H2Request] = {}
        self.outbound: dict[int, _Outbound] = {}
        self.transmit()

    def transmit(self) -> None:
        self.conn.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as e:  # h2 queued a GOAWAY
            log.info("http/2 protocol error %s", fields(peer=self.conn.peer, error=repr(e)))
            self.transmit()
            self.conn.close()
            return
        for event in events:
            self._event(event)
        self.transmit()

    def eof_received(self) -> None:
        pass  # connection_lost follows

    def _event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            headers, pseudo = merge_headers(event.headers)
            req = H2Request(self, event.stream_id, pseudo.get(":method", ""), pseudo.get(":path", ""), headers)
            self.streams[event.stream_id] = req
            req.on_headers(stream_ended=False)  # a StreamEnded event follows for a body-less request
        elif isinstance(event, h2.events.DataReceived):
            # Bodies are capped by max_body_bytes, so open the window as soon as bytes arrive; bytes of
            # an answered request are read and dropped likewise.
            try:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            except h2.exceptions.StreamClosedError:
                pass
            req = self.streams.get(event.stream_id)
            if req is not None and event.data:
                req.on_data(event.data, stream_ended=False)
        elif isinstance(event, h2.events.StreamEnded):
            req = self.streams.get(event.stream_id)
            if req is not None:
                req.on_end()
        elif isinstance(event, h2.events.StreamReset):
            self.outbound.pop(event.stream_id, None)
            req = self.streams.get(event.stream_id)
            if req is not None:
                req.closed = True  # the stream is gone: nothing to reset back
                req.cancel("stream_reset")
                self.forget(req)
        elif isinstance(event, h2.events.WindowUpdated):
            if event.stream_id == 0:
                self._flush_all()
            else:
                self._flush_safely(event.stream_id)
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            self._flush_all()  # INITIAL_WINDOW_SIZE may have grown every stream's window
        elif isinstance(event, h2.events.ConnectionTerminated):  # the client's GOAWAY
            self.transmit()
            self.conn.close()

    # ---- sending with flow control

    def send_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        out = self.outbound.setdefault(stream_id, _Outbound())
        out.data += data
        out.end = out.end or end_stream
        self._flush_stream(stream_id)

    def _flush_stream(self, stream_id: int) -> None:
        out = self.outbound.get(stream_id)
        if out is None:
            return
        while out.data:
            n = min(self.h2.local_flow_control_window(stream_id), self.h2.max_outbound_frame_size, len(out.data))
            if n <= 0:
                return  # the window is closed: WindowUpdated resumes
            last = out.end and n == len(out.data)
            self.h2.send_data(stream_id, bytes(out.data[:n]), end_stream=last)
            del out.data[:n]
            if last:
                del self.outbound[stream_id]
                return
        if out.end:
            self.h2.end_stream(stream_id)
            del self.outbound[stream_id]

    def _flush_safely(self, stream_id: int) -> None:
        try:
            self._flush_stream(stream_id)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError) as e:
            log.debug("flush failed %s", fields(stream=stream_id, error=repr(e)))
            self.outbound.pop(stream_id, None)
        self.conn.wake()

    def _flush_all(self) -> None:
        for stream_id in list(self.outbound):
            self._flush_safely(stream_id)

    def reset(self, stream_id: int) -> None:
        self.outbound.pop(stream_id, None)
        try:
            self.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError) as e:
            log.debug("reset failed %s", fields(stream=stream_id, error=repr(e)))
        self.transmit()

    def forget(self, req: H2Request) -> None:
        if self.streams.get(req.stream_id) is req:
            del self.streams[req.stream_id]

    def connection_lost(self) -> None:
        for req in list(self.streams.values()):
            req.cancel("connection_lost")
        self.streams.clear()
        self.outbound.clear()

    def active(self) -> bool:
        return bool(self.streams) or bool(self.outbound)

    def requests(self) -> list[HttpRequest]:
        return list(self.streams.values())

    def unsent(self) -> bool:
        return bool(self.outbound)

    def close(self) -> None:
        """GOAWAY, then close once it is out."""
        try:
            self.h2.close_connection()
            self.transmit()
        except h2.exceptions.ProtocolError:
            pass
        self.conn.close()


# ------------------------------------------------------------------ the listener

class TcpListener:
    """The TLS/TCP listener of one EdgedServer: its connections, for drain and close."""

    def __init__(self, server: EdgedServer, loop: asyncio.AbstractEventLoop, h3_port: int) -> None:
        self.server = server
        self.loop = loop
        self.alt_svc = f'h3=":{h3_port}"; ma={ALT_SVC_MAX_AGE_S}'
        self.connections: set[TcpConnection] = set()
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    def requests(self) -> list[HttpRequest]:
        return [r for c in list(self.connections) for r in c.requests()]

    def unsent(self) -> bool:
        return any(c.unsent() for c in list(self.connections))

    def close(self) -> None:
        """Stop accepting and close every connection (HTTP/2 ones with a GOAWAY)."""
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            if c.session is not None:
                c.session.close()
            else:
                c.close()
        log.info("tcp listener closed %s", fields(connections=len(self.connections)))


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    ctx.set_alpn_protocols(ALPN)
    return ctx


async def serve_tcp(server: EdgedServer, certfile: str, keyfile: str, *, host: str | None = None,
                    port: int | None = None, sock: socket.socket | None = None) -> TcpListener:
    """Serve HTTP/1.1 and HTTP/2 over TLS on `sock` (a listening TCP socket: a worker's share of the
    daemon's SO_REUSEPORT group), else on TCP host:port; requests go to `server`'s router."""
    loop = asyncio.get_running_loop()
    listener = TcpListener(server, loop, server.port)
    ctx = tls_context(certfile, keyfile)
    where: dict[str, object] = {"sock": sock} if sock is not None else {"host": host, "port": port}
    listener._server = await loop.create_server(
        lambda: TcpConnection(listener), ssl=ctx, ssl_handshake_timeout=server.settings.body_timeout_s,
        **where)  # type: ignore[arg-type]
    h, p = listener._server.sockets[0].getsockname()[:2]
    log.info("listening %s", fields(proto="h2,http/1.1", host=h, port=p))
    return listener
