"""A small async HTTP/3 client (aioquic), for `edged chat`, `edged bench serve` and the tests.

    async with H3Client("127.0.0.1", 4433, ca_file=cert) as c:
        r = await c.request("GET", "/healthz")
        async with await c.stream("POST", "/v1/chat/completions", body=json_bytes) as s:
            print(s.status, s.headers)
            async for chunk in s:         # body bytes as they arrive
                ...
            s.reset()                     # or: cancel mid-way (RESET_STREAM + STOP_SENDING)

Many requests may run concurrently on one connection.

Resumption and 0-RTT: give `session_ticket` (a ticket from an earlier connection, e.g.
`ClientTicketFile.load()`) and `on_ticket` (called with each new ticket the server sends), then
`await c.connect(early_data=True)`: it returns at once, and requests opened before the handshake
completes go out as 0-RTT data (the server runs only replay-safe ones early; quic_early_data.py).
`await c.rebind()` moves the connection to a new local UDP port (connection migration).
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aioquic.asyncio import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    QuicEvent,
    StreamReset,
)
from aioquic.quic.packet_builder import QuicDeliveryState
from aioquic.tls import Epoch, SessionTicket

from edged.server.quic_tickets import ClientTicketFile, default_client_state_dir

HeadersArg = Mapping[str, str] | Iterable[tuple[str, str]] | None
_END = object()


class H3ClientError(Exception):
    """Any client-side failure; subclasses say which."""


class ConnectError(H3ClientError):
    """No QUIC handshake: nothing answered in time, or the connection was refused/closed."""


class CertificateError(ConnectError):
    """The server's certificate did not verify."""


class StreamError(H3ClientError):
    """The server reset the stream or the connection went away mid-response."""


class HTTPError(H3ClientError):
    """A non-2xx response; `message` is the server's OpenAI-style error message when it sent one."""

    def __init__(self, status: int, message: str, body: bytes = b"") -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.body = body


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


@dataclass
class ResponseStream:
    """A response whose body arrives in pieces. `status`/`headers` are set once headers arrived."""

    client: H3Client
    stream_id: int
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    ended: bool = False
    _queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    _headers_seen: asyncio.Event = field(default_factory=asyncio.Event)
    _error: BaseException | None = None

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def read(self) -> bytes:
        return b"".join([c async for c in self])

    def reset(self) -> None:
        """Cancel the request: the server sees RESET_STREAM and STOP_SENDING."""
        self.client.reset(self)

    async def __aenter__(self) -> ResponseStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if not self.ended:
            self.reset()

    # fed by the protocol
    def _on_headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        for k, v in headers:
            name, value = k.decode("latin-1"), v.decode("latin-1")
            if name == ":status":
                self.status = int(value)
            elif name in self.headers:
                self.headers[name] += ", " + value
            else:
                self.headers[name] = value
        self._headers_seen.set()

    def _on_data(self, data: bytes) -> None:
        if data:
            self._queue.put_nowait(data)

    def _on_end(self) -> None:
        if not self.ended:
            self.ended = True
            self._headers_seen.set()
            self._queue.put_nowait(_END)

    def _on_error(self, exc: BaseException) -> None:
        if not self.ended:
            self.ended = True
            self._error = exc
            self._headers_seen.set()
            self._queue.put_nowait(exc)


class _ConnectedTransport:
    """The client's UDP socket is connected (so ICMP errors reach us); uvloop refuses sendto() with
    an address on a connected socket, so drop it."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport

    def sendto(self, data: bytes, addr: Any = None) -> None:
        self._transport.sendto(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _ClientConnection(QuicConnection):
    """aioquic's client connection, resending 0-RTT data after a Retry."""

    def _receive_retry_packet(self, header: Any, packet_without_tag: bytes, now: float) -> None:
        # aioquic answers a Retry with fresh packet spaces and forgets the 0-RTT packets it sent:
        # their stream data would never be resent (a request sent in 0-RTT would hang). Declare
        # them lost, as loss detection would have, so that it goes out again after the Retry.
        retries, old_spaces = self._retry_count, list(self._spaces.values())
        early = list(self._spaces[Epoch.ONE_RTT].sent_packets.values())
        super()._receive_retry_packet(header=header, packet_without_tag=packet_without_tag, now=now)
        if self._retry_count == retries:
            return  # not a valid Retry: ignored
        self._loss._cc.on_packets_expired(packets=[p for s in old_spaces for p in s.sent_packets.values() if p.in_flight])
        for packet in early:
            for handler, args in packet.delivery_handlers:
                handler(QuicDeliveryState.LOST, *args)


class _ClientProtocol(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.http = H3Connection(self._quic)
        self.streams: dict[int, ResponseStream] = {}
        self.terminated: ConnectionTerminated | None = None
        self.refused: Exception | None = None
        self.handshake_done = False
        self.early_data_accepted = False
        self.session_resumed = False
        self.settled = asyncio.Event()  # handshake completed, or failed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(_ConnectedTransport(transport))

    def transmit(self) -> None:
        if self._transport is None or self._transport.is_closing():  # closed: stop the timers too
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        super().transmit()

    def error_received(self, exc: Exception) -> None:
        # The socket is connected, so an ICMP port-unreachable surfaces here: fail the handshake
        # at once instead of waiting for the timeout.
        if isinstance(exc, ConnectionRefusedError) and not self.handshake_done:
            self.refused = exc
            self.settled.set()
            self.fail_streams(ConnectError("connection refused (nothing listens on that UDP port)"))

    def fail_streams(self, exc: BaseException) -> None:
        for rs in self.streams.values():
            rs._on_error(exc)
        self.streams.clear()

    def quic_event_received(self, event: QuicEvent) -> None:
        for h3_event in self.http.handle_event(event):
            self._h3_event(h3_event)
        if isinstance(event, HandshakeCompleted):
            # Tracked here rather than with wait_connected(): on a fast loopback the handshake can
            # complete before a waiter exists, and aioquic then never marks the protocol connected.
            self.handshake_done = True
            self.early_data_accepted = event.early_data_accepted
            self.session_resumed = event.session_resumed
            self.settled.set()
        elif isinstance(event, StreamReset):
            rs = self.streams.pop(event.stream_id, None)
            if rs is not None:
                rs._on_error(StreamError(f"the server reset the stream (error {event.error_code:#x})"))
        elif isinstance(event, ConnectionTerminated):
            self.terminated = event
            self.settled.set()
            for rs in self.streams.values():
                rs._on_error(StreamError(f"connection closed: {describe_close(event)}"))
            self.streams.clear()

    def _h3_event(self, event: H3Event) -> None:
        rs = self.streams.get(getattr(event, "stream_id", -1))
        if rs is None:
            return
        if isinstance(event, HeadersReceived):
            if not rs._headers_seen.is_set():
                rs._on_headers(event.headers)
        elif isinstance(event, DataReceived):
            rs._on_data(event.data)
        if getattr(event, "stream_ended", False):
            self.streams.pop(event.stream_id, None)
            rs._on_end()


def describe_close(event: ConnectionTerminated) -> str:
    reason = event.reason_phrase or "no reason given"
    return f"{reason} (error {event.error_code:#x})"


def _is_cert_failure(event: ConnectionTerminated | None) -> bool:
    if event is None:
        return False
    text = (event.reason_phrase or "").lower()
    # CRYPTO_ERROR 0x100 + TLS alert: 42 bad_certificate .. 48 unknown_ca
    return "certificate" in text or 0x100 + 42 <= event.error_code <= 0x100 + 48


class H3Client:
    """One QUIC connection to an HTTP/3 server; an async context manager."""

    def __init__(self, host: str, port: int, *, ca_file: str | None = None, insecure: bool = False,
                 server_name: str | None = None, connect_timeout: float = 5.0, idle_timeout: float = 60.0,
                 session_ticket: SessionTicket | None = None,
                 on_ticket: Callable[[SessionTicket], None] | None = None,
                 initial_dcid: bytes | None = None) -> None:
        self.host = host
        self.port = port
        self.ca_file = ca_file
        self.insecure = insecure
        self.server_name = server_name
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.session_ticket = session_ticket  # offered for resumption / 0-RTT
        self.on_ticket = on_ticket
        # the first Initial's Destination Connection ID (random when None): a server that steers by
        # connection ID (edged's workers) picks the worker from it, so a caller can pick the worker
        self.initial_dcid = initial_dcid
        self.new_tickets: list[SessionTicket] = []  # received on this connection, newest last
        self._addr: Any = None
        self._watchdog: asyncio.Future[None] | None = None
        self._family = socket.AF_INET
        self._protocol: _ClientProtocol | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self.authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def __aenter__(self) -> H3Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def early_data_accepted(self) -> bool:
        """The handshake completed and the server accepted this connection's 0-RTT data."""
        return self._protocol is not None and self._protocol.early_data_accepted

    @property
    def session_resumed(self) -> bool:
        return self._protocol is not None and self._protocol.session_resumed

    def _ticket_received(self, ticket: SessionTicket) -> None:
        self.new_tickets.append(ticket)
        if self.on_ticket is not None:
            self.on_ticket(ticket)

    def can_send_early_data(self) -> bool:
        t = self.session_ticket
        return (t is not None and t.is_valid and t.max_early_data_size is not None
                and t.server_name == (self.server_name or self.host))

    async def connect(self, *, early_data: bool = False) -> None:
        """Resolve, handshake; ConnectError (CertificateError) on failure within connect_timeout.

        early_data with a usable session ticket: return once the first flight is sent, so that the
        requests opened next travel as 0-RTT data; a failed handshake then fails those requests."""
        loop = asyncio.get_running_loop()
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, idle_timeout=self.idle_timeout,
                                   server_name=self.server_name or self.host)
        config.session_ticket = self.session_ticket
        if self.insecure:
            config.verify_mode = ssl.CERT_NONE
        elif self.ca_file:
            try:
                open(self.ca_file, "rb").close()
            except OSError as e:
                raise ConnectError(f"cannot read CA file {self.ca_file}: {e}") from None
            config.load_verify_locations(self.ca_file)
        try:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_DGRAM)
        except socket.gaierror as e:
            raise ConnectError(f"cannot resolve {self.host}: {e}") from None
        family, _, _, _, addr = infos[0]
        self._family, self._addr = family, addr[:2]
        quic = _ClientConnection(configuration=config, session_ticket_handler=self._ticket_received)
        if self.initial_dcid is not None:
            if not 8 <= len(self.initial_dcid) <= 20:  # RFC 9000 7.2: at least 8 bytes, at most 20
                raise ValueError("initial_dcid must be 8 to 20 bytes")
            quic._peer_cid.cid = quic._original_destination_connection_id = self.initial_dcid
        self._transport, protocol = await loop.create_datagram_endpoint(
            lambda: _ClientProtocol(quic), family=family, remote_addr=addr[:2])
        self._protocol = protocol
        protocol.connect(addr)
        if early_data and self.can_send_early_data():
            self._watchdog = asyncio.ensure_future(self._fail_unless_settled(protocol))
            return
        try:
            await asyncio.wait_for(protocol.settled.wait(), self.connect_timeout)
        except TimeoutError:
            pass
        if protocol.handshake_done and protocol.terminated is None:
            return
        term = protocol.terminated
        self._transport.close()
        self._protocol = None
        if _is_cert_failure(term):
            raise CertificateError(f"TLS certificate verification failed: {describe_close(term)}")
        if term is not None:
            raise ConnectError(f"connection closed during the handshake: {describe_close(term)}")
        if protocol.refused is not None:
            raise ConnectError("connection refused (nothing listens on that UDP port)")
        raise ConnectError(f"no QUIC handshake within {self.connect_timeout:g}s")

    async def _fail_unless_settled(self, protocol: _ClientProtocol) -> None:
        """In 0-RTT mode nobody awaits the handshake: fail the requests if it does not complete."""
        try:
            await asyncio.wait_for(protocol.settled.wait(), self.connect_timeout)
        except TimeoutError:
            protocol.fail_streams(ConnectError(f"no QUIC handshake within {self.connect_timeout:g}s"))

    async def wait_handshake(self, timeout: float | None = None) -> bool:
        """Whether the handshake completed (within `timeout`, default connect_timeout)."""
        p = self._protocol
        if p is None:
            return False
        try:
            await asyncio.wait_for(p.settled.wait(), self.connect_timeout if timeout is None else timeout)
        except TimeoutError:
            return False
        return p.handshake_done and p.terminated is None

    async def rebind(self) -> tuple[str, int]:
        """Move this connection to a new local UDP port (what a NAT rebinding or a network change
        looks like to the server); switch to a fresh connection ID when the server issued spares.
        The server validates the new path and keeps every stream. Returns the new local address."""
        p = self._protocol
        if p is None:
            raise ConnectError("not connected")
        loop = asyncio.get_running_loop()
        old = self._transport
        self._transport, _ = await loop.create_datagram_endpoint(lambda: p, family=self._family,
                                                                 remote_addr=self._addr)  # connection_made swaps it in
        if p._quic._peer_cid_available:
            p._quic.change_connection_id()
        p._quic.send_ping(0)  # a non-probing packet from the new address: the server moves the path
        p.transmit()
        if old is not None:
            old.close()
        return self._transport.get_extra_info("sockname")[:2]

    async def close(self) -> None:
        if self._protocol is None:
            return
        protocol, self._protocol = self._protocol, None
        protocol.close()
        try:
            await asyncio.wait_for(protocol.wait_closed(), 1.0)
        except TimeoutError:
            pass
        if self._transport is not None:
            self._transport.close()

    @property
    def connected(self) -> bool:
        return self._protocol is not None and self._protocol.terminated is None

    def _open(self, method: str, path: str, headers: HeadersArg, body: bytes | None,
              end_stream: bool) -> ResponseStream:
        p = self._protocol
        if p is None or p.terminated is not None:
            raise ConnectError("not connected" if p is None else f"connection closed: {describe_close(p.terminated)}")
        sid = p._quic.get_next_available_stream_id()
        rs = ResponseStream(self, sid)
        p.streams[sid] = rs
        h = [(b":method", method.encode()), (b":scheme", b"https"), (b":authority", self.authority.encode()),
             (b":path", path.encode()), (b"user-agent", b"edged-h3-client")]
        items = headers.items() if isinstance(headers, Mapping) else (headers or [])
        h += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in items]
        if body is not None and not any(k == b"content-length" for k, _ in h) and end_stream:
            h.append((b"content-length", str(len(body)).encode()))
        p.http.send_headers(sid, h, end_stream=end_stream and not body)
        if body:
            p.http.send_data(sid, body, end_stream=end_stream)
        p.transmit()
        return rs

    def send_body(self, stream: ResponseStream, data: bytes, end_stream: bool = False) -> None:
        """More request body on a stream opened with end_stream=False (tests: slow or endless uploads)."""
        p = self._protocol
        if p is None:
            raise ConnectError("not connected")
        p.http.send_data(stream.stream_id, data, end_stream=end_stream)
        p.transmit()

    async def stream(self, method: str, path: str, headers: HeadersArg = None, body: bytes | None = None, *,
                     end_stream: bool = True, timeout: float | None = 30.0) -> ResponseStream:
        """Send a request; return once the response headers arrived (or the stream failed: raises)."""
        rs = self._open(method, path, headers, body, end_stream)
        try:
            await asyncio.wait_for(rs._headers_seen.wait(), timeout)
        except TimeoutError:
            self.reset(rs)
            raise StreamError(f"no response headers within {timeout:g}s") from None
        if rs.status == 0 and rs._error is not None:
            raise rs._error
        return rs

    async def request(self, method: str, path: str, headers: HeadersArg = None, body: bytes | None = None, *,
                      timeout: float | None = 60.0) -> Response:
        """Send a request and read the whole response."""

        rs = self._open(method, path, headers, body, True)

        async def run() -> Response:
            await rs._headers_seen.wait()
            if rs.status == 0 and rs._error is not None:
                raise rs._error
            data = await rs.read()
            return Response(rs.status, rs.headers, data)

        try:
            return await asyncio.wait_for(run(), timeout)
        except TimeoutError:
            self.reset(rs)
            raise StreamError(f"no complete response within {timeout:g}s") from None

    def reset(self, stream: ResponseStream) -> None:
        """Abandon a request mid-way: STOP_SENDING (we want no more response) and RESET_STREAM."""
        p = self._protocol
        if p is None or stream.ended:
            stream._on_end()
            return
        for op in (p._quic.stop_stream, p._quic.reset_stream):
            try:
                op(stream.stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            except (ValueError, AssertionError):
                pass  # that half of the stream is already finished
        p.streams.pop(stream.stream_id, None)
        stream._on_end()
        p.transmit()


# ---------------------------------------------------------------- OpenAI helpers


async def iter_sse(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Body chunks of a text/event-stream -> the `data:` payload of each event ("[DONE]" included)."""
    buf = b""
    async for chunk in chunks:
        buf += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:
                yield b"\n".join(data).decode("utf-8", "replace")


def error_message(status: int, body: bytes) -> str:
    """The `error.message` of an OpenAI-style error body, else the body itself."""
    try:
        return str(json.loads(body)["error"]["message"])
    except Exception:
        text = body.decode("utf-8", "replace").strip()
        return text[:500] or f"HTTP {status}"


async def chat_stream(client: H3Client, messages: list[dict[str, Any]], *, model: str | None = None,
                      max_tokens: int | None = None, temperature: float | None = None,
                      headers: HeadersArg = None, extra: dict[str, Any] | None = None,
                      timeout: float | None = 30.0) -> AsyncIterator[str]:
    """Stream a chat completion; yield content deltas. Raises HTTPError / StreamError on failure."""
    body: dict[str, Any] = {"messages": messages, "stream": True}
    if model is not None:
        body["model"] = model
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    body.update(extra or {})
    hdrs = dict(headers.items() if isinstance(headers, Mapping) else (headers or []))
    hdrs.setdefault("content-type", "application/json")
    hdrs.setdefault("accept", "text/event-stream")
    rs = await client.stream("POST", "/v1/chat/completions", hdrs, json.dumps(body).encode(), timeout=timeout)
    async with rs:
        if rs.status != 200:
            data = await rs.read()
            raise HTTPError(rs.status, error_message(rs.status, data), data)
        async for data in iter_sse(rs):
            if data == "[DONE]":
                return
            obj = json.loads(data)
            if "error" in obj:
                err = obj["error"] or {}
                raise StreamError(err.get("message") or "the server reported an error")
            for choice in obj.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    yield text
        raise StreamError("the stream ended without [DONE]")


def _connect_host(host: str) -> str:
    # A listen address is not a destination: connect to loopback instead.
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host.strip("[]"))


class _Turn:
    """How a chat turn ended."""

    OK = 0
    FAILED = 1  # the server refused it or the stream broke: an interactive session goes on
    UNREACHABLE = 2  # no connection: the session ends


@dataclass
class _ChatSession:
    """`edged chat`'s connection settings and the messages so far; one QUIC connection per turn
    (between turns the event loop does not run, and an idle connection would die unnoticed)."""

    target: str
    port: int
    ca_file: str | None
    insecure: bool
    connect_timeout: float
    model: str | None
    max_tokens: int | None
    temperature: float | None
    headers: dict[str, str]
    tickets: ClientTicketFile | None = None  # QUIC session tickets for 0-RTT; None: full handshakes
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.target}:{self.port}" if ":" not in self.target else f"[{self.target}]:{self.port}"

    def _unreachable(self, e: ConnectError) -> tuple[int, str]:
        print(f"edged chat: could not reach edged at {self.where} over HTTP/3 (QUIC/UDP): {e}\n"
              f"  hint: is the daemon running and UDP port {self.port} open?", file=sys.stderr)
        return _Turn.UNREACHABLE, ""

    async def turn(self) -> tuple[int, str]:
        """Send the whole history, stream the answer to stdout; (a _Turn value, the answer's text)."""
        t = self.tickets
        client = H3Client(self.target, self.port, ca_file=self.ca_file, insecure=self.insecure,
                          connect_timeout=self.connect_timeout, session_ticket=t.load() if t else None,
                          on_ticket=t.save if t else None)
        try:
            await client.connect(early_data=True)  # with a ticket from the last run: the request rides in 0-RTT
        except CertificateError as e:
            hint = ("pass --ca-file with the server's certificate (the daemon's own is <state_dir>/tls/cert.pem)"
                    " or --insecure to skip verification"
                    + (f"; {self.ca_file} did not verify it" if self.ca_file else ""))
            print(f"edged chat: {e}\n  hint: {hint}", file=sys.stderr)
            return _Turn.UNREACHABLE, ""
        except ConnectError as e:
            return self._unreachable(e)
        parts: list[str] = []
        try:
            async for text in chat_stream(client, self.messages, model=self.model, max_tokens=self.max_tokens,
                                          temperature=self.temperature, headers=self.headers):
                sys.stdout.write(text)
                sys.stdout.flush()
                parts.append(text)
            sys.stdout.write("\n")
            sys.stdout.flush()
            return _Turn.OK, "".join(parts)
        except ConnectError as e:  # a 0-RTT attempt whose handshake failed
            return self._unreachable(e)
        except HTTPError as e:
            if parts:
                sys.stdout.write("\n")
            print(f"edged chat: the server refused the request (HTTP {e.status}): {e.message}", file=sys.stderr)
            if e.status == 401:
                print("  hint: give the key with --api-key KEY or in $EDGED_API_KEY", file=sys.stderr)
            return _Turn.FAILED, ""
        except H3ClientError as e:
            if parts:
                sys.stdout.write("\n")
            print(f"edged chat: generation failed: {e}", file=sys.stderr)
            return _Turn.FAILED, ""
        finally:
            await client.close()


def run_chat_command(prompt: str | None, host: str, port: int, ca_file: str | None, insecure: bool,
                     max_tokens: int | None, temperature: float | None, system: str | None = None,
                     model: str | None = None, connect_timeout: float = 5.0, api_key: str | None = None,
                     zero_rtt: bool = True) -> int:
    """`edged chat "PROMPT"`: stream the answer to stdout. 0 on success; 1 on any error (message on
    stderr); 130 on Ctrl-C.

    Without a prompt, a conversation: one user message per line of standard input ("> " on a
    terminal), each answer streamed, the whole history sent every turn (like `ollama run`). EOF
    (Ctrl-D) ends it with 0; Ctrl-C during an answer drops that turn and asks again; an unreachable
    daemon ends it with 1. A refused turn (e.g. the history outgrew the context) is reported and
    dropped from the history."""
    quic_log = logging.getLogger("quic")  # aioquic warns on stderr about e.g. a bad certificate; we say it better
    if quic_log.level == logging.NOTSET:
        quic_log.setLevel(logging.ERROR)
    session = _ChatSession(_connect_host(host), port, ca_file, insecure, connect_timeout, model, max_tokens,
                           temperature, {"authorization": f"Bearer {api_key}"} if api_key else {},
                           ClientTicketFile(default_client_state_dir(), _connect_host(host), port) if zero_rtt else None)
    if system:
        session.messages.append({"role": "system", "content": system})
    if prompt is not None:
        session.messages.append({"role": "user", "content": prompt})
        try:
            status, _ = asyncio.run(session.turn())
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            return 130
        return 0 if status == _Turn.OK else 1
    return _converse(session)


def _converse(session: _ChatSession) -> int:
    tty = sys.stdin.isatty()
    if tty:
        try:
            import readline  # noqa: F401  (line editing and recall for input())
        except ImportError:
            pass
        print("edged chat: Ctrl-D to leave", file=sys.stderr)
    with asyncio.Runner() as runner:  # one event loop for the session
        while True:
            try:
                line = input("> " if tty else "")
            except EOFError:
                if tty:
                    sys.stdout.write("\n")
                return 0
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                return 130
            if not line.strip():
                continue
            session.messages.append({"role": "user", "content": line})
            try:
                status, answer = runner.run(session.turn())
            except KeyboardInterrupt:  # the stream was reset on the way out; forget the question
                session.messages.pop()
                sys.stdout.write("\n")
                sys.stdout.flush()
                continue
            if status == _Turn.UNREACHABLE:
                return 1
            if status == _Turn.FAILED:
                session.messages.pop()
                continue
            session.messages.append({"role": "assistant", "content": answer})
