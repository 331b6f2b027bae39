"""A graph's inputs, written into pinned host memory and sent to the device in one copy.

CUDA graphs read their inputs from static device tensors. Here those tensors are views into one
device buffer whose byte layout the pinned host buffers share, so a step's token ids, positions, KV
slots, sequence lengths, block tables and placeholder indices travel in a single copy. Built as one
tensor each (torch.tensor, pin_memory, a copy) and copied into the static tensors, the same inputs
cost ~460 us of host time a decode step on the H200 machine, against ~450 us of device work for a
batch-1 SmolLM2 step.
"""
from __future__ import annotations

import numpy as np
import torch

from .pinned_ring import PinnedRing

RING_DEPTH = 4  # steps whose inputs may still be in flight: two overlapped, and room to spare
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


class StagedInputs:
    """Named integer fields, then a block table [table_rows, max_blocks] (last, so that a step sends
    the fields and only the table rows it uses)."""

    def __init__(self, fields: dict[str, tuple[torch.dtype, int]], table_rows: int, max_blocks: int,
                 device: torch.device, depth: int = RING_DEPTH) -> None:
        self.table_rows, self.max_blocks = table_rows, max_blocks
        self.row_bytes = 4 * max_blocks
        self._layout: dict[str, tuple[torch.dtype, int, int]] = {}
        at = 0
        for name, (dtype, length) in fields.items():
            if dtype not in _NUMPY:
                raise ValueError(f"{name}: only int64 and int32 fields")
            self._layout[name] = (dtype, at, length)
            at += -(-length * dtype.itemsize // 8) * 8  # each field 8-byte aligned
        self.header_bytes = at
        nbytes = at + table_rows * self.row_bytes
        self.device_buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.views = self._views(self.device_buffer)
        self.ring = PinnedRing(nbytes, depth, device)
        self._host = [{k: v.numpy() for k, v in self._views(buf).items()} for buf in self.ring.buffers]
        self._slot: int | None = None

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        views = {name: buf[at:at + length * dtype.itemsize].view(dtype)
                 for name, (dtype, at, length) in self._layout.items()}
        views["block_tables"] = buf[self.header_bytes:].view(torch.int32).view(self.table_rows, self.max_blocks)
        return views

    def begin(self) -> dict[str, np.ndarray]:
        """The next host buffer to write a step's inputs into (numpy views by field name). Entries
        left unwritten keep an earlier step's values: every field is sent whole each step."""
        self._slot, _ = self.ring.acquire()
        return self._host[self._slot]

    def write_tables(self, tables: list[list[int]]) -> None:
        """Row r of the block table takes tables[r]; entries past it keep what they held (attention
        reads only the blocks its context length covers)."""
        rows = self._host[self._slot]["block_tables"]
        for r, table in enumerate(tables):
            if len(table) > self.max_blocks:
                raise ValueError(f"a block table of {len(table)} blocks (max {self.max_blocks})")
            rows[r, :len(table)] = table

    def send(self, table_rows: int) -> None:
        """Queue the copy of the fields and the first table_rows rows of the block table."""
        i, self._slot = self._slot, None
        if i is None:
            raise RuntimeError("send() without begin()")
        nbytes = self.header_bytes + table_rows * self.row_bytes
        self.device_buffer[:nbytes].copy_(self.ring.buffers[i][:nbytes], non_blocking=self.ring.on_cuda)
        self.ring.record(i)

    def fill_placeholders(self, count: int, tokens: torch.Tensor, in_order: bool) -> None:
        """input_ids[fill_rows[j]] = tokens[fill_from[j]] for the first `count` staged pairs, on the
        device (tokens sampled by the step still in flight); in_order: the pairs are (j, j)."""
        ids = self.views["input_ids"]
        if in_order:
            ids[:count].copy_(tokens[:count])
        else:
            ids.index_copy_(0, self.views["fill_rows"][:count], tokens.index_select(0, self.views["fill_from"][:count]))
