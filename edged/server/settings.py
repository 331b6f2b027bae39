"""What the HTTP front end needs from the config, resolved once (edged/server/worker.py builds it)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class ApiKeyPolicy:
    """What one API key may do (ServerSettings.api_keys is keyed by the sha256 hex of the key)."""

    name: str
    tier: str | None = None  # None: ServerSettings.default_tier
    rate_limit_rps: float | None = None  # None: unlimited
    burst: int | None = None  # None: max(1, ceil(rate_limit_rps))


@dataclass(slots=True)
class ServerSettings:
    """What the HTTP front end (HTTP/3, and HTTP/2 + HTTP/1.1 over TCP) needs from config; may be
    replaced while running (live reload)."""

    max_body_bytes: int = 1 << 20  # larger bodies: 413, as soon as the limit is crossed
    default_max_tokens: int = 256  # when a request gives none (also capped by the limits and the room left)
    max_tokens_limit: int | None = None  # an explicit max_tokens above this: 400
    max_prompt_tokens: int | None = None  # longer prompts: 400 (None: max_model_len - 1)
    tiers: tuple[str, ...] | None = None  # known tier names; None: accept any well-formed name
    default_tier: str = "default"  # tier of a request that names none (and of keys without one)
    tier_max_tokens: dict[str, int] = field(default_factory=dict)  # per-tier cap under max_tokens_limit
    api_keys: dict[str, ApiKeyPolicy] | None = None  # sha256(key) hex -> policy; None: no authentication
    request_timeout_s: float | None = None  # generation running longer is ended with an error
    max_concurrent_streams: int = 128  # per connection: QUIC MAX_STREAMS / HTTP/2 SETTINGS (new connections only)
    body_timeout_s: float = 30.0  # headers not complete within this: reset; the body not within this after them: 408
    idle_timeout_s: float = 60.0  # QUIC idle timeout (new connections only); TCP: closed when idle this long
    keepalive_s: float = 15.0  # PING interval while a connection has requests in flight
    # unacknowledged bytes per stream (QUIC) / bytes in the TCP write buffer before a write waits; HTTP/2
    # writes also wait while the stream's flow-control window is closed
    send_high_water: int = 256 * 1024
    send_stall_timeout_s: float = 30.0  # a client that acknowledges nothing for this long is dropped
    max_datagram_frame_size: int = 65536
    drain_retry_after_s: int = 5  # Retry-After of the 503 sent while shutting down
    access_log: bool = True  # one INFO line per finished request (else DEBUG)
    allow_special_tokens_in_prompt: bool = False  # /v1/completions text may write control tokens
    worker: str | None = None  # the front-end worker's name, sent as x-edged-worker (matches its log lines)
    # QUIC (quic_listener.py, quic_tickets.py, quic_early_data.py); per worker process
    zero_rtt: bool = True  # issue session tickets and accept 0-RTT (replay-safe requests only run early)
    quic_max_connections: int = 2048  # more: new connections refused
    quic_max_connections_per_address: int = 256  # from one client IP
    quic_retry_above_per_s: float = 200.0  # new handshakes/s above which Initials get a Retry; 0: always
    quic_retry_above_unvalidated_per_address: int = 8  # unproven handshakes in flight from one IP; more: Retry
    quic_handshake_timeout_s: float = 10.0  # a handshake not complete by then: the connection is closed
    quic_congestion_control: str = "reno-floor"  # aioquic's name; reno-floor: quic_congestion.py
    quic_duplicate_datagram_bytes: int = 1500  # 1-RTT datagrams sent twice (quic_redundancy.py); 0: off
    quic_duplicate_delay_s: float = 0.002
    quic_duplicate_after_loss_s: float = 30.0  # only this long after the connection's last loss; 0: always
