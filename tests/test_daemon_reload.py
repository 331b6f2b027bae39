"""Live config in a running daemon: each key the README lists as live (tiers, batching limits, cache
settings, API keys, log level, limits) is changed by SIGHUP and its new behaviour observed through
the API, the metrics or the log; a rejected reload says so to systemd and changes nothing; a saved
file applies without SIGHUP; a stream running across a reload finishes whole.

One daemon for the module (it reports to a fake $NOTIFY_SOCKET); each test writes the whole file it
needs (BASE plus its own keys), so the tests do not depend on each other's order.
"""
from __future__ import annotations

import asyncio
import json
import signal
import uuid
from typing import Iterator

import pytest

from edged.config import hash_api_key
from edged.server.h3_client import H3Client, iter_sse
from helpers.daemon import DaemonProcess, NotifySocket, start_daemon, status_of, write_config
from helpers.metrics import metric_sum, metric_value

pytestmark = pytest.mark.slow

BASE = "logging:\n  level: info\n"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def notify() -> Iterator[NotifySocket]:
    n = NotifySocket()
    yield n
    n.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, notify: NotifySocket) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("reload"), BASE, env={**notify.env, "WATCHDOG_USEC": "2000000"})
    d.startup_notifications = []
    d.startup_ready = notify.wait_for("READY=1", 60, seen=d.startup_notifications)
    yield d
    assert d.stop() == 0, d.log_text()[-3000:]


def sighup(d: DaemonProcess, notify: NotifySocket, text: str) -> str:
    """Write the config, send SIGHUP, wait until the daemon reports the reload done; its STATUS."""
    assert d.config_path is not None
    write_config(d.config_path, text)
    notify.drain()
    d.proc.send_signal(signal.SIGHUP)
    notify.wait_for("RELOADING=1")
    return status_of(notify.wait_for("READY=1")) or ""


def body(max_tokens: int | None = 4, stream: bool = False, content: str | None = None, **extra) -> bytes:
    """A greedy chat request; its content is unique unless given (no result-cache hits by accident)."""
    obj = {"messages": [{"role": "user", "content": content or f"Say something. ({uuid.uuid4().hex[:8]})"}],
           "temperature": 0, "stream": stream, "ignore_eos": True, **extra}
    if max_tokens is not None:
        obj["max_tokens"] = max_tokens
    return json.dumps(obj).encode()


def client(d: DaemonProcess) -> H3Client:
    return H3Client("127.0.0.1", d.port, ca_file=d.ca_file)


async def scrape(c: H3Client) -> str:
    r = await c.request("GET", "/metrics")
    assert r.status == 200
    return r.text


# --------------------------------------------------------------------------------- systemd's view

def test_systemd_sees_ready_with_a_status_then_watchdog_pings_and_reloads(daemon: DaemonProcess,
                                                                         notify: NotifySocket) -> None:
    assert status_of(daemon.startup_ready).startswith("serving SmolLM2-135M-Instruct on 127.0.0.1:")
    assert ["STATUS=loading model"] in daemon.startup_notifications
    notify.drain()
    notify.wait_for("WATCHDOG=1", 30)
    notify.wait_for("WATCHDOG=1", 30)
    status = sighup(daemon, notify, BASE)
    assert status.startswith("serving SmolLM2-135M-Instruct") and "rejected" not in status


def test_a_rejected_reload_says_so_and_keeps_the_running_config(daemon: DaemonProcess,
                                                                notify: NotifySocket) -> None:
    async def limit_and_rejections() -> tuple[float, float]:
        async with client(daemon) as c:
            text = await scrape(c)
            return (metric_value(text, "edged_max_tokens_limit"),
                    metric_sum(text, "edged_config_reloads_total", {"result": "rejected"}))

    assert "rejected" not in sighup(daemon, notify, BASE + "limits:\n  max_tokens_limit: 300\n")
    limit, rejected = asyncio.run(limit_and_rejections())
    assert limit == 300
    status = sighup(daemon, notify, BASE + "limits:\n  max_tokens_limit: -5\n")
    assert status.startswith("config reload rejected: limits.max_tokens_limit:"), status
    assert status.endswith("still serving on the previous config")
    assert asyncio.run(limit_and_rejections()) == (300, rejected + 1)

    async def enforced() -> None:
        async with client(daemon) as c:
            r = await c.request("POST", "/v1/chat/completions", JSON, body(max_tokens=301))
            assert (r.status, r.json()["error"]["param"]) == (400, "max_tokens")

    asyncio.run(enforced())
    assert daemon.proc.poll() is None


# ------------------------------------------------------------------------------------------ limits

def test_limits_apply_live(daemon: DaemonProcess, notify: NotifySocket) -> None:
    async def main() -> tuple[int, int, int, int]:
        async with client(daemon) as c:
            async def post(data: bytes) -> tuple[int, dict]:
                r = await c.request("POST", "/v1/chat/completions", JSON, data)
                return r.status, r.json()

            long_prompt = "one two three four five six seven eight nine ten " * 8  # ~110 tokens, templated
            s1, _ = await post(body(max_tokens=6))
            s2, j2 = await post(body(max_tokens=None))
            s3, _ = await post(body(content=long_prompt))
            return s1, s2, j2["usage"]["completion_tokens"] if s2 == 200 else -1, s3

    sighup(daemon, notify, BASE + "limits:\n  max_tokens_default: 3\n")
    assert asyncio.run(main()) == (200, 200, 3, 200)
    sighup(daemon, notify, BASE + "limits:\n  max_tokens_limit: 5\n  max_tokens_default: 2\n"
                                  "  max_prompt_tokens: 70\n")
    assert asyncio.run(main()) == (400, 200, 2, 400)  # 6 > 5; default 2; ~110 prompt tokens > 70 (~40 pass)


def test_server_limits_apply_live(daemon: DaemonProcess, notify: NotifySocket) -> None:
    padded = body(max_tokens=1, content="x" * 1500)

    async def status() -> int:
        async with client(daemon) as c:
            return (await c.request("POST", "/v1/chat/completions", JSON, padded)).status

    sighup(daemon, notify, BASE)
    assert asyncio.run(status()) == 200
    sighup(daemon, notify, BASE + "server:\n  max_body_bytes: 1KiB\n")
    assert asyncio.run(status()) == 413


# ------------------------------------------------------------------------------------------- tiers

PLATINUM = """
scheduler:
  default_tier: bronze
tiers:
  platinum: {weight: 16, ttft_target_ms: 250, max_queue: 4, max_tokens: 2}
  gold: {weight: 8, ttft_target_ms: 500}
  bronze: {weight: 1, ttft_target_ms: 10000}
"""


def test_tiers_and_the_default_tier_apply_live(daemon: DaemonProcess, notify: NotifySocket) -> None:
    platinum = {**JSON, "x-edged-tier": "platinum"}

    async def main() -> tuple[int, int, str]:
        async with client(daemon) as c:
            before = await scrape(c)
            r1 = await c.request("POST", "/v1/chat/completions", platinum, body(max_tokens=2))
            r2 = await c.request("POST", "/v1/chat/completions", platinum, body(max_tokens=3))
            untiered = await c.request("POST", "/v1/chat/completions", JSON, body(max_tokens=2))
            assert untiered.status == 200
            after = await scrape(c)
            got = {t: metric_sum(after, "edged_requests_total", {"tier": t}) -
                   metric_sum(before, "edged_requests_total", {"tier": t}) for t in ("silver", "bronze")}
            default = max(got, key=got.get) if any(got.values()) else "?"
            return r1.status, r2.status, default, after

    sighup(daemon, notify, BASE)
    s1, s2, default, _ = asyncio.run(main())
    assert (s1, s2, default) == (400, 400, "silver")  # no platinum tier yet; silver is the built-in default
    sighup(daemon, notify, BASE + PLATINUM)
    s1, s2, default, text = asyncio.run(main())
    assert (s1, s2, default) == (200, 400, "bronze")  # platinum caps max_tokens at 2; the new default tier
    assert metric_value(text, "edged_tier_ttft_target_seconds", {"tier": "platinum"}) == 0.25
    assert metric_value(text, "edged_tier_max_queue", {"tier": "platinum"}) == 4
    assert metric_value(text, "edged_tier_ttft_target_seconds", {"tier": "silver"}) is None  # removed


# ---------------------------------------------------------------------------------- batching limits

def test_the_batch_cap_applies_live(daemon: DaemonProcess, notify: NotifySocket) -> None:
    """With scheduler.batch_cap 1 a second stream waits until the first has finished."""
    async def order_of_events() -> tuple[list[str], dict[str, int]]:
        events: list[str] = []
        tokens: dict[str, int] = {}
        async with client(daemon) as c:
            async def run(name: str, n: int, started: asyncio.Event | None) -> None:
                rs = await c.stream("POST", "/v1/chat/completions", JSON,
                                    body(max_tokens=n, stream=True, stream_options={"include_usage": True}))
                assert rs.status == 200, await rs.read()
                async for e in iter_sse(rs):
                    if e == "[DONE]":
                        break
                    chunk = json.loads(e)
                    if chunk.get("usage"):
                        tokens[name] = chunk["usage"]["completion_tokens"]
                    for choice in chunk["choices"]:
                        if choice["delta"].get("content"):
                            events.append(f"{name} token")
                            if started is not None:
                                started.set()
                        if choice.get("finish_reason"):
                            events.append(f"{name} done")

            first_token = asyncio.Event()
            a = asyncio.create_task(run("a", 32, first_token))
            await asyncio.wait_for(first_token.wait(), 120)
            await asyncio.wait_for(asyncio.gather(a, run("b", 2, None)), 300)
        return events, tokens

    # One tier with a target no queue can miss: admission must not refuse b for waiting on a.
    sighup(daemon, notify, BASE + "scheduler:\n  batch_cap: 1\ntiers:\n  silver: {ttft_target_ms: 600000}\n")
    events, tokens = asyncio.run(order_of_events())
    assert tokens == {"a": 32, "b": 2}
    assert events.index("a done") < events.index("b token"), events


# ------------------------------------------------------------------------------------ cache settings

def test_the_result_cache_can_be_switched_off_and_on_live(daemon: DaemonProcess, notify: NotifySocket) -> None:
    repeat = body(max_tokens=3, content="Name a color.")

    async def headers() -> tuple[str | None, float]:
        async with client(daemon) as c:
            r = await c.request("POST", "/v1/chat/completions", JSON, repeat)
            assert r.status == 200
            return r.headers.get("x-edged-cache"), metric_value(await scrape(c), "edged_result_cache_enabled")

    sighup(daemon, notify, BASE)
    asyncio.run(headers())  # stored
    assert asyncio.run(headers()) == ("hit", 1)
    sighup(daemon, notify, BASE + "cache:\n  enabled: false\n")
    assert asyncio.run(headers()) == (None, 0)  # not looked up, not stored
    sighup(daemon, notify, BASE)
    assert asyncio.run(headers()) == ("hit", 1)  # the entry from before is still there


# -------------------------------------------------------------------------------------------- API keys

def keys_config(*keys: tuple[str, str, str | None, str]) -> str:
    lines = ["auth:", "  enabled: true", "  keys:"]
    for name, key, tier, extra in keys:
        lines += [f"    - name: {name}", f"      sha256: {hash_api_key(key)}"]
        if tier:
            lines.append(f"      tier: {tier}")
        lines += [f"      {line}" for line in extra.splitlines() if line]
    return BASE + "\n".join(lines) + "\n"


def test_api_keys_apply_live_by_hash_with_tiers_and_rate_limits(daemon: DaemonProcess, notify: NotifySocket) -> None:
    def bearer(key: str) -> dict:
        return {**JSON, "authorization": f"Bearer {key}"}

    async def statuses(*headers: dict) -> list[int]:
        async with client(daemon) as c:
            return [(await c.request("POST", "/v1/chat/completions", h, body(max_tokens=1))).status for h in headers]

    sighup(daemon, notify, BASE)
    assert asyncio.run(statuses(JSON)) == [200]
    config = keys_config(("ops", "ops-secret", "gold", ""),
                         ("kiosk", "kiosk-secret", "bronze", "rate_limit_rps: 0.2\nburst: 1"))
    assert "ops-secret" not in config
    sighup(daemon, notify, config)

    async def with_ops_key() -> None:
        async with client(daemon) as c:
            before = await scrape(c)
            r = await c.request("POST", "/v1/chat/completions", JSON, body(max_tokens=1))
            assert (r.status, r.json()["error"]["code"]) == (401, "invalid_api_key")
            assert (await c.request("POST", "/v1/chat/completions", bearer("nope"), body(max_tokens=1))).status == 401
            r = await c.request("POST", "/v1/chat/completions", bearer("ops-secret"), body(max_tokens=1))
            assert r.status == 200, r.text
            assert (await c.request("POST", "/v1/chat/completions", bearer("kiosk-secret"), body(max_tokens=1))).status \
                == 200
            r = await c.request("POST", "/v1/chat/completions", bearer("kiosk-secret"), body(max_tokens=1))
            assert r.status == 429 and int(r.headers["retry-after"]) >= 1
            assert (await c.request("GET", "/healthz")).status == 200  # public
            after = await scrape(c)
            for tier in ("gold", "bronze"):
                n = metric_sum(after, "edged_requests_total", {"tier": tier, "outcome": "length"}) - \
                    metric_sum(before, "edged_requests_total", {"tier": tier, "outcome": "length"})
                assert n == 1, tier  # each key's request ran in its key's tier

    asyncio.run(with_ops_key())
    sighup(daemon, notify, keys_config(("ops2", "new-secret", "gold", "")))
    assert asyncio.run(statuses(bearer("ops-secret"), bearer("new-secret"), JSON)) == [401, 200, 401]
    sighup(daemon, notify, BASE)
    assert asyncio.run(statuses(JSON)) == [200]


# ------------------------------------------------------------------------------------------ log level

def test_the_log_level_and_access_log_apply_live(daemon: DaemonProcess, notify: NotifySocket) -> None:
    def lines_around_a_request(config: str) -> str:
        """The log from the reload to a marker after one request: a rejected reload, whose ERROR line
        every level shows and which the daemon writes after the request's own lines."""
        sighup(daemon, notify, config)
        mark = len(daemon.lines)

        async def one() -> None:
            async with client(daemon) as c:
                assert (await c.request("POST", "/v1/chat/completions", JSON, body(max_tokens=2))).status == 200

        asyncio.run(one())
        assert "rejected" in sighup(daemon, notify, config + "limits:\n  max_tokens_limit: -1\n")
        assert daemon.wait_for_log("max_tokens_limit", 30, start=mark)
        return "".join(daemon.lines[mark:])

    text = lines_around_a_request(BASE)
    assert "request done" in text and " DEBUG " not in text
    text = lines_around_a_request("logging:\n  level: warning\n")
    assert "request done" not in text and " INFO " not in text
    text = lines_around_a_request("logging:\n  level: debug\n")
    assert " DEBUG " in text and "result cached" in text
    text = lines_around_a_request("logging:\n  level: info\n  access_log: false\n")
    assert "request done" not in text and " INFO " in text
    sighup(daemon, notify, BASE)


# ------------------------------------------------------------------------------- streams and the file

def test_a_stream_runs_on_across_a_reload_and_a_saved_file_applies_without_sighup(daemon: DaemonProcess,
                                                                                 notify: NotifySocket) -> None:
    async def main() -> None:
        sighup(daemon, notify, BASE)
        async with client(daemon) as c:
            rs = await c.stream("POST", "/v1/chat/completions", JSON,
                                body(max_tokens=24, stream=True, stream_options={"include_usage": True}))
            events = iter_sse(rs)
            first = json.loads(await events.__anext__())  # the stream has started
            assert first["choices"][0]["delta"].get("role") == "assistant"
            await asyncio.to_thread(sighup, daemon, notify, BASE + "limits:\n  max_tokens_limit: 2000\n")
            rest = [e async for e in events]
            assert rest[-1] == "[DONE]"
            chunks = [json.loads(e) for e in rest[:-1]]
            assert all("error" not in ch for ch in chunks)
            finish = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
            assert finish[-1] == "length" and chunks[-1]["usage"]["completion_tokens"] == 24
            assert metric_value(await scrape(c), "edged_max_tokens_limit") == 2000
            # Saving the file is enough: the watcher applies it (no signal).
            write_config(daemon.config_path, BASE + "limits:\n  max_tokens_limit: 1000\n")
            notify.wait_for("RELOADING=1", 60)
            notify.wait_for("READY=1", 60)
            assert metric_value(await scrape(c), "edged_max_tokens_limit") == 1000

    notify.drain()
    asyncio.run(main())
