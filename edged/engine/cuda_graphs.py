"""Decode steps captured as CUDA graphs, one per batch-size bucket, and replayed.

A decode step launches a few hundred small kernels; replaying a captured graph removes the
per-launch CPU cost. Inputs live in static buffers; a batch is padded up to its bucket with rows
that write nowhere (slot -1) and attend over one token, and their outputs are ignored.
"""
from __future__ import annotations

import logging

import torch

from edged.models.batch import AttentionMetadata, KVCache
from edged.models.llama import LlamaModel

log = logging.getLogger("edged.engine")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv: KVCache, max_batch: int, max_blocks_per_seq: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        self.model = model
        self.kv = kv
        self.buckets = tuple(b for b in buckets if b < max_batch) + (max_batch,)
        self.max_batch = max_batch
        dev = model.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.logits: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(True, self.slot_mapping[:b], self.block_tables[:b], self.context_lens[:b],
                                 self.cu_seqlens[:b + 1])

    def _run(self, b: int) -> torch.Tensor:
        hidden = self.model.forward(self.input_ids[:b], self.positions[:b], self._meta(b), self.kv)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the largest bucket first so smaller ones reuse its memory pool."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in sorted(self.buckets, reverse=True):
                self._run(b)  # warm-up: compiles kernels, settles allocations
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.logits[b] = self._run(b)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured decode graphs for batch sizes %s", ",".join(map(str, sorted(self.buckets))))

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] for a decode step of B <= max_batch sequences."""
        n = input_ids.shape[0]
        b = self.bucket_for(n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:b].fill_(-1)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.context_lens[:n].copy_(meta.context_lens)
        self.context_lens[n:b].fill_(1)
        self.graphs[b].replay()
        return self.logits[b][:n]
