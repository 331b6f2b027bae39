"""The HTTP/3 server end to end: real QUIC over loopback against a fake engine.

Covers streaming SSE, JSON, msgpack, models/health, every bad input (then a normal request on the
same server), concurrency over several connections, cancellation by stream reset and by closing
the connection, back-pressure, draining, TLS, `edged chat`, and an independent client (curl).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import uuid

import pytest

from edged.server import openai_wire as wire
from edged.server.h3_client import (
    CertificateError,
    H3Client,
    HTTPError,
    chat_stream,
    iter_sse,
    run_chat_command,
)
from edged.server.settings import ApiKeyPolicy, ServerSettings
from edged.server.tls import TLSConfigError, default_ca_file, ensure_cert

from helpers.aio import run
from helpers.fake_engine import SCRIPT, FakeEngine, ServerThread, expected_text, wait_until

pytestmark = pytest.mark.timeout(60)

MAX_BODY = 64 * 1024
JSON = {"content-type": "application/json"}


def body(**kw) -> bytes:
    obj = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    obj.update(kw)
    return json.dumps(obj).encode()


@pytest.fixture(scope="module")
def srv(certs):
    settings = ServerSettings(max_body_bytes=MAX_BODY, body_timeout_s=1.0, default_max_tokens=64)
    with ServerThread(FakeEngine(max_model_len=256), *certs, settings=settings) as st:
        yield st


def client(st, certs, **kw) -> H3Client:
    return H3Client("127.0.0.1", st.port, ca_file=certs[0], **kw)


async def sse_events(c: H3Client, path: str, data: bytes, headers=None) -> tuple[int, dict, list]:
    rs = await c.stream("POST", path, {**JSON, **(headers or {})}, data)
    events = []
    async for payload in iter_sse(rs):
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return rs.status, rs.headers, events


async def assert_healthy(c: H3Client) -> None:
    r = await c.request("GET", "/healthz")
    assert r.status == 200 and r.json() == {"status": "ok"}
    out = [t async for t in chat_stream(c, [{"role": "user", "content": "again"}])]
    assert "".join(out) == expected_text()


# ------------------------------------------------------------------ basic endpoints

def test_healthz_models_and_common_headers(srv, certs):
    async def go():
        async with client(srv, certs) as c:
            r = await c.request("GET", "/healthz")
            assert (r.status, r.json()) == (200, {"status": "ok"})
            assert r.headers["server"] == "edged" and len(r.headers["x-request-id"]) == 32
            assert r.headers["content-type"] == "application/json"
            r = await c.request("GET", "/v1/models", {"x-request-id": "trace-42.a"})
            assert r.headers["x-request-id"] == "trace-42.a"
            data = r.json()
            assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["fake-model"]
            r = await c.request("GET", "/v1/models/fake-model", {"x-request-id": "bad id\x01" * 3})
            assert r.status == 200 and r.json()["id"] == "fake-model"
            assert r.headers["x-request-id"] != "bad id\x01" * 3
            r = await c.request("GET", "/v1/models/other")
            assert (r.status, r.json()["error"]["code"]) == (404, "model_not_found")
    run(go())


def test_chat_stream_sse(srv, certs):
    async def go():
        async with client(srv, certs) as c:
            status, headers, events = await sse_events(c, "/v1/chat/completions", body(stream=True),
                                                       {"x-request-id": "sse-1", "x-edged-tier": "gold"})
        assert status == 200 and headers["content-type"] == "text/event-stream"
        assert headers["x-request-id"] == "sse-1"
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(ch["id"] == "chatcmpl-sse-1" and ch["object"] == "chat.completion.chunk" for ch in chunks)
        assert all(set(ch) == {"id", "object", "created", "model", "choices"} for ch in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
        assert text == expected_text()
        assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
        assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])
        req = next(r for r in srv.engine.requests if r.request_id == "sse-1")
        assert req.tier == "gold" and req.sampling.max_tokens == 64
    run(go())


def test_chat_stream_include_usage_and_length(srv, certs):
    async def go():
        async with client(srv, certs) as c:
            _, _, events = await sse_events(c, "/v1/chat/completions", body(
                stream=True, max_tokens=3, stream_options={"include_usage": True}, tier="silver"))
        chunks = events[:-1]
        assert all("usage" in ch for ch in chunks)
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        u = chunks[-1]["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + 3
        assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"]) == \
            expected_text(3)
    run(go())


def test_chat_non_streaming_json(srv, certs):
    async def go():
        async with client(srv, certs) as c:
            r = await c.request("POST", "/v1/chat/completions", JSON, body(temperature=0, seed=3))
        assert r.status == 200
        obj = r.json()
        assert obj["object"] == "chat.completion" and obj["model"] == "fake-model"
        assert obj["choices"][0]["message"] == {"role": "assistant", "content": expected_text()}
        assert obj["choices"][0]["finish_reason"] == "stop"
        prompt = "<user>hi<assistant>"
        assert obj["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(SCRIPT),
                                "total_tokens": len(prompt) + len(SCRIPT)}
    run(go())


def test_completions_stream_and_json(srv, certs):
    async def go():
        async with client(srv, certs) as c:
            r = await c.request("POST", "/v1/completions", JSON,
                                json.dumps({"prompt": "abc", "max_tokens": 2}).encode())
            obj = r.json()
            assert obj["object"] == "text_completion" and obj["choices"][0]["text"] == expected_text(2)
            assert obj["choices"][0]["finish_reason"] == "length" and obj["usage"]["prompt_tokens"] == 3
            _, _, events = await sse_events(c, "/v1/completions", json.dumps(
                {"prompt": [104, 105], "stream": True}).encode())
        chunks = events[:-1]
        assert events[-1] == "[DONE]" and all(ch["object"] == "text_completion" for ch in chunks)
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == expected_text()
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    run(go())


def test_msgpack_stream(srv, certs):
    async def go():
        async with client(srv, certs) as c:
            rs = await c.stream("POST", "/v1/chat/completions", {**JSON, "accept": "application/x-msgpack"},
                                body(stream=True))
            assert rs.headers["content-type"] == "application/x-msgpack"
            frames, rest = wire.decode_msgpack_frames(await rs.read())
            assert rest == b"" and frames[-1] == {"done": True}
            text = "".join(f["choices"][0]["delta"].get("content", "") for f in frames[:-1])
            assert text == expected_text() and frames[-2]["choices"][0]["finish_reason"] == "stop"
            r = await c.request("POST", "/v1/chat/completions", {**JSON, "accept": "application/x-msgpack"}, body())
            assert r.headers["content-type"] == "application/x-msgpack"
            assert wire.msgpack.unpackb(r.body)["choices"][0]["message"]["content"] == expected_text()
    run(go())


# ------------------------------------------------------------------ bad input

LONG = "x" * 300  # > max_model_len 256 tokens with the fake's one-token-per-char
BAD = [
    # (id, method, path, headers, body, status, code)
    ("malformed-json", "POST", "/v1/chat/completions", JSON, b'{"messages": [', 400, "invalid_json"),
    ("empty-body", "POST", "/v1/chat/completions", JSON, b"", 400, "invalid_json"),
    ("invalid-utf8", "POST", "/v1/chat/completions", JSON, b'{"messages": "\xc3\x28"}', 400, "invalid_encoding"),
    ("not-object", "POST", "/v1/completions", JSON, b"[]", 400, "invalid_json"),
    ("missing-messages", "POST", "/v1/chat/completions", JSON, b'{"model": "fake-model"}', 400,
     "missing_required_parameter"),
    ("messages-not-list", "POST", "/v1/chat/completions", JSON, b'{"messages": "hi"}', 400, "invalid_type"),
    ("empty-messages", "POST", "/v1/chat/completions", JSON, b'{"messages": []}', 400, "invalid_value"),
    ("content-wrong-type", "POST", "/v1/chat/completions", JSON,
     b'{"messages": [{"role": "user", "content": {"a": 1}}]}', 400, "invalid_type"),
    ("temperature-string", "POST", "/v1/chat/completions", JSON, body(temperature="hot"), 400, "invalid_type"),
    ("prompt-too-long", "POST", "/v1/chat/completions", JSON,
     body(messages=[{"role": "user", "content": LONG}]), 400, "context_length_exceeded"),
    ("completion-too-long", "POST", "/v1/completions", JSON, json.dumps({"prompt": LONG}).encode(), 400,
     "context_length_exceeded"),
    ("max-tokens-zero", "POST", "/v1/chat/completions", JSON, body(max_tokens=0), 400, "invalid_value"),
    ("max-tokens-negative", "POST", "/v1/chat/completions", JSON, body(max_tokens=-1), 400, "invalid_value"),
    ("max-tokens-over", "POST", "/v1/chat/completions", JSON, body(max_tokens=10_000), 400,
     "context_length_exceeded"),
    ("max-tokens-float", "POST", "/v1/chat/completions", JSON, body(max_tokens=1.5), 400, "invalid_type"),
    ("n-2", "POST", "/v1/chat/completions", JSON, body(n=2), 400, "unsupported_value"),
    ("stop-too-many", "POST", "/v1/chat/completions", JSON, body(stop=list("abcde")), 400, "invalid_value"),
    ("top-p-zero", "POST", "/v1/chat/completions", JSON, body(top_p=0), 400, "invalid_value"),
    ("unknown-model", "POST", "/v1/chat/completions", JSON, body(model="gpt-9"), 404, "model_not_found"),
    ("wrong-method", "GET", "/v1/chat/completions", {}, None, 405, "method_not_allowed"),
    ("wrong-method-models", "POST", "/v1/models", JSON, b"{}", 405, "method_not_allowed"),
    ("unknown-path", "GET", "/v2/everything", {}, None, 404, "not_found"),
    ("too-large", "POST", "/v1/chat/completions", JSON, b"{" + b" " * (MAX_BODY + 10) + b"}", 413,
     "request_too_large"),
    ("template-error", "POST", "/v1/chat/completions", JSON, body(messages=[
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "[template-error]"}]), 400,
     "invalid_value"),
    ("bad-tier-header", "POST", "/v1/chat/completions", {**JSON, "x-edged-tier": "gold!!"}, body(), 400,
     "invalid_value"),
    ("admission-refused", "POST", "/v1/chat/completions", JSON,
     body(messages=[{"role": "user", "content": "[refuse]"}]), 429, "tier_queue_full"),
    ("admission-refused-stream", "POST", "/v1/chat/completions", JSON,
     body(stream=True, messages=[{"role": "user", "content": "[refuse]"}]), 429, "tier_queue_full"),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_4xx_then_server_still_serves(srv, certs, case):
    _, method, path, headers, data, status, code = case

    async def go():
        async with client(srv, certs) as c:
            r = await c.request(method, path, headers, data, timeout=10)
            assert r.status == status, r.body
            assert r.headers["content-type"] == "application/json" and r.headers["server"] == "edged"
            err = r.json()["error"]
            assert err["code"] == code and err["message"] and "type" in err and "param" in err
            if status == 405:
                assert r.headers["allow"]
            if status == 429:
                assert r.headers["retry-after"] == "2"
            await assert_healthy(c)  # same connection, same server

    run(go())


def test_oversized_body_is_refused_before_it_ends(srv, certs):
    async def go():
        async with client(srv, certs) as c:
            rs = await c.stream("POST", "/v1/chat/completions", JSON, b"x" * (MAX_BODY + 1), end_stream=False,
                                timeout=5)
            assert rs.status == 413
            await assert_healthy(c)
    run(go())


def test_declared_content_length_over_limit_is_413_at_once(srv, certs):
    async def go():
        async with client(srv, certs) as c:
            rs = await c.stream("POST", "/v1/chat/completions", {**JSON, "content-length": str(10 * MAX_BODY)},
                                b"{", end_stream=False, timeout=5)
            assert rs.status == 413
    run(go())


def test_body_that_never_ends_times_out_408(srv, certs):
    async def go():
        async with client(srv, certs) as c:
            rs = await c.stream("POST", "/v1/chat/completions", JSON, b'{"messages": ', end_stream=False, timeout=5)
            assert rs.status == 408
            assert json.loads(await rs.read())["error"]["code"] == "request_timeout"
            await assert_healthy(c)
    run(go())


def test_engine_error_mid_stream_is_a_final_error_event(srv, certs):
    async def go():
        async with client(srv, certs) as c:
            fail = [{"role": "user", "content": "[fail]"}]
            _, _, events = await sse_events(c, "/v1/chat/completions", body(stream=True, messages=fail))
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["message"] == "CUDA error: out of memory"
            assert events[-2]["error"]["type"] == "server_error"
            assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2]) == "ab"
            r = await c.request("POST", "/v1/chat/completions", JSON, body(messages=fail))
            assert r.status == 500 and r.json()["error"]["message"] == "CUDA error: out of memory"
            crash = [{"role": "user", "content": "[crash]"}]
            _, _, events = await sse_events(c, "/v1/chat/completions", body(stream=True, messages=crash))
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "internal_error"
            r = await c.request("POST", "/v1/chat/completions", JSON, body(messages=crash))
            assert r.status == 500
            await assert_healthy(c)
    run(go())


# ------------------------------------------------------------------ concurrency and cancellation

def test_32_concurrent_streams_over_4_connections(srv, certs):
    prefix = uuid.uuid4().hex[:8]

    async def one(c: H3Client, i: int) -> str:
        _, headers, events = await sse_events(c, "/v1/chat/completions", body(stream=True),
                                              {"x-request-id": f"{prefix}-{i}"})
        assert headers["x-request-id"] == f"{prefix}-{i}"
        return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])

    async def go():
        clients = [client(srv, certs) for _ in range(4)]
        for c in clients:
            await c.connect()
        try:
            texts = await asyncio.gather(*(one(clients[i % 4], i) for i in range(32)))
        finally:
            for c in clients:
                await c.close()
        assert texts == [expected_text()] * 32

    run(go())
    ids = {r.request_id for r in srv.engine.requests if r.request_id.startswith(prefix)}
    assert len(ids) == 32


def test_reused_request_id_gets_distinct_engine_ids(srv, certs):
    async def go():
        async with client(srv, certs) as c:
            rs = await asyncio.gather(*(c.request("POST", "/v1/chat/completions",
                                                  {**JSON, "x-request-id": "same-id"}, body()) for _ in range(3)))
        assert all(r.status == 200 and r.headers["x-request-id"] == "same-id" for r in rs)

    run(go())
    assert len({r.request_id for r in srv.engine.requests if r.request_id.startswith("same-id")}) == 3


def test_stream_reset_cancels_the_sequence(srv, certs):
    rid = "reset-" + uuid.uuid4().hex[:8]

    async def go():
        async with client(srv, certs) as c:
            rs = await c.stream("POST", "/v1/chat/completions", {**JSON, "x-request-id": rid},
                                body(stream=True, max_tokens=200, messages=[{"role": "user", "content": "[slow]"}]))
            got = 0
            async for _ in rs:
                got += 1
                if got == 3:
                    break
            rs.reset()
            await asyncio.sleep(0.1)
            await assert_healthy(c)

    run(go())
    assert wait_until(lambda: rid in srv.engine.cancelled)
    assert wait_until(lambda: rid not in srv.engine.active)
    assert rid in srv.engine.closed


def test_connection_close_cancels_its_sequences(srv, certs):
    rids = [f"gone-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]

    async def go():
        c = client(srv, certs)
        await c.connect()
        streams = [await c.stream("POST", "/v1/chat/completions", {**JSON, "x-request-id": rid},
                                  body(stream=True, max_tokens=200, messages=[{"role": "user", "content": "[slow]"}]))
                   for rid in rids]
        for s in streams:
            await s._queue.get()  # first chunk arrived: generation is under way
        await c.close()

    run(go())
    assert wait_until(lambda: all(r in srv.engine.cancelled for r in rids))
    assert wait_until(lambda: not any(r in srv.engine.active for r in rids))

    async def after():
        async with client(srv, certs) as c:
            await assert_healthy(c)
    run(after())


def test_back_pressure_waits_for_acks_and_still_delivers(certs):
    settings = ServerSettings(send_high_water=64)  # every chunk waits for its acknowledgement
    with ServerThread(FakeEngine(), *certs, settings=settings) as st:
        async def go():
            async with client(st, certs) as c:
                outs = await asyncio.gather(*(
                    sse_events(c, "/v1/chat/completions", body(stream=True)) for _ in range(4)))
            for _, _, events in outs:
                assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == expected_text()
        run(go())


def test_client_that_stops_acknowledging_is_dropped(certs):
    settings = ServerSettings(send_high_water=256, send_stall_timeout_s=1.0)
    engine = FakeEngine()
    with ServerThread(engine, *certs, settings=settings) as st:
        async def go():
            c = client(st, certs, idle_timeout=30)
            await c.connect()
            rs = await c.stream("POST", "/v1/chat/completions", {**JSON, "x-request-id": "deaf"},
                                body(stream=True, max_tokens=200, messages=[{"role": "user", "content": "[slow]"}]))
            await rs._queue.get()
            c._protocol.datagram_received = lambda data, addr: None  # go deaf: no more ACKs
            await asyncio.sleep(0.1)
            c._protocol = None  # abandon without closing
            c._transport.close()
        run(go())
        assert wait_until(lambda: "deaf" in engine.cancelled, timeout=15)
        assert wait_until(lambda: "deaf" not in engine.active)


def test_shutdown_drains_then_ends_streams_with_an_error_event(certs):
    engine = FakeEngine()
    with ServerThread(engine, *certs) as st:
        async def go():
            async with client(st, certs) as c:
                quick = asyncio.ensure_future(c.request("POST", "/v1/chat/completions", JSON, body()))
                rs = await c.stream("POST", "/v1/chat/completions", {**JSON, "x-request-id": "long"},
                                    body(stream=True, max_tokens=200, messages=[{"role": "user", "content": "[slow]"}]))
                shutdown = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(st.server.shutdown(2.0), st.loop))
                events = [p async for p in iter_sse(rs)]
                assert (await quick).status == 200  # finished within the drain window
                await shutdown
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        run(go())
        assert wait_until(lambda: "long" in engine.cancelled)


def test_shutdown_answers_503_to_new_requests_and_healthz_while_a_stream_finishes(certs):
    engine = FakeEngine()
    with ServerThread(engine, *certs) as st:
        async def go():
            async with client(st, certs) as c:
                rs = await c.stream("POST", "/v1/chat/completions", {**JSON, "x-request-id": "held"},
                                    body(stream=True, max_tokens=5, messages=[{"role": "user", "content": "[held]"}]))
                events = iter_sse(rs)
                assert "role" in json.loads(await events.__anext__())["choices"][0]["delta"]
                assert json.loads(await events.__anext__())["choices"][0]["delta"]["content"] == "x"
                # The real shutdown path, as SIGTERM runs it, with a drain timeout far beyond this test.
                shutdown = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(st.server.shutdown(600), st.loop))
                for _ in range(500):
                    health = await c.request("GET", "/healthz")
                    if health.status != 200:
                        break
                    await asyncio.sleep(0.01)
                assert (health.status, health.json()) == (503, {"status": "draining"})
                r = await c.request("POST", "/v1/chat/completions", {**JSON, "x-request-id": "late"}, body())
                assert r.status == 503 and r.headers["retry-after"] == "5"
                assert r.json()["error"]["code"] == "shutting_down"
                assert (await c.request("GET", "/v1/models")).status == 503
                assert "held" in engine.active and not shutdown.done()  # the stream is still being served
                engine.release.set()
                rest = [json.loads(e) for e in [e async for e in events] if e != "[DONE]"]
                assert "".join(e["choices"][0]["delta"].get("content", "") for e in rest) == "xxxx"
                assert rest[-1]["choices"][0]["finish_reason"] == "length"
                await asyncio.wait_for(shutdown, 10)  # done as soon as the last stream ended
        run(go())
        assert "late" not in [r.request_id for r in engine.requests]  # refused before the engine
        assert "held" not in engine.cancelled and "held" not in engine.closed


def test_api_keys_map_to_tiers_and_rate_limit(certs):
    engine = FakeEngine()
    keys = {hashlib.sha256(b"k-gold").hexdigest(): ApiKeyPolicy("alice", tier="gold"),
            hashlib.sha256(b"k-slow").hexdigest(): ApiKeyPolicy("bob", rate_limit_rps=0.5, burst=2)}
    settings = ServerSettings(api_keys=keys, tiers=("gold", "silver", "bronze"), default_tier="silver")
    with ServerThread(engine, *certs, settings=settings) as st:
        async def go():
            async with client(st, certs) as c:
                for auth in (None, "Bearer nope", "Basic k-gold"):
                    r = await c.request("POST", "/v1/chat/completions", {**JSON, **({"authorization": auth} if auth
                                                                                   else {})}, body())
                    assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"
                    assert r.headers["www-authenticate"] == "Bearer"
                assert (await c.request("GET", "/healthz")).status == 200  # public
                assert (await c.request("GET", "/v1/models")).status == 401
                r = await c.request("POST", "/v1/chat/completions",
                                    {**JSON, "authorization": "Bearer k-gold", "x-request-id": "keyed",
                                     "x-edged-tier": "bronze"}, body())
                assert r.status == 200  # the key's tier wins over the header
                slow = {**JSON, "authorization": "Bearer k-slow", "x-request-id": "bob"}
                statuses = [(await c.request("POST", "/v1/chat/completions", slow, body())).status for _ in range(3)]
                assert statuses == [200, 200, 429]
                r = await c.request("POST", "/v1/chat/completions", slow, body())
                assert r.status == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
                assert int(r.headers["retry-after"]) >= 1
        run(go())
        assert next(r for r in engine.requests if r.request_id == "keyed").tier == "gold"
        assert next(r for r in engine.requests if r.request_id == "bob").tier == "silver"  # key without a tier


def test_limits_tiers_and_defaults(certs):
    engine = FakeEngine(max_model_len=256)
    settings = ServerSettings(default_max_tokens=100, max_tokens_limit=50, max_prompt_tokens=40,
                              tiers=("gold", "silver"), default_tier="silver", tier_max_tokens={"gold": 5})
    with ServerThread(engine, *certs, settings=settings) as st:
        async def go():
            async with client(st, certs) as c:
                async def post(data, headers=None):
                    return await c.request("POST", "/v1/chat/completions", {**JSON, **(headers or {})}, data)

                r = await post(body(max_tokens=51))
                assert (r.status, r.json()["error"]["param"]) == (400, "max_tokens")
                r = await post(body(messages=[{"role": "user", "content": "y" * 40}]))
                assert (r.status, r.json()["error"]["code"]) == (400, "context_length_exceeded")
                r = await post(body(tier="platinum"))
                assert (r.status, r.json()["error"]["param"]) == (400, "tier")
                r = await post(body(max_tokens=6), {"x-edged-tier": "gold"})
                assert r.status == 400  # over gold's cap of 5
                assert (await post(body(), {"x-request-id": "dflt"})).status == 200
                assert (await post(body(), {"x-request-id": "gold", "x-edged-tier": "gold"})).status == 200
        run(go())
        by_id = {r.request_id: r for r in engine.requests}
        assert (by_id["dflt"].tier, by_id["dflt"].sampling.max_tokens) == ("silver", 50)
        assert (by_id["gold"].tier, by_id["gold"].sampling.max_tokens) == ("gold", 5)


def test_request_timeout_ends_generation(certs):
    engine = FakeEngine()
    with ServerThread(engine, *certs, settings=ServerSettings(request_timeout_s=0.3)) as st:
        async def go():
            slow = [{"role": "user", "content": "[slow]"}]
            async with client(st, certs) as c:
                _, _, events = await sse_events(c, "/v1/chat/completions",
                                                body(stream=True, max_tokens=100, messages=slow),
                                                {"x-request-id": "t-stream"})
                assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
                r = await c.request("POST", "/v1/chat/completions", {**JSON, "x-request-id": "t-json"},
                                    body(max_tokens=100, messages=slow))
                assert r.status == 504 and r.json()["error"]["code"] == "request_timeout"
                await assert_healthy(c)
        run(go())
        assert wait_until(lambda: {"t-stream", "t-json"} <= set(engine.cancelled))


def test_max_concurrent_streams_per_connection(certs):
    engine = FakeEngine()
    with ServerThread(engine, *certs, settings=ServerSettings(max_concurrent_streams=2)) as st:
        async def go():
            slow = [{"role": "user", "content": "[slow]"}]
            async with client(st, certs) as c:
                rs = await asyncio.gather(*(c.request("POST", "/v1/chat/completions", JSON,
                                                      body(max_tokens=4, messages=slow)) for _ in range(5)))
            assert [r.status for r in rs] == [200] * 5
        run(go())
        assert engine.peak_active == 2


def test_mounted_route_sees_the_peer_address(certs):
    async def whoami(req):
        req.respond(200, (req.peer_host or "?").encode(), "text/plain")

    with ServerThread(FakeEngine(), *certs, settings=ServerSettings(api_keys={})) as st:
        st.server.router.add("GET", "/whoami", whoami, public=True)
        st.server.router.add("GET", "/private", whoami)

        async def go():
            async with client(st, certs) as c:
                r = await c.request("GET", "/whoami")
                assert (r.status, r.text, r.headers["content-type"]) == (200, "127.0.0.1", "text/plain")
                assert (await c.request("GET", "/private")).status == 401
                assert (await c.request("POST", "/whoami", JSON, b"{}")).status == 405
        run(go())


def test_observers_get_one_record_per_request(certs):
    records = []
    with ServerThread(FakeEngine(), *certs) as st:
        st.server.router.observers.append(records.append)

        async def go():
            async with client(st, certs) as c:
                await c.request("POST", "/v1/chat/completions", {**JSON, "x-request-id": "ok"}, body(max_tokens=2))
                await c.request("POST", "/v1/chat/completions", {**JSON, "x-request-id": "bad"}, body(n=3))
                await c.request("POST", "/v1/chat/completions", {**JSON, "x-request-id": "refused"},
                                body(messages=[{"role": "user", "content": "[refuse]"}]))
                await c.request("POST", "/v1/chat/completions", {**JSON, "x-request-id": "big"},
                                b" " * (ServerSettings().max_body_bytes + 1))
                rs = await c.stream("POST", "/v1/chat/completions", {**JSON, "x-request-id": "gone"},
                                    body(stream=True, messages=[{"role": "user", "content": "[slow]"}]))
                await rs._queue.get()
                rs.reset()
                await c.request("GET", "/healthz")
        run(go())
        assert wait_until(lambda: len(records) == 5)
    by_id = {r.request_id: r for r in records}
    assert len(by_id) == 5
    ok = by_id["ok"]
    assert (ok.status, ok.outcome, ok.completion_tokens, ok.tier) == (200, "length", 2, "default")
    assert ok.prompt_tokens > 0 and ok.ttft_s is not None and ok.duration_s >= ok.ttft_s
    assert (by_id["bad"].status, by_id["bad"].outcome, by_id["bad"].code) == (400, "rejected", "unsupported_value")
    assert (by_id["refused"].status, by_id["refused"].outcome) == (429, "rejected")
    assert (by_id["big"].status, by_id["big"].code) == (413, "request_too_large")
    assert (by_id["gone"].status, by_id["gone"].outcome) == (200, "client_gone")


def test_ipv6_loopback(certs):
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        s.bind(("::1", 0))
        s.close()
    except OSError:
        pytest.skip("no IPv6 loopback")
    with ServerThread(FakeEngine(), *certs, host="::1") as st:
        async def go():
            async with H3Client("::1", st.port, ca_file=certs[0]) as c:
                await assert_healthy(c)
        run(go())


# ------------------------------------------------------------------ an independent client

def test_curl_http3_streams_sse(srv):
    pytest.importorskip("curl_cffi")
    from curl_cffi import CurlHttpVersion
    from curl_cffi import requests as creq

    def fetch() -> tuple[int, int, str, list[bytes]]:
        r = creq.post(f"https://127.0.0.1:{srv.port}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
                      http_version=CurlHttpVersion.V3ONLY, verify=False, stream=True, timeout=15)
        try:
            lines = [line for line in r.iter_lines() if line]
        finally:
            r.close()
        return r.status_code, r.http_version, r.headers.get("content-type"), lines

    status, version, ctype, lines = run(asyncio.to_thread(fetch), timeout=30)
    assert status == 200 and version == 30 and ctype == "text/event-stream"  # 30: CURL_HTTP_VERSION_3
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(line[len(b"data: "):]) for line in lines[:-1]]
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == expected_text()


# ------------------------------------------------------------------ TLS and `edged chat`

def test_client_on_uvloop(srv, certs):
    uvloop = pytest.importorskip("uvloop")

    async def go():
        async with client(srv, certs) as c:
            await assert_healthy(c)
    uvloop.run(asyncio.wait_for(go(), 20))


def test_self_signed_cert_is_created_once_and_reused(tmp_path):
    cert, key = ensure_cert(tmp_path)
    before = open(cert, "rb").read()
    assert ensure_cert(tmp_path) == (cert, key) and open(cert, "rb").read() == before
    assert default_ca_file(tmp_path) == cert and default_ca_file(tmp_path / "nope") is None
    assert (tmp_path / "tls" / "key.pem").stat().st_mode & 0o077 == 0
    assert ensure_cert(tmp_path / "other", cert, key) == (cert, key)  # configured pair used as is
    with pytest.raises(TLSConfigError, match="both"):
        ensure_cert(tmp_path, cert, None)
    with pytest.raises(TLSConfigError, match="does not exist"):
        ensure_cert(tmp_path, str(tmp_path / "missing.pem"), key)
    other_cert, _ = ensure_cert(tmp_path / "third")
    with pytest.raises(TLSConfigError, match="does not match"):
        ensure_cert(tmp_path, other_cert, key)


def test_client_rejects_an_untrusted_certificate(srv, tmp_path):
    wrong_ca, _ = ensure_cert(tmp_path)

    async def go():
        with pytest.raises(CertificateError):
            async with H3Client("127.0.0.1", srv.port, ca_file=wrong_ca):
                pass
        async with H3Client("127.0.0.1", srv.port, insecure=True) as c:
            assert (await c.request("GET", "/healthz")).status == 200
    run(go())


def test_chat_stream_raises_http_error(srv, certs):
    async def go():
        async with client(srv, certs) as c:
            with pytest.raises(HTTPError) as ei:
                async for _ in chat_stream(c, [{"role": "user", "content": "hi"}], model="nope"):
                    pass
            assert ei.value.status == 404 and "nope" in ei.value.message
    run(go())


def test_run_chat_command(srv, certs, capsys, tmp_path):
    assert run_chat_command("hi", "127.0.0.1", srv.port, certs[0], False, 4, 0.0, system="be brief") == 0
    out, err = capsys.readouterr()
    assert out == expected_text(4) + "\n" and err == ""

    assert run_chat_command("hi", "0.0.0.0", srv.port, None, True, None, None, model="nope") == 1
    out, err = capsys.readouterr()
    assert "HTTP 404" in err and "nope" in err

    wrong_ca, _ = ensure_cert(tmp_path)
    assert run_chat_command("hi", "127.0.0.1", srv.port, wrong_ca, False, None, None) == 1
    err = capsys.readouterr().err
    assert "certificate verification failed" in err and "--ca-file" in err and "--insecure" in err

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # a port nobody answers on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
        assert run_chat_command("hi", "127.0.0.1", dead, certs[0], False, None, None, connect_timeout=1.0) == 1
    err = capsys.readouterr().err
    assert f"could not reach edged at 127.0.0.1:{dead} over HTTP/3 (QUIC/UDP)" in err
