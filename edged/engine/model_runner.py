"""Turns a step plan into tensors, runs the model, and samples the next tokens."""
from __future__ import annotations

import torch

from edged import kernels
from edged.models.batch import AttentionMetadata, KVCache
from edged.models.llama import LlamaModel
from edged.scheduler.batcher import StepPlan

from .cuda_graphs import DecodeGraphs


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self.block_size = kv.block_size
        self.graphs: DecodeGraphs | None = None

    def enable_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Capture decode graphs for batches up to max_batch (CUDA only)."""
        if self.device.type != "cuda":
            return
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv, max_batch, max_blocks)
        self.graphs.capture()

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """input ids, positions, attention metadata, and the rows whose logits are sampled."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []
        bs = self.block_size
        for chunk in plan.chunks:
            seq, start = chunk.seq, chunk.seq.num_computed
            end = start + chunk.num_new_tokens
            ids.extend(seq.token_ids[start:end])
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
        return self._tensor(ids, torch.int64), self._tensor(positions, torch.int64), meta, sample_rows

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[int | None]:
        """Run one step; returns the sampled token per chunk (None where a prompt is not done yet)."""
        input_ids, positions, meta, rows = self.prepare(plan)
        if not rows:
            self.model.forward(input_ids, positions, meta, self.kv)
            return [None] * len(plan.chunks)
        if meta.is_decode and self.graphs is not None and self.graphs.bucket_for(len(rows)) is not None:
            logits = self.graphs.replay(input_ids, positions, meta)
        else:
            hidden = self.model.forward(input_ids, positions, meta, self.kv)
            logits = self.model.logits(hidden[self._tensor(rows, torch.int64)])
        sampled_seqs = [c.seq for c in plan.chunks if c.completes_prompt]
        sp = [s.request.sampling for s in sampled_seqs]
        tokens = kernels.sample(
            logits,
            self._tensor([p.temperature for p in sp], torch.float32),
            self._tensor([p.top_k for p in sp], torch.int64),
            self._tensor([p.top_p for p in sp], torch.float32),
            self._tensor([s.seed for s in sampled_seqs], torch.int64),
            self._tensor([s.num_generated for s in sampled_seqs], torch.int64),
        ).tolist()
        it = iter(tokens)
        return [next(it) if c.completes_prompt else None for c in plan.chunks]
