"""Fake sysfs PCI trees for topology tests, laid out exactly like the kernel's.

Devices are real directories nested under ``<root>/devices/pci<domain>:<bus>/`` by their place
in the PCI hierarchy; ``<root>/bus/pci/devices/<bus id>`` is a relative symlink to each, as in
``/sys``. Attribute files hold what the kernel writes (``0x030200``, ``16.0 GT/s PCIe``, ``-1``).
An attribute passed as None is not written (a missing file).

    fs = FakeSysfs(tmp_path)
    rp = fs.root_port("0000:00:01.0", speed=5, width=16)
    fs.gpu(rp, "0000:01:00.0", speed=5, width=16, numa_node=0, local_cpulist="0-7")
    discover(fs.root)
"""
from __future__ import annotations

import os
from pathlib import Path

NVIDIA = "0x10de"
GTS = {1: "2.5 GT/s PCIe", 2: "5.0 GT/s PCIe", 3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe", 5: "32.0 GT/s PCIe",
       6: "64.0 GT/s PCIe"}
Attr = str | int | None


class FakeSysfs:
    def __init__(self, tmp: Path) -> None:
        self.root = str(tmp / "sys")
        self.devices = Path(self.root) / "bus" / "pci" / "devices"
        self.devices.mkdir(parents=True)

    def host_bridge(self, domain: str = "0000", bus: str = "00") -> Path:
        path = Path(self.root) / "devices" / f"pci{domain}:{bus}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def device(self, parent: Path | None, bus_id: str, *, cls: str, vendor: str = "0x8086",
               speed: int | str | None = None, width: Attr = None, max_speed: int | str | None = None,
               max_width: Attr = None, numa_node: Attr = -1, local_cpulist: Attr = "0-1") -> Path:
        """Create a PCI device dir below `parent` (default: host bridge pci0000:00) and its
        /sys/bus/pci/devices link. `speed`/`max_speed`: a generation number or a raw string."""
        parent = parent or self.host_bridge(bus_id.split(":")[0], "00")
        path = parent / bus_id
        path.mkdir(parents=True)
        attrs: dict[str, Attr] = {
            "class": cls, "vendor": vendor,
            "current_link_speed": GTS[speed] if isinstance(speed, int) else speed,
            "current_link_width": width,
            "max_link_speed": GTS[max_speed] if isinstance(max_speed, int) else max_speed,
            "max_link_width": max_width,
            "numa_node": numa_node, "local_cpulist": local_cpulist,
        }
        for name, value in attrs.items():
            if value is not None:
                (path / name).write_text(f"{value}\n")
        link = self.devices / bus_id
        link.symlink_to(os.path.relpath(path, self.devices))
        return path

    def root_port(self, bus_id: str, *, speed: int | str | None = None, width: Attr = None, **kw) -> Path:
        return self.device(None, bus_id, cls="0x060400", speed=speed, width=width,
                           max_speed=speed, max_width=width, **kw)

    def bridge(self, parent: Path, bus_id: str, *, speed: int | str | None = None, width: Attr = None,
               vendor: str = "0x10b5", **kw) -> Path:
        """A switch port (PLX/Broadcom by default): upstream or downstream, both are bridges."""
        return self.device(parent, bus_id, cls="0x060400", vendor=vendor, speed=speed, width=width,
                           max_speed=speed, max_width=width, **kw)

    def gpu(self, parent: Path | None, bus_id: str, *, speed: int | str | None = None, width: Attr = None,
            max_speed: int | str | None = "same", max_width: Attr | str = "same", cls: str = "0x030200",
            audio: bool = True, **kw) -> Path:
        """An NVIDIA GPU (3D controller), with its HDMI audio function .1 next to it."""
        path = self.device(parent, bus_id, cls=cls, vendor=NVIDIA, speed=speed, width=width,
                           max_speed=speed if max_speed == "same" else max_speed,
                           max_width=width if max_width == "same" else max_width, **kw)
        if audio:
            self.device(parent, bus_id[:-1] + "1", cls="0x040300", vendor=NVIDIA, speed=speed, width=width)
        return path

    def broken_link(self, bus_id: str) -> None:
        """A /sys/bus/pci/devices entry whose target is gone (device removed mid-scan)."""
        (self.devices / bus_id).symlink_to(f"../../../devices/pci0000:00/{bus_id}")
