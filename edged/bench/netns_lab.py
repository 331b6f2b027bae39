"""The impaired path of `edged bench network`: two network namespaces this creates, one for the
client and one for the daemon, joined only by a DelayWire (delay_wire.py) through a TUN device in
each, and an nftables table in each namespace that drops N% of the UDP and TCP packets arriving
through its device (`numgen random mod 100 < N drop`, with a counter): N% loss each way.

Needs root, `ip` and `nft`; `missing_requirements()` says what is missing. Everything it makes
(namespaces, devices, the table) is removed by close(), and goes away with the namespaces if the
process dies. The two addresses are link-local and exist only inside these namespaces: nothing is
routed to or from the rest of the machine.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from edged.bench.delay_wire import DelayWire

CLIENT_ADDR = "169.254.77.1"
SERVER_ADDR = "169.254.77.2"
MTU = 1500  # an Ethernet path: QUIC's 1200-1350 byte datagrams and 1448-byte TCP segments
NFT_TABLE = "edged_bench"
PROTOCOLS = ("udp", "tcp")


def missing_requirements() -> str | None:
    """Why the lab cannot run here (not root, no `ip`, no `nft`, no /dev/net/tun), or None."""
    if os.geteuid() != 0:
        return "needs root (it creates network namespaces, TUN devices and nftables rules)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (Debian package {package})"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun (TUN devices)"
    return None


def _run(*argv: str, input_text: str | None = None) -> str:
    r = subprocess.run(argv, input=input_text, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or f'exit status {r.returncode}'}")
    return r.stdout


@dataclass
class NetnsLab:
    """create() / set_loss() / set_delay() / close(). `client_ns` and `server_ns` are the
    namespaces' names for `ip netns exec`."""

    tag: str = field(default_factory=lambda: str(os.getpid()))
    wire: DelayWire | None = None
    loss_pct: int = 0
    created: list[str] = field(default_factory=list)

    @property
    def client_ns(self) -> str:
        return f"edged-bench-c{self.tag}"

    @property
    def server_ns(self) -> str:
        return f"edged-bench-s{self.tag}"

    @property
    def server_dev(self) -> str:
        return f"ebs{self.tag}"[:15]

    @property
    def client_dev(self) -> str:
        return f"ebc{self.tag}"[:15]

    def netns_exec(self, ns: str) -> list[str]:
        """The argv prefix that runs a command in namespace `ns`."""
        return ["ip", "netns", "exec", ns]

    def create(self) -> None:
        """Namespaces, the wire and its devices, addresses, the (empty) loss rules. RuntimeError on failure."""
        try:
            for ns in (self.client_ns, self.server_ns):
                _run("ip", "netns", "add", ns)
                self.created.append(ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            self.wire = DelayWire((self.client_dev, self.server_dev))
            self.wire.open()
            for dev, ns, me, peer in ((self.client_dev, self.client_ns, CLIENT_ADDR, SERVER_ADDR),
                                      (self.server_dev, self.server_ns, SERVER_ADDR, CLIENT_ADDR)):
                _run("ip", "link", "set", dev, "netns", ns)
                _run("ip", "-n", ns, "link", "set", dev, "mtu", str(MTU), "up")
                _run("ip", "-n", ns, "addr", "add", me, "peer", peer, "dev", dev)
            self.wire.start()
            self.set_loss(0)
        except (RuntimeError, OSError):
            self.close()
            raise

    def tcp_congestion_control(self) -> str:
        """The daemon's namespace's net.ipv4.tcp_congestion_control (a new namespace starts with the host's)."""
        return _run(*self.netns_exec(self.server_ns), "cat", "/proc/sys/net/ipv4/tcp_congestion_control").strip()

    def set_tcp_congestion_control(self, name: str) -> None:
        """Set it in both namespaces. Outside the host's namespace the kernel allows only the algorithms
        in net.ipv4.tcp_allowed_congestion_control (RuntimeError otherwise)."""
        allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
        if name not in allowed:
            raise RuntimeError(f"TCP congestion control {name!r} cannot be set in a network namespace here: "
                               f"net.ipv4.tcp_allowed_congestion_control is {' '.join(allowed)!r}")
        for ns in (self.client_ns, self.server_ns):
            _run(*self.netns_exec(ns), "sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={name}")

    def set_delay(self, one_way_ms: float) -> None:
        assert self.wire is not None
        self.wire.delay_s = one_way_ms / 1000.0

    def set_loss(self, pct: int) -> None:
        """Drop `pct`% of UDP and TCP packets each way (0: rules that only count). Packets are dropped
        where they arrive, on the input hook of the receiving namespace: a drop on the sender's output
        hook would tell the sender at once (sendto fails with EPERM), which no lossy link does."""
        if not 0 <= pct < 100:
            raise ValueError(f"loss must be 0-99%, got {pct}")
        drop = f"numgen random mod 100 < {pct} counter drop" if pct else "counter"
        for ns, dev in ((self.server_ns, self.server_dev), (self.client_ns, self.client_dev)):
            script = (f"table inet {NFT_TABLE}\ndelete table inet {NFT_TABLE}\ntable inet {NFT_TABLE} {{\n"
                      f"  chain input {{ type filter hook input priority 0; policy accept;\n"
                      f"    iifname \"{dev}\" meta l4proto {{ {', '.join(PROTOCOLS)} }} {drop}\n  }}\n}}\n")
            _run(*self.netns_exec(ns), "nft", "-f", "-", input_text=script)
        self.loss_pct = pct

    def counters(self) -> dict[str, int]:
        """Packets the loss rules dropped since the last set_loss() (both directions), and the UDP/TCP
        packets that arrived in either namespace (0% loss: all of them counted, else the survivors
        are not)."""
        counted = 0
        for ns in (self.server_ns, self.client_ns):
            out = _run(*self.netns_exec(ns), "nft", "list", "table", "inet", NFT_TABLE)
            counted += sum(int(m) for m in re.findall(r"counter packets (\d+)", out))
        return {"dropped": counted if self.loss_pct else 0, "wire_packets": self.wire.packets if self.wire else 0}

    def close(self) -> None:
        if self.wire is not None:
            self.wire.close()
            self.wire = None
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.created.clear()
