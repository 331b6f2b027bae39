"""The engine core's wiring of the scheduler limits: batch cap from config, PCIe topology and CUDA-graph
size; the engine thread pinned to the GPU's local CPUs. A fake sysfs tree stands in for /sys and the
tiny engine's batcher receives the limits (no GPU, no model)."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch

import edged.scheduler.topology as topology
from edged.config import parse_config
from edged.engine.core import EngineCore
from helpers.sysfs import FakeSysfs
from helpers.tiny_engine import tiny_engine


def config(**scheduler):
    model = scheduler.pop("model", {})
    return parse_config({"scheduler": scheduler, "model": model})


@pytest.mark.parametrize("topology_cap, scheduler, model, want", [
    (None, {}, {}, (64, 2048)),  # CPU: no topology, the CUDA-graph size (model.max_num_seqs)
    (10, {}, {}, (10, 2048)),  # topology-derived cap
    (10, {"batch_cap": 24}, {}, (24, 2048)),  # the config overrides the topology
    (100, {}, {"max_num_seqs": 32}, (32, 2048)),  # never above the largest graph batch
    (10, {"batch_cap": 48}, {"max_num_seqs": 32}, (32, 2048)),
    (None, {"step_token_budget": 512}, {"max_batch_tokens": 1024}, (64, 512)),
    (None, {}, {"max_batch_tokens": 1024}, (64, 1024)),
])
def test_batch_limits_take_the_config_then_the_topology_then_the_graph_size(topology_cap, scheduler, model,
                                                                         want) -> None:
    d = EngineCore(config(**scheduler, model=model), "", None, [])
    d.topology_cap = topology_cap
    limits = d.batch_limits(d.config)
    assert (limits.max_num_seqs, limits.max_batch_tokens) == want


def test_the_cpu_warm_up_measures_decode_steps_of_several_rows() -> None:
    """Admission judges a first burst with the step model: on the CPU too, start-up measures the
    decode steps of batches, not only of one row (whose cost says nothing of the next rows')."""
    tiny = tiny_engine(num_blocks=256, max_num_seqs=32, max_batch_tokens=256)
    d = EngineCore(config(), "", None, [])
    d.engine, d.front = tiny, SimpleNamespace(max_model_len=tiny.max_model_len)
    d._send_outputs = lambda outputs: None
    try:
        d._warm_up()
    finally:
        tiny.stop()
    stats = tiny.batcher.step_stats
    assert max(stats.measured_decode_sizes()) >= 3 and stats.steps > 0


def test_the_warm_up_leaves_no_request_step_token_or_missed_target_in_the_metrics_or_the_log(caplog) -> None:
    """Warm-up requests are not service: with targets no step can meet, none of them is recorded or logged as
    a miss, and the engine's counters and every tier's figures start from zero once it is over."""
    tiny = tiny_engine(num_blocks=256, max_num_seqs=32, max_batch_tokens=256)
    impossible = parse_config({"tiers": {"silver": {"ttft_target_ms": 0.001, "tpot_target_ms": 0.001,
                                                    "batch_window_ms": {"min": 0, "initial": 5, "max": 50}}}})
    tiny.batcher.board.reconfigure(impossible.tiers, "silver")
    d = EngineCore(config(), "", None, [])
    d.engine, d.front = tiny, SimpleNamespace(max_model_len=tiny.max_model_len)
    d._send_outputs = lambda outputs: None
    try:
        with caplog.at_level("INFO", logger="edged"):
            d._warm_up()
    finally:
        tiny.stop()
    assert tiny.batcher.step_stats.steps > 0  # the step model keeps what the warm-up measured
    c = tiny.counters
    assert (c.steps, c.prefill_tokens, c.decode_tokens, tiny.blocks.counters.prefix_hits) == (0, 0, 0, 0)
    silver = tiny.batcher.board.snapshot()["silver"]
    assert {k: silver[k] for k in ("started", "finished", "ttft_count", "tpot_met", "tpot_missed")} == dict.fromkeys(
        ("started", "finished", "ttft_count", "tpot_met", "tpot_missed"), 0)
    assert (silver["sla_attainment"], silver["batch_window_ms"]) == (1.0, 5.0)
    assert not [r.message for r in caplog.records if "target missed" in r.message]


def plx_gen4_x8(fs: FakeSysfs, cpulist: str) -> None:
    """Root port x16 Gen4 -> PLX switch -> GPU at x8: 2 bridge hops, base 32 -> cap max(8, 32 // 3) = 10."""
    rp = fs.root_port("0000:00:03.0", speed=4, width=16)
    up = fs.bridge(rp, "0000:01:00.0", speed=4, width=16)
    down = fs.bridge(up, "0000:02:08.0", speed=4, width=8)
    fs.gpu(down, "0000:03:00.0", speed=4, width=8, numa_node=0, local_cpulist=cpulist)


def cuda_daemon(tmp_path, monkeypatch, cfg, cpu: int) -> tuple[EngineCore, object]:
    """An engine core whose engine looks like a CUDA one, on the fake topology; returns it and the real
    tiny engine whose batcher and block manager receive the limits."""
    fs = FakeSysfs(tmp_path)
    plx_gen4_x8(fs, str(cpu))
    real_plan = topology.plan
    monkeypatch.setattr(topology, "plan", lambda **kw: real_plan(fs.root, bus_id="0000:03:00.0", measure=False,
                                                                 batch_cap_override=kw.get("batch_cap_override")))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    tiny = tiny_engine()
    d = EngineCore(cfg, "", None, [])
    d.engine = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cuda")), batcher=tiny.batcher,
                               blocks=tiny.blocks)
    return d, tiny


def test_a_cuda_engine_gets_the_topology_cap_the_pcie_budget_and_its_cpus(tmp_path, monkeypatch) -> None:
    cpu = max(os.sched_getaffinity(0))
    d, tiny = cuda_daemon(tmp_path, monkeypatch, config(), cpu)
    d._topology(d.config)
    d._apply_scheduler_config(d.config)
    assert d.topology_cap == 10
    assert tiny.batcher.limits.max_num_seqs == 10 and tiny.batcher.limits.max_batch_tokens == 2048
    assert d.transfer_budget > 0 and tiny.blocks.transfer_budget_bytes == d.transfer_budget
    assert d.pinned_cpus == [cpu]

    before = set(os.sched_getaffinity(0))
    seen: list[set[int]] = []

    def engine_thread() -> None:
        d._pin_engine_thread()  # what the engine thread runs first
        seen.append(set(os.sched_getaffinity(0)))

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join(10)
    assert seen == [{cpu}]
    assert set(os.sched_getaffinity(0)) == before  # only the engine thread is pinned


def test_config_overrides_the_topology_cap_and_pinning_can_be_off(tmp_path, monkeypatch) -> None:
    cfg = parse_config({"scheduler": {"batch_cap": 6, "pin_threads": False, "transfer_budget_bytes": 12345}})
    d, tiny = cuda_daemon(tmp_path, monkeypatch, cfg, max(os.sched_getaffinity(0)))
    d._topology(d.config)
    d._apply_scheduler_config(d.config)
    assert tiny.batcher.limits.max_num_seqs == 6
    assert tiny.blocks.transfer_budget_bytes == 12345
    assert d.pinned_cpus == []


def test_a_cpu_engine_reads_no_topology_and_pins_nothing(monkeypatch) -> None:
    def no_plan(**kw):
        raise AssertionError("a CPU engine must not read the PCIe topology")

    monkeypatch.setattr(topology, "plan", no_plan)
    tiny = tiny_engine()
    d = EngineCore(config(), "", None, [])
    d.engine = tiny
    d._topology(d.config)
    d._apply_scheduler_config(d.config)
    assert (d.topology_cap, d.pinned_cpus) == (None, [])
    assert tiny.batcher.limits.max_num_seqs == 64
