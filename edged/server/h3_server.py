"""HTTP/3 over QUIC: one protocol object per connection, one `RequestStream` per request.

Modelled on aioquic's examples/http3_server.py: a sans-IO `QuicConnectionProtocol` subclass
feeds QUIC events to an `H3Connection`; each request stream collects its headers and body and
then runs the route handler (routes.py) as a task that writes the response back.

A stream reset, a STOP_SENDING or a lost connection cancels the handler task, whose `finally`
cancels the engine sequence. Writes wait (bounded) while a stream has too many unacknowledged
bytes, so one slow client cannot grow memory without limit.

The request side shared with HTTP/2 and HTTP/1.1 (tcp_server.py) is `HttpRequest` (request.py);
`EdgedServer` owns both listeners, so drain and close cover both.

QUIC specifics live beside it: admission control and Retry (quic_listener.py), connection-ID
routing between workers (quic_routing.py), session tickets (quic_tickets.py) and the rule for
requests that arrive as 0-RTT early data (quic_early_data.py): a replay-safe one runs at once, any
other waits here until the handshake completes. A client that migrates (new address or port) keeps
its connection; the move is logged and counted.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aioquic.asyncio import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection, HeadersState
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)

from edged.log import fields
from edged.server import quic_congestion  # noqa: F401  (registers "reno-floor" with aioquic)
from edged.server.quic_early_data import replay_safe
from edged.server.quic_listener import EdgedQuicServer
from edged.server.quic_redundancy import CopyRule, DuplicatingTransport
from edged.server.quic_routing import CidRoute
from edged.server.quic_tickets import TicketStore
from edged.server.request import HttpRequest, RequestHandler, merge_headers
from edged.server.settings import ServerSettings

if TYPE_CHECKING:
    from edged.server.tcp_server import TcpListener

__all__ = ["EdgedServer", "RequestHandler", "RequestStream", "serve"]

log = logging.getLogger("edged.server")


class RequestStream(HttpRequest):
    """One request on one HTTP/3 stream; the transport-neutral part is HttpRequest (request.py)."""

    http_version = "h3"

    def __init__(self, protocol: HttpServerProtocol, stream_id: int, raw_headers: list[tuple[bytes, bytes]]) -> None:
        headers, pseudo = merge_headers(raw_headers)
        super().__init__(protocol.server, protocol._loop, pseudo.get(":method", ""), pseudo.get(":path", ""), headers)
        self.protocol = protocol
        self.stream_id = stream_id
        self.early_data = not protocol.handshake_done  # its headers came in 0-RTT packets
        self.held_for_handshake = False

    def _peer_address(self) -> str | None:
        try:
            return self.protocol._quic._network_paths[0].addr[0]
        except (AttributeError, IndexError):
            return None

    def _dispatch(self) -> None:
        """Early data that is not replay-safe waits for the handshake (quic_early_data.py)."""
        if self.held_for_handshake:
            return
        if self.early_data and not self.protocol.handshake_done:
            router = self.server.router
            safe = replay_safe(self.method, self.path, bytes(self.body), getattr(router, "sampling_defaults", {}))
            log.info("early data request %s", fields(rid=self.request_id, path=self.path, replay_safe=safe,
                                                      action="run" if safe else "wait_for_handshake"))
            self.server.quic_event("early_data_run" if safe else "early_data_held")
            if not safe:
                self.held_for_handshake = True
                self._cancel_body_timer()
                self.protocol.hold_until_handshake(self)
                return
        super()._dispatch()

    def release(self) -> None:
        """The handshake completed: run the held request (unless the client went away meanwhile)."""
        self.held_for_handshake = False
        if not self.closed and self.cancel_reason is None:
            super()._dispatch()

    # ---- the HttpRequest hooks, on aioquic's H3Connection

    def _send_headers(self, status: int, headers: list[tuple[str, str]], end_stream: bool) -> None:
        h = [(b":status", str(status).encode())]
        h += [(k.encode("latin-1"), v.encode("latin-1", "replace")) for k, v in headers]
        self.protocol.http.send_headers(self.stream_id, h, end_stream=end_stream)

    def _send_data(self, data: bytes, end_stream: bool) -> None:
        self.protocol.http.send_data(self.stream_id, data, end_stream=end_stream)

    def _flush(self) -> None:
        # Coalesced: every stream written in this loop iteration goes out in one transmit.
        self.protocol.schedule_transmit()

    def _reset(self) -> None:
        self.protocol.reset_stream(self.stream_id)

    def _stop_reading(self) -> None:
        self.protocol.stop_reading(self.stream_id)

    def _forget(self) -> None:
        self.protocol.forget(self)

    def _dispatched_hook(self) -> None:
        self.protocol.ensure_keepalive()

    def _backlog(self) -> int:
        return self.protocol.unacked(self.stream_id)

    def _backlogged(self) -> bool:
        return self.protocol.unacked(self.stream_id) > self.settings.send_high_water

    async def _wait_writable(self, timeout: float) -> bool:
        return await self.protocol.wait_writable(self.stream_id, timeout)


class HttpServerProtocol(QuicConnectionProtocol):
    """One QUIC connection carrying HTTP/3 requests."""

    def __init__(self, *args: Any, server: EdgedServer, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server = server
        # QUIC's MAX_STREAMS is the per-connection concurrency limit; aioquic fixes it at 128 and
        # has no setting, so set its Limit before the handshake advertises it.
        limit = self._quic._local_max_streams_bidi
        limit.value = limit.sent = max(1, server.settings.max_concurrent_streams)
        self._http: H3Connection | None = None
        self._requests: dict[int, RequestStream] = {}
        self._drain_waiters: dict[int, asyncio.Future[None]] = {}
        self._keepalive: asyncio.TimerHandle | None = None
        self._header_timers: dict[int, asyncio.TimerHandle] = {}  # streams whose HEADERS frame is incomplete
        self.handshake_done = False
        self._copied = False  # has this connection sent a datagram twice yet (quic_redundancy.py)
        self._held: list[RequestStream] = []  # early-data requests waiting for the handshake
        self._handshake_timer: asyncio.TimerHandle | None = self._loop.call_later(
            server.settings.quic_handshake_timeout_s, self._handshake_timed_out)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        settings = self.server.settings
        if settings.quic_duplicate_datagram_bytes > 0:
            self._copy_rule = CopyRule(settings.quic_duplicate_after_loss_s)
            transport = DuplicatingTransport(transport, settings.quic_duplicate_datagram_bytes,  # type: ignore[arg-type]
                                             settings.quic_duplicate_delay_s, self._loop, self._copy_now)
        super().connection_made(transport)

    def _copy_now(self) -> bool:
        """Send this small datagram twice? (CopyRule over aioquic's loss recovery.) The first time a
        connection starts copying is logged and counted."""
        copy = self._copy_rule.applies(self._quic._loss, self._loop.time())
        if copy and not self._copied:
            self._copied = True
            self.server.quic_event("datagram_copies_started")
            log.info("small datagrams sent twice from now on %s", fields(
                cid=self._quic.host_cid.hex(), after_loss=self._copy_rule.after_loss_s > 0))
        return copy

    @property
    def http(self) -> H3Connection:
        assert self._http is not None
        return self._http

    def quic_event_received(self, event: QuicEvent) -> None:
        # Never let an exception escape into the datagram transport: it is shared by all connections.
        try:
            self._quic_event(event)
        except Exception:
            log.exception("quic event failed %s", fields(event=type(event).__name__))

    def _quic_event(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated):
            if event.alpn_protocol in H3_ALPN:
                self._http = H3Connection(self._quic)
            return
        if isinstance(event, HandshakeCompleted):
            self._handshake_completed(event)
            return
        if self._http is not None:
            for h3_event in self._http.handle_event(event):
                self._h3_event(h3_event)
            if isinstance(event, StreamDataReceived):
                self._watch_headers(event.stream_id)
        if isinstance(event, (StreamReset, StopSendingReceived)):
            self._unwatch_headers(event.stream_id)
            rs = self._requests.get(event.stream_id)
            if rs is not None:
                rs.cancel("stream_reset" if isinstance(event, StreamReset) else "stop_sending")
        elif isinstance(event, ConnectionTerminated):
            for rs in list(self._requests.values()):
                rs.cancel("connection_lost")
            self._requests.clear()
            for timer in self._header_timers.values():
                timer.cancel()
            self._header_timers.clear()
            for fut in self._drain_waiters.values():
                if not fut.done():
                    fut.set_result(None)
            if self._keepalive is not None:
                self._keepalive.cancel()
                self._keepalive = None
            if self._handshake_timer is not None:
                self._handshake_timer.cancel()
                self._handshake_timer = None
            self._held.clear()
            self.server._protocols.discard(self)

    def _handshake_completed(self, event: HandshakeCompleted) -> None:
        self.handshake_done = True
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None
        if event.session_resumed:
            self.server.quic_event("resumed")
        if event.early_data_accepted:
            self.server.quic_event("early_data_accepted")
        held, self._held = self._held, []
        for rs in held:
            rs.release()

    def hold_until_handshake(self, rs: RequestStream) -> None:
        self._held.append(rs)

    def _handshake_timed_out(self) -> None:
        """Reap a connection whose handshake stalled (a flood's half-open connections hold a slot)."""
        self._handshake_timer = None
        if self.handshake_done or self._closed.is_set():
            return
        self.server.quic_event("handshake_timeout")
        self._quic.close(error_code=0x0, reason_phrase="handshake timeout")
        self.transmit()

    def _watch_headers(self, stream_id: int) -> None:
        """A request stream whose HEADERS frame has not completed gets body_timeout_s to complete it
        (aioquic reports headers only once whole, so a stalled frame would otherwise hold the stream)."""
        if stream_id % 4 != 0 or stream_id in self._header_timers or stream_id in self._requests:
            return  # not client-initiated bidirectional, already watched, or headers already in
        h3_stream = self.http._stream.get(stream_id)  # aioquic keeps the receive state only here
        if h3_stream is None or h3_stream.headers_recv_state is not HeadersState.INITIAL:
            return
        self._header_timers[stream_id] = self._loop.call_later(
            self.server.settings.body_timeout_s, self._headers_timed_out, stream_id)

    def _unwatch_headers(self, stream_id: int) -> None:
        timer = self._header_timers.pop(stream_id, None)
        if timer is not None:
            timer.cancel()

    def _headers_timed_out(self, stream_id: int) -> None:
        self._header_timers.pop(stream_id, None)
        h3_stream = self.http._stream.get(stream_id)
        if h3_stream is None or h3_stream.headers_recv_state is not HeadersState.INITIAL:
            return
        log.info("request headers timed out %s", fields(stream=stream_id, buffered=len(h3_stream.buffer),
                                                       timeout_s=self.server.settings.body_timeout_s))
        self.stop_reading(stream_id, ErrorCode.H3_REQUEST_INCOMPLETE)
        self.reset_stream(stream_id, ErrorCode.H3_REQUEST_INCOMPLETE)

    def _h3_event(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            self._unwatch_headers(event.stream_id)
            rs = self._requests.get(event.stream_id)
            if rs is not None:  # trailers
                if event.stream_ended:
                    rs.on_end()
                return
            if not any(k == b":method" for k, _ in event.headers):
                return  # trailers of a stream we already answered
            rs = RequestStream(self, event.stream_id, event.headers)
            self._requests[event.stream_id] = rs
            rs.on_headers(event.stream_ended)
        elif isinstance(event, DataReceived):
            rs = self._requests.get(event.stream_id)
            if rs is not None:
                rs.on_data(event.data, event.stream_ended)

    # ---- helpers for RequestStream

    def forget(self, rs: RequestStream) -> None:
        if self._requests.get(rs.stream_id) is rs:
            del self._requests[rs.stream_id]

    def schedule_transmit(self) -> None:
        self._transmit_soon()

    def transmit(self) -> None:
        if self._transport is None or self._transport.is_closing():  # the server was closed
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        super().transmit()

    def reset_stream(self, stream_id: int, code: ErrorCode = ErrorCode.H3_REQUEST_CANCELLED) -> None:
        try:
            self._quic.reset_stream(stream_id, code)
        except Exception as e:
            log.debug("reset failed %s", fields(stream=stream_id, error=repr(e)))
        self.schedule_transmit()

    def stop_reading(self, stream_id: int, code: ErrorCode = ErrorCode.H3_NO_ERROR) -> None:
        """Ask the client to stop sending the request body (RFC 9114 4.1.1: H3_NO_ERROR)."""
        try:
            self._quic.stop_stream(stream_id, code)
        except Exception as e:
            log.debug("stop_sending failed %s", fields(stream=stream_id, error=repr(e)))
        self.schedule_transmit()

    def unacked(self, stream_id: int) -> int:
        """Bytes written to a stream and not yet acknowledged by the peer.

        aioquic has no public accessor; the sender keeps exactly these bytes in `_buffer`.
        """
        stream = self._quic._streams.get(stream_id)
        if stream is None:
            return 0
        return len(getattr(stream.sender, "_buffer", b""))

    async def wait_writable(self, stream_id: int, timeout: float) -> bool:
        fut = self._loop.create_future()
        self._drain_waiters[stream_id] = fut
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            if self._drain_waiters.get(stream_id) is fut:
                del self._drain_waiters[stream_id]

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        paths = self._quic._network_paths
        before = paths[0].addr if paths else None
        super().datagram_received(data, addr)
        paths = self._quic._network_paths
        if before is not None and paths and paths[0].addr != before:  # aioquic promoted a new path
            self.server.quic_event("migrated")
            log.info("connection migrated %s", fields(cid=self._quic.host_cid.hex(), old=_addr(before),
                                                       new=_addr(paths[0].addr), streams=len(self._requests)))
        if self._drain_waiters:  # acknowledgements may have freed room
            low = self.server.settings.send_high_water // 2
            for sid, fut in list(self._drain_waiters.items()):
                if not fut.done() and self.unacked(sid) <= low:
                    fut.set_result(None)

    def ensure_keepalive(self) -> None:
        if self._keepalive is None:
            self._keepalive = self._loop.call_later(self.server.settings.keepalive_s, self._keepalive_tick)

    def _keepalive_tick(self) -> None:
        # A request may wait long for its first token; PINGs keep the idle timer of both ends from firing.
        self._keepalive = None
        if not self._requests or self._closed.is_set():
            return
        self._quic.send_ping(0)
        self.transmit()
        self.ensure_keepalive()


def _addr(addr: Any) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


class EdgedServer:
    """The running server: HTTP/3, plus HTTP/1.1 and HTTP/2 over TLS/TCP when `tcp` is set (both feed
    the one router). `close()`, `await shutdown(timeout)`, `port`, live `settings`."""

    def __init__(self, router: RequestHandler) -> None:
        self.router = router
        self._quic_server: EdgedQuicServer | None = None
        self._quic_config: QuicConfiguration | None = None
        self.tickets: TicketStore | None = None  # 0-RTT session tickets (serve(tickets=...))
        self.quic_event: Callable[[str], None] = lambda name: None  # counts QUIC events (the worker's metrics)
        self.tcp: TcpListener | None = None  # the TCP listener (tcp_server.py), on the same port
        self._protocols: set[HttpServerProtocol] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def settings(self) -> ServerSettings:
        return self.router.settings

    @settings.setter
    def settings(self, value: ServerSettings) -> None:
        """Live reload: takes effect for new requests (the QUIC idle timeout only for new connections)."""
        self.router.settings = value
        if self._quic_config is not None:
            self._quic_config.idle_timeout = value.idle_timeout_s

    @property
    def address(self) -> tuple[str, int]:
        assert self._quic_server is not None and self._quic_server._transport is not None
        sockname = self._quic_server._transport.get_extra_info("sockname")
        return sockname[0], sockname[1]

    @property
    def port(self) -> int:
        return self.address[1]

    def active_requests(self) -> int:
        return len(self._tasks)

    def _create_protocol(self, quic: Any, stream_handler: Any = None) -> HttpServerProtocol:
        proto = HttpServerProtocol(quic, server=self)
        self._protocols.add(proto)
        return proto

    def _all_requests(self) -> list[HttpRequest]:
        quic: list[HttpRequest] = [rs for p in list(self._protocols) for rs in list(p._requests.values())]
        return quic + (self.tcp.requests() if self.tcp is not None else [])

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Drain: refuse new requests (503), let in-flight ones finish for up to `timeout` seconds,
        end the rest with a final error event, then close."""
        loop = asyncio.get_running_loop()
        self.router.draining = True
        deadline = loop.time() + timeout
        in_flight = len(self._tasks)
        while self._tasks and loop.time() < deadline:
            await asyncio.wait(set(self._tasks), timeout=deadline - loop.time())
        left = list(self._tasks)
        for rs in self._all_requests():
            rs.cancel("shutdown")
        if left:
            await asyncio.wait(left, timeout=2.0)
        # Let the final bytes reach the clients before the connections go.
        end = loop.time() + 1.0
        while loop.time() < end and self._any_unacked():
            await asyncio.sleep(0.02)
        log.info("server drained %s", fields(in_flight=in_flight, cut_off=len(left)))
        self.close()

    def _any_unacked(self) -> bool:
        if self.tcp is not None and self.tcp.unsent():
            return True
        for p in self._protocols:
            for sid in list(p._quic._streams):
                if p.unacked(sid):
                    return True
        return False

    def close(self) -> None:
        """Stop at once: cancel every request (and so its engine sequence), close connections and socket."""
        if self._closed:
            return
        self._closed = True
        self.router.draining = True
        for rs in self._all_requests():
            rs.cancel("server_closed")
        if self._quic_server is not None:
            self._quic_server.close()
        if self.tickets is not None:
            self.tickets.close()
        if self.tcp is not None:
            self.tcp.close()
        self._protocols.clear()
        log.info("server closed")

    async def wait_closed(self) -> None:
        """After close(): wait (briefly) for the cancelled handlers to run their cleanup."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5.0)


def free_port_pair(host: str, tries: int = 20) -> tuple[socket.socket, socket.socket]:
    """A UDP socket on a free port and a listening TCP socket on the same number (the kernel picks
    the UDP port; the TCP one may be taken, so try again)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(tries):
        udp = socket.socket(family, socket.SOCK_DGRAM)
        tcp = socket.socket(family, socket.SOCK_STREAM)
        try:
            udp.bind((host, 0))
            tcp.bind((host, udp.getsockname()[1]))
            tcp.listen(1024)
        except OSError:
            udp.close()
            tcp.close()
            continue
        udp.setblocking(False)
        tcp.setblocking(False)
        return udp, tcp
    raise OSError(f"no port on {host} free for both UDP and TCP after {tries} tries")


async def serve(
    router: RequestHandler,
    host: str,
    port: int,
    certfile: str,
    keyfile: str,
    *,
    sock: socket.socket | None = None,
    tcp: bool = False,
    tcp_sock: socket.socket | None = None,
    route: CidRoute | None = None,
    tickets: TicketStore | None = None,
) -> EdgedServer:
    """Listen for HTTP/3 on UDP host:port (IPv4 or IPv6; port 0 picks a free one), or on `sock`, a
    bound UDP socket (a worker's share of the daemon's SO_REUSEPORT group), and hand every request
    to `router`. With `tcp_sock` (a listening TCP socket) or `tcp`, HTTP/1.1 and HTTP/2 over TLS
    are served too: on `tcp_sock`, else on TCP at the UDP socket's address.

    `route`: this worker's share of a connection-ID-routed SO_REUSEPORT group (quic_routing.py);
    `tickets`: the shared session-ticket store that enables resumption and 0-RTT (quic_tickets.py)."""
    settings = router.settings
    config = QuicConfiguration(
        is_client=False,
        alpn_protocols=H3_ALPN,
        max_datagram_frame_size=settings.max_datagram_frame_size,
        idle_timeout=settings.idle_timeout_s,
        congestion_control_algorithm=settings.quic_congestion_control,
    )
    config.load_cert_chain(certfile, keyfile)
    server = EdgedServer(router)
    server._quic_config = config
    server.tickets = tickets
    loop = asyncio.get_running_loop()
    if tcp and sock is None and tcp_sock is None and port == 0:
        sock, tcp_sock = free_port_pair(host)  # a UDP port whose TCP twin is free too
    where: dict[str, Any] = {"sock": sock} if sock is not None else {"local_addr": (host, port)}
    _, server._quic_server = await loop.create_datagram_endpoint(
        lambda: EdgedQuicServer(configuration=config, create_protocol=server._create_protocol,
                                settings=lambda: server.settings, route=route or CidRoute(), tickets=tickets,
                                on_event=lambda name: server.quic_event(name)), **where)
    h, p = server.address
    log.info("listening %s", fields(proto="h3", host=h, port=p))
    if tcp or tcp_sock is not None:
        from edged.server.tcp_server import serve_tcp

        try:
            server.tcp = await serve_tcp(server, certfile, keyfile, host=h, port=p, sock=tcp_sock)
        except BaseException:
            server.close()
            raise
    return server
