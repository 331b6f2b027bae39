"""PCIe/NUMA topology of the GPU, read from sysfs, and the batch limits derived from it.

What is read, for the GPU and every PCI device on its path to the root port
(``/sys/bus/pci/devices/<bus id>`` is a symlink into ``/sys/devices/pci0000:00/...``):
``class``, ``vendor``, ``current_link_speed`` ("32.0 GT/s PCIe"), ``current_link_width``,
``max_link_speed``, ``max_link_width``, ``numa_node`` and ``local_cpulist``.

The GPU is the PCI device picked by bus id (from CUDA when present: ``cuda_bus_id()``), else
the first NVIDIA (vendor 0x10de) device of class 0x0300xx (VGA) or 0x0302xx (3D controller).

Path and hops
    The GPU's real sysfs path ends in a run of PCI address directories, e.g. behind a switch
    ``pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0``: root port
    ``00:01.0``, switch upstream port ``01:00.0``, switch downstream port ``02:08.0``, GPU
    ``03:00.0``. ``hops`` is the number of PCI bridges strictly between the GPU and its root
    port (the root port and the GPU themselves are not counted): 0 for a GPU in the root
    port's slot, 2 behind one switch (its upstream and downstream port), 4 behind two cascaded
    switches. A GPU directly on the root bus (no root port: an integrated endpoint or a VM
    passthrough) also has 0 hops.

Shared uplink
    Another NVIDIA GPU shares the GPU's uplink when both sit below the same bridge below the
    root port (one switch, one upstream link). Each link is described by the device below or
    above it (every device reports its own link); a link at device ``d`` is shared by the
    GPUs in ``d``'s subtree. ``link_gbps`` is the bandwidth of the slowest link on the path
    when the GPU transfers alone; ``shared_gbps`` = min over the path of
    ``link bandwidth / GPUs below that link``, its fair share when all GPUs transfer at once.
    Two GPUs under one x16 Gen3 uplink: each gets half of it.

Limits (``compute_limits``)
    batch cap = ``max(8, base // (1 + hops))``, base 64 when the effective link (the slowest
    link on the path; ties go to the narrower, then the one nearest the GPU) is x16 or wider,
    32 below; ``scheduler.batch_cap`` from config wins when given.

    per-step host<->device budget (bytes, per direction) =
    ``bandwidth * step_time_s * transfer_fraction``, where bandwidth is the measured pinned
    host-to-device bandwidth times ``uplink_share`` (= shared_gbps / link_gbps) when CUDA is
    available, else the theoretical ``shared_gbps * efficiency``. Defaults: 20 ms step, 25% of
    it for transfers, efficiency 0.8 (pinned copies reach about 80-90% of the PCIe payload rate).

Bandwidths are in GB/s (1e9 bytes/s) per direction, after line encoding (8b/10b up to Gen2,
128b/130b for Gen3-5, FLIT 242/256 from Gen6).

Nothing here raises on odd sysfs content: a missing GPU, unreadable or "Unknown" speed,
width 0, numa_node -1, an empty cpulist or a broken symlink give a conservative default
(Gen3 x8 link, no NUMA node, no pinning), a line in ``GpuTopology.warnings`` and a log line.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass, field

from edged.log import fields

log = logging.getLogger("edged.topology")

NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)  # class >> 8: VGA compatible, 3D controller
DEFAULT_GEN = 3  # assumed when the link speed cannot be read
DEFAULT_WIDTH = 8  # assumed when the link width cannot be read
DEFAULT_STEP_TIME_S = 0.020
DEFAULT_TRANSFER_FRACTION = 0.25
DEFAULT_LINK_EFFICIENCY = 0.8
MIN_BATCH_CAP = 8

GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6, 128.0: 7}
GTS_BY_GEN = {g: s for s, g in GEN_BY_GTS.items()}
_PCI_ADDR = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@dataclass(slots=True)
class GpuTopology:
    bus_id: str | None  # None: no GPU found, every other field is a default
    link_gen: int  # of the effective (slowest) link on the path
    link_width: int
    link_gbps: float  # GB/s per direction of that link, theoretical, GPU alone
    hops: int  # bridges strictly between the GPU and its root port
    shared_with: list[str]  # other GPUs below the same bridge under the root port
    numa_node: int | None  # None: unknown (sysfs -1 or unreadable)
    local_cpus: list[int]
    warnings: list[str] = field(default_factory=list)
    shared_gbps: float = 0.0  # fair share of the path when every GPU below it transfers
    path: list[str] = field(default_factory=list)  # bus ids, root port first, GPU last
    gpu_link: str = ""  # the GPU's own link as read, e.g. "Gen4 x16 (max Gen4 x16)"
    bottleneck: str | None = None  # bus id of the device reporting the effective link

    @property
    def root_port(self) -> str | None:
        return self.path[0] if len(self.path) >= 2 else None

    @property
    def uplink_share(self) -> float:
        return self.shared_gbps / self.link_gbps if self.link_gbps > 0 else 1.0


@dataclass(slots=True)
class BatchLimits:
    batch_cap: int
    step_transfer_budget_bytes: int  # per direction, per engine step
    pinned_cpus: list[int]  # empty: do not pin
    bandwidth_gbps: float = 0.0  # what the budget was computed from
    bandwidth_source: str = ""  # "measured" or "theoretical"
    reasons: list[str] = field(default_factory=list)  # why each limit is what it is
    warnings: list[str] = field(default_factory=list)


# -- parsing ---------------------------------------------------------------------------------

def parse_cpulist(text: str | None) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; empty or malformed -> []."""
    cpus: set[int] = set()
    for part in (text or "").strip().split(","):
        part = part.strip()
        if not part:
            continue
        try:
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
        except ValueError:
            return []
        if first < 0 or last < first:
            return []
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpulist(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'; the inverse of parse_cpulist."""
    runs: list[str] = []
    s = sorted(set(cpus))
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        runs.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(runs)


def parse_link_speed(text: str | None) -> int | None:
    """'32.0 GT/s PCIe' (or older '8 GT/s') -> PCIe generation 5; 'Unknown' or odd -> None."""
    m = re.match(r"\s*([0-9.]+)\s*GT/s", text or "")
    if not m:
        return None
    try:
        return GEN_BY_GTS.get(float(m.group(1)))
    except ValueError:
        return None


def parse_link_width(text: str | None) -> int | None:
    """'16' (or 'x16') -> 16; '0', 'Unknown' or odd -> None."""
    m = re.fullmatch(r"\s*x?(\d+)\s*", text or "")
    width = int(m.group(1)) if m else 0
    return width if width > 0 else None


def link_gbps(gen: int, width: int) -> float:
    """Theoretical payload bandwidth in GB/s per direction of a PCIe GenN xW link."""
    gts = GTS_BY_GEN.get(gen, GTS_BY_GEN[DEFAULT_GEN])
    encoding = 8 / 10 if gen <= 2 else (128 / 130 if gen <= 5 else 242 / 256)
    return gts * encoding / 8 * width


def normalize_bus_id(bus_id: str) -> str:
    """'00000000:3B:00.0' (NVML) or '3b:00.0' -> '0000:3b:00.0' (sysfs)."""
    s = bus_id.strip().lower()
    parts = s.split(":")
    if len(parts) == 2:
        parts.insert(0, "0000")
    if len(parts) == 3:
        parts[0] = f"{int(parts[0], 16):04x}" if re.fullmatch(r"[0-9a-f]+", parts[0]) else parts[0]
    return ":".join(parts)


def cuda_bus_id(index: int | None = None) -> str | None:
    """sysfs bus id of CUDA device `index` (default: current), or None without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except Exception as exc:  # an odd driver must not stop the daemon
        log.warning("cuda bus id unavailable %s", fields(error=exc))
        return None


# -- sysfs -----------------------------------------------------------------------------------

def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _read_hex(path: str) -> int | None:
    try:
        return int(_read(path) or "", 16)
    except ValueError:
        return None


def _is_nvidia_gpu(dev: str) -> bool:
    cls = _read_hex(os.path.join(dev, "class"))
    return _read_hex(os.path.join(dev, "vendor")) == NVIDIA_VENDOR and cls is not None and (cls >> 8) in GPU_CLASSES


def _chain(real: str) -> list[str]:
    """Directories of the PCI devices from the top of the path (root port) down to the device:
    the trailing run of PCI address components of its real path."""
    parts = real.rstrip(os.sep).split(os.sep)
    start = len(parts)
    while start > 0 and _PCI_ADDR.match(parts[start - 1]):
        start -= 1
    return [os.sep.join(parts[: i + 1]) for i in range(start, len(parts))] or [real]


def _scan(devices_dir: str, warn: list[str]) -> dict[str, str]:
    """{bus id: real device dir} of every NVIDIA GPU; broken symlinks are skipped with a warning."""
    try:
        names = sorted(os.listdir(devices_dir))
    except OSError as exc:
        warn.append(f"cannot list {devices_dir}: {exc.strerror or exc}")
        return {}
    gpus: dict[str, str] = {}
    for name in names:
        real = os.path.realpath(os.path.join(devices_dir, name))
        if not os.path.isdir(real):
            warn.append(f"{name}: broken sysfs link, skipped")
            continue
        if _is_nvidia_gpu(real):
            gpus[name] = real
    return gpus


def _link(dev: str) -> tuple[int | None, int | None, int | None, int | None]:
    """(current gen, current width, max gen, max width) of a device; None where unreadable."""
    r = lambda f: _read(os.path.join(dev, f))  # noqa: E731
    return (parse_link_speed(r("current_link_speed")), parse_link_width(r("current_link_width")),
            parse_link_speed(r("max_link_speed")), parse_link_width(r("max_link_width")))


def _default_topology(warn: list[str]) -> GpuTopology:
    bw = link_gbps(DEFAULT_GEN, DEFAULT_WIDTH)
    return GpuTopology(None, DEFAULT_GEN, DEFAULT_WIDTH, bw, 0, [], None, [], warn, shared_gbps=bw,
                       gpu_link=f"assumed Gen{DEFAULT_GEN} x{DEFAULT_WIDTH}")


def _finish(topo: GpuTopology) -> GpuTopology:
    for w in topo.warnings:
        log.warning("topology %s", fields(gpu=topo.bus_id or "none", warning=w))
    log.info("topology %s", fields(gpu=topo.bus_id or "none", link=f"Gen{topo.link_gen}x{topo.link_width}",
                                   gbps=f"{topo.link_gbps:.1f}", hops=topo.hops,
                                   shared_with=",".join(topo.shared_with) or "-",
                                   numa=topo.numa_node, cpus=format_cpulist(topo.local_cpus) or "-"))
    return topo


def discover(sysfs_root: str = "/sys", bus_id: str | None = None) -> GpuTopology:
    """Topology of the GPU `bus_id` (default: the first NVIDIA GPU) under `sysfs_root`."""
    warn: list[str] = []
    devices_dir = os.path.join(sysfs_root, "bus", "pci", "devices")
    gpus = _scan(devices_dir, warn)

    real: str | None = None
    if bus_id is not None:
        want = normalize_bus_id(bus_id)
        candidate = os.path.realpath(os.path.join(devices_dir, want))
        if os.path.isdir(candidate):
            bus, real = want, candidate
        else:
            warn.append(f"GPU {want} not found in {devices_dir}")
    if real is None:
        if not gpus:
            warn.append("no NVIDIA GPU found in sysfs; using defaults")
            return _finish(_default_topology(warn))
        bus, real = next(iter(gpus.items()))
        if bus_id is not None or len(gpus) > 1:
            log.info("topology picked %s", fields(gpu=bus, gpus=",".join(gpus)))

    chain = _chain(real)
    path = [os.path.basename(d) for d in chain]
    hops = max(0, len(chain) - 2)
    if len(chain) < 2:
        log.info("topology %s", fields(gpu=bus, note="on the root bus, no root port"))

    # The GPU's own link; defaults when unreadable.
    gen, width, max_gen, max_width = _link(real)
    if gen is None:
        speed = _read(os.path.join(real, "current_link_speed"))
        warn.append(f"link speed {speed!r} unreadable; assuming Gen{DEFAULT_GEN}")
        gen = DEFAULT_GEN
    if width is None:
        raw = _read(os.path.join(real, "current_link_width"))
        warn.append(f"link width {raw!r} unreadable; assuming x{DEFAULT_WIDTH}")
        width = DEFAULT_WIDTH
    if max_gen is not None and gen < max_gen:
        warn.append(f"link runs at Gen{gen} below its max Gen{max_gen}: idle power saving or a "
                    "downtrained link (the measured bandwidth, when CUDA is available, decides)")
    if max_width is not None and width < max_width:
        warn.append(f"link runs at x{width} below its max x{max_width}: downtrained (slot, riser or BIOS)")
    gpu_link = f"Gen{gen} x{width}" + (f" (max Gen{max_gen} x{max_width})" if max_gen and max_width else "")

    # Every link on the path: (bandwidth alone, GPUs sharing it, gen, width, depth, device).
    others = [r for b, r in gpus.items() if r != real]
    links: list[tuple[float, int, int, int, int, str]] = []
    for depth, dev in enumerate(chain):
        if dev == real:
            g, w = gen, width
        else:
            g, w, _, _ = _link(dev)
            if g is None or w is None:
                log.debug("topology %s", fields(bridge=os.path.basename(dev), note="no link info, skipped"))
                continue
        sharers = 1 + sum(o.startswith(dev + os.sep) for o in others)
        links.append((link_gbps(g, w), sharers, g, w, depth, os.path.basename(dev)))
    # The slowest link; on a tie the narrower, then the one nearest the GPU.
    alone, _, eff_gen, eff_width, _, bottleneck = min(links, key=lambda x: (x[0], x[3], -x[4]))
    shared = min(bw / n for bw, n, *_ in links)

    below_root = chain[1:-1]  # bridges under the root port (switch ports)
    shared_with = sorted(b for b, r in gpus.items() if r != real and any(r.startswith(d + os.sep) for d in below_root))

    numa_raw = _read(os.path.join(real, "numa_node"))
    try:
        numa: int | None = int(numa_raw or "")
    except ValueError:
        numa = None
    if numa is None or numa < 0:
        warn.append(f"numa_node {numa_raw!r}: NUMA node unknown")
        numa = None
    cpus_raw = _read(os.path.join(real, "local_cpulist"))
    cpus = parse_cpulist(cpus_raw)
    if not cpus:
        warn.append(f"local_cpulist {cpus_raw!r} empty or unreadable; engine thread not pinned")

    return _finish(GpuTopology(bus, eff_gen, eff_width, alone, hops, shared_with, numa, cpus, warn,
                               shared_gbps=shared, path=path, gpu_link=gpu_link, bottleneck=bottleneck))


# -- limits ----------------------------------------------------------------------------------

def measure_h2d_bandwidth(device: int | None = None, nbytes: int = 64 << 20, iters: int = 8,
                          rounds: int = 3) -> float | None:
    """Pinned host-to-device copy bandwidth in GB/s (best of `rounds`), or None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    try:
        dev = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        with torch.cuda.device(dev):
            src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            dst.copy_(src, non_blocking=True)  # warm-up; also wakes an idle link from Gen1
            torch.cuda.synchronize(dev)
            best = 0.0
            for _ in range(rounds):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                best = max(best, nbytes * iters / (start.elapsed_time(end) / 1e3) / 1e9)
            del src, dst
        log.info("h2d bandwidth %s", fields(device=str(dev), gbps=f"{best:.1f}"))
        return best
    except Exception as exc:  # no pinned memory, OOM, driver trouble: fall back to theory
        log.warning("h2d bandwidth measurement failed %s", fields(error=exc))
        return None


def available_cpus() -> set[int]:
    """CPUs this thread may run on (cgroup cpuset, taskset)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    try:
        import psutil

        return set(psutil.Process().cpu_affinity() or [])
    except Exception:
        return set()


def compute_limits(topo: GpuTopology, *, batch_cap_override: int | None = None,
                   measured_gbps: float | None = None, step_time_s: float = DEFAULT_STEP_TIME_S,
                   transfer_fraction: float = DEFAULT_TRANSFER_FRACTION,
                   efficiency: float = DEFAULT_LINK_EFFICIENCY,
                   cpus_available: set[int] | None = None) -> BatchLimits:
    """Batch cap, per-step transfer budget and engine CPUs for `topo` (formulas: module docstring)."""
    reasons: list[str] = []
    warn: list[str] = []

    base = 64 if topo.link_width >= 16 else 32
    cap = max(MIN_BATCH_CAP, base // (1 + topo.hops))
    width_note = "x16 or wider" if base == 64 else f"x{topo.link_width}, below x16"
    default_reason = f"max({MIN_BATCH_CAP}, {base} // (1 + {topo.hops} hops)) = {cap}; base {base}: link {width_note}"
    if batch_cap_override is not None and batch_cap_override >= 1:
        reasons.append(f"batch cap {batch_cap_override} from config scheduler.batch_cap (default would be {default_reason})")
        cap = batch_cap_override
    else:
        if batch_cap_override is not None:
            warn.append(f"scheduler.batch_cap {batch_cap_override} is not >= 1; ignored")
        reasons.append(f"batch cap {default_reason}")

    share = topo.uplink_share
    share_note = f" x {share:.2f} uplink share" if share < 1 else ""
    if measured_gbps is not None and measured_gbps > 0:
        bw, source = measured_gbps * share, "measured"
        bw_note = f"{measured_gbps:.1f} GB/s measured pinned h2d{share_note}"
    else:
        bw, source = topo.shared_gbps * efficiency, "theoretical"
        bw_note = f"{topo.link_gbps:.1f} GB/s theoretical Gen{topo.link_gen} x{topo.link_width}{share_note} x {efficiency:.2f} efficiency"
    budget = int(bw * 1e9 * step_time_s * transfer_fraction)
    reasons.append(f"step budget {budget / 1e6:.1f} MB = {bw_note} x {transfer_fraction:.0%} of a "
                   f"{step_time_s * 1e3:.0f} ms step")

    avail = available_cpus() if cpus_available is None else set(cpus_available)
    pinned = sorted(set(topo.local_cpus) & avail)
    if pinned:
        reasons.append(f"engine CPUs {format_cpulist(pinned)}: the GPU's local CPUs this process may use")
    elif topo.local_cpus:
        warn.append(f"none of the GPU's local CPUs {format_cpulist(topo.local_cpus)} are available "
                    f"(allowed: {format_cpulist(sorted(avail)) or 'unknown'}); engine thread not pinned")
    else:
        reasons.append("engine CPUs: not pinned (local CPUs unknown)")

    for w in warn:
        log.warning("limits %s", fields(warning=w))
    log.info("limits %s", fields(batch_cap=cap, step_budget_bytes=budget, bandwidth=source,
                                 gbps=f"{bw:.1f}", cpus=format_cpulist(pinned) or "-"))
    return BatchLimits(cap, budget, pinned, bw, source, reasons, warn)


def pin_engine_thread(cpus: list[int] | set[int]) -> list[int]:
    """Pin the calling thread to `cpus` (intersected with those allowed); returns the CPUs
    pinned, [] when it was a no-op. Call it first thing in the engine thread: on Linux
    affinity is per thread, and threads started afterwards inherit it."""
    allowed = available_cpus()
    want = sorted(set(cpus) & allowed) if allowed else sorted(set(cpus))
    if not want:
        if cpus:
            log.warning("pin skipped %s", fields(wanted=format_cpulist(list(cpus)),
                                                  allowed=format_cpulist(sorted(allowed)) or "unknown"))
        return []
    try:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, want)  # 0 = the calling thread (its native id)
        else:  # no per-thread affinity here: psutil pins the process
            import psutil

            psutil.Process().cpu_affinity(want)
    except Exception as exc:
        log.warning("pin failed %s", fields(cpus=format_cpulist(want), error=exc))
        return []
    log.info("pinned %s", fields(thread=threading.get_native_id(), cpus=format_cpulist(want)))
    return want


# -- report ----------------------------------------------------------------------------------

def describe(topo: GpuTopology, limits: BatchLimits) -> str:
    """What `edged topology` prints: what was found, the limits chosen, and why."""
    lines = ["edged topology"]
    if topo.bus_id is None:
        lines.append("  gpu       none found")
    else:
        lines.append(f"  gpu       {topo.bus_id}, link {topo.gpu_link}")
        if topo.root_port:
            bridges = topo.path[1:-1]
            via = f" via {' -> '.join(bridges)}" if bridges else ""
            lines.append(f"  path      root port {topo.root_port}{via} -> {topo.bus_id}: "
                         f"{topo.hops} hop{'s' * (topo.hops != 1)} (bridges between GPU and root port)")
        else:
            lines.append("  path      on the root bus (no root port: integrated or VM passthrough), 0 hops")
    where = f" at {topo.bottleneck}" if topo.bottleneck and topo.bottleneck != topo.bus_id else ""
    what = "assumed" if topo.bus_id is None else "slowest link on the path"
    lines.append(f"  uplink    Gen{topo.link_gen} x{topo.link_width}{where}: "
                 f"{topo.link_gbps:.1f} GB/s per direction ({what})")
    if topo.shared_with:
        lines.append(f"  shared    with {', '.join(topo.shared_with)}: fair share {topo.shared_gbps:.1f} GB/s "
                     f"({topo.uplink_share:.2f} of the uplink)")
    else:
        lines.append("  shared    no other GPU behind the same switch")
    numa = "unknown" if topo.numa_node is None else str(topo.numa_node)
    lines.append(f"  numa      node {numa}, local CPUs {format_cpulist(topo.local_cpus) or 'unknown'}")
    lines.append("limits")
    lines.append(f"  batch cap        {limits.batch_cap}")
    lines.append(f"  step budget      {limits.step_transfer_budget_bytes} bytes ({limits.bandwidth_source} bandwidth "
                 f"{limits.bandwidth_gbps:.1f} GB/s)")
    lines.append(f"  engine CPUs      {format_cpulist(limits.pinned_cpus) or 'not pinned'}")
    lines.append("why")
    lines.extend(f"  - {r}" for r in limits.reasons)
    if topo.warnings or limits.warnings:
        lines.append("warnings")
        lines.extend(f"  - {w}" for w in topo.warnings + limits.warnings)
    return "\n".join(lines)


def plan(sysfs_root: str = "/sys", *, bus_id: str | None = None, device_index: int | None = None,
         batch_cap_override: int | None = None, measure: bool = True) -> tuple[GpuTopology, BatchLimits]:
    """Discover + measure + compute: what the daemon calls at startup. The bandwidth is measured
    before sysfs is read so that an idle link has woken from power saving (Gen1) by then."""
    measured = measure_h2d_bandwidth(device_index) if measure else None
    if bus_id is None:
        bus_id = cuda_bus_id(device_index)
    topo = discover(sysfs_root, bus_id)
    return topo, compute_limits(topo, batch_cap_override=batch_cap_override, measured_gbps=measured)


def run_topology_command(sysfs_root: str = "/sys", batch_cap_override: int | None = None) -> int:
    """`edged topology`: print what was found and the limits chosen."""
    topo, limits = plan(sysfs_root, batch_cap_override=batch_cap_override)
    print(describe(topo, limits))
    return 0
