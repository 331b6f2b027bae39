"""Pinned host buffers allocated once and handed out in turn, for copies between host and device.

A fresh pinned tensor a copy costs tens of microseconds of host time (the caching host allocator, and
cudaHostAlloc while earlier copies still hold its blocks); a step of a small model on the H200 leaves
less than that. A buffer is handed out again only once the device work recorded against it has run.
"""
from __future__ import annotations

import torch


class PinnedRing:
    def __init__(self, nbytes: int, depth: int, device: torch.device) -> None:
        if depth < 2:
            raise ValueError("a ring needs at least two buffers")
        self.on_cuda = device.type == "cuda"
        self.buffers = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.on_cuda) for _ in range(depth)]
        self._events = [torch.cuda.Event() if self.on_cuda else None for _ in range(depth)]
        self._generations = [0] * depth
        self._next = 0

    def acquire(self) -> tuple[int, int]:
        """The next buffer's index and generation, once the device is done with it."""
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        event = self._events[i]
        if event is not None:
            event.synchronize()  # returns at once for an event never recorded
        self._generations[i] += 1
        return i, self._generations[i]

    def record(self, i: int) -> None:
        """Mark buffer i in use by the device work queued so far on the current stream."""
        event = self._events[i]
        if event is not None:
            event.record()

    def wait(self, i: int) -> None:
        event = self._events[i]
        if event is not None:
            event.synchronize()

    def holds(self, i: int, generation: int) -> bool:
        """Whether buffer i still holds what was written under `generation` (not handed out since)."""
        return self._generations[i] == generation
