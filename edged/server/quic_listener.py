"""The QUIC listener of one worker: aioquic's `QuicServer` with admission control in front of it.

A new connection (an Initial packet for an unknown connection ID) costs the server a full TLS
handshake and a connection's state, and asks nothing of the sender. Before creating one:

1. total cap: this worker holds `quic_max_connections` connections -> refused;
2. Retry (RFC 9000 8.1.2): an Initial without a token gets a stateless Retry while this worker
   sees more than `quic_retry_above_per_s` new handshakes per second (0: always), or while its
   address has `quic_retry_above_unvalidated_per_address` handshakes in flight that never proved
   the address, or holds `quic_max_connections_per_address` connections; only a client that
   really owns its address comes back with the token (AES-GCM, aioquic's QuicRetryTokenHandler;
   cheap next to a handshake);
3. per-address cap for clients that came back with a token: `quic_max_connections_per_address`
   connections from that IP, not counting half-open connections that never proved the address
   (a spoofed flood's), so such a flood cannot lock a real client behind the same IP out -> refused.

Refused means a CONNECTION_CLOSE with CONNECTION_REFUSED in a server Initial, no larger than what
the client sent, so the client fails at once instead of timing out. Connections whose handshake
does not complete within `quic_handshake_timeout_s` are closed by the protocol (h3_server.py);
idle ones by aioquic's idle timeout. Every decision is counted (`on_event`).

Connection IDs route to this worker (quic_routing.CidRoute), Retry source IDs included.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, cast

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE, QuicConfiguration
from aioquic.quic.connection import TRANSPORT_CLOSE_FRAME_CAPACITY, NetworkAddress
from aioquic.quic.crypto import CryptoPair
from aioquic.quic.packet import (
    QuicErrorCode,
    QuicFrameType,
    QuicPacketType,
    encode_quic_retry,
    encode_quic_version_negotiation,
    pull_quic_header,
)
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.retry import QuicRetryTokenHandler

from edged.log import fields
from edged.server.quic_routing import CidRoute, RoutedQuicConnection
from edged.server.quic_tickets import TicketStore
from edged.server.settings import ServerSettings

log = logging.getLogger("edged.server")


def encode_refusal(version: int, client_dcid: bytes, client_scid: bytes, reason: str) -> bytes:
    """A server Initial closing the connection with CONNECTION_REFUSED (keys from the client's DCID)."""
    crypto = CryptoPair()
    crypto.setup_initial(cid=client_dcid, is_client=False, version=version)
    builder = QuicPacketBuilder(host_cid=client_dcid, is_client=False, max_datagram_size=SMALLEST_MAX_DATAGRAM_SIZE,
                                peer_cid=client_scid, version=version)
    builder.start_packet(QuicPacketType.INITIAL, crypto)
    buf = builder.start_frame(QuicFrameType.TRANSPORT_CLOSE, capacity=TRANSPORT_CLOSE_FRAME_CAPACITY)
    phrase = reason.encode()[:64]
    buf.push_uint_var(QuicErrorCode.CONNECTION_REFUSED)
    buf.push_uint_var(QuicFrameType.PADDING)
    buf.push_uint_var(len(phrase))
    buf.push_bytes(phrase)
    datagrams, _ = builder.flush()
    return datagrams[0]


class HandshakeRate:
    """New handshakes per second, over the current and the previous one-second window."""

    def __init__(self) -> None:
        self._window = 0
        self._now = 0
        self._prev = 0

    def add(self, now: float) -> None:
        self._roll(now)
        self._now += 1

    def per_s(self, now: float) -> float:
        self._roll(now)
        frac = now - int(now)
        return self._now + self._prev * (1.0 - frac)

    def _roll(self, now: float) -> None:
        w = int(now)
        if w != self._window:
            self._prev = self._now if w == self._window + 1 else 0
            self._now = 0
            self._window = w


class EdgedQuicServer(QuicServer):
    """aioquic's QuicServer (datagram demultiplexing by connection ID) plus admission control."""

    def __init__(self, *, configuration: QuicConfiguration, create_protocol: Callable[..., QuicConnectionProtocol],
                 settings: Callable[[], ServerSettings], route: CidRoute, tickets: TicketStore | None,
                 on_event: Callable[[str], None]) -> None:
        super().__init__(configuration=configuration, create_protocol=create_protocol,
                         session_ticket_fetcher=self._fetch_ticket if tickets is not None else None,
                         session_ticket_handler=self._store_ticket if tickets is not None else None)
        self._settings = settings
        self._route = route
        self._tickets = tickets
        self._on_event = on_event
        self._retry_tokens = QuicRetryTokenHandler()
        self._rate = HandshakeRate()
        self._host_of: dict[QuicConnectionProtocol, str] = {}  # live connections -> the client's IP
        self._per_host: dict[str, set[QuicConnectionProtocol]] = {}
        self._validated: set[QuicConnectionProtocol] = set()  # created with a Retry token

    # ---- session tickets (0-RTT); live: zero_rtt off stops issuing and accepting them

    def _fetch_ticket(self, ticket_id: bytes) -> Any:
        if self._tickets is None or not self._settings().zero_rtt:
            return None
        ticket = self._tickets.take(ticket_id)
        self._on_event("ticket_found" if ticket is not None else "ticket_unknown")
        return ticket

    def _store_ticket(self, ticket: Any) -> None:
        if self._tickets is not None and self._settings().zero_rtt:
            self._tickets.add(ticket)

    # ---- connections

    @property
    def connection_count(self) -> int:
        return len(self._host_of)

    def connections_from(self, host: str) -> int:
        return len(self._per_host.get(host, ()))

    def _proven_from(self, host: str) -> int:
        """Connections from `host` that proved the address: by a Retry token or a completed handshake."""
        return sum(1 for p in self._per_host.get(host, ())
                   if p in self._validated or getattr(p, "handshake_done", False))

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        data = cast(bytes, data)
        buf = Buffer(data=data)
        try:
            header = pull_quic_header(buf, host_cid_length=self._configuration.connection_id_length)
        except ValueError:
            return
        if (header.packet_type != QuicPacketType.VERSION_NEGOTIATION and header.version is not None
                and header.version not in self._configuration.supported_versions):
            self._transport.sendto(encode_quic_version_negotiation(
                source_cid=header.destination_cid, destination_cid=header.source_cid,
                supported_versions=self._configuration.supported_versions), addr)
            return
        protocol = self._protocols.get(header.destination_cid)
        if protocol is None and len(data) >= SMALLEST_MAX_DATAGRAM_SIZE and header.packet_type == QuicPacketType.INITIAL:
            protocol = self._admit(header, addr)
        if protocol is not None:
            protocol.datagram_received(data, addr)

    def _admit(self, header: Any, addr: NetworkAddress) -> QuicConnectionProtocol | None:
        """A new connection for this Initial, or None (refused, or answered with a Retry)."""
        st = self._settings()
        now = self._loop.time()
        host = str(addr[0])
        if len(self._host_of) >= st.quic_max_connections:
            return self._refuse(header, addr, "refused_total", "server busy")
        original_dcid = header.destination_cid
        retry_scid: bytes | None = None
        if header.token:
            try:
                original_dcid = self._retry_tokens.validate_token(
                    address=addr, destination_cid=header.destination_cid, token=header.token, now=now)
            except ValueError:
                self._on_event("retry_invalid")
                self._transport.sendto(encode_refusal(header.version, header.destination_cid, header.source_cid,
                                                      "invalid token"), addr)
                return None
            retry_scid = header.destination_cid
            if self._proven_from(host) >= st.quic_max_connections_per_address:
                return self._refuse(header, addr, "refused_per_address", "too many connections from this address")
        elif (st.quic_retry_above_per_s == 0 or self._rate.per_s(now) >= st.quic_retry_above_per_s
              or self.connections_from(host) - self._proven_from(host) >= st.quic_retry_above_unvalidated_per_address
              or self.connections_from(host) >= st.quic_max_connections_per_address):
            # Stateless: a flood from spoofed addresses costs one small packet each.
            scid = self._route.new_cid(self._configuration.connection_id_length)
            token = self._retry_tokens.create_token(address=addr, original_destination_connection_id=header.destination_cid,
                                                    retry_source_connection_id=scid, now=now)
            self._transport.sendto(encode_quic_retry(version=header.version, source_cid=scid,
                                                     destination_cid=header.source_cid,
                                                     original_destination_cid=header.destination_cid,
                                                     retry_token=token), addr)
            self._on_event("retry_sent")
            return None
        if retry_scid is None:
            self._rate.add(now)  # handshakes that start now, unvalidated
        connection = RoutedQuicConnection(
            route=self._route, configuration=self._configuration,
            original_destination_connection_id=original_dcid, retry_source_connection_id=retry_scid,
            # zero_rtt off: no ticket is issued (a client would hold a useless one) nor accepted
            session_ticket_fetcher=self._session_ticket_fetcher if st.zero_rtt else None,
            session_ticket_handler=self._session_ticket_handler if st.zero_rtt else None)
        protocol = self._create_protocol(connection, stream_handler=self._stream_handler)
        protocol.connection_made(self._transport)
        protocol._connection_id_issued_handler = partial(self._connection_id_issued, protocol=protocol)
        protocol._connection_id_retired_handler = partial(self._connection_id_retired, protocol=protocol)
        protocol._connection_terminated_handler = partial(self._connection_terminated, protocol=protocol)
        self._protocols[header.destination_cid] = protocol
        self._protocols[connection.host_cid] = protocol
        self._host_of[protocol] = host
        self._per_host.setdefault(host, set()).add(protocol)
        if retry_scid is not None:
            self._validated.add(protocol)
        self._on_event("accepted" if retry_scid is None else "accepted_after_retry")
        return protocol

    def _refuse(self, header: Any, addr: NetworkAddress, event: str, reason: str) -> None:
        self._on_event(event)
        log.debug("quic connection refused %s", fields(peer=addr[0], reason=event))
        self._transport.sendto(encode_refusal(header.version, header.destination_cid, header.source_cid, reason), addr)

    def _connection_terminated(self, protocol: QuicConnectionProtocol) -> None:
        super()._connection_terminated(protocol)
        host = self._host_of.pop(protocol, None)
        self._validated.discard(protocol)
        if host is not None:
            conns = self._per_host.get(host, set())
            conns.discard(protocol)
            if not conns:
                self._per_host.pop(host, None)

    def close(self) -> None:
        super().close()
        self._host_of.clear()
        self._per_host.clear()
        self._validated.clear()
