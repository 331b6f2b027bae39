"""The whole path, end to end: `edged serve` as a real process, real HTTP/3 clients over loopback."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import msgpack
import pytest

from helpers.daemon import DaemonProcess, free_udp_port, start_daemon
from edged.server.h3_client import H3Client, iter_sse

pytestmark = pytest.mark.slow

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
           "What is 2 plus 2?", "Say hello in Spanish.", "What is a cat?", "List two planets.",
           "Why is the sky blue?"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("daemon"), "model:\n  max_num_seqs: 32\n")
    yield d
    assert d.stop() == 0, d.log_text()[-3000:]


def chat_body(content: str, max_tokens: int = 24, stream: bool = True, **extra) -> bytes:
    return json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}).encode()


async def stream_text(client: H3Client, body: bytes) -> str:
    rs = await client.stream("POST", "/v1/chat/completions", {"content-type": "application/json"}, body)
    assert rs.status == 200, await rs.read()
    text = ""
    events = [e async for e in iter_sse(rs)]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        for choice in json.loads(e)["choices"]:
            text += choice["delta"].get("content") or ""
    return text


def test_edged_chat_streams_an_answer_naming_paris(daemon: DaemonProcess) -> None:
    out = subprocess.run([sys.executable, "-m", "edged.cli", "chat", "What is the capital of France?",
                          "--port", str(daemon.port), "--state-dir", str(daemon.state_dir), "--temperature", "0",
                          "--max-tokens", "32"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_an_independent_http3_client_streams_paris(daemon: DaemonProcess) -> None:
    from curl_cffi import CurlHttpVersion, requests

    r = requests.post(f"https://127.0.0.1:{daemon.port}/v1/chat/completions", http_version=CurlHttpVersion.V3ONLY,
                      verify=daemon.ca_file, timeout=120, stream=True,
                      json={"messages": PARIS, "stream": True, "temperature": 0, "max_tokens": 32})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert "Paris" in text


def test_32_concurrent_greedy_streams_over_4_connections_equal_their_solo_runs(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) as c:
            alone = [await stream_text(c, chat_body(p)) for p in PROMPTS]
        clients = [H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) for _ in range(4)]
        for c in clients:
            await c.connect()
        try:
            together = await asyncio.wait_for(asyncio.gather(
                *[stream_text(c, chat_body(p)) for c in clients for p in PROMPTS]), 300)
        finally:
            for c in clients:
                await c.close()
        assert all(alone)
        assert together == alone * 4

    asyncio.run(main())


def test_non_streaming_and_msgpack_responses_carry_the_same_text(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) as c:
            sse = await stream_text(c, chat_body(PROMPTS[0]))
            r = await c.request("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                chat_body(PROMPTS[0], stream=False))
            assert r.status == 200 and r.headers.get("x-request-id")
            body = r.json()
            assert body["choices"][0]["message"]["content"] == sse
            assert body["usage"]["completion_tokens"] > 0
            rs = await c.stream("POST", "/v1/chat/completions",
                                {"content-type": "application/json", "accept": "application/x-msgpack"},
                                chat_body(PROMPTS[0]))
            assert rs.headers["content-type"] == "application/x-msgpack"
            data = await rs.read()
            frames, text = [], ""
            while data:
                n = int.from_bytes(data[:4], "big")
                frames.append(msgpack.unpackb(data[4:4 + n]))
                data = data[4 + n:]
            assert frames[-1] == {"done": True}
            for f in frames[:-1]:
                text += f["choices"][0]["delta"].get("content") or ""
            assert text == sse
            models = (await c.request("GET", "/v1/models")).json()
            assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
            assert (await c.request("GET", "/healthz")).json() == {"status": "ok"}

    asyncio.run(main())


BAD_REQUESTS = [
    # (method, path, headers, body, status, code)
    ("POST", "/v1/chat/completions", {}, b"{not json", 400, None),
    ("POST", "/v1/chat/completions", {}, b'{"model": "x"}', 400, None),  # messages missing
    ("POST", "/v1/chat/completions", {}, b'{"messages": "hi"}', 400, None),
    ("POST", "/v1/chat/completions", {}, b'{"messages": []}', 400, None),
    ("POST", "/v1/chat/completions", {}, b'{"messages": [{"role": "user", "content": 5}]}', 400, None),
    ("POST", "/v1/chat/completions", {}, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
     400, None),
    ("POST", "/v1/chat/completions", {}, chat_body("hi", max_tokens=0), 400, None),
    ("POST", "/v1/chat/completions", {}, chat_body("hi", max_tokens=-3), 400, None),
    ("POST", "/v1/chat/completions", {}, chat_body("hi", max_tokens=10**9), 400, None),
    ("POST", "/v1/chat/completions", {}, chat_body("word " * 9000), 400, "context_length_exceeded"),
    ("POST", "/v1/chat/completions", {}, json.dumps({"model": "gpt-17", "messages": PARIS}).encode(), 404,
     "model_not_found"),
    ("GET", "/v1/chat/completions", {}, None, 405, None),
    ("POST", "/v1/nothing-here", {}, b"{}", 404, None),
    ("POST", "/v1/chat/completions", {}, b'{"messages": [{"role": "user", "content": "' + b"a" * (2 << 20) + b'"}]}',
     413, None),
    ("POST", "/v1/chat/completions", {}, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("POST", "/v1/completions", {}, b'{"prompt": 12}', 400, None),
]


def test_every_bad_input_gets_a_4xx_with_an_openai_error_and_the_daemon_keeps_serving(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) as c:
            for method, path, headers, body, status, code in BAD_REQUESTS:
                r = await c.request(method, path, {"content-type": "application/json", **headers}, body, timeout=60)
                assert r.status == status, (path, body[:80] if body else None, r.status, r.text[:300])
                err = r.json()["error"]
                assert err["message"] and err["type"]
                if code:
                    assert err["code"] == code
            assert "Paris" in await stream_text(c, chat_body(PARIS[0]["content"], max_tokens=32))

    asyncio.run(main())
    assert daemon.proc.poll() is None


def test_edged_chat_reports_an_unreachable_daemon_and_exits_non_zero(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "edged.cli", "chat", "hi", "--port", str(free_udp_port()),
                          "--insecure"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "could not reach edged" in out.stderr
