"""The load spread over N client processes, so that the load generator is never the bottleneck.

One Python process can only drive so many QUIC connections: aioquic does its packet work, TLS and
SSE parsing on one core, and a daemon whose front end scales over several worker processes would
otherwise be measured against one client core. Each phase is split into N shares (a closed loop's
concurrency and requests, an open loop's arrivals round-robin, keeping their send times), each
share runs in its own process (multiprocessing "spawn": no forked event loop or sockets), the
shares start at the same instant, and their results merge into one phase.

With one client the share runs in the benchmark's own event loop, as it always did.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

from edged.bench.load import ClientLoad, ClientSettings, Share, ShareResult, WorkItem
from edged.bench.report import RequestResult

START_MARGIN_S = 0.05  # "go" reaches every client process well within this; all start together after it
POLL_S = 0.005  # how often the benchmark looks for its clients' answers (they carry no timing)


def default_clients() -> int:
    """Half the cores this process may use (the other half for a daemon on the same machine), 1 to 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


# ------------------------------------------------------------------------------ splitting, merging


def split_phase(items: list[WorkItem], clients: int, *, concurrency: int | None = None,
                offsets: list[float] | None = None, streams_per_connection: int = 16) -> list[Share]:
    """At most `clients` shares. Closed loop: the concurrency is split as evenly as it goes and the
    requests in the same proportion, so every share drains in about the same time. Open loop: the
    arrivals are dealt round-robin and keep their send times (the union of the shares is the
    phase's schedule)."""
    clients = max(1, clients)
    if offsets is not None:
        n = max(1, min(clients, len(items)))
        shares = []
        for k in range(n):
            mine = items[k::n]
            shares.append(Share(mine, offsets=offsets[k::n], warm=min(len(mine), streams_per_connection)))
        return shares
    c = max(1, concurrency or 1)
    n = min(clients, c)
    conc = [c // n + (k < c % n) for k in range(n)]
    # Slot j of the c closed-loop slots belongs to the share that holds it; item i goes to slot i % c.
    slots = [k for rnd in range(max(conc)) for k in range(n) if rnd < conc[k]]
    mine: list[list[WorkItem]] = [[] for _ in range(n)]
    for i, item in enumerate(items):
        mine[slots[i % c]].append(item)
    return [Share(mine[k], concurrency=conc[k], warm=conc[k]) for k in range(n)]


@dataclass(slots=True)
class PhaseRun:
    """The merged shares of one phase."""

    results: list[RequestResult]  # in send order, `start` in seconds after the phase start
    duration_s: float
    handshakes: list[float] = field(default_factory=list)
    client_cpu_s: list[float] = field(default_factory=list)  # one per client process


def merge(shares: list[ShareResult]) -> PhaseRun:
    results = sorted((r for s in shares for r in s.results), key=lambda r: r.start)
    return PhaseRun(results, max((s.end for s in shares), default=0.0),
                    [h for s in shares for h in s.handshakes], [s.cpu_s for s in shares])


# ------------------------------------------------------------------------------------- the clients


class Clients(Protocol):
    async def prepare(self, shares: list[Share]) -> None:
        """Hand out the shares and open their connections (untimed)."""

    async def run(self) -> PhaseRun:
        """Send every share from the same instant; the merged phase."""

    async def close(self) -> None: ...


class LocalClients:
    """One client in this process's event loop."""

    def __init__(self, settings: ClientSettings) -> None:
        self.load = ClientLoad(settings)
        self.share: Share | None = None

    async def prepare(self, shares: list[Share]) -> None:
        [self.share] = shares
        await self.load.prepare(self.share)

    async def run(self) -> PhaseRun:
        assert self.share is not None, "prepare() first"
        return merge([await self.load.run(self.share, time.perf_counter())])

    async def close(self) -> None:
        await self.load.close()


class ProcessClients:
    """N client processes, started once and kept for every phase (a spawn costs an interpreter start)."""

    def __init__(self, settings: ClientSettings, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for k in range(n):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=client_main, args=(theirs, settings), name=f"edged-bench-client-{k}", daemon=True)
            p.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(p)
        self.busy = 0  # how many processes hold a share this phase

    async def _recv(self, k: int) -> Any:
        conn, proc = self.conns[k], self.procs[k]
        while not conn.poll():
            if not proc.is_alive():
                raise RuntimeError(f"bench client process {k} exited with status {proc.exitcode}")
            await asyncio.sleep(POLL_S)
        kind, payload = conn.recv()
        if kind == "connect_error":
            from edged.server.h3_client import ConnectError

            raise ConnectError(payload)
        if kind == "error":
            raise RuntimeError(f"bench client process {k} failed:\n{payload}")
        return payload

    async def prepare(self, shares: list[Share]) -> None:
        if len(shares) > len(self.conns):
            raise ValueError(f"{len(shares)} shares for {len(self.conns)} client processes")
        self.busy = len(shares)
        for conn, share in zip(self.conns, shares):
            conn.send(("prepare", share))
        await asyncio.gather(*(self._recv(k) for k in range(self.busy)))

    async def run(self) -> PhaseRun:
        start_at = time.time() + START_MARGIN_S
        for conn in self.conns[: self.busy]:
            conn.send(("go", start_at))
        return merge(list(await asyncio.gather(*(self._recv(k) for k in range(self.busy)))))

    async def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(("stop", None))
                except OSError:
                    pass
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if proc.is_alive():
                proc.terminate()
            proc.join(1.0)
        for conn in self.conns:
            conn.close()


def open_clients(settings: ClientSettings, n: int) -> Clients:
    return LocalClients(settings) if n <= 1 else ProcessClients(settings, n)


# ----------------------------------------------------------------------------- in a client process


def client_main(conn: Connection, settings: ClientSettings) -> None:
    """A client process: prepare / go / stop messages from the benchmark, one at a time."""
    try:
        import uvloop  # less CPU per packet than asyncio's loop: more load per client core

        factory: Any = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_serve(conn, ClientLoad(settings)))


async def _serve(conn: Connection, load: ClientLoad) -> None:
    from edged.server.h3_client import ConnectError

    # Messages are read from the event loop, so that the connections keep running (ACKs, timers)
    # while the client waits for "go".
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def read() -> None:  # a thread: uvloop's add_reader missed pipe data now and then (see edged/daemon.py)
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the benchmark is gone
                loop.call_soon_threadsafe(inbox.put_nowait, ("stop", None))
                return
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "stop":
                return

    threading.Thread(target=read, name="bench-control", daemon=True).start()
    share: Share | None = None
    try:
        while True:
            kind, payload = await inbox.get()
            if kind == "stop":
                return
            try:
                if kind == "prepare":
                    share = payload
                    await load.prepare(share)
                    conn.send(("ready", None))
                elif kind == "go" and share is not None:
                    t0 = time.perf_counter() + (payload - time.time())  # the shared instant on this clock
                    conn.send(("done", await load.run(share, t0)))
                else:
                    conn.send(("error", f"unexpected message {kind!r} (share: {share is not None})"))
            except ConnectError as e:
                conn.send(("connect_error", str(e)))
            except Exception:  # noqa: BLE001  (reported to the benchmark, which raises it)
                conn.send(("error", traceback.format_exc()))
    finally:
        await load.close()

