"""Paged KV block manager with automatic prefix caching.

Blocks live in one preallocated pool. A full block is named by a hash chained over its tokens and
every block before it, so identical prefixes map to the same blocks; blocks are ref-counted, and
unreferenced ones stay cached until reused, least recently freed first. With a host tier, a named
block is copied to host memory when it is reused, and a later prefix lookup that misses on the
device copies it back, within a per-step byte budget.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .sequence import Sequence

if TYPE_CHECKING:
    from .host_kv_tier import HostKVTier


@dataclass(slots=True)
class BlockCounters:
    prefix_hits: int = 0  # sequences that reused at least one cached block
    prefix_tokens_reused: int = 0
    evictions: int = 0  # cached blocks reclaimed for new content


def chain_hash(previous: bytes, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 host_tier: HostKVTier | None = None, transfer_budget_bytes: int | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one slot")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.counters = BlockCounters()
        self._seq_hashes: dict[int, list[bytes]] = {}  # id(seq) -> hashes of its full blocks
        self.host_tier = host_tier if prefix_caching else None
        self.transfer_budget_bytes = transfer_budget_bytes  # host -> device bytes per step; None: unlimited
        self.step_restore_bytes = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that seq's table covers its first num_tokens tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def begin_step(self) -> None:
        """A new engine step: its host -> device byte budget starts afresh."""
        self.step_restore_bytes = 0

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:
            if self.host_tier is not None:
                self.host_tier.save(block, old)
            self.cached.pop(old, None)
            self.block_hash[block] = None
            self.counters.evictions += 1
        self.ref_count[block] = 1
        return block

    def _ref(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def attach_prefix(self, seq: Sequence) -> int:
        """Give a new sequence the cached blocks of its longest cached prefix; returns tokens reused.
        At least one token is left to compute, since the step needs its logits."""
        if not self.prefix_caching or seq.block_table:
            return 0
        hashes: list[bytes] = []
        for previous in self._leading_block_hashes(seq.token_ids):
            block = self.cached.get(previous)
            if block is not None:
                self._ref(block)
            elif (block := self._restore(previous)) is None:
                break
            hashes.append(previous)
            seq.block_table.append(block)
        reused = len(hashes) * self.block_size
        self._seq_hashes[id(seq)] = hashes
        seq.num_computed = seq.num_cached_prefix = reused
        if reused:
            self.counters.prefix_hits += 1
            self.counters.prefix_tokens_reused += reused
        return reused

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of a prompt attach_prefix would find cached now (on the device or the
        host tier), without taking anything: admission's estimate of what is left to compute. Safe to
        call from another thread: it only hashes and tests dict membership."""
        if not self.prefix_caching:
            return 0
        host = self.host_tier
        reused = 0
        for h in self._leading_block_hashes(token_ids):
            if h not in self.cached and (host is None or h not in host):
                break
            reused += self.block_size
        return reused

    def _leading_block_hashes(self, token_ids: list[int]) -> Iterator[bytes]:
        """The chained hashes of a prompt's full blocks, first to last, short of its last token (the
        step that computes it gives the logits)."""
        bs = self.block_size
        previous = b""
        for i in range((len(token_ids) - 1) // bs):
            previous = chain_hash(previous, token_ids[i * bs:(i + 1) * bs])
            yield previous

    def _restore(self, block_hash: bytes) -> int | None:
        """Copy a block from the host tier into a free device block, named and referenced like a
        device hit; None when the host lacks it, no block is free or the step's budget is spent."""
        tier = self.host_tier
        if tier is None or not self.free or not tier.lookup(block_hash):
            return None
        cost = tier.bytes_per_block
        if self.transfer_budget_bytes is not None and self.step_restore_bytes + cost > self.transfer_budget_bytes:
            return None
        block = self._take_free()  # may spill its old content first: same stream, so read before overwritten
        if not tier.restore(block_hash, block):  # that spill dropped the entry itself (a one-block tier)
            self.ref_count[block] = 0
            self.free[block] = None
            self.free.move_to_end(block, last=False)
            return None
        self.step_restore_bytes += cost
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash
        return block

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to cover num_tokens tokens; False (nothing taken) if blocks lack."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def commit(self, seq: Sequence) -> None:
        """Name the blocks that this step filled so later requests can share them."""
        if not self.prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(id(seq), [])
        bs = self.block_size
        while (len(hashes) + 1) * bs <= seq.num_computed:
            i = len(hashes)
            h = chain_hash(hashes[-1] if hashes else b"", seq.token_ids[i * bs:(i + 1) * bs])
            hashes.append(h)
            block = seq.block_table[i]
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block] = h

    def release(self, seq: Sequence) -> None:
        """Drop seq's references; blocks nobody holds go back to the pool (kept cached if named)."""
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
        seq.block_table.clear()
        seq.num_computed = 0
        self._seq_hashes.pop(id(seq), None)
