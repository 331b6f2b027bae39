"""edged/metrics.py and the daemon's /metrics and /readyz routes, without the model.

Each family is rendered from fake sources holding known values and read back with Prometheus'
own parser; the routes run on a real HTTP/3 server (fake engine) reached from a loopback and a
non-loopback address. (After real requests against the real daemon: tests/test_daemon_e2e.py.)
"""
from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import psutil
import pytest

import edged.metrics as metrics_mod
from edged.config import Config, hash_api_key, parse_config
from edged.metrics import EdgedMetrics, EngineSnapshot
from edged.server.h3_client import H3Client
from edged.server.routes import RequestRecord
from edged.server.worker import Worker
from edged.server.tls import ensure_cert
from helpers.fake_engine import FakeEngine, ServerThread
from helpers.metrics import families, metric_value, samples


def fake_engine(**counters):
    c = dict(last_batch_size=3, last_step_s=0.025, decode_tokens=120, prefill_tokens=64, steps=41, preemptions=2,
             yielded_steps=6)
    c.update(counters)
    host = SimpleNamespace(counters=SimpleNamespace(spilled=5, restored=4))
    blocks = SimpleNamespace(num_used=10, num_free=54, counters=SimpleNamespace(prefix_tokens_reused=32),
                             host_tier=host)
    tiers = {"gold": {"queue_depth": 2, "running": 5, "sla_attainment": 0.9, "batch_window_ms": 4.0},
             "bronze": {"queue_depth": 7, "running": 1, "sla_attainment": 0.5, "batch_window_ms": 50.0}}
    return SimpleNamespace(counters=SimpleNamespace(**c), blocks=blocks, batcher=SimpleNamespace(snapshot=lambda: tiers))


def full_metrics() -> EdgedMetrics:
    """As a worker renders them: the engine core's snapshot (taken on the core from the engine's objects)."""
    m = EdgedMetrics()
    s = m.sources
    snap = EngineSnapshot.of(fake_engine(), {"allocated": 1 << 30, "reserved": 3 << 29})
    s.engine = lambda: EngineSnapshot(**snap.to_dict())  # as it travels: a plain dict
    for hit in (True, True, True, False, False, False, False):
        m.observe_cache_lookup(hit)
    cache = SimpleNamespace(stats=lambda: {"bytes": 4096})
    s.result_cache = lambda: cache
    config = parse_config({"limits": {"max_tokens_limit": 777}, "cache": {"enabled": False}})
    s.config = lambda: config
    return m


def test_every_family_renders_the_values_of_its_sources() -> None:
    v = samples(full_metrics().render().decode())

    def get(name: str, **labels: str) -> float:
        return v[(name, frozenset(labels.items()))]

    assert (get("edged_kv_blocks", state="used"), get("edged_kv_blocks", state="free")) == (10, 54)
    assert get("edged_batch_size") == 3 and get("edged_step_seconds") == 0.025
    assert get("edged_engine_steps_total") == 41 and get("edged_generated_tokens_total") == 120
    assert get("edged_prefill_tokens_total") == 64 and get("edged_preemptions_total") == 2
    assert get("edged_yielded_steps_total") == 6
    assert get("edged_prefix_tokens_reused_total") == 32
    assert (get("edged_host_kv_blocks_total", event="spilled"), get("edged_host_kv_blocks_total", event="restored")) \
        == (5, 4)
    assert (get("edged_queue_depth", tier="gold"), get("edged_queue_depth", tier="bronze")) == (2, 7)
    assert (get("edged_running_requests", tier="gold"), get("edged_running_requests", tier="bronze")) == (5, 1)
    assert (get("edged_sla_attainment", tier="gold"), get("edged_sla_attainment", tier="bronze")) == (0.9, 0.5)
    assert get("edged_batch_window_seconds", tier="gold") == pytest.approx(0.004)
    assert get("edged_batch_window_seconds", tier="bronze") == pytest.approx(0.05)
    assert (get("edged_result_cache_lookups_total", result="hit"), get("edged_result_cache_lookups_total",
                                                                       result="miss")) == (3, 4)
    assert get("edged_result_cache_bytes") == 4096
    assert (get("edged_gpu_memory_bytes", kind="allocated"), get("edged_gpu_memory_bytes", kind="reserved")) == \
        (1 << 30, 3 << 29)
    assert get("edged_max_tokens_limit") == 777 and get("edged_result_cache_enabled") == 0
    defaults = Config().tiers
    for tier, t in defaults.items():
        assert get("edged_tier_ttft_target_seconds", tier=tier) == pytest.approx(t.ttft_target_ms / 1000)
        assert get("edged_tier_max_queue", tier=tier) == t.max_queue
        assert get("edged_tier_weight", tier=tier) == t.weight
    rss = get("edged_process_rss_bytes", process="edged")
    assert 10e6 < rss < 2 * psutil.Process().memory_info().rss  # this process, not a constant
    assert get("edged_process_cpu_percent", process="edged") >= 0


def test_without_sources_only_the_request_and_process_families_are_served() -> None:
    text = EdgedMetrics().render().decode()
    assert families(text) == {"edged_requests", "edged_ttft_seconds", "edged_itl_seconds", "edged_request_seconds",
                              "edged_config_reloads", "edged_result_cache_lookups", "edged_worker_restarts",
                              "edged_quic_connection_events", "edged_quic_migrations",
                              "edged_process_cpu_percent", "edged_process_rss_bytes"}
    m = EdgedMetrics()
    m.sources.engine = lambda: EngineSnapshot.of(fake_engine(), {})  # a CPU node: no GPU memory family at all
    assert "edged_gpu_memory_bytes" not in families(m.render().decode())


def test_tokens_per_second_is_the_rate_between_scrapes_at_least_a_second_apart(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(metrics_mod.time, "monotonic", lambda: now[0])
    m = full_metrics()
    engine = fake_engine(decode_tokens=0)
    m.sources.engine = lambda: EngineSnapshot.of(engine)

    def rate() -> float:
        return metric_value(m.render().decode(), "edged_tokens_per_second")

    assert rate() == 0.0
    engine.counters.decode_tokens, now[0] = 50, 102.0
    assert rate() == pytest.approx(25.0)  # 50 tokens in 2 s
    engine.counters.decode_tokens, now[0] = 80, 102.5
    assert rate() == pytest.approx(25.0)  # half a second later: the last value
    engine.counters.decode_tokens, now[0] = 90, 104.0
    assert rate() == pytest.approx(20.0)  # 40 tokens in the 2 s since the last window


def test_request_records_fill_the_per_tier_counters_and_histograms() -> None:
    d = Worker("w0", Config(), FakeEngine())
    d.metrics.observe_request(RequestRecord("a", "/v1/chat/completions", 200, "length", "gold", prompt_tokens=5,
                             completion_tokens=11, ttft_s=0.2, duration_s=1.2))
    d.metrics.observe_request(RequestRecord("b", "/v1/chat/completions", 200, "stop", "gold", completion_tokens=1, ttft_s=0.03,
                             duration_s=0.03))
    d.metrics.observe_request(RequestRecord("c", "/v1/chat/completions", 429, "rejected", "bronze", code="tier_queue_full",
                                            protocol="h2"))
    text = d.metrics.render().decode()
    assert metric_value(text, "edged_requests_total", {"tier": "gold", "outcome": "length", "protocol": "h3"}) == 1
    assert metric_value(text, "edged_requests_total", {"tier": "bronze", "protocol": "h2"}) == 1
    assert metric_value(text, "edged_requests_total", {"tier": "gold", "outcome": "stop"}) == 1
    assert metric_value(text, "edged_requests_total", {"tier": "bronze", "outcome": "rejected"}) == 1
    assert metric_value(text, "edged_ttft_seconds_count", {"tier": "gold"}) == 2
    assert metric_value(text, "edged_ttft_seconds_sum", {"tier": "gold"}) == pytest.approx(0.23)
    assert metric_value(text, "edged_ttft_seconds_bucket", {"tier": "gold", "le": "0.05"}) == 1
    # inter-token latency: (1.2 - 0.2) / (11 - 1) = 0.1 s, one observation (one token has no gaps)
    assert metric_value(text, "edged_itl_seconds_count", {"tier": "gold"}) == 1
    assert metric_value(text, "edged_itl_seconds_sum", {"tier": "gold"}) == pytest.approx(0.1)
    assert metric_value(text, "edged_request_seconds_count", {"tier": "gold"}) == 2
    assert metric_value(text, "edged_ttft_seconds_count", {"tier": "bronze"}) is None  # refused: no latency
    assert metric_value(text, "edged_request_seconds_count", {"tier": "bronze"}) is None


# ------------------------------------------------------------------------------------ the routes

def non_loopback_ipv4() -> str | None:
    """An address of this machine that is not loopback (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def test_metrics_are_for_loopback_or_a_key_and_readyz_says_whether_the_engine_serves(tmp_path) -> None:
    ip = non_loopback_ipv4()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    cert, key = ensure_cert(tmp_path)
    daemon = Worker("w0", Config(), FakeEngine())
    alive = [True]
    daemon.engine_alive = lambda: alive[0]
    with ServerThread(FakeEngine(), cert, key, host="0.0.0.0") as st:
        daemon.server = st.server
        st.server.router.add("GET", "/metrics", daemon.metrics_route, public=True)
        st.server.router.add("GET", "/readyz", daemon.readyz_route, public=True)

        async def get(host: str, path: str, headers: dict | None = None):
            async with H3Client(host, st.port, insecure=True) as c:
                return await c.request("GET", path, headers or {})

        async def go() -> None:
            r = await get("127.0.0.1", "/metrics")
            assert r.status == 200 and r.headers["content-type"].startswith("text/plain")
            assert metric_value(r.text, "edged_process_rss_bytes", {"process": "edged"}) > 0
            r = await get(ip, "/metrics")
            assert (r.status, r.json()["error"]["code"]) == (403, "forbidden")
            daemon.config = parse_config({"auth": {"enabled": True, "keys": [
                {"name": "ops", "sha256": hash_api_key("ops-key"), "tier": "gold"}]}})
            assert (await get(ip, "/metrics", {"authorization": "Bearer ops-key"})).status == 200
            assert (await get(ip, "/metrics", {"authorization": "Bearer other"})).status == 403
            daemon.config = parse_config({"auth": {"metrics_requires_key": True, "keys": [
                {"name": "ops", "sha256": hash_api_key("ops-key")}]}})
            assert (await get("127.0.0.1", "/metrics")).status == 401  # even on loopback
            assert (await get("127.0.0.1", "/metrics", {"authorization": "Bearer ops-key"})).status == 200
            daemon.config = parse_config({"auth": {"metrics_loopback_only": False}})
            assert (await get(ip, "/metrics")).status == 200
            # /readyz is a probe: any address; 200 while the engine serves, else 503
            r = await get(ip, "/readyz")
            assert (r.status, r.json()) == (200, {"status": "ready"})
            alive[0] = False
            r = await get("127.0.0.1", "/readyz")
            assert (r.status, r.json()) == (503, {"status": "not ready"})
            alive[0] = True
            st.server.router.draining = True
            assert (await get("127.0.0.1", "/readyz")).status == 503

        asyncio.run(asyncio.wait_for(go(), 60))
