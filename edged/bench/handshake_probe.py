"""QUIC handshakes of fresh connections made one after another while a phase's load runs.

A daemon under load must still take new clients quickly (a handshake must not queue behind other
connections' token traffic). The probe runs in the benchmark's own process, beside the client
processes: connect, time the handshake, ask `GET /healthz`, close, wait `interval_s`, again.
"""
from __future__ import annotations

import asyncio
import time

PROBE_INTERVAL_S = 0.05


async def probe_handshakes(host: str, port: int, ca_file: str | None, insecure: bool, stop: asyncio.Event,
                           interval_s: float = PROBE_INTERVAL_S) -> list[float]:
    """Handshake seconds of each probe connection until `stop` is set."""
    from edged.server.h3_client import ConnectError, H3Client

    times: list[float] = []
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            async with H3Client(host, port, ca_file=ca_file, insecure=insecure) as c:
                times.append(time.perf_counter() - t0)
                await c.request("GET", "/healthz", {}, timeout=10)
        except (ConnectError, OSError, TimeoutError):
            pass  # a failed probe is not a handshake time; the phase's own errors tell that story
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass
    return times
