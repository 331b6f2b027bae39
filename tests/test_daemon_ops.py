"""SIGTERM on a real daemon with 16 live streams: it stops admitting (503 on new requests, /healthz
and /readyz) at once, lets the streams that can finish within server.drain_timeout_s finish, ends the
rest with a final error event, tells systemd STOPPING and exits 0.

No absolute times: the drain timeout is derived in the same run from how long this machine takes to
finish 16 short streams once they have started, and the long streams are far too long for it at any
engine speed.
(systemd READY/WATCHDOG/RELOADING and live reload: test_daemon_reload.py.)
"""
from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import pytest

from edged.server.h3_client import H3Client, iter_sse
from helpers.daemon import NotifySocket, start_daemon, write_config

pytestmark = pytest.mark.slow

SHORT, LONG = 8, 4000  # tokens: a short stream finishes inside the drain, a long one cannot
# A generous TTFT target: admission must not refuse any of the 16 streams on a slow machine.
CONFIG = """
model:
  max_num_seqs: 16
cache:
  enabled: false
tiers:
  silver: {ttft_target_ms: 600000, max_queue: 64}
server:
  drain_timeout_s: %s
"""


def chat(max_tokens: int, content: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()


async def read_stream(c: H3Client, body: bytes, started: asyncio.Event | None = None,
                      ended: list[str] | None = None, name: str = "") -> list[str]:
    rs = await c.stream("POST", "/v1/chat/completions", {"content-type": "application/json"}, body)
    assert rs.status == 200, await rs.read()
    events = []
    async for e in iter_sse(rs):
        events.append(e)
        if started is not None and e != "[DONE]" and json.loads(e).get("choices") and \
                json.loads(e)["choices"][0]["delta"].get("content"):
            started.set()
    if ended is not None:
        ended.append(name)
    return events


def test_sigterm_during_16_live_streams_refuses_new_work_and_ends_each_with_its_answer_or_a_final_error(
        tmp_path: Path) -> None:
    notify = NotifySocket()
    d = start_daemon(tmp_path, CONFIG % 600, env=notify.env)
    try:
        async def measure() -> float:
            """Seconds this machine takes, with 16 streams running, to go from every stream's first
            token to the end of the short ones: what the short streams still need when SIGTERM comes."""
            async with H3Client("127.0.0.1", d.port, ca_file=d.ca_file) as c:
                started = [asyncio.Event() for _ in range(16)]
                tasks = [asyncio.create_task(read_stream(c, chat(SHORT, f"Warm-up {i}."), started[i]))
                         for i in range(16)]
                await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 600)
                t0 = time.monotonic()
                await asyncio.wait_for(asyncio.gather(*tasks), 600)
                return time.monotonic() - t0

        drain = max(2.0, 3 * asyncio.run(measure()))
        write_config(d.config_path, CONFIG % round(drain, 2))  # drain_timeout_s applies live
        notify.drain()
        d.proc.send_signal(signal.SIGHUP)
        notify.wait_for("RELOADING=1")
        notify.wait_for("READY=1")

        async def main() -> tuple[list[list[str]], list[str], dict]:
            order: list[str] = []
            seen: dict = {}
            async with H3Client("127.0.0.1", d.port, ca_file=d.ca_file) as c:
                started = [asyncio.Event() for _ in range(16)]
                tasks = [asyncio.create_task(read_stream(c, chat(SHORT if i % 2 else LONG, f"Story number {i}."),
                                                         started[i], order, "short" if i % 2 else "long"))
                         for i in range(16)]
                await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 600)  # all 16 streaming
                d.proc.send_signal(signal.SIGTERM)
                for _ in range(1000):  # until the daemon has taken the signal
                    health = await c.request("GET", "/healthz")
                    if health.status != 200:
                        break
                    await asyncio.sleep(0.01)
                seen["healthz"] = (health.status, health.json())
                r = await c.request("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                    chat(4, "A late question."))
                seen["new"] = (r.status, r.headers.get("retry-after"), r.json()["error"]["code"])
                seen["readyz"] = (await c.request("GET", "/readyz")).status
                order.append("refused")
                results = await asyncio.wait_for(asyncio.gather(*tasks), drain + 120)
            return results, order, seen

        results, order, seen = asyncio.run(main())
        assert d.proc.wait(60) == 0
        assert seen == {"healthz": (503, {"status": "draining"}), "new": (503, "5", "shutting_down"), "readyz": 503}
        assert order.index("refused") < order.index("long")  # refused while streams were still running
        for i, events in enumerate(results):
            assert events[-1] == "[DONE]", events[-3:]  # never cut silently
            last = json.loads(events[-2])
            if i % 2:  # short: its whole answer
                assert last["choices"][0]["finish_reason"] == "length", (i, events[-3:])
            else:  # long: a final error event once the drain timeout is up
                assert last["error"]["code"] == "shutting_down", (i, events[-3:])
        stopping = notify.drain()
        assert any("STOPPING=1" in fields for fields in stopping), stopping
    finally:
        d.stop(signal.SIGKILL)
        notify.close()
