"""One client's load: its QUIC connections, its requests, its share of one benchmark phase.

`edged bench serve` and `edged bench transport` run one of these in each client process
(clients.py); with `--clients 1` it runs in the benchmark's own event loop. Times are taken with
time.perf_counter() and handed back relative to the phase's start, so that shares timed in
different processes merge into one phase.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from edged.bench.report import RequestResult

STREAMS_PER_CONNECTION = 16
MAX_CONNECTIONS = 64
DEFAULT_TIMEOUT_S = 300.0


@dataclass(slots=True)
class WorkItem:
    prompt: str
    max_tokens: int
    tier: str


@dataclass(slots=True)
class ClientSettings:
    """What every client needs to reach the daemon and send requests (picklable: sent to each process)."""

    host: str = "127.0.0.1"
    port: int = 4433
    ca_file: str | None = None
    insecure: bool = False
    model: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S  # per request
    streams_per_connection: int = STREAMS_PER_CONNECTION


@dataclass(slots=True)
class Share:
    """One client's part of a phase: closed loop (`concurrency` workers drain `items`) or open loop
    (item i is sent `offsets[i]` seconds after the phase starts, whatever is in flight)."""

    items: list[WorkItem]
    concurrency: int = 0
    offsets: list[float] | None = None
    warm: int = 1  # requests in flight to open connections for before timing (an open loop opens more)


@dataclass(slots=True)
class ShareResult:
    results: list[RequestResult]  # `start` in seconds after the phase start
    handshakes: list[float] = field(default_factory=list)  # seconds, one per connection opened
    end: float = 0.0  # seconds after the phase start when this share's last request ended
    cpu_s: float = 0.0  # this process's CPU time over the share


# ------------------------------------------------------------------------------------ connections


class ConnectionPool:
    """QUIC connections opened as the load needs them: one more whenever every open one carries
    `per_connection` requests in flight (up to `max_connections`). Each handshake is timed."""

    def __init__(self, host: str, port: int, ca_file: str | None, insecure: bool,
                 per_connection: int = STREAMS_PER_CONNECTION, max_connections: int = MAX_CONNECTIONS,
                 idle_timeout_s: float = 120.0) -> None:
        from edged.server.h3_client import H3Client

        # A queued request may see no packets for a long while: keep the connection past its timeout.
        self._make = lambda: H3Client(host, port, ca_file=ca_file, insecure=insecure, idle_timeout=idle_timeout_s)
        self.per_connection = per_connection
        self.max_connections = max_connections
        self.inflight: dict[Any, int] = {}
        self.handshakes: list[float] = []
        self._lock = asyncio.Lock()

    async def _connect(self) -> Any:
        c = self._make()
        t = time.perf_counter()
        await c.connect()
        self.handshakes.append(time.perf_counter() - t)
        self.inflight[c] = 0
        return c

    async def acquire(self) -> Any:
        async with self._lock:
            for c in [c for c in self.inflight if not c.connected]:
                self.inflight.pop(c)
            best = min(self.inflight, key=self.inflight.__getitem__, default=None)
            if best is None or (self.inflight[best] >= self.per_connection
                                and len(self.inflight) < self.max_connections):
                best = await self._connect()
            self.inflight[best] += 1
            return best

    def release(self, c: Any) -> None:
        if c in self.inflight:
            self.inflight[c] -= 1

    async def warm(self, n: int) -> None:
        """Open enough connections for n requests in flight before timing starts. One at a time: each
        handshake is then timed against an idle server, not against this client's other handshakes."""
        want = min(self.max_connections, max(1, math.ceil(n / self.per_connection)))
        while len(self.inflight) < want:
            await self._connect()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.inflight), return_exceptions=True)
        self.inflight.clear()


# --------------------------------------------------------------------------------------- requests


def request_body(item: WorkItem, model: str | None) -> bytes:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": item.prompt}], "max_tokens": item.max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    return json.dumps(body).encode()


async def run_request(pool: ConnectionPool, item: WorkItem, model: str | None, timeout_s: float) -> RequestResult:
    """Send one streaming chat completion and time it. The clock starts once the request has a
    connection: a handshake it waited for is the pool's to report, not part of its TTFT."""
    from edged.server.h3_client import H3ClientError, error_message, iter_sse

    body = request_body(item, model)
    headers = {"content-type": "application/json", "accept": "text/event-stream", "x-edged-tier": item.tier}
    try:
        client = await pool.acquire()
    except (H3ClientError, OSError) as e:
        return RequestResult(item.tier, time.perf_counter(), error=f"connect: {e}")
    res = RequestResult(item.tier, time.perf_counter())
    usage_tokens, done, last = None, False, 0.0
    try:
        async with asyncio.timeout(timeout_s):
            rs = await client.stream("POST", "/v1/chat/completions", headers, body, timeout=None)
            res.status = rs.status
            async with rs:
                if rs.status != 200:
                    res.error = f"HTTP {rs.status}: {error_message(rs.status, await rs.read())}"
                    return res
                async for data in iter_sse(rs):
                    now = time.perf_counter()
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        res.error = (obj["error"] or {}).get("message") or "error event"
                        break
                    if obj.get("usage"):
                        usage_tokens = obj["usage"].get("completion_tokens")
                        res.prompt_tokens = obj["usage"].get("prompt_tokens")
                    if any((c.get("delta") or {}).get("content") or c.get("text") for c in obj.get("choices") or []):
                        res.events += 1
                        if res.ttft is None:
                            res.ttft = now - res.start
                        else:
                            res.itls.append(now - last)
                        last = now
                if done:
                    res.e2e = time.perf_counter() - res.start
                elif res.error is None:
                    res.error = "the stream ended without [DONE]"
    except TimeoutError:
        res.error = f"no complete response within {timeout_s:g}s"
    except (H3ClientError, ValueError) as e:  # ValueError: a malformed SSE payload
        res.error = str(e) or type(e).__name__
    finally:
        pool.release(client)
    res.output_tokens = usage_tokens if usage_tokens is not None else res.events
    return res


async def run_share(pool: ConnectionPool, share: Share, t0: float, settings: ClientSettings) -> list[RequestResult]:
    """The share's requests from perf_counter time t0 on: at their offsets (open loop) or from
    `concurrency` workers that each send the next item as soon as their last one ended (closed loop)."""
    model, timeout_s = settings.model, settings.timeout_s
    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
    if share.offsets is not None:
        tasks = []
        for item, at in zip(share.items, share.offsets):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.create_task(run_request(pool, item, model, timeout_s)))
        return list(await asyncio.gather(*tasks))
    queue = list(reversed(share.items))
    results: list[RequestResult] = []

    async def worker() -> None:
        while queue:
            results.append(await run_request(pool, queue.pop(), model, timeout_s))

    await asyncio.gather(*(worker() for _ in range(max(1, share.concurrency))))
    return results


class ClientLoad:
    """One client: `prepare` opens the connections a share needs (untimed), `run` sends it and closes
    them, so each phase starts from fresh connections and reports its own handshakes."""

    def __init__(self, settings: ClientSettings) -> None:
        self.settings = settings
        self.pool: ConnectionPool | None = None

    def _new_pool(self) -> ConnectionPool:
        s = self.settings
        return ConnectionPool(s.host, s.port, s.ca_file, s.insecure, s.streams_per_connection,
                              idle_timeout_s=max(120.0, s.timeout_s + 30))

    async def prepare(self, share: Share) -> None:
        self.pool = self.pool or self._new_pool()
        await self.pool.warm(share.warm)

    async def run(self, share: Share, t0: float) -> ShareResult:
        """Send the share from perf_counter time t0; every time in the result is relative to t0."""
        pool = self.pool or self._new_pool()
        cpu0 = time.process_time()
        try:
            results = await run_share(pool, share, t0, self.settings)
            end = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
        finally:
            self.pool = None
            await pool.close()
        for r in results:
            r.start -= t0
        return ShareResult(results, pool.handshakes, end, cpu)

    async def close(self) -> None:
        if self.pool is not None:
            pool, self.pool = self.pool, None
            await pool.close()
