"""Turns a step plan into tensors, runs the model, and samples the next tokens."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from edged import kernels
from edged.models.batch import AttentionMetadata, KVCache
from edged.models.llama import LlamaModel
from edged.scheduler.batcher import StepPlan

from .cuda_graphs import DecodeGraphs, MixedGraphs
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self.block_size = kv.block_size
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None

    def enable_cuda_graphs(self, max_batch: int, max_model_len: int, max_tokens: int | None = None) -> None:
        """Capture decode graphs for batches up to max_batch and, given max_tokens (the step token
        budget), graphs of steps with prompt tokens up to that many (CUDA only)."""
        if self.device.type != "cuda":
            return
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv, max_batch, max_blocks)
        self.graphs.capture()
        if max_tokens:
            self.mixed_graphs = MixedGraphs(self.model, self.kv, max_batch, max_blocks, max_tokens,
                                            pool=self.graphs.pool)
            self.mixed_graphs.capture()

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def prepare(self, plan: StepPlan, prev: LaunchedStep | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """input ids, positions, attention metadata, and the rows whose logits are sampled.
        A PLACEHOLDER input token (sampled by `prev`, still on the device) is filled on the device."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []
        fill_rows: list[int] = []
        fill_from: list[int] = []
        bs = self.block_size
        for chunk in plan.chunks:
            seq, start = chunk.seq, chunk.seq.num_computed
            end = start + chunk.num_new_tokens
            new = seq.token_ids[start:end]
            if PLACEHOLDER in new:
                if prev is None:
                    raise RuntimeError(f"sequence {seq.request_id} has an unsampled token but no step in flight")
                for i, t in enumerate(new):
                    if t == PLACEHOLDER:
                        fill_rows.append(len(ids) + i)
                        fill_from.append(prev.row_of(seq, start + i))
            ids.extend(new)
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu.append(cu[-1] + chunk.num_new_tokens)
            context_lens.append(end)
            if chunk.completes_prompt:
                sample_rows.append(cu[-1] - 1)
        width = max(len(c.seq.block_table) for c in plan.chunks)
        tables = [c.seq.block_table + [0] * (width - len(c.seq.block_table)) for c in plan.chunks]
        meta = AttentionMetadata(
            is_decode=plan.is_decode,
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor(tables, torch.int32),
            context_lens=self._tensor(context_lens, torch.int32),
            cu_seqlens_q=self._tensor(cu, torch.int32),
        )
        input_ids = self._tensor([0 if t == PLACEHOLDER else t for t in ids], torch.int64)
        if fill_rows:
            input_ids[self._tensor(fill_rows, torch.int64)] = prev.tokens[self._tensor(fill_from, torch.int64)]
        return input_ids, self._tensor(positions, torch.int64), meta, sample_rows

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: LaunchedStep | None = None,
               between_layers: Callable[[], None] | None = None) -> LaunchedStep:
        """Queue one step on the device and return at once; its tokens reach the host when asked.
        between_layers goes to the model's eager forward (LlamaModel.forward), not into graphs."""
        input_ids, positions, meta, rows = self.prepare(plan, prev)
        sampled = [c.seq for c in plan.chunks if c.completes_prompt]
        index = [c.seq.num_tokens for c in plan.chunks if c.completes_prompt]
        mixed = self.mixed_graphs
        if not meta.is_decode and mixed is not None and mixed.bucket_for(input_ids.shape[0], len(plan.chunks)):
            logits = mixed.replay(input_ids, positions, meta)  # each sequence's last token
            if not rows:
                return LaunchedStep(plan, [], [], None)
            if len(rows) < len(plan.chunks):  # keep the sequences whose prompt this step completes
                logits = logits[self._tensor([i for i, c in enumerate(plan.chunks) if c.completes_prompt],
                                             torch.int64)]
        elif not rows:
            self.model.forward(input_ids, positions, meta, self.kv, between_layers)
            return LaunchedStep(plan, [], [], None)
        elif meta.is_decode and self.graphs is not None and self.graphs.bucket_for(len(rows)) is not None:
            logits = self.graphs.replay(input_ids, positions, meta)
        else:
            hidden = self.model.forward(input_ids, positions, meta, self.kv, between_layers)
            logits = self.model.logits(hidden[self._tensor(rows, torch.int64)])
        sp = [s.request.sampling for s in sampled]
        if all(p.temperature <= 0 for p in sp):
            tokens = kernels.argmax(logits)  # decided on the host: no device sync before the next launch
        else:
            tokens = kernels.sample(
                logits,
                self._tensor([p.temperature for p in sp], torch.float32),
                self._tensor([p.top_k for p in sp], torch.int64),
                self._tensor([p.top_p for p in sp], torch.float32),
                self._tensor([s.seed for s in sampled], torch.int64),
                self._tensor([s.num_generated for s in sampled], torch.int64),
            )
        return LaunchedStep(plan, sampled, index, tokens)


PLACEHOLDER = -1  # a token sampled by a step still in flight


class LaunchedStep:
    """A step queued on the device. Its sampled tokens are copied to pinned host memory behind the
    step, so reading them waits for this step only, not for one launched after it."""

    def __init__(self, plan: StepPlan, sampled: list[Sequence], index: list[int], tokens: torch.Tensor | None) -> None:
        self.plan = plan
        self.sampled = sampled  # sequences whose next token this step samples, in row order
        self.index = index  # where each sampled token goes in its sequence's token_ids
        self.tokens = tokens  # [len(sampled)] on the device
        self.launched_at = time.perf_counter()
        self._rows = {(id(s), i): r for r, (s, i) in enumerate(zip(sampled, index))}
        self._host: torch.Tensor | None = None
        self._done: torch.cuda.Event | None = None
        if tokens is not None and tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()

    def row_of(self, seq: Sequence, index: int) -> int:
        """The row of this step's tokens that holds seq's token at `index`."""
        row = self._rows.get((id(seq), index))
        if row is None:
            raise RuntimeError(f"token {index} of {seq.request_id} is not sampled by the step in flight")
        return row

    def result(self) -> list[int]:
        if self.tokens is None:
            return []
        if self._done is not None:
            self._done.synchronize()
            return self._host.tolist()
        return self.tokens.tolist()
