"""The client side of `edged bench network`, run in the client's network namespace as
`python -m edged.bench.network_client HOST PORT CA_FILE`: one JSON command per line on standard
input, one JSON result per line on standard output, until EOF. One process for the whole run, so
that imports cost nothing per case and a session ticket outlives its connection.

Commands ({"op": ...}):
  streams    N concurrent streaming chat completions of `max_tokens` tokens each on ONE connection
             (prompts named by "prompts": equal keys, equal prompts; greedy, so equal tokens),
             over "h3" (edged's aioquic client) or "h2" (HTTP/2 over TLS/TCP: h2_stream_client.py). The connection
             is set up first (handshake + GET /healthz, timed as connect_s); then every stream starts
             at once. Per stream: TTFT, the gaps between token events, total time.
  returning  one request over a new HTTP/3 connection, timed from before the handshake to the first
             token: mode "full" (no ticket: a full handshake) or "0rtt" (the session ticket the last
             connection got, the request sent in 0-RTT data; a priming connection first if there is
             no ticket). Reports whether the server accepted the early data.
  first_h2   the same over a new TLS/TCP connection (TCP + TLS 1.3: two round trips before the request).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import ssl
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

REQUEST_TIMEOUT_S = 120.0
# Prompts without a "prompts" key are new in each call; a seed differs per call: no answer comes from the
# daemon's result cache (kept on, as deployed).
NONCE = itertools.count()
CONNECT_TIMEOUT_S = 20.0  # a lost Initial or SYN costs a second or more at 5% loss


@dataclass
class StreamResult:
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between successive token events
    events: int = 0
    total_s: float | None = None
    error: str | None = None


def chat_body(prompt: str, max_tokens: int, seed: int) -> bytes:
    """Greedy and seeded (replay-safe: the kind a server may answer from 0-RTT data), exactly
    max_tokens tokens (ignore_eos)."""
    return json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "seed": seed, "ignore_eos": True, "stream": True}).encode()


HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}


def has_token(data: str) -> bool:
    obj = json.loads(data)
    if obj.get("error"):
        raise ValueError((obj["error"] or {}).get("message") or "error event")
    return any((c.get("delta") or {}).get("content") for c in obj.get("choices") or [])


async def time_sse(chunks: Any, start: float, res: StreamResult) -> None:
    """Read an SSE body to [DONE], stamping each token event as it arrives."""
    from edged.server.h3_client import iter_sse

    last = 0.0
    async for data in iter_sse(chunks):
        now = time.perf_counter()
        if data == "[DONE]":
            res.total_s = now - start
            return
        if has_token(data):
            res.events += 1
            if res.ttft_s is None:
                res.ttft_s = now - start
            else:
                res.gaps_s.append(now - last)
            last = now
    res.error = "the stream ended without [DONE]"


# ------------------------------------------------------------------------ N streams, one connection


async def h3_streams(host: str, port: int, ca_file: str, bodies: list[bytes]) -> tuple[float, list[StreamResult]]:
    from edged.server.h3_client import H3Client, H3ClientError

    t = time.perf_counter()
    async with H3Client(host, port, ca_file=ca_file, connect_timeout=CONNECT_TIMEOUT_S) as client:
        await client.request("GET", "/healthz", timeout=CONNECT_TIMEOUT_S)
        connect_s = time.perf_counter() - t

        async def one(body: bytes) -> StreamResult:
            res = StreamResult()
            start = time.perf_counter()
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    rs = await client.stream("POST", "/v1/chat/completions", HEADERS, body, timeout=None)
                    async with rs:
                        if rs.status != 200:
                            res.error = f"HTTP {rs.status}: {(await rs.read())[:200]!r}"
                            return res
                        await time_sse(rs, start, res)
            except (H3ClientError, ValueError, TimeoutError) as e:
                res.error = str(e) or type(e).__name__
            return res

        results = await asyncio.gather(*(one(b) for b in bodies))
    return connect_s, list(results)


def tls_context(ca_file: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca_file)
    ctx.set_alpn_protocols(["h2"])
    return ctx


async def h2_streams(host: str, port: int, ca_file: str, bodies: list[bytes]) -> tuple[float, list[StreamResult]]:
    from edged.bench.h2_stream_client import H2StreamClient, H2StreamError

    t = time.perf_counter()
    async with H2StreamClient(host, port, tls_context(ca_file), connect_timeout=CONNECT_TIMEOUT_S) as client:
        health = client.request("GET", "/healthz", {})
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            status = await health.status()
            await health.read()
        if status != 200:
            raise RuntimeError(f"GET /healthz answered {status}")
        connect_s = time.perf_counter() - t

        async def one(body: bytes) -> StreamResult:
            res = StreamResult()
            start = time.perf_counter()
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    rs = client.request("POST", "/v1/chat/completions", HEADERS, body)
                    if (status := await rs.status()) != 200:
                        res.error = f"HTTP {status}: {(await rs.read())[:200]!r}"
                        return res
                    await time_sse(rs, start, res)
            except (H2StreamError, ValueError, TimeoutError) as e:
                res.error = str(e) or type(e).__name__
            return res

        results = await asyncio.gather(*(one(b) for b in bodies))
    return connect_s, list(results)


async def run_streams(cmd: dict[str, Any], host: str, port: int, ca_file: str) -> dict[str, Any]:
    n, tokens, seed = int(cmd["streams"]), int(cmd["max_tokens"]), int(cmd.get("seed", 0))
    # The same "prompts" key gives the same prompts, hence the same greedy tokens, whatever the protocol:
    # runs compared with each other then carry the same special tokens (sent without text, so the next
    # token event comes a step or more later). Each call's own seed keeps the result cache from answering.
    key = cmd.get("prompts", f"n{next(NONCE)}")
    bodies = [chat_body(f"Request {key}, stream {i}: tell a long story about the sea.", tokens,
                        seed * 1000 + i) for i in range(n)]
    run = h3_streams if cmd["proto"] == "h3" else h2_streams
    t = time.perf_counter()
    connect_s, results = await run(host, port, ca_file, bodies)
    return {"connect_s": connect_s, "total_s": time.perf_counter() - t - connect_s,
            "streams": [asdict(r) for r in results]}


# ------------------------------------------------------------------------ a returning client


@dataclass
class TicketStore:
    """The last session ticket the server sent (aioquic's session_ticket_handler)."""

    ticket: Any = None

    def keep(self, ticket: Any) -> None:
        self.ticket = ticket


async def h3_first_token(host: str, port: int, ca_file: str, body: bytes, tickets: TicketStore,
                         use_ticket: bool) -> dict[str, Any]:
    """A new QUIC connection whose request goes out with the first flight: in 0-RTT data when
    `use_ticket` and a ticket allows early data, else as soon as the handshake completes."""
    from aioquic.asyncio.client import connect
    from aioquic.h3.connection import H3_ALPN
    from aioquic.quic.configuration import QuicConfiguration

    from edged.bench.h3_probe import ProbeProtocol

    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=host)
    config.load_verify_locations(ca_file)
    offered = tickets.ticket if use_ticket else None
    config.session_ticket = offered
    start = time.perf_counter()
    async with asyncio.timeout(REQUEST_TIMEOUT_S):
        async with connect(host, port, configuration=config, create_protocol=ProbeProtocol,
                           session_ticket_handler=tickets.keep, wait_connected=False) as proto:
            assert isinstance(proto, ProbeProtocol)
            proto.send_request(host, port, "/v1/chat/completions", HEADERS, body)
            await proto.first_token.wait()
            ttft = time.perf_counter() - start
            await proto.done.wait()
            await asyncio.sleep(0.01)  # a NewSessionTicket sent with the last frames
    return {"ttft_s": ttft, "ticket_offered": offered is not None,
            "early_data_offered": offered is not None and getattr(offered, "max_early_data_size", None) is not None,
            "early_data_accepted": proto.early_data_accepted, "session_resumed": proto.session_resumed,
            "error": proto.error}


async def h2_first_token(host: str, port: int, ca_file: str, body: bytes) -> dict[str, Any]:
    from edged.bench.h2_stream_client import H2StreamClient

    start = time.perf_counter()
    res = StreamResult()
    async with asyncio.timeout(REQUEST_TIMEOUT_S), \
            H2StreamClient(host, port, tls_context(ca_file), connect_timeout=CONNECT_TIMEOUT_S) as client:
        await time_sse(client.request("POST", "/v1/chat/completions", HEADERS, body), start, res)
    return {"ttft_s": res.ttft_s, "error": res.error}


async def handle(cmd: dict[str, Any], host: str, port: int, ca_file: str, tickets: TicketStore) -> dict[str, Any]:
    op = cmd["op"]
    if op == "streams":
        return await run_streams(cmd, host, port, ca_file)
    body = chat_body(f"Request {next(NONCE)}, a returning client: hello.", int(cmd.get("max_tokens", 8)),
                     int(cmd.get("seed", 0)))
    if op == "returning":
        if cmd["mode"] == "0rtt" and tickets.ticket is None:  # prime: a first visit leaves a ticket
            await h3_first_token(host, port, ca_file, body, tickets, use_ticket=False)
        return await h3_first_token(host, port, ca_file, body, tickets, use_ticket=cmd["mode"] == "0rtt")
    if op == "first_h2":
        return await h2_first_token(host, port, ca_file, body)
    raise ValueError(f"unknown op {op!r}")


async def serve_commands(host: str, port: int, ca_file: str) -> None:
    tickets = TicketStore()
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        try:
            out = await handle(json.loads(line), host, port, ca_file, tickets)
        except Exception as e:  # noqa: BLE001  (reported to the benchmark, which records the case as failed)
            out = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    import logging

    logging.getLogger("quic").setLevel(logging.ERROR)
    asyncio.run(serve_commands(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
