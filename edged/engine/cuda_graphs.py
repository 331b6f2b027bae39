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

import numpy as np
import torch

from edged import kernels
from edged.models.batch import AttentionMetadata, KVCache
from edged.models.llama import LlamaModel

from .staged_inputs import StagedInputs
from .step_inputs import StepInputs

log = logging.getLogger("edged.engine")

# 3: three sequences take the GEMV of several x rows (grouped w8) where 4 take the matmul; on the H200 the
# engine's overlapped steps at 3 rows: 8B w8 657 tok/s (4.59 ms a step against 5.31 padded to 4), 1B w8 2,576
# (1.17 ms against 1.27) (docs/BENCHMARKS.md, session 25)
DEFAULT_BUCKETS = (1, 2, 3, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv: KVCache, max_batch: int, max_blocks_per_seq: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        self.model = model
        self.kv = kv
        self.buckets = tuple(b for b in buckets if b < max_batch) + (max_batch,)
        self.max_batch = max_batch
        dev = model.device
        # the graphs' inputs: views into one buffer that a step fills with one copy (stage)
        i64, i32, mb = torch.int64, torch.int32, max_batch
        self.inputs = StagedInputs({"input_ids": (i64, mb), "positions": (i64, mb), "slot_mapping": (i64, mb),
                                    "fill_rows": (i64, mb), "fill_from": (i64, mb), "context_lens": (i32, mb)},
                                   mb, max_blocks_per_seq, dev)
        v = self.inputs.views
        self.input_ids, self.positions, self.slot_mapping = v["input_ids"], v["positions"], v["slot_mapping"]
        self.block_tables, self.context_lens = v["block_tables"], v["context_lens"]
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)
        self.cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.logits: dict[int, torch.Tensor] = {}
        self.greedy: dict[int, torch.Tensor] = {}  # each row's argmax, computed by the graph
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
                kernels.argmax(self._run(b))  # warm-up: compiles kernels, settles allocations
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.logits[b] = self._run(b)
                    # greedy tokens in the graph: a separate launch costs ~50 us of host time a step
                    self.greedy[b] = kernels.argmax(self.logits[b])
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured decode graphs for batch sizes %s", ",".join(map(str, sorted(self.buckets))))

    def stage(self, step: StepInputs) -> None:
        """Queue the copy of a decode step's inputs (n <= max_batch one-token rows); rows n.. of its
        bucket are padding that writes no KV (slot -1) and attends over one position."""
        n = len(step.ids)
        b = self.bucket_for(n)
        if n == 0 or b is None:
            raise ValueError(f"no decode graph for {n} rows (max {self.max_batch})")
        h = self.inputs.begin()
        h["input_ids"][:n] = step.ids
        h["positions"][:n] = step.positions
        h["slot_mapping"][:n] = step.slots
        h["slot_mapping"][n:b] = -1
        h["context_lens"][:n] = step.context_lens
        h["context_lens"][n:b] = 1
        _stage_fills(h, step)
        self.inputs.write_tables(step.tables)
        self.inputs.send(n)

    def replay_staged(self, n: int) -> torch.Tensor:
        """Logits [n, vocab] for the decode step of n rows that `stage` queued."""
        b = self.bucket_for(n)
        self.graphs[b].replay()
        return self.logits[b][:n]

    def greedy_tokens(self, n: int) -> torch.Tensor:
        """The greedy tokens of the step just replayed, as a tensor of their own (the graph's output
        is overwritten by its next replay, while a step's tokens are still read after that)."""
        return self.greedy[self.bucket_for(n)][:n].clone()


def _stage_fills(h: dict[str, np.ndarray], step: StepInputs) -> None:
    k = len(step.fill_rows)
    if k:
        h["fill_rows"][:k] = step.fill_rows
        h["fill_from"][:k] = step.fill_from


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
        i64, i32, mt = torch.int64, torch.int32, max_tokens
        self.inputs = StagedInputs({"input_ids": (i64, mt), "positions": (i64, mt), "slot_mapping": (i64, mt),
                                    "fill_rows": (i64, rows), "fill_from": (i64, rows), "last_rows": (i64, rows),
                                    "context_lens": (i32, rows), "cu_seqlens": (i32, rows + 1)},
                                   rows, max_blocks_per_seq, model.device)
        v = self.inputs.views
        self.input_ids, self.positions, self.slot_mapping = v["input_ids"], v["positions"], v["slot_mapping"]
        self.block_tables, self.context_lens = v["block_tables"], v["context_lens"]
        self.cu_seqlens, self.last_rows = v["cu_seqlens"], v["last_rows"]
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

    def stage(self, step: StepInputs, bucket: int | None = None) -> tuple[int, int]:
        """Queue the copy of a step's inputs (T tokens in S sequences) into the bucket that bucket_for
        gives, or `bucket`: rows S.. hold no tokens but the last, which owns the padding tokens T..b.
        Returns (b, S)."""
        n, s = len(step.ids), len(step.context_lens)
        b = bucket or self.bucket_for(n, s)
        if b is None or n > b or s >= self.rows_for(b):
            raise ValueError(f"no graph for a step of {n} tokens in {s} sequences")
        r = self.rows_for(b)
        h = self.inputs.begin()
        h["input_ids"][:n] = step.ids
        h["positions"][:n] = step.positions
        h["slot_mapping"][:n] = step.slots
        h["slot_mapping"][n:b] = -1
        cu = h["cu_seqlens"]
        cu[:s + 1] = step.cu_seqlens
        cu[s + 1:r] = n
        cu[r] = b
        ctx = h["context_lens"]
        ctx[:s] = step.context_lens
        ctx[s:r - 1] = 0
        ctx[r - 1] = b - n
        np.maximum(cu[1:r + 1] - 1, 0, out=h["last_rows"][:r])
        _stage_fills(h, step)
        self.inputs.write_tables(step.tables)
        self.inputs.send(r)
        return b, s

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so smaller ones reuse its memory pool."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in sorted(self.buckets, reverse=True):
                self.stage(StepInputs(), b)  # the padding row alone: a valid layout to run while capturing
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

    def replay_staged(self, b: int, s: int) -> torch.Tensor:
        """Logits [S, vocab] of each sequence's last new token, for the step `stage` queued."""
        self.graphs[b].replay()
        self.replays += 1
        return self.logits[b][:s]
