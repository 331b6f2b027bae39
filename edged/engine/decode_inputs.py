"""A decode step's inputs, written into pinned host memory and sent to the device in one copy.

The decode graphs read their inputs from static device tensors. Here those tensors are views into one
device buffer whose byte layout the pinned host buffers share, so a step's token ids, positions, KV
slots, context lengths, block tables and placeholder indices travel in a single copy. Built as one
tensor each (torch.tensor, pin_memory, a copy), the same inputs cost ~340 us of host time a step on the
H200 machine, against ~450 us of device work for a batch-1 SmolLM2 step.
"""
from __future__ import annotations

import numpy as np
import torch

from .pinned_ring import PinnedRing

INT64_FIELDS = ("input_ids", "positions", "slot_mapping", "fill_rows", "fill_from")
RING_DEPTH = 4  # steps whose inputs may still be in flight: two overlapped, and room to spare


class DecodeInputs:
    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device,
                 depth: int = RING_DEPTH) -> None:
        self.max_batch = max_batch
        self.max_blocks = max_blocks_per_seq
        self.row_bytes = 4 * max_blocks_per_seq
        # int64 fields, then int32 context lengths (padded to 8 bytes), then the block-table rows last,
        # so that a step sends the fixed part and only the rows it uses
        self.header_bytes = 8 * len(INT64_FIELDS) * max_batch + 8 * (-(-max_batch // 2))
        nbytes = self.header_bytes + max_batch * self.row_bytes
        self.device_buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        dev = self._views(self.device_buffer)
        self.input_ids, self.positions, self.slot_mapping = dev["input_ids"], dev["positions"], dev["slot_mapping"]
        self.fill_rows, self.fill_from = dev["fill_rows"], dev["fill_from"]
        self.context_lens, self.block_tables = dev["context_lens"], dev["block_tables"]
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)
        self.ring = PinnedRing(nbytes, depth, device)
        self._host = [{k: v.numpy() for k, v in self._views(buf).items()} for buf in self.ring.buffers]

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        mb, views, at = self.max_batch, {}, 0
        for name in INT64_FIELDS:
            views[name] = buf[at:at + 8 * mb].view(torch.int64)
            at += 8 * mb
        views["context_lens"] = buf[at:at + 4 * mb].view(torch.int32)
        views["block_tables"] = buf[self.header_bytes:].view(torch.int32).view(mb, self.max_blocks)
        return views

    def stage(self, ids: list[int], positions: list[int], slots: list[int], context_lens: list[int],
              tables: list[list[int]], fill_rows: list[int], fill_from: list[int], bucket: int) -> None:
        """Queue the copy of n = len(ids) rows' inputs; rows n..bucket are padding that writes no KV
        (slot -1) and attends over one position. Block-table entries past a row's table are left as
        they were: attention reads only the blocks its context length covers."""
        n = len(ids)
        if not 0 < n <= bucket <= self.max_batch:
            raise ValueError(f"a decode step of {n} rows in a bucket of {bucket} (max {self.max_batch})")
        i, _ = self.ring.acquire()
        h = self._host[i]
        h["input_ids"][:n] = ids
        h["positions"][:n] = positions
        h["slot_mapping"][:n] = slots
        h["slot_mapping"][n:bucket] = -1
        h["context_lens"][:n] = context_lens
        h["context_lens"][n:bucket] = 1
        k = len(fill_rows)
        if k:
            h["fill_rows"][:k] = fill_rows
            h["fill_from"][:k] = fill_from
        rows = h["block_tables"]
        for r, table in enumerate(tables):
            if len(table) > self.max_blocks:
                raise ValueError(f"a block table of {len(table)} blocks (max {self.max_blocks})")
            rows[r, :len(table)] = table
        nbytes = self.header_bytes + n * self.row_bytes
        self.device_buffer[:nbytes].copy_(self.ring.buffers[i][:nbytes], non_blocking=self.ring.on_cuda)
        self.ring.record(i)

    def fill_placeholders(self, count: int, tokens: torch.Tensor, in_order: bool) -> None:
        """input_ids[fill_rows[j]] = tokens[fill_from[j]] for the first `count` staged pairs, on the
        device (tokens sampled by the step still in flight); in_order: the pairs are (j, j)."""
        if in_order:
            self.input_ids[:count].copy_(tokens[:count])
        else:
            self.input_ids.index_copy_(0, self.fill_rows[:count], tokens.index_select(0, self.fill_from[:count]))
