"""Sampled tokens copied back to the host behind their step, into pinned buffers reused in turn."""
from __future__ import annotations

import torch

from .pinned_ring import PinnedRing

READBACK_TOKENS = 1024  # sampled tokens a step reads back through the ring
READBACK_DEPTH = 8  # steps whose tokens may be unread at once (two while steps overlap)


class TokenReadback:
    """Pinned buffers, reused in turn, that sampled tokens are copied into behind their step."""

    def __init__(self, capacity: int, device: torch.device, depth: int = READBACK_DEPTH) -> None:
        self.capacity = capacity
        self.ring = PinnedRing(8 * capacity, depth, device)
        self._host = [buf.view(torch.int64) for buf in self.ring.buffers]

    def start(self, tokens: torch.Tensor) -> tuple[int, int] | None:
        """Queue the copy of tokens (int64 on the device); None if they do not fit a buffer."""
        n = tokens.shape[0]
        if n > self.capacity:
            return None
        i, generation = self.ring.acquire()
        self._host[i][:n].copy_(tokens, non_blocking=True)
        self.ring.record(i)
        return i, generation

    def read(self, ticket: tuple[int, int], n: int) -> list[int]:
        i, generation = ticket
        self.ring.wait(i)
        if not self.ring.holds(i, generation):
            raise RuntimeError("a step's tokens were overwritten before they were read")
        return self._host[i][:n].tolist()
