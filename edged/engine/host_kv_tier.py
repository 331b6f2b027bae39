"""Host tier of the prefix cache: named KV blocks evicted from the device pool wait in host memory.

The pool holds block-shaped slots for every layer's K and V (and int8 scales), pinned when the
KV cache is on CUDA so that copies are asynchronous DMA. Entries are keyed by the block's chained
content hash and dropped least recently used first. Copies go on the current stream, the one the
forward runs on, so a restored block is complete before any kernel reads it and an evicted block
is read before it is overwritten; the CPU never reads the pool, so it never has to synchronize.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from edged.models.batch import KVCache


@dataclass(slots=True)
class HostTierCounters:
    spilled: int = 0  # evicted device blocks copied to the host
    restored: int = 0  # host blocks copied back into the device pool
    hits: int = 0  # prefix lookups the host held (restored, or left to recompute by the step budget)
    misses: int = 0
    dropped: int = 0  # host entries overwritten to make room, least recently used first
    bytes_spilled: int = 0
    bytes_restored: int = 0


class HostKVTier:
    def __init__(self, kv: KVCache, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("the host KV tier needs at least one block")
        self.capacity = capacity_blocks
        self.pinned = kv.k[0].device.type == "cuda"
        device = [*kv.k, *kv.v, *(kv.k_scale or []), *(kv.v_scale or [])]
        host = [torch.empty((capacity_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=self.pinned) for t in device]
        self._pairs = list(zip(device, host))  # (device pool, host pool) per layer and kind
        self.bytes_per_block = sum(d[0].numel() * d.element_size() for d in device)
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # content hash -> host slot, least recent first
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self.counters = HostTierCounters()

    @property
    def nbytes(self) -> int:
        return self.capacity * self.bytes_per_block

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.slots

    def save(self, block: int, block_hash: bytes) -> None:
        """Copy device block `block` (content named block_hash) to a host slot."""
        if block_hash in self.slots:  # the same content is already here (restored earlier)
            self.slots.move_to_end(block_hash)
            return
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self.slots.popitem(last=False)
            self.counters.dropped += 1
        for dev, host in self._pairs:
            host[slot].copy_(dev[block], non_blocking=self.pinned)
        self.slots[block_hash] = slot
        self.counters.spilled += 1
        self.counters.bytes_spilled += self.bytes_per_block

    def lookup(self, block_hash: bytes) -> bool:
        """Whether the host holds block_hash; counts a hit or a miss and keeps a hit recent."""
        if block_hash in self.slots:
            self.slots.move_to_end(block_hash)
            self.counters.hits += 1
            return True
        self.counters.misses += 1
        return False

    def restore(self, block_hash: bytes, block: int) -> bool:
        """Copy the host copy of block_hash into device block `block`; False if the host lacks it.
        The host copy stays, so a later eviction of the same content costs no copy."""
        slot = self.slots.get(block_hash)
        if slot is None:
            return False
        for dev, host in self._pairs:
            dev[block].copy_(host[slot], non_blocking=self.pinned)
        self.slots.move_to_end(block_hash)
        self.counters.restored += 1
        self.counters.bytes_restored += self.bytes_per_block
        return True
