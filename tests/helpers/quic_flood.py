"""A QUIC handshake flood: many first Initial packets (a real ClientHello each), sent from one socket.

Making each with an aioquic client costs ~2 ms (key shares), so one real ClientHello Initial is
made once and re-encrypted under a fresh Destination Connection ID per packet (the Initial keys
derive from it): to the server, each is a new connection attempt. The sender never answers
(nothing comes back from it but Retry/close packets, which it ignores). `Flood` runs it in a
process of its own.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from aioquic.buffer import Buffer
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.crypto import CryptoPair
from aioquic.quic.packet import pull_quic_header


def initial_packets(count: int, server_name: str = "localhost") -> list[bytes]:
    """`count` distinct client Initial datagrams (1200 bytes each) that carry the same ClientHello."""
    client = QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN,
                                                            server_name=server_name))
    client.connect(("127.0.0.1", 443), now=0.0)
    [(datagram, _)] = client.datagrams_to_send(now=0.0)
    # Decrypt the datagram's packet(s) once; zero bytes after them are padding.
    plain: list[tuple[bytes, bytes, int]] = []
    buf = Buffer(data=datagram)
    start = 0
    while start < len(datagram) and datagram[start] != 0:
        buf.seek(start)
        header = pull_quic_header(buf, host_cid_length=8)
        dcid = header.destination_cid
        rx = CryptoPair()
        rx.setup_initial(cid=dcid, is_client=False, version=header.version)
        packet = datagram[start:start + header.packet_length]
        plain.append(rx.decrypt_packet(packet, buf.tell() - start, len(plain)))
        start += header.packet_length
    packets = []
    for _ in range(count):
        new_dcid = os.urandom(len(dcid))
        tx = CryptoPair()
        tx.setup_initial(cid=new_dcid, is_client=True, version=header.version)
        packet = b"".join(tx.encrypt_packet(h[:6] + new_dcid + h[6 + len(dcid):], payload, pn)
                          for h, payload, pn in plain)
        packets.append(packet + bytes(len(datagram) - len(packet)))
    return packets


def send_evenly(addr: tuple[str, int], packets: list[bytes], seconds: float) -> int:
    """Send `packets` to `addr` from one UDP socket, spread evenly over `seconds`; the count sent."""
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        start = time.monotonic()
        batch = max(1, len(packets) // max(1, int(seconds * 200)))  # ~200 bursts a second
        for i in range(0, len(packets), batch):
            for p in packets[i:i + batch]:
                s.sendto(p, addr)
                sent += 1
            due = start + seconds * (i + batch) / len(packets)
            if (pause := due - time.monotonic()) > 0:
                time.sleep(pause)
    return sent


class Flood:
    """The flood in its own process (a thread would take the GIL from the client that measures):
    `start()` once the packets are made, `wait()` -> packets sent."""

    def __init__(self, addr: tuple[str, int], count: int, seconds: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "helpers.quic_flood", addr[0], str(addr[1]), str(count),
                                      str(seconds)], cwd=Path(__file__).resolve().parents[1],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def start(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def wait(self, timeout: float = 30.0) -> int:
        out, _ = self.proc.communicate(timeout=timeout)
        return int(out.split()[-1])


if __name__ == "__main__":
    host, port, count, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    made = initial_packets(count)
    print("ready", flush=True)
    sys.stdin.readline()
    print("sent", send_evenly((host, port), made, seconds), flush=True)
