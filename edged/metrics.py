"""Prometheus metrics for a daemon of several processes.

- Request-path counters and histograms (requests, TTFT, inter-token latency, latency, result-cache
  lookups, config reloads, worker restarts) are prometheus_client metrics. In the daemon the
  supervisor sets PROMETHEUS_MULTIPROC_DIR before any child starts, so every process writes its
  samples to memory-mapped files there and a scrape on any worker sums them over all processes
  (a restarted worker's counts stay). Without the variable they are an ordinary registry.
- Engine, scheduler and GPU families are read at scrape time from the engine core's latest
  `EngineSnapshot`, which the core sends every worker twice a second.
- Per-process CPU and RSS come from psutil for every process of the daemon, labelled by role.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
disable_created_metrics()  # *_created series: not kept in multiprocess mode, so never shown


def use_multiprocess_dir(path: str) -> None:
    """Make this process and the children it starts write metrics under `path` (before any metric
    is created: prometheus_client picks its value storage when a metric is made)."""
    os.makedirs(path, exist_ok=True)
    os.environ[MULTIPROC_ENV] = path
    values.ValueClass = values.get_value_class()


@dataclass(slots=True)
class EngineSnapshot:
    """What /metrics shows of the engine core, taken on the core and sent to the workers."""

    kv_used: int = 0
    kv_free: int = 0
    batch_size: int = 0
    step_s: float = 0.0
    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    prefix_tokens_reused: int = 0
    host_spilled: int | None = None  # None: no host KV tier
    host_restored: int | None = None
    tiers: dict[str, dict] = field(default_factory=dict)
    gpu_memory: dict[str, int] = field(default_factory=dict)
    yielded_steps: int = 0  # CPU steps abandoned for a more important request (llm_engine.StepYielded)

    @classmethod
    def of(cls, engine: Any, gpu_memory: dict[str, int] | None = None) -> EngineSnapshot:
        c, blocks = engine.counters, engine.blocks
        tier = getattr(blocks, "host_tier", None)
        snap = engine.batcher.snapshot() if getattr(engine, "batcher", None) is not None else {}
        return cls(blocks.num_used, blocks.num_free, c.last_batch_size, c.last_step_s, c.steps, c.decode_tokens,
                   c.prefill_tokens, c.preemptions, blocks.counters.prefix_tokens_reused,
                   tier.counters.spilled if tier else None, tier.counters.restored if tier else None,
                   {k: dict(v) for k, v in snap.items()}, dict(gpu_memory or {}),
                   c.yielded_steps)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _LiveCollector(Collector):
    """Reads the engine snapshot, the config, the result cache and the processes at scrape time."""

    def __init__(self, sources: MetricSources) -> None:
        self.sources = sources
        self._cpu: dict[int, psutil.Process] = {}  # pid -> Process: cpu_percent is since the last scrape

    def collect(self) -> Iterable:
        s = self.sources
        e = s.engine() if s.engine else None
        if e is not None:
            yield from self._engine(e, s)
        cache = s.result_cache() if s.result_cache else None
        if cache is not None:
            yield GaugeMetricFamily("edged_result_cache_bytes", "bytes stored in the result cache",
                                    value=cache.stats().get("bytes", 0))
        config = s.config() if s.config else None
        if config is not None:
            yield from self._config(config)
        yield from self._processes(s.processes() if s.processes else [("edged", os.getpid())])

    @staticmethod
    def _engine(e: EngineSnapshot, s: MetricSources) -> Iterable:
        kv = GaugeMetricFamily("edged_kv_blocks", "KV cache blocks by state", labels=["state"])
        kv.add_metric(["used"], e.kv_used)
        kv.add_metric(["free"], e.kv_free)
        yield kv
        yield GaugeMetricFamily("edged_batch_size", "sequences in the last engine step", value=e.batch_size)
        yield GaugeMetricFamily("edged_step_seconds", "duration of the last engine step", value=e.step_s)
        yield GaugeMetricFamily("edged_tokens_per_second", "generated tokens per second over the last window",
                                value=s.token_rate(e.decode_tokens))
        yield CounterMetricFamily("edged_engine_steps", "engine steps run", value=e.steps)
        yield CounterMetricFamily("edged_generated_tokens", "tokens sampled", value=e.decode_tokens)
        yield CounterMetricFamily("edged_prefill_tokens", "prompt tokens computed", value=e.prefill_tokens)
        yield CounterMetricFamily("edged_preemptions", "sequences preempted", value=e.preemptions)
        yield CounterMetricFamily("edged_yielded_steps", "CPU engine steps abandoned between layers for a "
                                  "request of a more important tier", value=e.yielded_steps)
        yield CounterMetricFamily("edged_prefix_tokens_reused", "prompt tokens served from the prefix cache",
                                  value=e.prefix_tokens_reused)
        if e.host_spilled is not None:
            host = CounterMetricFamily("edged_host_kv_blocks", "KV blocks spilled to / restored from host memory",
                                       labels=["event"])
            host.add_metric(["spilled"], e.host_spilled)
            host.add_metric(["restored"], e.host_restored or 0)
            yield host
        if e.tiers:
            depth = GaugeMetricFamily("edged_queue_depth", "requests waiting per tier", labels=["tier"])
            running = GaugeMetricFamily("edged_running_requests", "sequences in the engine's batch per tier (prompt "
                                        "or generation)", labels=["tier"])
            att = GaugeMetricFamily("edged_sla_attainment", "share of recent requests within their TTFT target",
                                    labels=["tier"])
            window = GaugeMetricFamily("edged_batch_window_seconds", "current adaptive batch window", labels=["tier"])
            tpot_att = GaugeMetricFamily("edged_tpot_attainment",
                                         "share of recent finished requests within their time-per-output-token target",
                                         labels=["tier"])
            tpot = CounterMetricFamily("edged_tpot_requests", "finished requests by TPOT target met or missed",
                                       labels=["tier", "result"])
            pred_n = CounterMetricFamily("edged_ttft_predictions", "admitted requests whose predicted TTFT was "
                                         "compared with the observed one", labels=["tier"])
            pred_abs = CounterMetricFamily("edged_ttft_prediction_abs_error_seconds",
                                           "sum of |observed - predicted| TTFT over those requests", labels=["tier"])
            pred_err = GaugeMetricFamily("edged_ttft_prediction_error_seconds_sum",
                                         "sum of (observed - predicted) TTFT: > 0 when admission was optimistic",
                                         labels=["tier"])
            for tier, snap in e.tiers.items():
                depth.add_metric([tier], snap.get("queue_depth", 0))
                running.add_metric([tier], snap.get("running", 0))
                att.add_metric([tier], snap.get("sla_attainment", 1.0))
                window.add_metric([tier], snap.get("batch_window_ms", 0.0) / 1000.0)
                tpot_att.add_metric([tier], snap.get("tpot_attainment", 1.0))
                tpot.add_metric([tier, "met"], snap.get("tpot_met", 0))
                tpot.add_metric([tier, "missed"], snap.get("tpot_missed", 0))
                pred_n.add_metric([tier], snap.get("ttft_prediction_count", 0))
                pred_abs.add_metric([tier], snap.get("ttft_prediction_abs_error_sum_s", 0.0))
                pred_err.add_metric([tier], snap.get("ttft_prediction_error_sum_s", 0.0))
            yield from (depth, running, att, window, tpot_att, tpot, pred_n, pred_abs, pred_err)
        if e.gpu_memory:
            g = GaugeMetricFamily("edged_gpu_memory_bytes", "GPU memory", labels=["kind"])
            for kind, value in e.gpu_memory.items():
                g.add_metric([kind], value)
            yield g

    @staticmethod
    def _config(config: Any) -> Iterable:
        """The config in effect in the process that answers the scrape (shows that a reload reached it)."""
        target = GaugeMetricFamily("edged_tier_ttft_target_seconds", "configured TTFT target", labels=["tier"])
        queue = GaugeMetricFamily("edged_tier_max_queue", "configured queue bound", labels=["tier"])
        weight = GaugeMetricFamily("edged_tier_weight", "configured weighted-fair-share weight", labels=["tier"])
        tpot = GaugeMetricFamily("edged_tier_tpot_target_seconds", "configured time-per-output-token target",
                                 labels=["tier"])
        for name, tier in config.tiers.items():
            target.add_metric([name], tier.ttft_target_ms / 1000.0)
            queue.add_metric([name], tier.max_queue)
            weight.add_metric([name], tier.weight)
            if tier.tpot_target_ms is not None:
                tpot.add_metric([name], tier.tpot_target_ms / 1000.0)
        yield from (target, queue, weight, tpot)
        yield GaugeMetricFamily("edged_max_tokens_limit", "largest max_tokens accepted",
                                value=config.limits.max_tokens_limit)
        yield GaugeMetricFamily("edged_result_cache_enabled", "1 when the result cache is on",
                                value=int(config.cache.enabled))

    def _processes(self, procs: list[tuple[str, int]]) -> Iterable:
        cpu = GaugeMetricFamily("edged_process_cpu_percent", "CPU use since the previous scrape, % of one core",
                                labels=["process"])
        rss = GaugeMetricFamily("edged_process_rss_bytes", "resident memory", labels=["process"])
        live: dict[int, psutil.Process] = {}
        for name, pid in procs:
            try:
                p = self._cpu.get(pid) or psutil.Process(pid)
                with p.oneshot():
                    cpu.add_metric([name], p.cpu_percent(None))
                    rss.add_metric([name], p.memory_info().rss)
                live[pid] = p
            except psutil.Error:  # exited since it was listed
                continue
        self._cpu = live
        yield from (cpu, rss)


class MetricSources:
    """Callables the live collector reads; any may be None."""

    def __init__(self) -> None:
        self.engine: Callable[[], EngineSnapshot | None] | None = None
        self.result_cache: Callable[[], object] | None = None
        self.config: Callable[[], object] | None = None  # the config in effect, to show live reloads
        self.processes: Callable[[], list[tuple[str, int]]] | None = None  # (role, pid) of each process
        self._rate_mark = (time.monotonic(), 0)
        self._rate = 0.0

    def token_rate(self, total: int) -> float:
        """Tokens/s since the previous scrape (at least a second apart, else the last value)."""
        t0, n0 = self._rate_mark
        now = time.monotonic()
        if now - t0 >= 1.0:
            self._rate = (total - n0) / (now - t0)
            self._rate_mark = (now, total)
        return self._rate


class EdgedMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.sources = MetricSources()
        r = self.registry
        self.requests = Counter("edged_requests", "requests by tier, outcome and protocol (h1, h2, h3)",
                                ["tier", "outcome", "protocol"], registry=r)
        self.ttft = Histogram("edged_ttft_seconds", "time to first token", ["tier"], buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("edged_itl_seconds", "inter-token latency", ["tier"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("edged_request_seconds", "request latency, end to end", ["tier"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.reloads = Counter("edged_config_reloads", "config reloads by result", ["result"], registry=r)
        self.cache_lookups = Counter("edged_result_cache_lookups", "result cache lookups", ["result"], registry=r)
        self.worker_restarts = Counter("edged_worker_restarts", "front-end workers that died and were restarted",
                                       registry=r)
        # accepted, accepted_after_retry, retry_sent, retry_invalid, refused_total, refused_per_address,
        # handshake_timeout, resumed, early_data_accepted, early_data_run, early_data_held, ticket_found,
        # ticket_unknown, datagram_copies_started (h3_server.py, quic_listener.py)
        self.quic_connections = Counter("edged_quic_connection_events", "QUIC connection admission and 0-RTT events",
                                        ["event"], registry=r)
        self.quic_migrations = Counter("edged_quic_migrations", "QUIC connections that moved to a new client address",
                                       registry=r)
        self._live = _LiveCollector(self.sources)

    def observe_request(self, rec: Any) -> None:
        """A finished or refused request (routes.RequestRecord)."""
        tier = rec.tier or "none"
        self.requests.labels(tier, rec.outcome, rec.protocol).inc()
        if rec.ttft_s is not None:
            self.ttft.labels(tier).observe(rec.ttft_s)
            if rec.completion_tokens > 1:
                self.itl.labels(tier).observe((rec.duration_s - rec.ttft_s) / (rec.completion_tokens - 1))
        if rec.status is not None and rec.status < 400:
            self.e2e.labels(tier).observe(rec.duration_s)

    def observe_quic_event(self, event: str) -> None:
        if event == "migrated":
            self.quic_migrations.inc()
        else:
            self.quic_connections.labels(event).inc()

    def observe_cache_lookup(self, hit: bool) -> None:
        self.cache_lookups.labels("hit" if hit else "miss").inc()

    def render(self) -> bytes:
        path = os.environ.get(MULTIPROC_ENV)
        if path:
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry, path)  # every process's counters and histograms, summed
        else:
            registry = CollectorRegistry()
            for collector in (self.requests, self.ttft, self.itl, self.e2e, self.reloads, self.cache_lookups,
                              self.worker_restarts, self.quic_connections, self.quic_migrations):
                registry.register(collector)
        registry.register(self._live)
        return generate_latest(registry)


def mark_process_dead(pid: int) -> None:
    """A child exited: drop its live-gauge files (its counters stay in the sums)."""
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
