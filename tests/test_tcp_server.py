"""HTTP/1.1 and HTTP/2 over TLS/TCP (tcp_server.py) against the fake engine: the same router as HTTP/3.

httpx is the client (http2=True for HTTP/2). Each case is checked against what HTTP/3 answers for
the same request on the same server: status, error body and the headers that matter.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import ssl
import time
import uuid
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import pytest

from edged.server.h3_client import H3Client, iter_sse
from edged.server.settings import ApiKeyPolicy, ServerSettings

from helpers.aio import run
from helpers.fake_engine import FakeEngine, ServerThread, expected_text, wait_until
from test_h3_server import BAD, JSON, MAX_BODY, body

pytestmark = pytest.mark.timeout(60)

PROTOCOLS = ["http1", "h2"]
OPEN_KEY, SLOW_KEY = "k-open", "k-slow"


@pytest.fixture(scope="module")
def srv(certs):
    settings = ServerSettings(max_body_bytes=MAX_BODY, body_timeout_s=1.0, default_max_tokens=64)
    with ServerThread(FakeEngine(max_model_len=256), *certs, settings=settings, tcp=True) as st:
        yield st


@pytest.fixture(scope="module")
def auth_srv(certs):
    keys = {hashlib.sha256(OPEN_KEY.encode()).hexdigest(): ApiKeyPolicy("open"),
            hashlib.sha256(SLOW_KEY.encode()).hexdigest(): ApiKeyPolicy("slow", rate_limit_rps=0.01, burst=1)}
    settings = ServerSettings(api_keys=keys, tiers=("gold", "silver"), default_tier="silver")
    with ServerThread(FakeEngine(), *certs, settings=settings, tcp=True) as st:
        yield st


def tls(certs) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=certs[0])


def http(certs, proto: str, **kw) -> httpx.Client:
    """An httpx client that speaks only `proto` ("http1" or "h2")."""
    return httpx.Client(verify=tls(certs), http1=proto == "http1", http2=proto == "h2", timeout=10, **kw)


def url(st: ServerThread, path: str) -> str:
    return f"https://127.0.0.1:{st.port}{path}"


def alt_svc(st: ServerThread) -> str:
    return f'h3=":{st.port}"; ma=86400'


def sse_text(lines: list[str]) -> str:
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            ev = json.loads(line[6:])
            for ch in ev.get("choices", []):
                out.append(ch.get("delta", {}).get("content") or ch.get("text") or "")
    return "".join(out)


def h3_request(st: ServerThread, certs, method: str, path: str, headers: dict, data: bytes | None):
    async def go():
        async with H3Client("127.0.0.1", st.port, ca_file=certs[0]) as c:
            return await c.request(method, path, headers, data, timeout=10)
    return run(go())


# ------------------------------------------------------------------ streaming, keep-alive, Alt-Svc

@pytest.mark.parametrize("proto", PROTOCOLS)
def test_sse_stream_json_and_keep_alive_carry_alt_svc(srv, certs, proto):
    with http(certs, proto) as c:
        with c.stream("POST", url(srv, "/v1/chat/completions"), content=body(stream=True),
                      headers={**JSON, "x-request-id": f"tcp-{proto}", "x-edged-tier": "gold"}) as r:
            assert r.http_version == ("HTTP/2" if proto == "h2" else "HTTP/1.1")
            assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
            assert r.headers["alt-svc"] == alt_svc(srv) and r.headers["x-request-id"] == f"tcp-{proto}"
            if proto == "http1":
                assert r.headers["transfer-encoding"] == "chunked"
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and sse_text(lines) == expected_text()
        r = c.post(url(srv, "/v1/chat/completions"), content=body(max_tokens=3), headers=JSON)
        assert r.status_code == 200 and r.headers["alt-svc"] == alt_svc(srv)
        assert r.json()["choices"][0]["message"]["content"] == expected_text(3)
        r = c.get(url(srv, "/v1/models"))
        assert r.json()["data"][0]["id"] == "fake-model" and r.headers["server"] == "edged"
    assert wait_until(lambda: not srv.server.tcp.connections)  # one connection, closed by the client
    req = next(q for q in srv.engine.requests if q.request_id == f"tcp-{proto}")
    assert req.tier == "gold"


def test_streamed_text_equals_http3(srv, certs):
    async def h3():
        async with H3Client("127.0.0.1", srv.port, ca_file=certs[0]) as c:
            rs = await c.stream("POST", "/v1/completions", JSON, json.dumps({"prompt": "abc", "stream": True}).encode())
            return [f"data: {p}" async for p in iter_sse(rs)]

    want = run(h3())
    for proto in PROTOCOLS:
        with http(certs, proto) as c, c.stream("POST", url(srv, "/v1/completions"), headers=JSON,
                                                content=json.dumps({"prompt": "abc", "stream": True})) as r:
            got = [line for line in r.iter_lines() if line]
        assert sse_text(got) == sse_text(want) == expected_text() and len(got) == len(want)


def test_16_concurrent_http2_streams_on_one_connection(srv, certs):
    prefix = uuid.uuid4().hex[:8]

    async def one(c: httpx.AsyncClient, i: int) -> tuple[str, str]:
        async with c.stream("POST", url(srv, "/v1/chat/completions"), headers={**JSON, "x-request-id": f"{prefix}-{i}"},
                            content=body(stream=True, max_tokens=1 + i % 6)) as r:
            assert r.http_version == "HTTP/2" and r.headers["x-request-id"] == f"{prefix}-{i}"
            return r.headers["alt-svc"], sse_text([line async for line in r.aiter_lines() if line])

    async def go():
        async with httpx.AsyncClient(verify=tls(certs), http1=False, http2=True, timeout=10) as c:
            solo = [(await one(c, i))[1] for i in range(6)]
            together = await asyncio.gather(*(one(c, i) for i in range(16)))
            assert len(srv.server.tcp.connections) == 1
        return solo, together

    solo, together = run(go())
    assert solo == [expected_text(1 + i) for i in range(6)]
    assert [t for _, t in together] == [solo[i % 6] for i in range(16)]
    assert {a for a, _ in together} == {alt_svc(srv)}
    assert srv.engine.peak_active >= 2  # they really ran concurrently


def test_http2_flow_control_small_window(srv, certs):
    """A client that opens its window a few bytes at a time still gets the whole stream."""
    ctx = ssl.create_default_context(cafile=certs[0])
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        assert s.selected_alpn_protocol() == "h2"
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 64})
        conn.initiate_connection()
        data = body(stream=True)
        conn.send_headers(1, [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "https"),
                              (":authority", "127.0.0.1"), ("content-type", "application/json"),
                              ("content-length", str(len(data)))])
        conn.send_data(1, data, end_stream=True)
        s.sendall(conn.data_to_send())
        got, status, ended, frames = bytearray(), None, False, 0
        while not ended:
            chunk = s.recv(65536)
            assert chunk, "server closed the connection"
            for ev in conn.receive_data(chunk):
                if isinstance(ev, h2.events.ResponseReceived):
                    status = dict(ev.headers)[b":status"]
                elif isinstance(ev, h2.events.DataReceived):
                    got += ev.data
                    frames += 1
                    assert len(ev.data) <= 64  # never more than the window
                    if ev.stream_ended is None:
                        conn.increment_flow_control_window(ev.flow_controlled_length, 1)  # give back what it took
                elif isinstance(ev, h2.events.StreamEnded):
                    ended = True
            s.sendall(conn.data_to_send())
    assert status == b"200" and frames > 10
    lines = [line for line in got.decode().split("\n") if line]
    assert lines[-1] == "data: [DONE]" and sse_text(lines) == expected_text()


def raw_http1(st: ServerThread, certs, data: bytes, responses: int) -> list[tuple[int, dict, bytes]]:
    """Send raw bytes over TLS (ALPN http/1.1) and parse `responses` responses with an h11 client."""
    import h11

    ctx = ssl.create_default_context(cafile=certs[0])
    ctx.set_alpn_protocols(["http/1.1"])
    out = []
    with socket.create_connection(("127.0.0.1", st.port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        s.sendall(data)
        conn = h11.Connection(h11.CLIENT)
        for _ in range(responses):
            conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))  # mirror the client's side
            conn.send(h11.EndOfMessage())
            status, headers, payload = 0, {}, b""
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    conn.receive_data(s.recv(65536))
                elif isinstance(ev, h11.Response):
                    status, headers = ev.status_code, {k.decode(): v.decode() for k, v in ev.headers}
                elif isinstance(ev, h11.Data):
                    payload += ev.data
                elif isinstance(ev, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
            out.append((status, headers, payload))
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
    return out


def test_http1_pipelining_and_malformed_requests(srv, certs):
    pipelined = (b"GET /healthz HTTP/1.1\r\nhost: a\r\nx-request-id: p-1\r\n\r\n"
                 b"GET /v1/models HTTP/1.1\r\nhost: a\r\nx-request-id: p-2\r\n\r\n")
    (s1, h1, b1), (s2, h2_, b2) = raw_http1(srv, certs, pipelined, 2)
    assert (s1, h1["x-request-id"], json.loads(b1)) == (200, "p-1", {"status": "ok"})
    assert (s2, h2_["x-request-id"]) == (200, "p-2") and json.loads(b2)["object"] == "list"
    [(status, headers, payload)] = raw_http1(srv, certs, b"NOT HTTP AT ALL\r\n\r\n", 1)
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(payload)["error"]["code"] == "invalid_request"


def test_http1_status_lines_carry_their_reason_phrase(srv, certs):
    ctx = ssl.create_default_context(cafile=certs[0])
    ctx.set_alpn_protocols(["http/1.1"])
    lines = []
    for request in (b"GET /healthz HTTP/1.1\r\nhost: a\r\n\r\n", b"GET /nowhere HTTP/1.1\r\nhost: a\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nhost: a\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(request)
            head = b""
            while b"\r\n" not in head:
                head += tls.recv(4096)
            lines.append(head.split(b"\r\n", 1)[0])
    assert lines == [b"HTTP/1.1 200 OK", b"HTTP/1.1 404 Not Found", b"HTTP/1.1 100 Continue"]


# ------------------------------------------------------------------ the same errors as HTTP/3

@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_same_as_http3(srv, certs, case):
    _, method, path, headers, data, status, code = case
    want = h3_request(srv, certs, method, path, headers, data)
    assert want.status == status
    for proto in PROTOCOLS:
        with http(certs, proto) as c:
            r = c.request(method, url(srv, path), headers=headers, content=data)
            assert r.status_code == status, (proto, r.text)
            assert r.json() == want.json() and r.json()["error"]["code"] == code
            assert r.headers["content-type"] == "application/json" and r.headers["alt-svc"] == alt_svc(srv)
            for h in ("allow", "retry-after"):
                assert r.headers.get(h) == want.headers.get(h)
            # the connection is still good (HTTP/1.1: the rest of a refused body was read and dropped)
            r = c.post(url(srv, "/v1/chat/completions"), content=body(max_tokens=2), headers=JSON)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected_text(2)


def test_unknown_tier_same_as_http3(auth_srv, certs):
    h = {**JSON, "authorization": f"Bearer {OPEN_KEY}"}
    data = json.dumps({"prompt": "x", "tier": "platinum"}).encode()
    with ServerThread(FakeEngine(), *certs, settings=ServerSettings(tiers=("gold",)), tcp=True) as st:
        want = h3_request(st, certs, "POST", "/v1/completions", JSON, data)
        assert (want.status, want.json()["error"]["param"]) == (400, "tier")
        for proto in PROTOCOLS:
            with http(certs, proto) as c:
                r = c.post(url(st, "/v1/completions"), content=data, headers=JSON)
                assert (r.status_code, r.json()) == (400, want.json())
                r = c.post(url(st, "/v1/completions"), content=b'{"prompt": "x"}',
                           headers={**JSON, "x-edged-tier": "bronze"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "x-edged-tier"
    with http(certs, "h2") as c:  # a key's tier wins over the body's
        assert c.post(url(auth_srv, "/v1/completions"), content=data, headers=h).status_code == 200


def test_auth_401_and_rate_limit_429_same_as_http3(auth_srv, certs):
    for auth in (None, "Bearer nope"):
        h = {**JSON, **({"authorization": auth} if auth else {})}
        want = h3_request(auth_srv, certs, "POST", "/v1/chat/completions", h, body())
        assert want.status == 401
        for proto in PROTOCOLS:
            with http(certs, proto) as c:
                r = c.post(url(auth_srv, "/v1/chat/completions"), content=body(), headers=h)
                assert (r.status_code, r.json()) == (401, want.json())
                assert r.headers["www-authenticate"] == "Bearer"
                assert c.get(url(auth_srv, "/healthz")).status_code == 200  # public
    slow = {**JSON, "authorization": f"Bearer {SLOW_KEY}"}
    assert h3_request(auth_srv, certs, "POST", "/v1/chat/completions", slow, body()).status == 200  # the burst
    want = h3_request(auth_srv, certs, "POST", "/v1/chat/completions", slow, body())
    assert want.status == 429
    for proto in PROTOCOLS:
        with http(certs, proto) as c:
            r = c.post(url(auth_srv, "/v1/chat/completions"), content=body(), headers=slow)
            assert (r.status_code, r.json()) == (429, want.json())
            assert int(r.headers["retry-after"]) >= 1


# ------------------------------------------------------------------ cancellation and drain

@pytest.mark.parametrize("proto", PROTOCOLS)
def test_client_closing_its_connection_mid_stream_cancels(srv, certs, proto):
    rid = f"tcp-gone-{proto}-{uuid.uuid4().hex[:6]}"
    with http(certs, proto) as c:
        with c.stream("POST", url(srv, "/v1/chat/completions"), headers={**JSON, "x-request-id": rid},
                      content=body(stream=True, max_tokens=200, messages=[{"role": "user", "content": "[slow]"}])) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(line.startswith("data: ") for line in got)
    # leaving both blocks closed the TCP connection with the stream unfinished
    assert wait_until(lambda: rid in srv.engine.cancelled)
    assert wait_until(lambda: rid not in srv.engine.active)
    assert rid in srv.engine.closed


def test_http2_stream_reset_cancels_only_that_stream(srv, certs):
    rid = "tcp-reset-" + uuid.uuid4().hex[:6]

    async def go():
        async with httpx.AsyncClient(verify=tls(certs), http1=False, http2=True, timeout=10) as c:
            async with c.stream("POST", url(srv, "/v1/chat/completions"), headers={**JSON, "x-request-id": rid},
                                content=body(stream=True, max_tokens=200,
                                             messages=[{"role": "user", "content": "[slow]"}])) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and '"x"' in line:
                        break
            # closed early: httpcore resets the stream and keeps the connection
            r = await c.post(url(srv, "/v1/chat/completions"), content=body(max_tokens=2), headers=JSON)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected_text(2)

    run(go())
    assert wait_until(lambda: rid in srv.engine.cancelled)


def test_drain_finishes_tcp_streams_refuses_new_ones_then_closes(certs):
    engine = FakeEngine()
    with ServerThread(engine, *certs, tcp=True) as st:
        async def go():
            async with httpx.AsyncClient(verify=tls(certs), http1=False, http2=True, timeout=10) as c2, \
                    httpx.AsyncClient(verify=tls(certs), http1=True, http2=False, timeout=10) as c1:
                held = body(stream=True, max_tokens=5, messages=[{"role": "user", "content": "[held]"}])
                async with c2.stream("POST", url(st, "/v1/chat/completions"),
                                     headers={**JSON, "x-request-id": "held-h2"}, content=held) as r2, \
                        c1.stream("POST", url(st, "/v1/chat/completions"),
                                  headers={**JSON, "x-request-id": "held-h1"}, content=held) as r1:
                    lines2, lines1 = r2.aiter_lines(), r1.aiter_lines()
                    for lines in (lines2, lines1):
                        while '"x"' not in await lines.__anext__():
                            pass
                    shutdown = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(st.server.shutdown(600),
                                                                                    st.loop))
                    for _ in range(500):
                        health = await c2.get(url(st, "/healthz"))
                        if health.status_code != 200:
                            break
                        await asyncio.sleep(0.01)
                    assert (health.status_code, health.json()) == (503, {"status": "draining"})
                    async with httpx.AsyncClient(verify=tls(certs), http1=True, http2=False, timeout=10) as c3:
                        late = await c3.post(url(st, "/v1/chat/completions"), content=body(),
                                             headers={**JSON, "x-request-id": "late"})
                    assert late.status_code == 503 and late.headers["retry-after"] == "5"
                    assert late.json()["error"]["code"] == "shutting_down"
                    assert late.headers["alt-svc"] == alt_svc(st)
                    assert not shutdown.done()
                    engine.release.set()
                    rest2 = [line async for line in lines2 if line]
                    rest1 = [line async for line in lines1 if line]
                for rest in (rest1, rest2):
                    assert rest[-1] == "data: [DONE]" and "shutting_down" not in "".join(rest)
                await asyncio.wait_for(shutdown, 10)  # done once the streams ended
                # then every connection is closing, and the listener is gone
                assert all(c.transport.is_closing() for c in list(st.server.tcp.connections))
                for c in (c1, c2):
                    with pytest.raises(httpx.TransportError):
                        await c.get(url(st, "/healthz"))
        run(go())
        assert "late" not in [r.request_id for r in engine.requests]
        assert not {"held-h1", "held-h2"} & set(engine.cancelled)


def test_observer_records_match_http3(certs):
    records = []
    with ServerThread(FakeEngine(), *certs, tcp=True) as st:
        st.server.router.observers.append(records.append)
        h3_request(st, certs, "POST", "/v1/chat/completions", {**JSON, "x-request-id": "m-h3"}, body(max_tokens=2))
        h3_request(st, certs, "POST", "/v1/chat/completions", {**JSON, "x-request-id": "m-h3-bad"}, body(n=2))
        for proto in PROTOCOLS:
            with http(certs, proto) as c:
                c.post(url(st, "/v1/chat/completions"), content=body(max_tokens=2),
                       headers={**JSON, "x-request-id": f"m-{proto}"})
                c.post(url(st, "/v1/chat/completions"), content=body(n=2),
                       headers={**JSON, "x-request-id": f"m-{proto}-bad"})
        assert wait_until(lambda: len(records) == 6)

    def label(r):
        return (r.path, r.status, r.outcome, r.tier, r.code, r.prompt_tokens, r.completion_tokens)

    by_id = {r.request_id: r for r in records}
    for proto in PROTOCOLS:
        assert label(by_id[f"m-{proto}"]) == label(by_id["m-h3"])
        assert label(by_id[f"m-{proto}-bad"]) == label(by_id["m-h3-bad"])
    # the one label that differs: the metrics' protocol
    label_of = {"http1": "h1", "h2": "h2"}
    assert {rid: r.protocol for rid, r in by_id.items()} == {
        "m-h3": "h3", "m-h3-bad": "h3", **{f"m-{p}{bad}": label_of[p] for p in PROTOCOLS for bad in ("", "-bad")}}


def test_peer_host_over_tcp(certs):
    async def whoami(req):
        req.respond(200, (req.peer_host or "?").encode(), "text/plain")

    with ServerThread(FakeEngine(), *certs, tcp=True) as st:
        st.server.router.add("GET", "/whoami", whoami, public=True)
        for proto in PROTOCOLS:
            with http(certs, proto) as c:
                r = c.get(url(st, "/whoami"))
                assert (r.status_code, r.text) == (200, "127.0.0.1")


# ------------------------------------------------------------------ an independent client

@pytest.mark.parametrize("version", ["V1_1", "V2TLS"])
def test_curl_without_http3_streams_sse(srv, certs, version):
    pytest.importorskip("curl_cffi")
    from curl_cffi import CurlHttpVersion
    from curl_cffi import requests as creq

    def fetch() -> tuple[int, int, str | None, str | None, list[bytes]]:
        r = creq.post(f"https://127.0.0.1:{srv.port}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
                      http_version=getattr(CurlHttpVersion, version), verify=certs[0], stream=True, timeout=15)
        try:
            lines = [line for line in r.iter_lines() if line]
        finally:
            r.close()
        return r.status_code, r.http_version, r.headers.get("content-type"), r.headers.get("alt-svc"), lines

    status, used, ctype, alt, lines = run(asyncio.to_thread(fetch), timeout=30)
    assert used == {"V1_1": CurlHttpVersion.V1_1, "V2TLS": CurlHttpVersion.V2_0}[version]  # what was negotiated
    assert status == 200 and ctype == "text/event-stream" and alt == alt_svc(srv)
    assert lines[-1] == b"data: [DONE]"
    assert sse_text([line.decode() for line in lines]) == expected_text()


def test_idle_connections_are_closed_busy_ones_are_not(certs):
    engine = FakeEngine()
    with ServerThread(engine, *certs, settings=ServerSettings(idle_timeout_s=0.3), tcp=True) as st:
        for proto in PROTOCOLS:
            with http(certs, proto) as c:
                # a stream quiet for longer than the idle timeout (its tokens come every 50 ms, but
                # the client sends nothing) keeps its connection
                r = c.post(url(st, "/v1/chat/completions"), headers=JSON,
                           content=body(max_tokens=10, messages=[{"role": "user", "content": "[slow]"}]))
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "x" * 10
                [conn] = st.server.tcp.connections
                assert not conn.transport.is_closing()
                assert wait_until(conn.transport.is_closing, timeout=3)  # then idle: closed by the server
            # a new connection is served (a fresh client: a pooled one may race the server's close)
            with http(certs, proto) as c:
                assert c.get(url(st, "/healthz")).status_code == 200


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_client_that_stops_reading_is_dropped(certs, proto):
    """Writes wait while the client is behind (HTTP/1.1: the TCP write buffer; HTTP/2: the stream's
    window), and a client that takes nothing for send_stall_timeout_s is dropped."""
    settings = ServerSettings(send_high_water=16 * 1024, send_stall_timeout_s=1.0)
    done: dict[str, int] = {}

    async def firehose(req):
        req.start(200, "application/octet-stream")
        sent, chunk = 0, b"x" * 16384
        while sent < 1 << 30 and await req.write(chunk):
            sent += len(chunk)
        done["sent"] = sent

    with ServerThread(FakeEngine(), *certs, settings=settings, tcp=True) as st:
        st.server.router.add("GET", "/firehose", firehose, public=True)
        with http(certs, proto) as c, c.stream("GET", url(st, "/firehose")) as r:
            assert r.status_code == 200
            assert wait_until(lambda: "sent" in done, timeout=20)  # the handler's write said "gone"
    # bounded by the client's window / the socket buffers, not by how much the handler had
    assert done["sent"] < 64 << 20


def test_bind_tcp_shares_the_udp_port_number():
    from edged.daemon import bind_tcp, bind_udp

    udp = bind_udp("127.0.0.1", 0, 2)
    port = udp[0].getsockname()[1]
    tcp = bind_tcp("127.0.0.1", port, 2)
    try:
        assert {s.getsockname()[1] for s in tcp} == {port}
        assert all(s.type == socket.SOCK_STREAM for s in tcp)
        with socket.socket() as taken:  # a TCP port held by someone else (no SO_REUSEPORT)
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            with pytest.raises(OSError, match="cannot listen on tcp 127.0.0.1"):
                bind_tcp("127.0.0.1", taken.getsockname()[1], 2)
    finally:
        for s in udp + tcp:
            s.close()


def test_bind_tcp_refuses_a_port_another_daemons_listeners_hold():
    from edged.daemon import bind_tcp

    first = bind_tcp("127.0.0.1", 0, 2)  # another edged: an SO_REUSEPORT group that a second one could join
    try:
        with pytest.raises(OSError, match="cannot listen on tcp 127.0.0.1:[0-9]+: address already in use"):
            bind_tcp("127.0.0.1", first[0].getsockname()[1], 2)
    finally:
        for s in first:
            s.close()


def _time_wait_on(port: int, timeout_s: float = 5.0) -> bool:
    """A TIME_WAIT (state 06) connection from 127.0.0.1:port shows in /proc/net/tcp within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
        if any(r[1] == f"0100007F:{port:04X}" and r[3] == "06" for r in rows):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def test_a_restart_binds_tcp_again_beside_the_last_runs_time_wait_connections():
    from edged.daemon import bind_tcp

    first = bind_tcp("127.0.0.1", 0, 1)
    port = first[0].getsockname()[1]
    first[0].setblocking(True)
    with socket.create_connection(("127.0.0.1", port)) as client:
        served, _ = first[0].accept()
        served.close()  # the server closes first: its end of the connection stays in TIME_WAIT
        assert client.recv(1) == b""
    first[0].close()
    assert _time_wait_on(port)
    again = bind_tcp("127.0.0.1", port, 2)
    for s in again:
        s.close()
