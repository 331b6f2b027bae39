"""Connection-ID routing of QUIC packets to the worker that owns the connection.

The daemon's workers share one UDP port (SO_REUSEPORT). The kernel's default pick is a hash of the
4-tuple, so a client that changes address or port (connection migration, NAT rebinding) would land
on a worker that does not know its connection. Instead, a classic BPF program attached to the
group (SO_ATTACH_REUSEPORT_CBPF) picks the socket from the packet's Destination Connection ID:

    index = DCID[0] % workers

(DCID at byte 6 of a long-header packet, byte 1 of a short-header one; the program sees the UDP
payload). Every connection ID a worker issues, including a Retry's, has a first byte that maps to
its own index (`CidRoute`), so every packet of a connection reaches the same socket whatever its
source address. A client's very first Initial carries a DCID the client chose at random: it goes
to worker `DCID[0] % workers`, which then issues IDs that map to itself; the client's later
Initials and 0-RTT packets reuse that first DCID, so they follow it there too.

Prior art: the Linux selftest tools/testing/selftests/net/reuseport_bpf.c (a cBPF program
returning a socket index from the payload), and the CID-steering eBPF programs of quic-go/
quiche/HAProxy deployments; classic BPF needs no capabilities and no compiler.
"""
from __future__ import annotations

import ctypes
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from aioquic.quic.connection import QuicConnection

SO_ATTACH_REUSEPORT_CBPF = 51  # include/uapi/asm-generic/socket.h

# struct sock_filter opcodes
_LDB_ABS = 0x30  # BPF_LD | BPF_B | BPF_ABS: A = payload[k]
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_JA = 0x05  # BPF_JMP | BPF_JA
_MOD = 0x94  # BPF_ALU | BPF_MOD | BPF_K: A %= k
_RET_A = 0x16  # BPF_RET | BPF_A


@dataclass(slots=True, frozen=True)
class CidRoute:
    """This worker's place in the SO_REUSEPORT group: connection IDs it issues map to `index`."""

    index: int = 0
    count: int = 1

    def new_cid(self, length: int = 8) -> bytes:
        cid = bytearray(os.urandom(length))
        if self.count > 1:
            first = cid[0] - cid[0] % self.count + self.index
            cid[0] = first if first < 256 else first - self.count
        return bytes(cid)

    def owns(self, cid: bytes) -> bool:
        return self.count <= 1 or (len(cid) > 0 and cid[0] % self.count == self.index)


def reuseport_cbpf_program(count: int) -> list[tuple[int, int, int, int]]:
    """The classic BPF program: the socket index from the first DCID byte (see the module docstring)."""
    return [
        (_LDB_ABS, 0, 0, 0),  # 0: A = first byte
        (_JSET, 0, 2, 0x80),  # 1: long header? -> 2, else -> 4
        (_LDB_ABS, 0, 0, 6),  # 2: A = DCID[0] of a long header (after flags, version, DCID length)
        (_JA, 0, 0, 1),  # 3: -> 5
        (_LDB_ABS, 0, 0, 1),  # 4: A = DCID[0] of a short header
        (_MOD, 0, 0, count),  # 5: A %= workers
        (_RET_A, 0, 0, 0),  # 6: the socket index (a packet too short to read returns 0: worker 0)
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def attach_cid_routing(sock: socket.socket, count: int) -> None:
    """Steer the SO_REUSEPORT group `sock` belongs to by connection ID (sockets in bind order).
    OSError when the kernel refuses it."""
    prog = reuseport_cbpf_program(count)
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = _SockFprog(len(prog), ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, bytes(fprog))


class RoutedQuicConnection(QuicConnection):
    """An aioquic server connection whose connection IDs all route to this worker (CidRoute)."""

    def __init__(self, *, route: CidRoute, **kwargs: Any) -> None:
        self._route = route
        super().__init__(**kwargs)
        first = self._host_cids[0]
        first.cid = route.new_cid(len(first.cid))
        self.host_cid = first.cid
        self._local_initial_source_connection_id = first.cid

    def _replenish_connection_ids(self) -> None:
        known = len(self._host_cids)
        super()._replenish_connection_ids()
        for c in self._host_cids[known:]:  # not yet announced: safe to replace
            c.cid = self._route.new_cid(len(c.cid))
