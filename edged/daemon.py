"""The supervisor: starts the engine core and the front-end workers, and is what systemd sees.

    supervisor (this process: signals, live reload, sd_notify, restarts)
      |-- engine core  (edged/engine/core.py: the device, the batcher, the step loop)
      |-- worker w0 .. wN-1  (edged/server/worker.py: HTTP/3 on a shared UDP port, tokenization, streaming)

The supervisor binds the UDP sockets itself, one per worker, all in one SO_REUSEPORT group, and
keeps them: a worker that dies is restarted on the same socket, so the kernel's assignment of
every other connection to its worker never changes. Each child has a control pipe to the
supervisor (config, drain, stop; ready, heartbeats); core and workers talk over ZeroMQ
(edged/engine/ipc.py).

READY goes to systemd once the core and every worker are up; WATCHDOG pings only while all of them
send heartbeats (the core only while its engine loop makes progress). A worker that dies is
restarted and only its connections are lost; if the core dies the daemon stops its workers and
exits non-zero, so that systemd restarts it (Restart=on-failure).
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from edged.config import Config, ConfigError, apply_overrides, auto_workers, load_config, reload_config, warnings
from edged.log import fields, setup_logging
from edged.systemd import Notifier, Watchdog

log = logging.getLogger("edged.daemon")

CONFIG_POLL_IDLE_S = 1.0  # with server.config_poll_s 0, how often to look whether it was turned back on
STALL_S = 20.0  # a child without a heartbeat for this long: withhold watchdog pings
RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)  # between restarts of a worker that keeps dying
CORE_STOP_S = 15.0
APPLY_TIMEOUT_S = 10.0  # a reload waits this long for every process to apply it before READY


@dataclass
class Child:
    """One child process and its control pipe, as the supervisor sees it."""

    name: str
    process: Any  # multiprocessing.Process
    conn: Connection
    ready: asyncio.Future
    last_beat: float = field(default_factory=time.monotonic)
    restarts: int = 0
    applied: asyncio.Future | None = None  # the config generation being applied; set when it acks

    def send(self, *message: Any) -> None:
        try:
            self.conn.send(message)
        except (OSError, ValueError) as e:  # it is exiting; the sentinel will say so
            log.debug("control send failed %s", fields(process=self.name, error=repr(e)))


def bind_group(host: str, port: int, count: int, kind: socket.SocketKind, backlog: int = 1024) -> list[socket.socket]:
    """`count` sockets on one address in one SO_REUSEPORT group, one per worker (the kernel spreads
    connections over them); port 0: the first one picks it. TCP sockets are listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks: list[socket.socket] = []
    try:
        if port:
            _check_port_free(family, kind, host, port)
        for _ in range(count):
            s = socket.socket(family, kind)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if kind == socket.SOCK_STREAM:  # so that the next start's probe passes this one's TIME_WAIT connections
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind((host, port))
            port = s.getsockname()[1]
            if kind == socket.SOCK_STREAM:
                s.listen(backlog)
            s.setblocking(False)
    except OSError as e:
        for s in socks:
            s.close()
        proto = "tcp" if kind == socket.SOCK_STREAM else "udp"
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        raise OSError(f"cannot listen on {proto} {where}: {e.strerror or e}") from None
    return socks


def _check_port_free(family: socket.AddressFamily, kind: socket.SocketKind, host: str, port: int) -> None:
    """EADDRINUSE while any other socket holds host:port, another edged's SO_REUSEPORT group included (which
    the group's own binds would join, and the kernel would share connections between two daemons)."""
    with socket.socket(family, kind) as probe:  # no SO_REUSEPORT: any holder conflicts
        if kind == socket.SOCK_STREAM:  # a restart's TIME_WAIT connections do not; a listener does
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(e.errno, "address already in use (by another edged, or another program)") from None
            raise


def bind_udp(host: str, port: int, count: int) -> list[socket.socket]:
    return bind_group(host, port, count, socket.SOCK_DGRAM)


def bind_tcp(host: str, port: int, count: int) -> list[socket.socket]:
    """Beside the UDP sockets on the same port number: HTTP/1.1 and HTTP/2 next to HTTP/3."""
    return bind_group(host, port, count, socket.SOCK_STREAM)


class Daemon:
    def __init__(self, config: Config, config_path: str | None, overrides: dict[str, str | None],
                 run_dir: str) -> None:
        from edged.metrics import EdgedMetrics

        self.config = config
        self.config_path = config_path
        self.overrides = overrides
        self.run_dir = run_dir
        self.notifier = Notifier()
        self.metrics = EdgedMetrics()
        self.ctx = mp.get_context("spawn")
        self.core: Child | None = None
        self.workers: dict[str, Child] = {}
        self.sockets: dict[str, socket.socket] = {}
        self.tcp_sockets: dict[str, socket.socket] = {}  # empty when server.tcp is off
        self.info: Any = None  # the core's ModelInfo
        self.certfile = self.keyfile = ""
        self.exit_code = 0
        self._stop = asyncio.Event()
        self._stopping = False
        self._reload_lock = asyncio.Lock()
        self._config_seen = self._fingerprint()

    def _fingerprint(self) -> tuple[int, int, int] | None:
        """What the watcher compares: the file's mtime, size and inode (None: no file)."""
        try:
            st = os.stat(self.config_path) if self.config_path else None
        except OSError:
            return None
        return None if st is None else (st.st_mtime_ns, st.st_size, st.st_ino)

    def children(self) -> list[Child]:
        return ([self.core] if self.core else []) + list(self.workers.values())

    def all_alive(self) -> bool:
        """Every child sent a heartbeat lately (the core only sends them while its engine progresses)."""
        now = time.monotonic()
        return all(c.process.is_alive() and now - c.last_beat < STALL_S for c in self.children())

    # ---- children

    def _start_child(self, name: str, target: Any, args: tuple) -> Child:
        loop = asyncio.get_running_loop()
        parent, child_end = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(target=target, args=(*args, child_end), name=f"edged-{name}", daemon=False)
        proc.start()
        child_end.close()
        ready = loop.create_future()
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # a start failure is logged, not "never retrieved"
        child = Child(name, proc, parent, ready)
        loop.add_reader(parent.fileno(), self._on_message, child)
        loop.add_reader(proc.sentinel, self._on_exit, child)
        return child

    def _on_message(self, child: Child) -> None:
        try:
            kind, *args = child.conn.recv()
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(child.conn.fileno())
            return
        if kind == "beat":
            child.last_beat = time.monotonic()
        elif kind == "ready" and not child.ready.done():
            child.last_beat = time.monotonic()
            child.ready.set_result(args[0] if args else None)
        elif kind == "failed" and not child.ready.done():
            child.ready.set_exception(RuntimeError(args[0]))
        elif kind == "applied" and child.applied is not None and not child.applied.done():
            child.applied.set_result(args[0] if args else None)

    def _forget(self, child: Child) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(child.process.sentinel)
        try:
            loop.remove_reader(child.conn.fileno())
        except (OSError, ValueError):
            pass
        child.conn.close()

    def _on_exit(self, child: Child) -> None:
        from edged.metrics import mark_process_dead

        self._forget(child)
        child.process.join(0)
        code = child.process.exitcode
        mark_process_dead(child.process.pid)
        if not child.ready.done():
            child.ready.set_exception(RuntimeError(f"{child.name} exited with status {code} while starting"))
        if self._stopping:
            return
        if child is self.core:
            log.error("engine core exited, stopping the daemon %s", fields(exitcode=code, pid=child.process.pid))
            self.exit_code = 1
            self._stop.set()
            return
        log.error("worker exited, restarting it %s", fields(worker=child.name, exitcode=code, pid=child.process.pid))
        self.metrics.worker_restarts.inc()
        if self.core is not None:
            self.core.send("worker_gone", child.name)  # its sequences end, their KV blocks free
        asyncio.ensure_future(self._restart_worker(child))

    async def _restart_worker(self, old: Child) -> None:
        await asyncio.sleep(RESTART_BACKOFF_S[min(old.restarts, len(RESTART_BACKOFF_S) - 1)])
        if self._stopping:
            return
        child = self._start_worker(old.name)
        child.restarts = old.restarts + 1
        try:
            await asyncio.wait_for(asyncio.shield(child.ready), 120)
            log.info("worker restarted %s", fields(worker=child.name, pid=child.process.pid))
        except Exception as e:
            log.error("worker restart failed %s", fields(worker=child.name, error=repr(e)))

    def _start_worker(self, name: str) -> Child:
        from edged.server.worker import run_worker

        child = self._start_child(name, run_worker, (name, self.config, self.info, self.run_dir, self.sockets[name],
                                                     self.tcp_sockets.get(name), self.certfile, self.keyfile))
        self.workers[name] = child
        return child

    # ---- run

    async def run(self) -> int:
        from edged.engine.core import run_engine_core
        from edged.processes import register_process
        from edged.server.tls import ensure_cert

        cfg = self.config
        for w in warnings(cfg):
            log.warning("%s", w)
        start = time.monotonic()
        register_process(self.run_dir, "supervisor")
        names = [f"w{i}" for i in range(auto_workers(cfg.server.workers))]
        self.sockets = dict(zip(names, bind_udp(cfg.server.host, cfg.server.port, len(names))))
        if len(names) > 1:
            self._route_by_connection_id(self.sockets[names[0]], len(names))
        if cfg.server.tcp:
            try:
                udp_port = self.sockets[names[0]].getsockname()[1]
                self.tcp_sockets = dict(zip(names, bind_tcp(cfg.server.host, udp_port, len(names))))
            except OSError:
                for s in self.sockets.values():
                    s.close()
                raise
        os.makedirs(cfg.server.state_dir, exist_ok=True)
        self.certfile, self.keyfile = ensure_cert(cfg.server.state_dir, cfg.server.certfile, cfg.server.keyfile)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        try:
            self.notifier.status("loading model")
            self.core = self._start_child("core", run_engine_core, (cfg, self.run_dir, names))
            self.info = await self._until_ready([self.core])
            self.notifier.status(f"starting {len(names)} workers")
            for name in names:
                self._start_worker(name)
            await self._until_ready(list(self.workers.values()))
        except _Stopped:
            return await self._shutdown(code=1 if self.exit_code else 0)
        except RuntimeError as e:
            log.error("cannot start: %s", e)
            return await self._shutdown(code=1)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self._reload_once("SIGHUP")))
        tasks = [asyncio.create_task(Watchdog(self.notifier, self.all_alive).run()),
                 asyncio.create_task(self._watch_config())]
        port = self.sockets[names[0]].getsockname()[1]
        self.notifier.ready(self._status())
        log.info("ready %s", fields(model=self.info.model_id, listen=cfg.server.listen, port=port, workers=len(names),
                                    device=self.info.device, startup_s=round(time.monotonic() - start, 1),
                                    pid=os.getpid()))
        await self._stop.wait()
        for t in tasks:
            t.cancel()
        return await self._shutdown(code=self.exit_code)

    @staticmethod
    def _route_by_connection_id(sock: socket.socket, count: int) -> None:
        """QUIC packets go to the worker that issued their connection ID, whatever the client's
        address (migration); see edged/server/quic_routing.py."""
        from edged.server.quic_routing import attach_cid_routing

        try:
            attach_cid_routing(sock, count)
            log.info("quic connection-id routing on %s", fields(workers=count))
        except OSError as e:  # the kernel's 4-tuple hash: a migrating client may reach the wrong worker
            log.warning("quic connection-id routing unavailable %s", fields(error=repr(e)))

    async def _until_ready(self, children: list[Child]) -> Any:
        """The first child's ready payload once all are ready; _Stopped on SIGTERM or a child's death."""
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            pending = {asyncio.ensure_future(asyncio.shield(c.ready)) for c in children}
            while pending:
                done, pending = await asyncio.wait(pending | {stop}, return_when=asyncio.FIRST_COMPLETED)
                if stop in done:
                    raise _Stopped
                pending.discard(stop)
                for d in done:
                    d.result()  # raises if the child failed
            return children[0].ready.result()
        finally:
            stop.cancel()

    def _status(self) -> str:
        protocols = "h3 + h2/http1.1" if self.config.server.tcp else "h3"
        return (f"serving {self.info.model_id if self.info else '?'} on {self.config.server.listen} ({protocols}), "
                f"{len(self.workers)} workers")

    async def _shutdown(self, code: int) -> int:
        """Workers drain (in-flight streams finish up to drain_timeout_s; at once when the core is
        gone, since nothing more will come), then the core stops."""
        self._stopping = True
        self.notifier.stopping()
        core_alive = self.core is not None and self.core.process.is_alive()
        timeout = self.config.server.drain_timeout_s if core_alive else 0.0
        log.info("stopping %s", fields(drain_timeout_s=timeout, workers=len(self.workers), exit_code=code))
        workers = [c for c in self.workers.values() if c.process.is_alive()]
        for c in workers:
            c.send("drain", timeout)
        await self._join(workers, timeout + 10.0)
        if self.core is not None and self.core.process.is_alive():
            self.core.send("stop")
            await self._join([self.core], CORE_STOP_S)
        for s in [*self.sockets.values(), *self.tcp_sockets.values()]:
            s.close()
        log.info("stopped")
        return code

    async def _join(self, children: list[Child], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for c in children:
            while c.process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if c.process.is_alive():
                log.warning("child did not stop in time, killing it %s", fields(process=c.name))
                c.process.kill()
            c.process.join(1.0)

    # ---- live reload

    async def _watch_config(self) -> None:
        while True:
            poll_s = self.config.server.config_poll_s  # live: each pause reads the current config
            await asyncio.sleep(poll_s or CONFIG_POLL_IDLE_S)
            if poll_s and not self._reload_lock.locked() and self._fingerprint() != self._config_seen:
                await self._reload_once("file changed")

    async def _reload_once(self, reason: str) -> None:
        """One reload at a time; noting the file's fingerprint first keeps the watcher from parsing
        a change that a SIGHUP already read."""
        async with self._reload_lock:
            self._config_seen = self._fingerprint()
            await self.reload(reason)

    async def reload(self, reason: str) -> None:
        """Re-read the config; an invalid file changes nothing anywhere; a valid one goes to every process."""
        self.notifier.reloading()
        log.info("reloading config %s", fields(reason=reason, path=self.config_path))
        try:
            # Off the loop: reading and parsing a file (at most 1 MiB) must not stall the supervisor.
            new, diff = await asyncio.to_thread(reload_config, self.config, self.config_path, self.overrides)
        except ConfigError as e:
            self.metrics.reloads.labels("rejected").inc()
            # READY ends systemd's reload state; STATUS says it was not applied, and why.
            problems = e.messages()
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            self.notifier.ready(f"config reload rejected: {problems[0] if problems else 'invalid'}{more}; "
                                f"still serving on the previous config")
            return
        self.config = new
        self.metrics.reloads.labels("applied").inc()
        setup_logging(new.logging.level)
        # READY once every process applied it: a request after `systemctl reload` returns sees the new config.
        loop = asyncio.get_running_loop()
        children = self.children()
        for child in children:
            child.applied = loop.create_future()
            child.send("config", new)
        waits = [c.applied for c in children if c.applied is not None]
        done, pending = await asyncio.wait(waits, timeout=APPLY_TIMEOUT_S) if waits else (set(), set())
        if pending:
            log.warning("config not yet applied everywhere %s", fields(
                processes=",".join(c.name for c in children if c.applied in pending), timeout_s=APPLY_TIMEOUT_S))
        log.info("config applied %s", fields(processes=len(done), reason=reason))
        self.notifier.ready(self._status())


class _Stopped(Exception):
    """SIGTERM (or a dead core) while starting."""


def make_run_dir() -> str:
    """A private directory for the core's sockets, the metrics files and the process table:
    under $RUNTIME_DIRECTORY (systemd's RuntimeDirectory=edged) when set, else the temp dir."""
    base = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or None
    return tempfile.mkdtemp(prefix="edged-", dir=base)


def _overrides(args: argparse.Namespace) -> dict[str, str | None]:
    return {"listen": args.listen, "state_dir": args.state_dir, "model": args.model, "log_level": args.log_level}


def run_serve_command(args: argparse.Namespace) -> int:
    setup_logging(args.log_level or "info")
    overrides = _overrides(args)
    try:
        config = apply_overrides(load_config(args.config, missing_ok=False) if args.config else load_config(None),
                                 **overrides)
    except ConfigError as e:
        if e.errors == [("", "file not found")]:
            log.error("cannot start: config file %s not found (from --config)", e.source)
            return 2
        for m in e.messages():
            log.error("invalid config %s", fields(source=e.source, problem=m))
        return 2
    setup_logging(config.logging.level)
    from edged.metrics import use_multiprocess_dir

    run_dir = make_run_dir()
    use_multiprocess_dir(os.path.join(run_dir, "metrics"))  # before any metric exists, here or in a child
    try:
        # asyncio, not uvloop: the supervisor only waits on its children (uvloop's add_reader missed
        # the control pipes' data now and then, under load), the workers carry the traffic.
        return asyncio.run(Daemon(config, args.config, overrides, run_dir).run())
    except (OSError, ValueError, RuntimeError) as e:
        log.error("cannot start: %s", e)
        return 1
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def state_dir_for(config_path: str | None, state_dir: str | None) -> str:
    """The state directory a command should use: the flag, else the config's, else the default."""
    if state_dir:
        return state_dir
    return load_config(config_path).server.state_dir


def resolve_ca_file(ca_file: str | None, insecure: bool, state_dir: str | None) -> str | None:
    """`edged chat` trusts the local daemon's self-signed certificate by default."""
    if ca_file or insecure:
        return ca_file
    from edged.server.tls import default_ca_file

    return default_ca_file(state_dir_for(None, state_dir))


def run_models_command(args: argparse.Namespace) -> int:
    from edged.models.loader import load_model

    config = apply_overrides(load_config(args.config), model=args.model)
    try:
        loaded = load_model(config.model.path)
    except (OSError, ValueError) as e:
        print(f"edged: cannot load the model: {e}", file=sys.stderr)
        return 1
    c = loaded.config
    print(f"{loaded.model_id}  ({loaded.source_path})")
    print(f"  layers {c.num_layers}, hidden {c.hidden_size}, heads {c.num_heads}/{c.num_kv_heads} (q/kv), "
          f"head_dim {c.head_dim}, vocab {c.vocab_size}, context {c.max_position_embeddings}")
    return 0
