"""Prometheus metrics: request-path observations plus engine, cache and process gauges read at scrape time."""
from __future__ import annotations

import time
from typing import Callable, Iterable

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _LiveCollector(Collector):
    """Reads the engine, scheduler, caches and process when /metrics is scraped (no per-step cost)."""

    def __init__(self, sources: "MetricSources") -> None:
        self.sources = sources
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # the first call only primes the counter

    def collect(self) -> Iterable:
        s = self.sources
        engine = s.engine() if s.engine else None
        if engine is not None:
            c, blocks = engine.counters, engine.blocks
            kv = GaugeMetricFamily("edged_kv_blocks", "KV cache blocks by state", labels=["state"])
            kv.add_metric(["used"], blocks.num_used)
            kv.add_metric(["free"], blocks.num_free)
            yield kv
            yield GaugeMetricFamily("edged_batch_size", "sequences in the last engine step", value=c.last_batch_size)
            yield GaugeMetricFamily("edged_step_seconds", "duration of the last engine step", value=c.last_step_s)
            yield GaugeMetricFamily("edged_tokens_per_second", "generated tokens per second over the last window",
                                    value=s.token_rate(c.decode_tokens))
            yield CounterMetricFamily("edged_engine_steps", "engine steps run", value=c.steps)
            yield CounterMetricFamily("edged_generated_tokens", "tokens sampled", value=c.decode_tokens)
            yield CounterMetricFamily("edged_prefill_tokens", "prompt tokens computed", value=c.prefill_tokens)
            yield CounterMetricFamily("edged_preemptions", "sequences preempted", value=c.preemptions)
            yield CounterMetricFamily("edged_prefix_tokens_reused", "prompt tokens served from the prefix cache",
                                      value=blocks.counters.prefix_tokens_reused)
            tier = getattr(blocks, "host_tier", None)
            if tier is not None:
                host = CounterMetricFamily("edged_host_kv_blocks", "KV blocks spilled to / restored from host memory",
                                           labels=["event"])
                host.add_metric(["spilled"], tier.counters.spilled)
                host.add_metric(["restored"], tier.counters.restored)
                yield host
            tiers = s.tier_snapshot() if s.tier_snapshot else {}
            if tiers:
                depth = GaugeMetricFamily("edged_queue_depth", "requests waiting per tier", labels=["tier"])
                att = GaugeMetricFamily("edged_sla_attainment", "share of recent requests within their TTFT target",
                                        labels=["tier"])
                window = GaugeMetricFamily("edged_batch_window_seconds", "current adaptive batch window",
                                           labels=["tier"])
                for tier, snap in tiers.items():
                    depth.add_metric([tier], snap.get("queue_depth", 0))
                    att.add_metric([tier], snap.get("sla_attainment", 1.0))
                    window.add_metric([tier], snap.get("batch_window_ms", 0.0) / 1000.0)
                yield from (depth, att, window)
        cache = s.result_cache() if s.result_cache else None
        if cache is not None:
            st = cache.stats()
            hits = CounterMetricFamily("edged_result_cache_lookups", "result cache lookups", labels=["result"])
            hits.add_metric(["hit"], st.get("hits", 0))
            hits.add_metric(["miss"], st.get("misses", 0))
            yield hits
            yield GaugeMetricFamily("edged_result_cache_bytes", "bytes stored in the result cache",
                                    value=st.get("bytes", 0))
        gpu = s.gpu_memory() if s.gpu_memory else None
        if gpu:
            g = GaugeMetricFamily("edged_gpu_memory_bytes", "GPU memory", labels=["kind"])
            for kind, value in gpu.items():
                g.add_metric([kind], value)
            yield g
        config = s.config() if s.config else None
        if config is not None:
            target = GaugeMetricFamily("edged_tier_ttft_target_seconds", "configured TTFT target", labels=["tier"])
            queue = GaugeMetricFamily("edged_tier_max_queue", "configured queue bound", labels=["tier"])
            for name, tier in config.tiers.items():
                target.add_metric([name], tier.ttft_target_ms / 1000.0)
                queue.add_metric([name], tier.max_queue)
            yield from (target, queue)
            yield GaugeMetricFamily("edged_max_tokens_limit", "largest max_tokens accepted",
                                    value=config.limits.max_tokens_limit)
            yield GaugeMetricFamily("edged_result_cache_enabled", "1 when the result cache is on",
                                    value=int(config.cache.enabled))
        with self.process.oneshot():
            yield GaugeMetricFamily("edged_process_cpu_percent", "process CPU use since the last scrape",
                                    value=self.process.cpu_percent(None))
            yield GaugeMetricFamily("edged_process_rss_bytes", "resident memory", value=self.process.memory_info().rss)


class MetricSources:
    """Callables the live collector reads; any may be None."""

    def __init__(self) -> None:
        self.engine: Callable[[], object] | None = None
        self.tier_snapshot: Callable[[], dict[str, dict]] | None = None
        self.result_cache: Callable[[], object] | None = None
        self.gpu_memory: Callable[[], dict[str, int]] | None = None
        self.config: Callable[[], object] | None = None  # the config in effect, to show live reloads
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
        self.requests = Counter("edged_requests", "requests by tier and outcome", ["tier", "outcome"], registry=r)
        self.ttft = Histogram("edged_ttft_seconds", "time to first token", ["tier"], buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("edged_itl_seconds", "inter-token latency", ["tier"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("edged_request_seconds", "request latency, end to end", ["tier"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.reloads = Counter("edged_config_reloads", "config reloads by result", ["result"], registry=r)
        r.register(_LiveCollector(self.sources))

    def render(self) -> bytes:
        return generate_latest(self.registry)
