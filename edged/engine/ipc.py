"""The engine core <-> front-end worker wire: ZeroMQ sockets carrying msgpack messages.

Why ZeroMQ (pyzmq) rather than Unix sockets with length-prefixed msgpack: it is what vLLM's v1
engine client and SGLang's managers use, and it gives for free what we would otherwise write and
test ourselves - message framing, reconnection of a restarted worker under the same identity
(ROUTER_HANDOVER), dropping messages to a worker that is gone instead of blocking the core, and
background I/O threads, so the core's Python threads never wait on a socket.

Sockets, all `ipc://` files in the daemon's private run directory (mode 0700):

    core.in   PULL, bound by the core: every worker PUSHes requests, aborts and rate-limit asks.
    core.out  ROUTER, bound by the core: each worker connects a DEALER whose identity is its
              name ("w0", "w1", ...); the core sends each worker only its own streams' messages.

Messages are msgpack maps with a type "t". Worker -> core:

    {"t": "add", "id", "prompt", "sp", "tier", "arrival"}   a request (sp: SamplingParams fields)
    {"t": "abort", "ids": [...]}                            cancel sequences
    {"t": "rate", "q", "key", "rps", "burst"}               take one token of a key's rate limit
    {"t": "stats", "w", "q"}                                the engine's numbers now (a /metrics scrape)

Core -> worker:

    {"t": "ack", "id", "err"}   the request was admitted (err None) or refused: err = [status,
                                code, message, retry_after_s] (429: tier queue full or deadline unreachable)
    {"t": "out", "o": [[id, token_ids, finish_reason, error], ...]}
                                one message per engine step per worker with every new token of
                                every stream of that worker (never one message per token)
    {"t": "rate", "q", "wait"}  None: go ahead; else seconds until the key may send again
    {"t": "stats", "q", "s", "alive"}
                                the engine's metrics (metrics.EngineSnapshot) and whether its loop
                                makes progress: to every worker twice a second (q None; the
                                workers' health) and in answer to a "stats" ask

Request ids on the wire are the worker's engine id plus "@" and the worker's name, so ids are
unique across workers, the core knows whose a sequence is, and a log line still shows the
client's x-request-id.
"""
from __future__ import annotations

import os
from typing import Any

import msgpack

from .request import GenerationRequest, SamplingParams

CORE_IN = "core.in"
CORE_OUT = "core.out"


def address(run_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(run_dir, name)}"


def wire_id(request_id: str, worker: str) -> str:
    return f"{request_id}@{worker}"


def split_wire_id(wire: str) -> tuple[str, str]:
    """(request id, worker name) of a wire id."""
    rid, _, worker = wire.rpartition("@")
    return rid, worker


pack = msgpack.Packer(use_bin_type=True).pack


def unpack(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False, use_list=True)


def add_message(request: GenerationRequest, worker: str) -> bytes:
    sp = request.sampling
    return pack({"t": "add", "id": wire_id(request.request_id, worker), "prompt": request.prompt_token_ids,
                 "sp": [sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.max_tokens, sp.stop_token_ids,
                        sp.ignore_eos],
                 "tier": request.tier, "arrival": request.arrival_time})


def request_from(msg: dict[str, Any]) -> GenerationRequest:
    """The core's copy of a request (stop strings stay with the worker, which applies them)."""
    temperature, top_p, top_k, seed, max_tokens, stop_ids, ignore_eos = msg["sp"]
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens,
                              stop_token_ids=list(stop_ids), ignore_eos=ignore_eos)
    return GenerationRequest(msg["id"], list(msg["prompt"]), sampling, msg["tier"], msg["arrival"])
