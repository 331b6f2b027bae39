"""Per-API-key rate limits: a token bucket per key name, kept in the engine core so that a limit of
N requests/s admits N per second across all front-end workers, not N per worker."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class RatePolicy:
    name: str
    rate_limit_rps: float | None
    burst: int | None


class RateLimiter:
    """Token bucket per key name: `burst` requests at once, refilled at `rate_limit_rps`."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # key name -> (tokens, last refill time)

    def take(self, policy: RatePolicy) -> float | None:
        """None if the request may run; else the seconds (at least 1) until it may."""
        rps = float(policy.rate_limit_rps or 0)
        if rps <= 0:
            return None
        burst = float(policy.burst or max(1, math.ceil(rps)))
        now = time.monotonic()
        tokens, last = self._buckets.get(policy.name, (burst, now))
        tokens = min(burst, tokens + (now - last) * rps)
        if tokens < 1.0:
            self._buckets[policy.name] = (tokens, now)
            return float(max(1, math.ceil((1.0 - tokens) / rps)))
        self._buckets[policy.name] = (tokens - 1.0, now)
        return None
