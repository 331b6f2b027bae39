"""Engine steps captured as CUDA graphs and replayed: decode steps per batch-size bucket, steps with
prompt tokens per token-count bucket.

A step launches a few hundred small kernels; eagerly, each costs tens of microseconds of host time
(a SmolLM2 step of a 30-token prompt: ~300 kernels, ~20-30 ms on the H200 machine against ~1 ms of
device work), so a step replayed from a graph is what keeps a first token, and a burst of prompts,
from waiting on Python. Inputs live in static buffers; a batch is padded up to its bucket with rows
that write nowhere (slot -1), and their outputs are ignored.
"""
from __future__ import annotations

import logging

import torch

from edged.models.batch import AttentionMetadata, KVCache
from edged.models.llama import LlamaModel

from .decode_inputs import DecodeInputs

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
        # the graphs' inputs: views into one buffer that a step fills with one copy (DecodeInputs.stage)
        self.inputs = DecodeInputs(max_batch, max_blocks_per_seq, dev)
        self.input_ids, self.positions = self.inputs.input_ids, self.inputs.positions
        self.slot_mapping, self.block_tables = self.inputs.slot_mapping, self.inputs.block_tables
        self.context_lens = self.inputs.context_lens
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

    def replay_staged(self, n: int) -> torch.Tensor:
        """Logits [n, vocab] for a decode step whose n rows `inputs.stage` has queued."""
        b = self.bucket_for(n)
        self.graphs[b].replay()
        return self.logits[b][:n]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] for a decode step of B <= max_batch sequences, from device tensors."""
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


# Token-count buckets of steps with prompt tokens; the engine's token budget is the last.
MIXED_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)


class MixedGraphs:
    """Steps that compute prompt tokens (prefill chunks, alone or beside decodes), one graph per
    token-count bucket. A step of T tokens in S sequences runs in the smallest bucket b >= T that has a
    spare sequence row (S <= min(b, max_seqs)): its sequences take the first S rows, the rows after
    them have no tokens, and the last row owns the b - T padding tokens (slot -1: they write nowhere;
    they attend over a few cached keys, so every row stays finite). The graph's logits are those of
    each sequence's last token; the runner keeps the rows it samples."""

    def __init__(self, model: LlamaModel, kv: KVCache, max_seqs: int, max_blocks_per_seq: int, max_tokens: int,
                 buckets: tuple[int, ...] = MIXED_TOKEN_BUCKETS, pool=None) -> None:
        self.model = model
        self.kv = kv
        self.max_seqs = max_seqs
        # the padding row attends over up to a bucket's tokens through one block-table row
        max_tokens = min(max_tokens, max_blocks_per_seq * kv.block_size)
        self.buckets = tuple(b for b in buckets if b < max_tokens) + (max_tokens,)
        rows = self.rows_for(max_tokens)
        dev = model.device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
        self.last_rows = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.logits: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = pool
        self.replays = 0

    def rows_for(self, bucket: int) -> int:
        """Sequence rows of a bucket's graph: as many sequences as it can hold, plus the padding row."""
        return min(bucket, self.max_seqs) + 1

    def bucket_for(self, tokens: int, seqs: int) -> int | None:
        for b in self.buckets:
            if b >= tokens and seqs < self.rows_for(b):
                return b
        return None

    def _meta(self, b: int) -> AttentionMetadata:
        r = self.rows_for(b)
        return AttentionMetadata(False, self.slot_mapping[:b], self.block_tables[:r], self.context_lens[:r],
                                 self.cu_seqlens[:r + 1])

    def _run(self, b: int) -> torch.Tensor:
        hidden = self.model.forward(self.input_ids[:b], self.positions[:b], self._meta(b), self.kv)
        return self.model.logits(hidden[self.last_rows[:self.rows_for(b)]])

    def _pad(self, b: int, tokens: int, seqs: int) -> None:
        """Rows seqs.. of bucket b hold no tokens but the last, which owns tokens..b."""
        r = self.rows_for(b)
        self.slot_mapping[tokens:b].fill_(-1)
        self.cu_seqlens[seqs + 1:r].fill_(tokens)
        self.cu_seqlens[r:r + 1].fill_(b)
        self.context_lens[seqs:r - 1].fill_(0)
        self.context_lens[r - 1:r].fill_(b - tokens)
        torch.sub(self.cu_seqlens[1:r + 1], 1, out=self.last_rows[:r])
        self.last_rows[:r].clamp_(min=0)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so smaller ones reuse its memory pool."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in sorted(self.buckets, reverse=True):
                self.cu_seqlens[:1].fill_(0)
                self._pad(b, 0, 0)  # the padding row alone: a valid layout to run while capturing
                self._run(b)  # warm-up: compiles kernels, settles allocations
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.logits[b] = self._run(b)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured prompt-step graphs for token counts %s", ",".join(map(str, sorted(self.buckets))))

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [S, vocab] of each sequence's last new token, for a step that bucket_for accepts."""
        n, s = input_ids.shape[0], meta.context_lens.shape[0]
        b = self.bucket_for(n, s)
        if b is None:
            raise ValueError(f"no graph for a step of {n} tokens in {s} sequences")
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:s, :width].copy_(meta.block_tables)
        self.context_lens[:s].copy_(meta.context_lens)
        self.cu_seqlens[:s + 1].copy_(meta.cu_seqlens_q)
        self._pad(b, n, s)
        self.graphs[b].replay()
        self.replays += 1
        return self.logits[b][:s]
