"""A front-end worker process: HTTP/3 on its share of the daemon's UDP port (and HTTP/1.1 + HTTP/2
on its share of the same TCP port), and all per-request work.

Each worker runs uvloop + aioquic on a UDP socket that the supervisor bound with SO_REUSEPORT (the
kernel keeps a connection's packets on one socket, hence one worker) and does, for the requests of
its connections: QUIC/TLS, HTTP/3, auth, parsing and validation, chat template and tokenization,
result-cache lookups (the SQLite file is shared in WAL mode), detokenization, stop strings and
SSE/JSON/msgpack framing. The engine is the core process, reached through `RemoteEngineClient`.

The control pipe from the supervisor brings config reloads and "drain"; the worker answers
"ready" once it serves and the core's first health report has reached it, and a heartbeat twice a
second while its event loop runs.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sqlite3
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from edged.config import Config, auto_workers, is_loopback
from edged.log import fields, setup_logging
from edged.metrics import EdgedMetrics, EngineSnapshot
from edged.processes import process_table
from edged.server.settings import ApiKeyPolicy, ServerSettings

log = logging.getLogger("edged.worker")

HEARTBEAT_S = 0.5
ENGINE_STALE_S = 5.0  # no engine stats from the core for this long: not ready


def server_settings(config: Config, worker: str | None = None) -> ServerSettings:
    """The front end's settings from the config (resolved once per config, here)."""
    keys = None
    if config.auth.enabled:
        keys = {k.sha256: ApiKeyPolicy(k.name, k.tier, k.rate_limit_rps, k.burst) for k in config.auth.keys}
    return ServerSettings(
        max_body_bytes=config.server.max_body_bytes,
        default_max_tokens=config.limits.max_tokens_default,
        max_tokens_limit=config.limits.max_tokens_limit,
        max_prompt_tokens=config.limits.max_prompt_tokens,
        tiers=tuple(config.tiers),
        default_tier=config.scheduler.default_tier,
        tier_max_tokens={n: t.max_tokens for n, t in config.tiers.items() if t.max_tokens},
        api_keys=keys,
        request_timeout_s=config.server.request_timeout_s,
        max_concurrent_streams=config.server.max_concurrent_streams,
        access_log=config.logging.access_log,
        allow_special_tokens_in_prompt=config.limits.allow_special_tokens_in_prompt,
        worker=worker,
        idle_timeout_s=config.server.quic.idle_timeout_s,
        zero_rtt=config.server.zero_rtt,
        quic_max_connections=config.server.quic.max_connections,
        quic_max_connections_per_address=config.server.quic.max_connections_per_address,
        quic_retry_above_per_s=config.server.quic.retry_above_handshakes_per_s,
        quic_retry_above_unvalidated_per_address=config.server.quic.retry_above_unvalidated_per_address,
        quic_handshake_timeout_s=config.server.quic.handshake_timeout_s,
        quic_congestion_control=config.server.quic.congestion_control,
        quic_duplicate_datagram_bytes=config.server.quic.duplicate_datagram_bytes,
        quic_duplicate_delay_s=config.server.quic.duplicate_delay_ms / 1000.0,
        quic_duplicate_after_loss_s=config.server.quic.duplicate_after_loss_s,
    )


def cid_route(config: Config, worker: str) -> Any:
    """Worker "wI" of N: the connection IDs it issues route to socket I of the group (quic_routing.py)."""
    from edged.server.quic_routing import CidRoute

    index = int(worker[1:]) if worker[:1] == "w" and worker[1:].isdigit() else 0
    count = auto_workers(config.server.workers)
    return CidRoute(index, count) if index < count else CidRoute()


class Worker:
    def __init__(self, name: str, config: Config, engine: Any, run_dir: str | None = None,
                 control: Connection | None = None, sampling_defaults: dict[str, float | int] | None = None) -> None:
        self.name = name
        self.config = config
        self.engine = engine  # an EngineClient
        self.sampling_defaults = sampling_defaults  # the core's ModelInfo.sampling_defaults
        self.run_dir = run_dir
        self.control = control
        self.metrics = EdgedMetrics()
        self.server = None
        self.result_cache = None
        self.tickets = None  # QUIC session tickets (quic_tickets.TicketStore), shared through the state dir
        self._drain = asyncio.Event()
        self._drain_timeout: float | None = None  # from the supervisor's "drain"; None: the config's

    # ---- health

    def engine_alive(self) -> bool:
        """The core reports twice a second, with whether its engine loop makes progress."""
        stats_at = getattr(self.engine, "engine_stats_at", None)
        return stats_at is not None and time.monotonic() - stats_at < ENGINE_STALE_S and \
            bool(getattr(self.engine, "engine_alive", False))

    async def _first_engine_stats(self) -> None:
        """Ask the core until its health has reached this worker: otherwise "ready" could come before
        the core's first heartbeat, and /healthz would answer 503 "unhealthy" in between."""
        deadline = time.monotonic() + ENGINE_STALE_S
        while not self.engine_alive() and time.monotonic() < deadline:
            await self.engine.fresh_stats(timeout=HEARTBEAT_S)
        if not self.engine_alive():
            log.warning("engine not alive at start %s", fields(worker=self.name))

    # ---- run

    async def run(self, sock: socket.socket, certfile: str, keyfile: str,
                  tcp_sock: socket.socket | None = None) -> int:
        """Serve HTTP/3 on `sock` and, given `tcp_sock` (server.tcp), HTTP/1.1 + HTTP/2 on it, until drained."""
        from edged.server.h3_server import serve
        from edged.server.routes import Router

        cfg = self.config
        self.engine.start()
        self.engine.warm_up()
        await self._first_engine_stats()
        await self._open_result_cache()
        router = Router(self.engine, server_settings(cfg, self.name),
                        sampling_defaults=self.sampling_defaults)
        self.tickets = await asyncio.to_thread(self._open_tickets)
        self.server = await serve(router, cfg.server.host, cfg.server.port, certfile, keyfile, sock=sock,
                                  tcp_sock=tcp_sock, route=cid_route(cfg, self.name), tickets=self.tickets)
        self.mount(router)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._drain.set)  # systemd's KillMode=mixed sends it only to the supervisor
        if self.control is not None:
            # A thread that blocks on the pipe: uvloop's add_reader proved unreliable for these fds.
            threading.Thread(target=self._read_control, args=(loop,), name="control", daemon=True).start()
            self.control.send(("ready",))
        log.info("worker ready %s", fields(worker=self.name, pid=os.getpid()))
        beat = asyncio.create_task(self._heartbeat())
        await self._drain.wait()
        timeout = self.config.server.drain_timeout_s if self._drain_timeout is None else self._drain_timeout
        log.info("draining %s", fields(worker=self.name, drain_timeout_s=timeout))
        await self.server.shutdown(timeout)
        beat.cancel()
        if self.result_cache is not None:
            await asyncio.to_thread(self.result_cache.close)  # flushes queued writes
        self.engine.close()
        log.info("worker stopped %s", fields(worker=self.name))
        return 0

    async def _open_result_cache(self) -> None:
        from edged.cache.result_cache import ResultCache, db_path
        from edged.cache.result_front import ResultCacheFront

        c = self.config.cache
        Path(self.config.server.state_dir).mkdir(parents=True, exist_ok=True)
        self.result_cache = await asyncio.to_thread(ResultCache.open, db_path(self.config.server.state_dir),
                                                    c.max_bytes, c.ttl_s, c.enabled)
        self.cache_front = ResultCacheFront(self.result_cache, self.engine.model_id)
        self.cache_front.on_lookup = self.metrics.observe_cache_lookup

    def _open_tickets(self) -> Any:
        from edged.server.quic_tickets import TICKETS_DB, TicketStore

        q = self.config.server.quic
        try:
            return TicketStore(Path(self.config.server.state_dir) / TICKETS_DB, q.ticket_lifetime_s, q.max_tickets)
        except (OSError, sqlite3.Error) as e:  # a read-only state dir: no 0-RTT, still serving
            log.warning("quic session tickets off %s", fields(worker=self.name, error=repr(e)))
            return None

    def mount(self, router: Any) -> None:
        """Health, metrics and the result cache on the router."""
        router.health_check = self.engine_alive
        router.result_cache = getattr(self, "cache_front", None)
        router.observers.append(self.metrics.observe_request)
        router.add("GET", "/metrics", self.metrics_route, public=True)
        router.add("GET", "/readyz", self.readyz_route, public=True)
        src = self.metrics.sources
        src.engine = self._engine_snapshot
        src.result_cache = lambda: self.result_cache
        src.config = lambda: self.config
        if self.run_dir is not None:
            src.processes = lambda: process_table(self.run_dir)
        if self.server is not None:
            self.server.quic_event = self.metrics.observe_quic_event

    def _engine_snapshot(self) -> EngineSnapshot | None:
        stats = getattr(self.engine, "engine_stats", None)
        return EngineSnapshot(**stats) if stats else None

    async def metrics_route(self, req: Any) -> None:
        from edged.server.auth import lookup
        from edged.server.openai_wire import WireError

        auth = self.config.auth
        if auth.metrics_requires_key or (auth.metrics_loopback_only and not is_loopback(req.peer_host)):
            if lookup(req.header("authorization"), {k.sha256: k for k in auth.keys}) is None:
                raise WireError(401 if auth.metrics_requires_key else 403,
                                "/metrics is served to loopback clients or with an API key.", code="forbidden")
        if (fresh := getattr(self.engine, "fresh_stats", None)) is not None:
            await fresh()  # the engine's counters as of this scrape, not up to half a second old
        req.respond(200, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")

    async def readyz_route(self, req: Any) -> None:
        ready = self.engine_alive() and not self.server.router.draining
        req.respond_json(200 if ready else 503, {"status": "ready" if ready else "not ready"})

    # ---- supervisor

    def _read_control(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                message = self.control.recv()
            except (EOFError, OSError):  # the supervisor is gone: stop at once
                loop.call_soon_threadsafe(self._supervisor_gone)
                return
            loop.call_soon_threadsafe(self._control_message, message)

    def _supervisor_gone(self) -> None:
        log.error("supervisor gone %s", fields(worker=self.name))
        self._drain_timeout = 0.0
        self._drain.set()

    def _control_message(self, message: tuple) -> None:
        kind, *args = message
        if kind == "config":
            asyncio.ensure_future(self._apply_and_ack(args[0]))
        elif kind == "drain":
            self._drain_timeout = args[0] if args else None
            self._drain.set()

    async def _apply_and_ack(self, new: Config) -> None:
        await self.apply_config(new)
        self.control.send(("applied",))

    async def apply_config(self, new: Config) -> None:
        self.config = new
        setup_logging(new.logging.level)
        if self.result_cache is not None:
            c = new.cache  # off the loop: it may open, expire and evict in the file
            await asyncio.to_thread(self.result_cache.reconfigure, c.max_bytes, c.ttl_s, c.enabled)
        if self.server is not None:
            self.server.settings = server_settings(new, self.name)
        if self.tickets is not None:
            self.tickets.lifetime_s, self.tickets.max_tickets = new.server.quic.ticket_lifetime_s, new.server.quic.max_tickets
        log.debug("config applied %s", fields(worker=self.name))

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if self.control is not None:
                try:
                    self.control.send(("beat",))
                except OSError:
                    return


def run_worker(name: str, config: Config, info: Any, run_dir: str, sock: socket.socket,
               tcp_sock: socket.socket | None, certfile: str, keyfile: str, control: Connection) -> None:
    """Entry point of a front-end worker process (multiprocessing "spawn")."""
    from edged.engine.remote_client import RemoteEngineClient
    from edged.processes import child_setup, register_process

    child_setup(name, config.logging.level)
    register_process(run_dir, name)

    async def main() -> int:
        worker = Worker(name, config, RemoteEngineClient(info, run_dir, name), run_dir, control,
                        sampling_defaults=getattr(info, "sampling_defaults", None))
        return await worker.run(sock, certfile, keyfile, tcp_sock)

    try:
        import uvloop
        code = uvloop.run(main())
    except ImportError:
        code = asyncio.run(main())
    raise SystemExit(code)
