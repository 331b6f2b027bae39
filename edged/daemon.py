"""Wiring: config -> model -> engine thread -> HTTP/3 server; signals, live reload, systemd notify."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

from edged.config import Config, ConfigError, apply_overrides, is_loopback, load_config, reload_config, warnings
from edged.engine.async_engine import AsyncEngine
from edged.engine.request import GenerationRequest, SamplingParams
from edged.engine.setup import EngineSettings, build_engine
from edged.log import fields, setup_logging
from edged.metrics import EdgedMetrics
from edged.systemd import Notifier, Watchdog

log = logging.getLogger("edged.daemon")

ENGINE_STALL_S = 20.0  # no engine-loop iteration for this long: withhold watchdog pings
CONFIG_POLL_S = 2.0  # how often the config file's mtime is checked for edits


def server_settings(config: Config):
    from edged.server.h3_server import ApiKeyPolicy, ServerSettings

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
    )


def gpu_memory() -> dict[str, int]:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


class Daemon:
    def __init__(self, config: Config, config_path: str | None, overrides: dict[str, str | None]) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = overrides
        self.notifier = Notifier()
        self.engine: AsyncEngine | None = None
        self.server = None
        self.result_cache = None
        self.metrics = EdgedMetrics()
        self.topology_cap: int | None = None
        self.pinned_cpus: list[int] = []
        self.transfer_budget: int | None = None
        self._stop = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._config_seen = self._fingerprint()

    def _fingerprint(self) -> tuple[int, int, int] | None:
        """What the watcher compares: the file's mtime, size and inode (None: no file)."""
        try:
            st = os.stat(self.config_path) if self.config_path else None
        except OSError:
            return None
        return None if st is None else (st.st_mtime_ns, st.st_size, st.st_ino)

    def _pin_engine_thread(self) -> None:
        if self.pinned_cpus:
            from edged.scheduler.topology import pin_engine_thread
            pin_engine_thread(self.pinned_cpus)

    def engine_alive(self) -> bool:
        e = self.engine
        return e is not None and e.engine.is_alive() and \
            time.monotonic() - e.engine.counters.last_progress < ENGINE_STALL_S

    async def warm_up(self, engine: AsyncEngine) -> None:
        """One real step through every layer before READY, so the first client does not pay for it."""
        ids = engine.encode("Hello")
        request = GenerationRequest("warmup", ids, SamplingParams(temperature=0.0, max_tokens=2))
        async for _ in engine.generate(request):
            pass

    async def run(self) -> int:
        from edged.models.loader import load_model, with_overrides
        from edged.server.h3_server import serve
        from edged.server.tls import ensure_cert

        cfg = self.config
        for w in warnings(cfg):
            log.warning("%s", w)
        self.notifier.status("loading model")
        start = time.monotonic()
        loaded = await asyncio.to_thread(load_model, cfg.model.path)
        loaded = with_overrides(loaded, cfg.model.served_name, cfg.model.tokenizer, cfg.model.chat_template)
        settings = EngineSettings.from_config(cfg.model, cfg.cache.prefix_cache, cfg.cache.host_spill_bytes,
                                              cfg.scheduler.transfer_budget_bytes)
        self.engine = engine = await asyncio.to_thread(build_engine, loaded, settings)
        self._topology(cfg)
        self._scheduler_config(cfg)
        engine.start(self._pin_engine_thread)
        self.notifier.status("warming up")
        await self.warm_up(engine)
        Path(cfg.server.state_dir).mkdir(parents=True, exist_ok=True)
        certfile, keyfile = ensure_cert(cfg.server.state_dir, cfg.server.certfile, cfg.server.keyfile)
        await self._open_result_cache(engine.model_id)
        self.server = await serve(engine, cfg.server.host, cfg.server.port, certfile, keyfile, server_settings(cfg))
        self._mount(self.server.router)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self._reload_once("SIGHUP")))
        tasks = [asyncio.create_task(Watchdog(self.notifier, self.engine_alive).run()),
                 asyncio.create_task(self._watch_config())]
        status = f"serving {engine.model_id} on {cfg.server.listen} (h3)"
        self.notifier.ready(status)
        log.info("ready %s", fields(model=engine.model_id, listen=cfg.server.listen,
                                    startup_s=round(time.monotonic() - start, 1), pid=os.getpid()))
        await self._stop.wait()
        self.notifier.stopping()
        log.info("stopping %s", fields(drain_timeout_s=cfg.server.drain_timeout_s))
        await self.server.shutdown(self.config.server.drain_timeout_s)
        for t in tasks:
            t.cancel()
        engine.engine.stop()
        if self.result_cache is not None:
            await asyncio.to_thread(self.result_cache.close)  # flushes queued writes
        log.info("stopped")
        return 0

    async def _open_result_cache(self, model_id: str) -> None:
        from edged.cache.result_cache import ResultCache, db_path
        from edged.cache.result_front import ResultCacheFront

        c = self.config.cache
        self.result_cache = await asyncio.to_thread(ResultCache.open, db_path(self.config.server.state_dir),
                                                    c.max_bytes, c.ttl_s, c.enabled)
        self.cache_front = ResultCacheFront(self.result_cache, model_id)

    def _mount(self, router) -> None:
        """Health, metrics and the result cache on the server's router."""
        router.health_check = self.engine_alive
        router.admission = self.engine.engine.batcher.admission()
        router.result_cache = self.cache_front
        router.observers.append(self._observe)
        router.add("GET", "/metrics", self._metrics_route, public=True)
        router.add("GET", "/readyz", self._readyz_route, public=True)
        src = self.metrics.sources
        src.engine = lambda: self.engine.engine if self.engine else None
        src.result_cache = lambda: self.result_cache
        src.gpu_memory = gpu_memory
        src.config = lambda: self.config
        src.tier_snapshot = self.engine.engine.batcher.snapshot

    def _observe(self, rec) -> None:
        m, tier = self.metrics, rec.tier or "none"
        m.requests.labels(tier, rec.outcome).inc()
        if rec.ttft_s is not None:
            m.ttft.labels(tier).observe(rec.ttft_s)
            if rec.completion_tokens > 1:
                m.itl.labels(tier).observe((rec.duration_s - rec.ttft_s) / (rec.completion_tokens - 1))
        if rec.status is not None and rec.status < 400:
            m.e2e.labels(tier).observe(rec.duration_s)

    async def _metrics_route(self, req) -> None:
        from edged.server.auth import lookup
        from edged.server.openai_wire import WireError

        auth = self.config.auth
        if auth.metrics_requires_key or (auth.metrics_loopback_only and not is_loopback(req.peer_host)):
            if lookup(req.header("authorization"), {k.sha256: k for k in auth.keys}) is None:
                raise WireError(401 if auth.metrics_requires_key else 403,
                                "/metrics is served to loopback clients or with an API key.", code="forbidden")
        req.respond(200, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")

    async def _readyz_route(self, req) -> None:
        ready = self.engine_alive() and not self.server.router.draining
        req.respond_json(200 if ready else 503, {"status": "ready" if ready else "not ready"})

    async def _watch_config(self) -> None:
        while True:
            await asyncio.sleep(CONFIG_POLL_S)
            if not self._reload_lock.locked() and self._fingerprint() != self._config_seen:
                await self._reload_once("file changed")

    async def _reload_once(self, reason: str) -> None:
        """One reload at a time; noting the file's fingerprint first keeps the watcher from parsing
        a change that a SIGHUP already read."""
        async with self._reload_lock:
            self._config_seen = self._fingerprint()
            await self.reload(reason)

    async def reload(self, reason: str) -> None:
        """Re-read the config; apply what may change live; keep the old config if the new one is invalid."""
        self.notifier.reloading()
        log.info("reloading config %s", fields(reason=reason, path=self.config_path))
        try:
            # Off the loop: reading and parsing a file (at most 1 MiB) must not stall requests.
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
        if self.result_cache is not None:
            c = new.cache
            await asyncio.to_thread(self.result_cache.reconfigure, c.max_bytes, c.ttl_s, c.enabled)
        if self.server is not None:
            self.server.settings = server_settings(new)
        if self.engine is not None:
            self.engine.engine.call(lambda: self._scheduler_config(new))
        self.notifier.ready(f"serving {self.engine.model_id if self.engine else '?'} on {new.server.listen} (h3)")

    def batch_limits(self, config: Config):
        """The engine's per-step limits: the batch cap never exceeds what the PCIe topology allows
        unless the config overrides it, nor model.max_num_seqs (the CUDA graphs' largest batch)."""
        from edged.scheduler.batcher import BatchLimits

        cap = config.scheduler.batch_cap or self.topology_cap or config.model.max_num_seqs
        return BatchLimits(min(cap, config.model.max_num_seqs),
                           config.scheduler.step_token_budget or config.model.max_batch_tokens)

    def _scheduler_config(self, config: Config) -> None:
        """Tiers, default tier, limits and preemption into the batcher (engine thread or before start)."""
        self.engine.engine.batcher.reconfigure(config.tiers, config.scheduler.default_tier,
                                               self.batch_limits(config), preemption=config.scheduler.preemption)
        self.engine.engine.blocks.transfer_budget_bytes = config.scheduler.transfer_budget_bytes or self.transfer_budget

    def _topology(self, config: Config) -> None:
        """On a GPU node: batch cap and per-step PCIe budget from the topology; the engine thread
        pinned to the GPU's local CPUs."""
        import torch

        self.topology_cap = None
        self.pinned_cpus: list[int] = []
        if self.engine is None or self.engine.engine.runner.device.type != "cuda":
            return
        from edged.scheduler.topology import plan

        topo, limits = plan(device_index=torch.cuda.current_device(), batch_cap_override=config.scheduler.batch_cap)
        self.topology_cap = limits.batch_cap
        self.transfer_budget = limits.step_transfer_budget_bytes
        if config.scheduler.pin_threads:
            self.pinned_cpus = limits.pinned_cpus
        log.info("topology %s", fields(bus=topo.bus_id, hops=topo.hops, gen=topo.link_gen, width=topo.link_width,
                                       batch_cap=limits.batch_cap, step_budget_mb=limits.step_transfer_budget_bytes >> 20,
                                       cpus=len(self.pinned_cpus)))


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
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(Daemon(config, args.config, overrides).run())
    except (OSError, ValueError, RuntimeError) as e:
        log.error("cannot start: %s", e)
        return 1


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
