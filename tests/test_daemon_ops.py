"""Operating the daemon: systemd notifications, live config reload, graceful drain, real signals."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.daemon import DaemonProcess, start_daemon
from edged.server.h3_client import H3Client, iter_sse

pytestmark = pytest.mark.slow


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    with tempfile.TemporaryDirectory(prefix="sdn") as d:  # sun_path holds 108 bytes
        path = os.path.join(d, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        yield sock, path
        sock.close()


def read_notifications(sock: socket.socket, until: str, timeout: float) -> list[str]:
    """Every notification line received until one equal to `until` arrives."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            lines = sock.recv(4096).decode().split("\n")
        except socket.timeout:
            break
        seen.extend(lines)
        if until in lines:
            return seen
    raise AssertionError(f"no {until} within {timeout}s; saw {seen}")


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return sample.value
    return None


async def get_metrics(d: DaemonProcess) -> str:
    async with H3Client("127.0.0.1", d.port, ca_file=d.ca_file) as c:
        r = await c.request("GET", "/metrics")
        assert r.status == 200, r.text
        return r.text


def chat(max_tokens: int, content: str = "Tell me about the sea.") -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()


async def read_stream(c: H3Client, body: bytes) -> list[str]:
    rs = await c.stream("POST", "/v1/chat/completions", {"content-type": "application/json"}, body)
    assert rs.status == 200
    return [e async for e in iter_sse(rs)]


def test_systemd_sees_ready_watchdog_reloading_and_stopping(tmp_path: Path, notify_socket) -> None:
    sock, path = notify_socket
    d = start_daemon(tmp_path, "logging:\n  level: info\n",
                     env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"})
    try:
        seen = read_notifications(sock, "READY=1", 30)
        assert any(s.startswith("STATUS=") for s in seen)
        read_notifications(sock, "WATCHDOG=1", 5)
        read_notifications(sock, "WATCHDOG=1", 5)
        d.proc.send_signal(signal.SIGHUP)
        seen = read_notifications(sock, "RELOADING=1", 10)
        seen = read_notifications(sock, "READY=1", 10)
        d.proc.send_signal(signal.SIGTERM)
        read_notifications(sock, "STOPPING=1", 10)
        assert d.proc.wait(60) == 0
    finally:
        d.stop(signal.SIGKILL)


def test_a_config_edit_applies_live_without_dropping_a_stream_and_a_bad_edit_keeps_the_old_config(
        tmp_path: Path) -> None:
    base = "limits:\n  max_tokens_limit: 4096\n"
    d = start_daemon(tmp_path, base)
    assert d.config_path is not None
    try:
        async def main() -> None:
            assert metric_value(await get_metrics(d), "edged_max_tokens_limit") == 4096
            async with H3Client("127.0.0.1", d.port, ca_file=d.ca_file) as c:
                stream = asyncio.create_task(read_stream(c, chat(120)))
                await asyncio.sleep(1.0)
                d.config_path.write_text("limits:\n  max_tokens_limit: 2000\n")
                os.utime(d.config_path, (time.time() + 5, time.time() + 5))  # mtime must change visibly
                for _ in range(100):
                    if metric_value(await get_metrics(d), "edged_max_tokens_limit") == 2000:
                        break
                    await asyncio.sleep(0.2)
                assert metric_value(await get_metrics(d), "edged_max_tokens_limit") == 2000
                events = await asyncio.wait_for(stream, 240)
                assert events[-1] == "[DONE]"
                finish = json.loads(events[-2])["choices"][0]["finish_reason"]
                assert finish == "length"
                # An invalid edit: logged with the key and reason; the old config stays.
                mark = len(d.lines)
                d.config_path.write_text("limits:\n  max_tokens_limit: -5\n")
                os.utime(d.config_path, (time.time() + 10, time.time() + 10))
                assert d.wait_for_log("max_tokens_limit", 20, start=mark)
                await asyncio.sleep(0.5)
                assert metric_value(await get_metrics(d), "edged_max_tokens_limit") == 2000
                assert d.proc.poll() is None
                r = await c.request("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                    chat(3000).replace(b'"stream": true', b'"stream": false'))
                assert r.status == 400  # the new limit is what is enforced

        asyncio.run(main())
    finally:
        assert d.stop() == 0


def test_sigterm_during_16_live_streams_ends_each_with_its_answer_or_a_final_error(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "server:\n  drain_timeout_s: 3\nmodel:\n  max_num_seqs: 16\n")
    try:
        async def main() -> list[list[str]]:
            async with H3Client("127.0.0.1", d.port, ca_file=d.ca_file) as c:
                # Half finish quickly, half are far too long for the drain timeout.
                bodies = [chat(8 if i % 2 else 400, f"Story number {i}.") for i in range(16)]
                tasks = [asyncio.create_task(read_stream(c, b)) for b in bodies]
                await asyncio.sleep(2.0)
                d.proc.send_signal(signal.SIGTERM)
                return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        results = asyncio.run(main())
        assert d.proc.wait(60) == 0
        complete = errored = 0
        for events in results:
            assert events[-1] == "[DONE]", events[-3:]  # never cut silently
            last = json.loads(events[-2])
            if "error" in last:
                errored += 1
            else:
                assert last["choices"][0]["finish_reason"] in ("length", "stop")
                complete += 1
        assert complete >= 8 and errored >= 1
    finally:
        d.stop(signal.SIGKILL)


def test_api_keys_are_checked_by_hash_and_rate_limited_per_key(tmp_path: Path) -> None:
    from edged.config import hash_api_key

    config = f"""
auth:
  enabled: true
  keys:
    - name: ops
      sha256: {hash_api_key("ops-secret")}
      tier: gold
    - name: kiosk
      sha256: {hash_api_key("kiosk-secret")}
      tier: bronze
      rate_limit_rps: 0.2
      burst: 1
"""
    d = start_daemon(tmp_path, config)
    assert "ops-secret" not in (d.config_path.read_text() if d.config_path else "")
    try:
        async def main() -> None:
            async with H3Client("127.0.0.1", d.port, ca_file=d.ca_file) as c:
                hdr = {"content-type": "application/json"}
                small = chat(4).replace(b'"stream": true', b'"stream": false')
                r = await c.request("POST", "/v1/chat/completions", hdr, small)
                assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"
                r = await c.request("POST", "/v1/chat/completions", {**hdr, "authorization": "Bearer nope"}, small)
                assert r.status == 401
                r = await c.request("POST", "/v1/chat/completions", {**hdr, "authorization": "Bearer ops-secret"},
                                    small)
                assert r.status == 200, r.text
                kiosk = {**hdr, "authorization": "Bearer kiosk-secret"}
                assert (await c.request("POST", "/v1/chat/completions", kiosk, small)).status == 200
                r = await c.request("POST", "/v1/chat/completions", kiosk, small)
                assert r.status == 429 and int(r.headers["retry-after"]) >= 1
                assert (await c.request("GET", "/healthz")).status == 200  # public
                text = (await c.request("GET", "/metrics")).text  # loopback: no key needed
                assert metric_value(text, "edged_requests_total", {"tier": "gold"}) is not None

        asyncio.run(main())
    finally:
        assert d.stop() == 0
