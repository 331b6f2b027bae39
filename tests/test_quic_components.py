"""The QUIC parts on their own: the session-ticket stores, the replay rule, connection-ID routing
(a real SO_REUSEPORT group with the cBPF program), admission control on an in-process server
(real QUIC over loopback, fake engine), and the config keys."""
from __future__ import annotations

import asyncio
import datetime as dt
import os
import socket
import stat
import time

import pytest
from aioquic.tls import CipherSuite, SessionTicket
from helpers.aio import run
from helpers.fake_engine import FakeEngine, ServerThread, wait_until
from helpers.quic_flood import initial_packets

from edged.config import ConfigError, parse_config
from edged.daemon import bind_udp
from edged.server.h3_client import ConnectError, H3Client
from edged.server.quic_early_data import replay_safe
from edged.server.quic_routing import CidRoute, attach_cid_routing
from edged.server.quic_tickets import (
    ClientTicketFile,
    TicketStore,
    decode_ticket,
    encode_ticket,
)
from edged.server.settings import ServerSettings

pytestmark = pytest.mark.timeout(60)


def ticket(ticket_id: bytes = b"t" * 64, valid_s: float = 3600) -> SessionTicket:
    now = dt.datetime.now(dt.UTC)
    return SessionTicket(age_add=7, cipher_suite=CipherSuite.AES_128_GCM_SHA256, not_valid_after=now + dt.timedelta(seconds=valid_s),
                         not_valid_before=now, resumption_secret=b"s" * 32, server_name="localhost", ticket=ticket_id,
                         max_early_data_size=0xFFFFFFFF, other_extensions=[(0x39, b"params")])


# ------------------------------------------------------------------ session tickets

def test_ticket_codec_round_trips_and_rejects_garbage() -> None:
    t = ticket()
    back = decode_ticket(encode_ticket(t))
    assert back is not None and encode_ticket(back) == encode_ticket(t)
    assert back.other_extensions == [(0x39, b"params")] and back.cipher_suite == CipherSuite.AES_128_GCM_SHA256
    assert decode_ticket(b"\x93not a ticket") is None


def test_the_server_store_is_shared_private_single_use_and_bounded(tmp_path) -> None:
    path = tmp_path / "quic_tickets.sqlite"
    w0, w1 = TicketStore(path, 3600, max_tickets=32), TicketStore(path, 3600, max_tickets=32)  # two workers
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    w0.add(ticket(b"a" * 64))
    found = w1.take(b"a" * 64)  # issued by one worker, redeemed at another
    assert found is not None and found.resumption_secret == b"s" * 32
    assert w0.take(b"a" * 64) is None and w1.take(b"a" * 64) is None  # used once: a replay finds nothing
    for i in range(100):
        w0.add(ticket(i.to_bytes(64, "big")))
    assert w0.count() <= 32 + 32 // 16 and w0.take((99).to_bytes(64, "big")) is not None  # newest kept
    assert w0.take((0).to_bytes(64, "big")) is None  # oldest dropped
    short = TicketStore(path, lifetime_s=1, max_tickets=32)
    short.add(ticket(b"b" * 64))
    assert short.take(b"b" * 64).not_valid_after <= dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    w0._db.execute("INSERT INTO tickets VALUES (?, ?, ?)", (b"c" * 64, time.time() - 7200, encode_ticket(ticket())))
    assert w1.take(b"c" * 64) is None  # older than the lifetime
    for s in (w0, w1, short):
        s.close()


def test_the_client_keeps_one_private_ticket_per_server(tmp_path) -> None:
    f = ClientTicketFile(tmp_path, "127.0.0.1", 4433)
    assert f.load() is None
    f.save(ticket())
    assert stat.S_IMODE(os.stat(f.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(f.path.parent).st_mode) == 0o700
    assert f.load().ticket == ticket().ticket
    assert ClientTicketFile(tmp_path, "127.0.0.1", 4434).load() is None
    f.save(ticket(valid_s=-1))  # expired: not offered
    assert f.load() is None


# ------------------------------------------------------------------ the replay rule

@pytest.mark.parametrize("method,path,body,defaults,safe", [
    ("GET", "/v1/models", b"", {}, True),
    ("GET", "/metrics", b"", {}, True),
    ("POST", "/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"temperature":0}', {}, True),
    ("POST", "/v1/completions", b'{"prompt":"hi","temperature":0.9,"seed":3}', {}, True),
    ("POST", "/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}]}', {"temperature": 0.0}, True),
    ("POST", "/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}]}', {"temperature": 0.7}, False),
    ("POST", "/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}]}', {}, False),  # default 1.0
    ("POST", "/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"temperature":0.5}', {}, False),
    ("POST", "/v1/chat/completions", b'not json', {}, False),
    ("POST", "/v1/unknown", b'{}', {}, False),
    ("DELETE", "/v1/models", b'', {}, False),
])
def test_replay_safe(method, path, body, defaults, safe) -> None:
    assert replay_safe(method, path, body, defaults) is safe


# ------------------------------------------------------------------ connection-ID routing

@pytest.mark.parametrize("count", [2, 3])
def test_the_cbpf_program_routes_each_packet_to_the_worker_its_connection_id_names(count: int) -> None:
    socks = bind_udp("127.0.0.1", 0, count)
    try:
        attach_cid_routing(socks[0], count)
        addr = socks[0].getsockname()
        sent: list[tuple[int, bytes]] = []
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            for index in range(count):
                route = CidRoute(index, count)
                for _ in range(5):
                    cid = route.new_cid()
                    assert route.owns(cid) and not CidRoute((index + 1) % count, count).owns(cid)
                    short = bytes([0x40]) + cid + os.urandom(30)
                    long = bytes([0xC0, 0, 0, 0, 1, 8]) + cid + os.urandom(30)
                    for packet in (short, long):
                        client.sendto(packet, addr)  # same source port throughout: the hash would pick one
                        sent.append((index, packet))
        got: dict[bytes, int] = {}
        for index, s in enumerate(socks):
            s.settimeout(1.0)
        for _ in sent:
            for index, s in enumerate(socks):
                s.setblocking(False)
                try:
                    got[s.recv(2048)] = index
                except BlockingIOError:
                    pass
            if len(got) == len(sent):
                break
            time.sleep(0.01)
        assert {p: i for i, p in sent} == got
    finally:
        for s in socks:
            s.close()


def test_a_client_initial_dcid_is_the_one_its_first_packet_carries_and_must_be_8_to_20_bytes() -> None:
    async def first_packet_dcid(dcid: bytes) -> bytes:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
            server.bind(("127.0.0.1", 0))
            server.setblocking(False)
            client = H3Client("127.0.0.1", server.getsockname()[1], insecure=True, connect_timeout=0.5,
                              initial_dcid=dcid)
            connecting = asyncio.ensure_future(client.connect())
            packet = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(server, 2048), 5)
            with pytest.raises(ConnectError):
                await connecting
            return packet[6:6 + packet[5]]  # a long header: flags, version, DCID length, DCID

    dcid = CidRoute(1, 2).new_cid()
    assert run(first_packet_dcid(dcid)) == dcid
    for bad in (b"short", bytes(21)):
        with pytest.raises(ValueError):
            run(H3Client("127.0.0.1", 9, insecure=True, initial_dcid=bad).connect())


# ------------------------------------------------------------------ admission control, in process

def server(certs, **limits) -> ServerThread:
    return ServerThread(FakeEngine(max_model_len=256), *certs, settings=ServerSettings(**limits))


def test_per_address_cap_refuses_a_proven_client_over_it(certs) -> None:
    with server(certs, quic_max_connections_per_address=2) as st:
        events: list[str] = []
        st.server.quic_event = events.append

        async def go() -> None:
            a, b = H3Client("127.0.0.1", st.port, ca_file=certs[0]), H3Client("127.0.0.1", st.port, ca_file=certs[0])
            await a.connect()
            await b.connect()
            with pytest.raises(ConnectError, match="too many connections from this address"):
                await H3Client("127.0.0.1", st.port, ca_file=certs[0]).connect()
            await a.close()
            assert wait_until(lambda: st.server._quic_server.connection_count == 1)
            c = H3Client("127.0.0.1", st.port, ca_file=certs[0])
            await c.connect()  # a slot is free again
            await b.close()
            await c.close()

        run(go())
        # The third client first got a Retry (its address held the cap), proved it, then was refused.
        assert events.count("retry_sent") >= 1 and "refused_per_address" in events


def test_total_cap_refuses_and_retry_always_still_connects(certs) -> None:
    with server(certs, quic_max_connections=1, quic_retry_above_per_s=0) as st:
        events: list[str] = []
        st.server.quic_event = events.append

        async def go() -> None:
            async with H3Client("127.0.0.1", st.port, ca_file=certs[0]) as c:
                assert (await c.request("GET", "/healthz")).status == 200
                with pytest.raises(ConnectError, match="server busy"):
                    await H3Client("127.0.0.1", st.port, ca_file=certs[0]).connect()

        run(go())
        assert events[:2] == ["retry_sent", "accepted_after_retry"] and "refused_total" in events


def test_a_stalled_handshake_is_reaped_and_a_spoofed_flood_gets_retries(certs) -> None:
    with server(certs, quic_handshake_timeout_s=0.3, quic_retry_above_unvalidated_per_address=4) as st:
        events: list[str] = []
        st.server.quic_event = events.append
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for packet in initial_packets(10):
                s.sendto(packet, ("127.0.0.1", st.port))  # never answers
        assert wait_until(lambda: events.count("accepted") + events.count("retry_sent") == 10)
        assert events.count("accepted") == 4  # then the address had 4 unproven handshakes in flight
        assert wait_until(lambda: events.count("handshake_timeout") == 4, timeout=5)
        assert wait_until(lambda: st.server._quic_server.connection_count == 0, timeout=5)


def test_an_idle_connection_is_reaped(certs) -> None:
    with server(certs, idle_timeout_s=0.5) as st:
        async def go() -> None:
            c = H3Client("127.0.0.1", st.port, ca_file=certs[0])
            await c.connect()
            assert (await c.request("GET", "/healthz")).status == 200
            assert st.server._quic_server.connection_count == 1
            assert await asyncio.to_thread(wait_until, lambda: st.server._quic_server.connection_count == 0, 5.0)
            await c.close()

        run(go())


# ------------------------------------------------------------------ config

def test_quic_config_keys_and_their_validation() -> None:
    c = parse_config({"server": {"zero_rtt": False, "quic": {"max_connections_per_address": 3,
                                                              "retry_above_handshakes_per_s": 0}}}, "t.yaml")
    assert c.server.zero_rtt is False and c.server.quic.max_connections_per_address == 3
    assert c.server.quic.retry_above_handshakes_per_s == 0
    with pytest.raises(ConfigError) as e:
        parse_config({"server": {"zero_rtt": "maybe", "quic": {
            "max_connections": 0, "max_connections_per_address": -1, "retry_above_handshakes_per_s": -1,
            "retry_above_unvalidated_per_address": 0, "handshake_timeout_s": 0, "idle_timeout_s": 0,
            "ticket_lifetime_s": 90000, "max_tickets": 0, "bogus": 1}}}, "t.yaml")
    problems = "\n".join(e.value.messages())
    for key in ("zero_rtt", "max_connections", "max_connections_per_address", "retry_above_handshakes_per_s",
                "retry_above_unvalidated_per_address", "handshake_timeout_s", "idle_timeout_s",
                "ticket_lifetime_s", "max_tickets", "bogus"):
        assert f"server.{'' if key == 'zero_rtt' else 'quic.'}{key}:" in problems, key


def test_congestion_control_key_defaults_to_reno_floor_and_names_only_known_algorithms() -> None:
    assert parse_config({}, "t.yaml").server.quic.congestion_control == "reno-floor"
    assert parse_config({"server": {"quic": {"congestion_control": "cubic"}}}, "t.yaml").server.quic.congestion_control == "cubic"
    with pytest.raises(ConfigError) as e:
        parse_config({"server": {"quic": {"congestion_control": "bbr"}}}, "t.yaml")
    assert "server.quic.congestion_control:" in "\n".join(e.value.messages())


def test_reno_floor_keeps_the_initial_window_through_losses_where_reno_shrinks_to_two_datagrams() -> None:
    from aioquic.quic.congestion.base import K_INITIAL_WINDOW, create_congestion_control
    from aioquic.quic.packet_builder import QuicSentPacket

    from edged.server import quic_congestion  # noqa: F401  (registers reno-floor)

    def after_losses(name: str) -> tuple[int, int]:
        cc = create_congestion_control(name, max_datagram_size=1200)
        for i in range(20):  # a loss per round trip, then persistent congestion
            lost = QuicSentPacket(epoch=3, in_flight=True, is_ack_eliciting=True, is_crypto_packet=False,
                                  packet_number=i, packet_type=0, sent_bytes=1200, sent_time=float(i))
            cc.on_packet_sent(packet=lost)
            cc.on_packets_lost(now=float(i) + 0.5, packets=[lost])
        shrunk = cc.congestion_window
        cc.on_persistent_congestion()
        return shrunk, cc.congestion_window

    assert after_losses("reno") == (2 * 1200, 2 * 1200)
    assert after_losses("reno-floor") == (K_INITIAL_WINDOW * 1200, K_INITIAL_WINDOW * 1200)


def test_server_connections_run_the_configured_congestion_control(certs) -> None:
    from edged.server.h3_server import serve
    from edged.server.quic_congestion import RenoFloorCongestionControl
    from edged.server.routes import Router

    async def go() -> None:
        srv = await serve(Router(FakeEngine(max_model_len=256), ServerSettings()), "127.0.0.1", 0, *certs)
        try:
            async with H3Client("127.0.0.1", srv.port, ca_file=certs[0]) as c:
                assert (await c.request("GET", "/healthz")).status == 200
                conns = {p._quic for p in srv._quic_server._protocols.values()}
                assert len(conns) == 1
                assert type(conns.pop()._loss._cc) is RenoFloorCongestionControl
        finally:
            srv.close()
            await srv.wait_closed()

    run(go())


# ------------------------------------------------------------------ zero_rtt on and off, in process

@pytest.mark.parametrize("zero_rtt", [True, False])
def test_zero_rtt_setting_issues_and_accepts_tickets_or_neither(certs, tmp_path, zero_rtt: bool) -> None:
    from edged.server.h3_server import serve
    from edged.server.routes import Router

    store = TicketStore(tmp_path / "quic_tickets.sqlite", 3600, 100)

    async def go() -> None:
        srv = await serve(Router(FakeEngine(max_model_len=256), ServerSettings(zero_rtt=zero_rtt)), "127.0.0.1", 0,
                          *certs, tickets=store)
        try:
            async with H3Client("127.0.0.1", srv.port, ca_file=certs[0]) as c:
                assert (await c.request("GET", "/healthz")).status == 200
                issued = list(c.new_tickets)
            assert bool(issued) is zero_rtt and (store.count() == 1) is zero_rtt
            if zero_rtt:
                c = H3Client("127.0.0.1", srv.port, ca_file=certs[0], session_ticket=issued[-1])
                await c.connect(early_data=True)
                assert (await c.request("GET", "/v1/models")).status == 200
                assert c.early_data_accepted and c.session_resumed
                await c.close()
        finally:
            srv.close()
            await srv.wait_closed()

    run(go())


# ------------------------------------------------------------------ small datagrams sent twice

class _RecordingTransport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def sendto(self, data: bytes, addr=None) -> None:
        self.sent.append(data)

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 4433) if name == "sockname" else default


def test_only_small_short_header_datagrams_of_a_light_sender_are_sent_twice() -> None:
    from edged.server.quic_redundancy import DuplicatingTransport

    inner = _RecordingTransport()
    light = [True]
    dup = DuplicatingTransport(inner, 100, 0.0, asyncio.new_event_loop(), lambda: light[0])
    short, long_header, big = b"\x40" + b"t" * 50, b"\xc0" + b"h" * 50, b"\x40" + b"b" * 200
    for d in (short, long_header, big):
        dup.sendto(d, ("127.0.0.1", 9))
    light[0] = False  # the window is half full: bulk data, paced by the congestion controller
    dup.sendto(short, ("127.0.0.1", 9))
    assert inner.sent == [short, short, long_header, big, short]
    assert dup.copies_sent == 1 and dup.get_extra_info("sockname") == ("127.0.0.1", 4433)  # the rest delegates


def test_small_datagrams_go_twice_only_after_the_connection_has_lost_one(certs) -> None:
    """The default rule: a clean connection sends every datagram once. Once datagrams of the server's
    went missing (dropped at the client's socket) and its loss recovery declared them lost, the
    connection's next streams are sent twice, counted once as an event; every answer is whole."""
    from edged.server.h3_server import serve
    from edged.server.quic_redundancy import DuplicatingTransport
    from edged.server.routes import Router

    def body(word: str) -> bytes:  # a prompt of its own per request: no answer comes from the result cache
        return (b'{"messages":[{"role":"user","content":"' + word.encode() +
                b'"}],"temperature":0,"max_tokens":24,"stream":true}')

    async def scenario() -> tuple[list[int], list[bytes], list[int], list[str]]:
        settings = ServerSettings(quic_duplicate_delay_s=0.001)
        assert settings.quic_duplicate_datagram_bytes == 1500 and settings.quic_duplicate_after_loss_s > 0
        srv = await serve(Router(FakeEngine(max_model_len=256), settings), "127.0.0.1", 0, *certs)
        events: list[str] = []
        srv.quic_event = events.append
        copies, bodies, dropped = [], [], []
        try:
            async with H3Client("127.0.0.1", srv.port, ca_file=certs[0]) as c:
                def sent_twice() -> int:
                    return sum(t.copies_sent for p in srv._quic_server._protocols.values()
                               if isinstance(t := p._transport, DuplicatingTransport))

                async def ask(word: str) -> None:
                    r = await c.request("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                        body(word))
                    assert r.status == 200
                    bodies.append(r.body)
                    copies.append(sent_twice())

                await ask("one")
                protocol = c._protocol
                receive = protocol.datagram_received

                def lossy(data: bytes, addr: object) -> None:  # the next three 1-RTT datagrams of stream
                    if len(dropped) < 3 and len(data) > 100 and not data[0] & 0x80:  # data never arrive (not ACKs)
                        dropped.append(len(data))
                        return
                    receive(data, addr)

                protocol.datagram_received = lossy
                await ask("two")
                await ask("three")
        finally:
            srv.close()
            await srv.wait_closed()
        return copies, bodies, dropped, events

    copies, bodies, dropped, events = run(scenario())
    assert copies[0] == 0  # no loss yet: nothing sent twice
    assert len(dropped) == 3 and copies[2] > copies[1] >= 0  # after the loss: the next stream goes twice
    assert events.count("datagram_copies_started") == 1
    for sse in bodies:
        assert sse.count(b'"content":') > 3 and sse.rstrip().endswith(b"data: [DONE]")


def test_a_stream_over_duplicated_datagrams_has_the_same_text(certs) -> None:
    """The 1-RTT datagrams of a light connection arrive twice: the client discards the copies
    (RFC 9000 12.3) and the streamed text equals a run without them."""
    from edged.server.h3_server import serve
    from edged.server.quic_redundancy import DuplicatingTransport
    from edged.server.routes import Router

    body = b'{"messages":[{"role":"user","content":"hi"}],"temperature":0,"max_tokens":24,"stream":true}'

    async def text(settings: ServerSettings) -> tuple[bytes, int]:
        srv = await serve(Router(FakeEngine(max_model_len=256), settings), "127.0.0.1", 0, *certs)
        try:
            async with H3Client("127.0.0.1", srv.port, ca_file=certs[0]) as c:
                r = await c.request("POST", "/v1/chat/completions", {"content-type": "application/json"}, body)
                assert r.status == 200
                transports = [p._transport for p in srv._quic_server._protocols.values()]
                copies = sum(t.copies_sent for t in transports if isinstance(t, DuplicatingTransport))
            return r.body, copies
        finally:
            srv.close()
            await srv.wait_closed()

    plain, none = run(text(ServerSettings(quic_duplicate_datagram_bytes=0)))
    twice, copies = run(text(ServerSettings(quic_duplicate_datagram_bytes=1500, quic_duplicate_delay_s=0.001,
                                            quic_duplicate_after_loss_s=0)))  # copy loss or not
    assert none == 0 and copies > 0

    def contents(sse: bytes) -> list[bytes]:  # the deltas' text (ids and timestamps differ between runs)
        return [line.split(b'"content":')[1].split(b"}")[0] for line in sse.split(b"\n") if b'"content":' in line]

    assert len(contents(plain)) > 3 and contents(twice) == contents(plain)
