"""Which requests may be answered from QUIC 0-RTT data (TLS early data), which an attacker can replay.

The rule (RFC 8470's spirit, decided per request rather than with 425 Too Early):

- GET and HEAD: safe (no route has side effects).
- POST /v1/chat/completions and /v1/completions: safe when the generation is deterministic, i.e.
  greedy (temperature 0, given or the model's default) or seeded: a replay yields the same tokens
  and, with the result cache on, is answered from it without engine work.
- anything else (sampled generations, unknown routes, bodies that do not parse): not safe; such a
  request received as early data waits until the handshake completes (which a replayer cannot do).

Tickets are also single-use (quic_tickets.py), so one daemon accepts a given 0-RTT flight once.
"""
from __future__ import annotations

from collections.abc import Mapping

from edged.server import openai_wire as wire

GENERATION_PATHS = {"/v1/chat/completions": wire.parse_chat_request, "/v1/completions": wire.parse_completion_request}


def replay_safe(method: str, path: str, body: bytes, sampling_defaults: Mapping[str, float | int]) -> bool:
    """True when answering this request twice does no harm (see the module docstring)."""
    if method in ("GET", "HEAD"):
        return True
    parse = GENERATION_PATHS.get(path.rstrip("/"))
    if method != "POST" or parse is None:
        return False
    try:
        p = parse(body)
    except wire.WireError:
        return False  # answered (400) once the handshake completes
    s = p.sampling
    if s.seed is not None:
        return True
    temperature = s.temperature if "temperature" in p.sampling_given else \
        float(sampling_defaults.get("temperature", s.temperature))
    return temperature == 0
