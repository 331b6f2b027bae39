"""PCIe/NUMA topology -> batch limits. Each test builds one fake sysfs tree (tests/helpers/sysfs.py)."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from edged.scheduler.topology import (
    BatchLimits, GpuTopology, compute_limits, cuda_bus_id, describe, discover, format_cpulist, link_gbps,
    measure_h2d_bandwidth, normalize_bus_id, parse_cpulist, parse_link_speed, parse_link_width,
    pin_engine_thread, run_topology_command,
)
from helpers.sysfs import NVIDIA, FakeSysfs

ALL_CPUS = set(range(64))
MB = 1e6


def limits(topo: GpuTopology, **kw) -> BatchLimits:
    return compute_limits(topo, cpus_available=kw.pop("cpus_available", ALL_CPUS), **kw)


@pytest.fixture
def fs(tmp_path) -> FakeSysfs:
    return FakeSysfs(tmp_path)


# -- topologies ------------------------------------------------------------------------------

def direct_gen5(fs: FakeSysfs) -> None:
    """A GPU in a root port's slot at x16 Gen5, and the server's ASPEED BMC VGA (not a GPU)."""
    fs.device(None, "0000:00:1f.0", cls="0x030000", vendor="0x1a03")
    rp = fs.root_port("0000:00:01.0", speed=5, width=16, numa_node=0, local_cpulist="0-7")
    fs.gpu(rp, "0000:01:00.0", speed=5, width=16, numa_node=0, local_cpulist="0-7")


def plx_gen4_x8(fs: FakeSysfs) -> None:
    """Root port x16 Gen4 -> PLX switch (upstream 01:00.0, downstream 02:08.0) -> GPU x8 Gen4."""
    rp = fs.root_port("0000:00:03.0", speed=4, width=16)
    up = fs.bridge(rp, "0000:01:00.0", speed=4, width=16)
    down = fs.bridge(up, "0000:02:08.0", speed=4, width=8)
    fs.gpu(down, "0000:03:00.0", speed=4, width=8, numa_node=0, local_cpulist="0-7")


def shared_gen3(fs: FakeSysfs, n_gpus: int = 2) -> None:
    """n GPUs (x16 Gen4 each) behind one switch whose uplink is x16 Gen3; one more GPU elsewhere."""
    rp = fs.root_port("0000:00:02.0", speed=3, width=16)
    up = fs.bridge(rp, "0000:01:00.0", speed=3, width=16)
    for i in range(n_gpus):
        down = fs.bridge(up, f"0000:02:{8 * i:02x}.0", speed=4, width=16)
        fs.gpu(down, f"0000:{3 + i:02x}:00.0", speed=4, width=16, numa_node=0, local_cpulist="0-7")
    other = fs.root_port("0000:00:03.0", speed=4, width=16)
    fs.gpu(other, "0000:81:00.0", speed=4, width=16, numa_node=0, local_cpulist="0-7")


def test_direct_root_port_x16_gen5(fs):
    direct_gen5(fs)
    topo = discover(fs.root)
    assert topo.bus_id == "0000:01:00.0"
    assert (topo.link_gen, topo.link_width, topo.hops) == (5, 16, 0)
    assert topo.path == ["0000:00:01.0", "0000:01:00.0"] and topo.root_port == "0000:00:01.0"
    assert topo.link_gbps == pytest.approx(63.0, rel=1e-3)
    assert topo.shared_with == [] and topo.shared_gbps == topo.link_gbps
    assert (topo.numa_node, topo.local_cpus) == (0, list(range(8)))
    assert topo.warnings == []
    lim = limits(topo)
    assert lim.batch_cap == 64
    assert lim.bandwidth_source == "theoretical"
    # 63.0 GB/s x 0.8 efficiency x 25% of 20 ms
    assert lim.step_transfer_budget_bytes == pytest.approx(63.0e9 * 0.8 * 0.005, rel=1e-3)
    assert lim.pinned_cpus == list(range(8))


def test_behind_plx_switch_x8_gen4(fs):
    plx_gen4_x8(fs)
    topo = discover(fs.root)
    assert topo.path == ["0000:00:03.0", "0000:01:00.0", "0000:02:08.0", "0000:03:00.0"]
    assert topo.hops == 2  # the switch's upstream and downstream ports
    assert (topo.link_gen, topo.link_width) == (4, 8)
    assert topo.bottleneck == "0000:03:00.0"
    assert limits(topo).batch_cap == max(8, 32 // (1 + 2)) == 10


def test_cascaded_switches_count_every_bridge(fs):
    rp = fs.root_port("0000:00:01.0", speed=4, width=16)
    parent = rp
    for bus_id in ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"]:
        parent = fs.bridge(parent, bus_id, speed=4, width=16)
    fs.gpu(parent, "0000:05:00.0", speed=4, width=16)
    topo = discover(fs.root)
    assert topo.hops == 4
    assert limits(topo).batch_cap == max(8, 64 // 5) == 12


def test_cap_never_below_eight(fs):
    rp = fs.root_port("0000:00:01.0", speed=4, width=8)
    parent = rp
    for bus_id in ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"]:
        parent = fs.bridge(parent, bus_id, speed=4, width=8)
    fs.gpu(parent, "0000:05:00.0", speed=4, width=8)
    assert limits(discover(fs.root)).batch_cap == 8  # 32 // 5 = 6 -> floor 8


def test_two_gpus_share_a_gen3_uplink(fs):
    shared_gen3(fs)
    a, b = discover(fs.root, "0000:03:00.0"), discover(fs.root, "0000:04:00.0")
    assert a.shared_with == ["0000:04:00.0"] and b.shared_with == ["0000:03:00.0"]
    for t in (a, b):
        assert t.hops == 2
        assert (t.link_gen, t.link_width) == (3, 16)  # the uplink, not the GPU's own Gen4 link
        assert t.bottleneck == "0000:01:00.0"
        assert t.link_gbps == pytest.approx(15.75, rel=1e-3)
        assert t.shared_gbps == pytest.approx(t.link_gbps / 2)
        assert limits(t).batch_cap == 64 // 3
    # The GPU on its own root port shares nothing.
    assert discover(fs.root, "0000:81:00.0").shared_with == []


def test_shared_uplink_halves_the_budget(tmp_path):
    alone_fs, pair_fs = FakeSysfs(tmp_path / "alone"), FakeSysfs(tmp_path / "pair")
    shared_gen3(alone_fs, n_gpus=1)
    shared_gen3(pair_fs, n_gpus=2)
    alone = limits(discover(alone_fs.root, "0000:03:00.0"))
    pair = limits(discover(pair_fs.root, "0000:03:00.0"))
    assert pair.step_transfer_budget_bytes == pytest.approx(alone.step_transfer_budget_bytes / 2, abs=1)
    assert alone.step_transfer_budget_bytes == pytest.approx(15.75e9 * 0.8 * 0.005, rel=1e-3)
    # A measured bandwidth is scaled by the same share.
    measured = limits(discover(pair_fs.root, "0000:03:00.0"), measured_gbps=12.0)
    assert measured.bandwidth_source == "measured"
    assert measured.bandwidth_gbps == pytest.approx(6.0)
    assert measured.step_transfer_budget_bytes == int(6.0e9 * 0.020 * 0.25)


def test_budget_parameters_are_explicit(fs):
    direct_gen5(fs)
    topo = discover(fs.root)
    lim = limits(topo, step_time_s=0.010, transfer_fraction=0.5, efficiency=1.0)
    assert lim.step_transfer_budget_bytes == int(topo.link_gbps * 1e9 * 0.010 * 0.5)
    assert limits(topo, measured_gbps=50.0).step_transfer_budget_bytes == int(50e9 * 0.005)


def test_remote_numa_node(fs):
    rp = fs.root_port("0000:80:01.0", speed=4, width=16, numa_node=1, local_cpulist="8-15")
    fs.gpu(rp, "0000:81:00.0", speed=4, width=16, numa_node=1, local_cpulist="8-15")
    topo = discover(fs.root)
    assert (topo.numa_node, topo.local_cpus) == (1, list(range(8, 16)))
    assert limits(topo).pinned_cpus == list(range(8, 16))
    # Only the allowed CPUs (cpuset) are pinned; none allowed -> no pinning, with a warning.
    assert limits(topo, cpus_available={0, 1, 8, 9}).pinned_cpus == [8, 9]
    none = limits(topo, cpus_available={0, 1})
    assert none.pinned_cpus == [] and "not pinned" in none.warnings[0]


def test_config_override_wins(fs):
    plx_gen4_x8(fs)
    topo = discover(fs.root)
    lim = limits(topo, batch_cap_override=48)
    assert lim.batch_cap == 48
    assert "scheduler.batch_cap" in lim.reasons[0] and "= 10" in lim.reasons[0]
    bad = limits(topo, batch_cap_override=0)
    assert bad.batch_cap == 10 and "ignored" in bad.warnings[0]


# -- odd sysfs -------------------------------------------------------------------------------

def assert_defaults(topo: GpuTopology) -> None:
    assert topo.bus_id is None
    assert (topo.link_gen, topo.link_width, topo.hops, topo.shared_with) == (3, 8, 0, [])
    assert topo.numa_node is None and topo.local_cpus == []
    lim = limits(topo)
    assert lim.batch_cap == 32 and lim.step_transfer_budget_bytes > 0 and lim.pinned_cpus == []


def test_no_gpu(fs, caplog):
    fs.device(None, "0000:00:1f.0", cls="0x030000", vendor="0x1a03")  # BMC VGA only
    fs.device(None, "0000:00:02.0", cls="0x068000", vendor="0x10de")  # NVIDIA, not a GPU (NVSwitch)
    with caplog.at_level(logging.WARNING, logger="edged.topology"):
        topo = discover(fs.root)
    assert_defaults(topo)
    assert "no NVIDIA GPU" in topo.warnings[0]
    assert "no NVIDIA GPU" in caplog.text


def test_no_sysfs_at_all(tmp_path):
    topo = discover(str(tmp_path / "nowhere"))
    assert_defaults(topo)
    assert any("cannot list" in w for w in topo.warnings)


def test_unknown_speed_and_zero_width(fs):
    rp = fs.root_port("0000:00:01.0", speed=5, width=16)
    fs.gpu(rp, "0000:01:00.0", speed="Unknown", width=0, max_speed="Unknown speed", max_width=0)
    topo = discover(fs.root)
    assert (topo.link_gen, topo.link_width) == (3, 8)  # assumed, the slowest on the path
    assert any("link speed 'Unknown'" in w for w in topo.warnings)
    assert any("link width '0'" in w for w in topo.warnings)
    assert limits(topo).batch_cap == 32


def test_missing_files(fs):
    rp = fs.root_port("0000:00:01.0")  # a root port without link files: skipped
    fs.gpu(rp, "0000:01:00.0", numa_node=None, local_cpulist=None)
    topo = discover(fs.root)
    assert topo.bus_id == "0000:01:00.0" and topo.hops == 0
    assert (topo.link_gen, topo.link_width, topo.numa_node, topo.local_cpus) == (3, 8, None, [])
    assert len(topo.warnings) == 4  # speed, width, numa_node, local_cpulist
    assert limits(topo).pinned_cpus == []


def test_numa_minus_one_and_empty_cpulist(fs):
    rp = fs.root_port("0000:00:01.0", speed=4, width=16)
    fs.gpu(rp, "0000:01:00.0", speed=4, width=16, numa_node=-1, local_cpulist="")
    topo = discover(fs.root)
    assert topo.numa_node is None and topo.local_cpus == []
    assert any("numa_node '-1'" in w for w in topo.warnings)
    assert any("local_cpulist ''" in w for w in topo.warnings)


def test_garbage_files(fs):
    rp = fs.root_port("0000:00:01.0", speed="garbage", width="x")
    fs.device(rp, "0000:01:00.0", cls="not hex", vendor="0x10de")
    fs.gpu(fs.root_port("0000:00:02.0", speed=4, width=16), "0000:02:00.0", speed=4, width=16,
           numa_node="zero", local_cpulist="0-a")
    topo = discover(fs.root)
    assert topo.bus_id == "0000:02:00.0"
    assert topo.numa_node is None and topo.local_cpus == []


def test_broken_symlinks(fs):
    fs.broken_link("0000:00:05.0")
    direct_gen5(fs)
    topo = discover(fs.root)
    assert topo.bus_id == "0000:01:00.0"
    assert any("broken" in w and "0000:00:05.0" in w for w in topo.warnings)
    # Asked for the broken one (e.g. by CUDA): warn and use the GPU that is there.
    asked = discover(fs.root, "0000:00:05.0")
    assert asked.bus_id == "0000:01:00.0"
    assert any("0000:00:05.0 not found" in w for w in asked.warnings)


def test_downtrained_link_warns(fs):
    rp = fs.root_port("0000:00:01.0", speed=4, width=16)
    fs.gpu(rp, "0000:01:00.0", speed=1, width=8, max_speed=4, max_width=16)
    topo = discover(fs.root)
    assert (topo.link_gen, topo.link_width) == (1, 8)
    assert any("below its max Gen4" in w for w in topo.warnings)
    assert any("below its max x16" in w for w in topo.warnings)


def test_gpu_on_root_bus_has_no_root_port(fs):
    """VM passthrough: the GPU sits on pci0000:00 itself."""
    fs.gpu(None, "0000:00:05.0", speed=4, width=16, numa_node=0, local_cpulist="0-1")
    topo = discover(fs.root)
    assert topo.bus_id == "0000:00:05.0" and topo.hops == 0 and topo.root_port is None
    assert limits(topo).batch_cap == 64
    assert "root bus" in describe(topo, limits(topo))


def test_pick_gpu_by_bus_id(fs):
    shared_gen3(fs)
    assert discover(fs.root).bus_id == "0000:03:00.0"  # first by bus id
    assert discover(fs.root, "0000:81:00.0").bus_id == "0000:81:00.0"
    assert discover(fs.root, "00000000:81:00.0").bus_id == "0000:81:00.0"  # NVML form
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("3b:00.0") == "0000:3b:00.0"


def test_real_sysfs_gives_this_machines_gpu_or_the_stated_defaults():
    devices = Path("/sys/bus/pci/devices")
    nvidia = sorted(d.name for d in (devices.iterdir() if devices.is_dir() else [])
                    if _read(d / "vendor") == NVIDIA and _read(d / "class").startswith("0x03"))
    topo = discover()
    lim = compute_limits(topo)
    if nvidia:
        assert topo.bus_id == nvidia[0] and topo.link_width >= 1 and topo.path[-1] == nvidia[0]
    else:
        assert topo.bus_id is None and topo.warnings == ["no NVIDIA GPU found in sysfs; using defaults"]
        assert (topo.link_gen, topo.link_width, topo.hops, lim.pinned_cpus) == (3, 8, 0, [])
    base = 64 if topo.link_width >= 16 else 32
    assert lim.batch_cap == max(8, base // (1 + topo.hops))
    text = describe(topo, lim)
    assert text.startswith("edged topology") and f"{lim.batch_cap}" in text


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


# -- parsing ---------------------------------------------------------------------------------

def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("5") == [5]
    assert parse_cpulist("") == [] and parse_cpulist(None) == []
    assert parse_cpulist("3-1") == [] and parse_cpulist("0-a") == []
    assert format_cpulist([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


def test_parse_link():
    assert parse_link_speed("32.0 GT/s PCIe") == 5
    assert parse_link_speed("8 GT/s") == 3  # older kernels
    assert parse_link_speed("2.5 GT/s PCIe") == 1
    assert parse_link_speed("Unknown") is None and parse_link_speed("7.0 GT/s") is None
    assert parse_link_width("16") == 16 and parse_link_width("0") is None and parse_link_width("") is None
    assert link_gbps(1, 1) == pytest.approx(0.25)
    assert link_gbps(3, 16) == pytest.approx(15.754, rel=1e-3)
    assert link_gbps(4, 16) == pytest.approx(31.508, rel=1e-3)


# -- pinning, measurement, report ------------------------------------------------------------

def test_pin_engine_thread_pins_only_that_thread():
    before = os.sched_getaffinity(0)
    target = min(before)
    seen: dict[str, object] = {}

    def engine() -> None:
        seen["pinned"] = pin_engine_thread([target, 10_000])  # 10000: not a CPU here, dropped
        seen["affinity"] = os.sched_getaffinity(0)

    t = threading.Thread(target=engine)
    t.start()
    t.join()
    assert seen["pinned"] == [target]
    assert seen["affinity"] == {target}
    assert os.sched_getaffinity(0) == before  # the calling thread is untouched


def test_pin_engine_thread_noop_when_impossible(caplog):
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.WARNING, logger="edged.topology"):
        assert pin_engine_thread([10_000]) == []
        assert pin_engine_thread([]) == []
    assert os.sched_getaffinity(0) == before
    assert "pin skipped" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_measure_returns_none_on_cpu():
    assert measure_h2d_bandwidth() is None
    assert cuda_bus_id() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_on_gpu():
    gbps = measure_h2d_bandwidth()
    assert gbps is not None and 1.0 < gbps < 200.0
    assert discover("/sys", cuda_bus_id()).bus_id == cuda_bus_id()


def test_describe_says_what_and_why(fs):
    shared_gen3(fs)
    topo = discover(fs.root, "0000:04:00.0")
    text = describe(topo, limits(topo))
    for needle in ["0000:04:00.0", "root port 0000:00:02.0", "2 hops", "Gen3 x16", "0000:03:00.0",
                   "batch cap        21", "max(8, 64 // (1 + 2 hops))", "0.50 uplink share", "25% of a 20 ms step"]:
        assert needle in text, needle


def test_run_topology_command(fs, capsys):
    plx_gen4_x8(fs)
    assert run_topology_command(fs.root) == 0
    out = capsys.readouterr().out
    assert "batch cap        10" in out and "0000:03:00.0" in out
    assert run_topology_command(fs.root, batch_cap_override=17) == 0
    assert "batch cap        17" in capsys.readouterr().out
