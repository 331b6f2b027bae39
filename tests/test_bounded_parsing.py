"""Bounded parsing at the edge: what a client sends is checked against its real domain and never
echoed at length, and a request that never finishes its headers does not hold a stream.

The HTTP/3 server runs on loopback against the fake engine; the wire checks are pure functions.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import pytest

from edged.server import openai_wire as wire
from edged.server.h3_client import H3Client, ResponseStream, StreamError
from edged.server.settings import ServerSettings
from helpers.aio import run as _run
from helpers.fake_engine import FakeEngine, ServerThread, expected_text

pytestmark = pytest.mark.timeout(60)

JSON = {"content-type": "application/json"}
BODY_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def srv(certs: tuple[str, str]) -> Iterator[ServerThread]:
    with ServerThread(FakeEngine(), *certs, settings=ServerSettings(body_timeout_s=BODY_TIMEOUT_S)) as st:
        yield st


def client(st: ServerThread, certs: tuple[str, str]) -> H3Client:
    return H3Client("127.0.0.1", st.port, ca_file=certs[0])


def run(coro):  # type: ignore[no-untyped-def]
    return _run(coro, 30)


def test_an_incomplete_headers_frame_is_reset_after_the_body_timeout(srv: ServerThread, certs) -> None:
    async def go() -> None:
        async with client(srv, certs) as c:
            p = c._protocol
            assert p is not None
            sid = p._quic.get_next_available_stream_id()
            stalled = ResponseStream(c, sid)
            p.streams[sid] = stalled
            # A HEADERS frame (type 0x01) announcing 64 bytes of which only 3 ever come.
            p._quic.send_stream_data(sid, b"\x01\x40\x40" + b"\x00\x00\x00")
            p.transmit()
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(StreamError, match="reset the stream"):
                await asyncio.wait_for(stalled.read(), 10 * BODY_TIMEOUT_S)
            assert loop.time() - start >= BODY_TIMEOUT_S * 0.9
            # The connection and the server carry on.
            r = await c.request("POST", "/v1/chat/completions", JSON,
                                json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())
            assert r.status == 200 and r.json()["choices"][0]["message"]["content"] == expected_text()
    run(go())


def test_complete_headers_are_not_cut_by_the_header_timer(srv: ServerThread, certs) -> None:
    async def go() -> None:
        async with client(srv, certs) as c:
            rs = await c.stream("POST", "/v1/chat/completions", JSON, b'{"messages": [{"role": "user", ',
                                end_stream=False, timeout=10)
            assert rs.status == 408  # the body timeout, once headers were whole: not a reset
    run(go())


def test_a_long_path_is_cut_in_the_404_body_and_the_log(srv: ServerThread, certs,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    path = "/v1/" + "a" * 10_000

    async def go() -> None:
        async with client(srv, certs) as c:
            r = await c.request("GET", path, {"x-request-id": "long-path"})
            assert r.status == 404
            message = r.json()["error"]["message"]
            assert len(message) < 300 and "... (10004 characters)" in message

    with caplog.at_level(logging.INFO, logger="edged.server"):
        run(go())
    line = next(r.getMessage() for r in caplog.records if "rid=long-path" in r.getMessage())
    assert len(line) < 400 and "a" * 200 not in line


# ------------------------------------------------------------------ the wire checks


def chat(**kw) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def refusal(body: bytes) -> wire.WireError:
    with pytest.raises(wire.WireError) as e:
        wire.parse_chat_request(body)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("body, param, message", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "temperature",
     "'temperature' must be a finite number, got inf."),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -1e999}', "top_p",
     "'top_p' must be a finite number, got -inf."),
    (chat(temperature="hot"), "temperature", "'temperature' must be a number, got a string."),
    (chat(seed=2**63), "seed", "'seed' must be in 0..9223372036854775807, got 9223372036854775808."),
    (chat(seed=-1), "seed", "'seed' must be in 0..9223372036854775807, got -1."),
    (chat(top_k=2**63), "top_k", "'top_k' must be in -1..9223372036854775807 (0 or -1: off), got 9223372036854775808."),
    (chat(stop_token_ids=list(range(65))), "stop_token_ids", "'stop_token_ids' accepts at most 64 ids, got 65."),
    (chat(stop_token_ids=[2**31]), "stop_token_ids", None),
    (chat(max_tokens=-(10**100)), "max_tokens", None),
])
def test_each_tensor_bound_field_is_checked_with_a_400_naming_it(body: bytes, param: str, message: str | None) -> None:
    e = refusal(body)
    assert e.param == param
    if message is not None:
        assert e.message == message
    assert len(e.message) < 200  # a huge number is never echoed whole


def test_token_ids_are_checked_against_the_vocabulary_and_top_k_is_clamped() -> None:
    p = wire.parse_completion_request(json.dumps({"prompt": [1, 49152], "top_k": 10**6}).encode())
    with pytest.raises(wire.WireError) as e:
        wire.make_generation_request(p, p.prompt, "r", "default", 8192, 16, vocab_size=49152)
    assert (e.value.param, e.value.message) == (
        "prompt", "'prompt' contains token id 49152, outside this model's vocabulary (0..49151).")
    ok = wire.make_generation_request(p, [1, 49151], "r", "default", 8192, 16, vocab_size=49152)
    assert ok.sampling.top_k == 49152
    p = wire.parse_chat_request(chat(stop_token_ids=[7, 60000]))
    with pytest.raises(wire.WireError) as e:
        wire.make_generation_request(p, [1, 2], "r", "default", 8192, 16, vocab_size=49152)
    assert e.value.param == "stop_token_ids"


def test_the_default_seed_range_takes_the_extremes() -> None:
    for seed in (0, 2**63 - 1):
        assert wire.parse_chat_request(chat(seed=seed)).sampling.seed == seed
