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
from .token_readback import READBACK_TOKENS, TokenReadback
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self.block_size = kv.block_size
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        # sampled tokens come back through a ring of pinned buffers (a larger step pins its own)
        self._readback = TokenReadback(READBACK_TOKENS, self.device) if self.device.type == "cuda" else None

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
                for i, t in enumerate(new):
                    if t == PLACEHOLDER:
                        fill_rows.append(len(ids) + i)
                        fill_from.append(_sampled_row(prev, seq, start + i))
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
        sampled = [c.seq for c in plan.chunks if c.completes_prompt]
        index = [c.seq.num_tokens for c in plan.chunks if c.completes_prompt]
        # a decode graph when every row samples (a one-token chunk that does not end its prompt runs eagerly)
        if len(sampled) == len(plan.chunks) and plan.is_decode and self.graphs is not None \
                and self.graphs.bucket_for(len(sampled)):
            logits = self._replay_decode(plan, prev)
            return LaunchedStep(plan, sampled, index, self._sample(logits, sampled), self._readback)
        input_ids, positions, meta, rows = self.prepare(plan, prev)
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
        else:
            hidden = self.model.forward(input_ids, positions, meta, self.kv, between_layers)
            logits = self.model.logits(hidden[self._tensor(rows, torch.int64)])
        return LaunchedStep(plan, sampled, index, self._sample(logits, sampled), self._readback)

    def _replay_decode(self, plan: StepPlan, prev: LaunchedStep | None) -> torch.Tensor:
        """A decode step from its graph: its inputs staged in one copy, and the tokens that `prev` is
        still computing filled in on the device."""
        graphs, bs = self.graphs, self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        fill_rows: list[int] = []
        fill_from: list[int] = []
        for r, chunk in enumerate(plan.chunks):
            seq = chunk.seq
            p = seq.num_computed
            token = seq.token_ids[p]
            if token == PLACEHOLDER:
                fill_rows.append(r)
                fill_from.append(_sampled_row(prev, seq, p))
                token = 0
            ids.append(token)
            positions.append(p)
            table = seq.block_table
            slots.append(table[p // bs] * bs + p % bs)
            tables.append(table)
        n = len(ids)
        graphs.inputs.stage(ids, positions, slots, [p + 1 for p in positions], tables, fill_rows, fill_from,
                            graphs.bucket_for(n))
        if fill_rows:
            in_order = fill_rows == fill_from == list(range(len(fill_rows)))
            graphs.inputs.fill_placeholders(len(fill_rows), prev.tokens, in_order)
        return graphs.replay_staged(n)

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence]) -> torch.Tensor:
        sp = [s.request.sampling for s in sampled]
        if all(p.temperature <= 0 for p in sp):
            return kernels.argmax(logits)  # decided on the host: no device sync before the next launch
        return kernels.sample(
            logits,
            self._tensor([p.temperature for p in sp], torch.float32),
            self._tensor([p.top_k for p in sp], torch.int64),
            self._tensor([p.top_p for p in sp], torch.float32),
            self._tensor([s.seed for s in sampled], torch.int64),
            self._tensor([s.num_generated for s in sampled], torch.int64),
        )


PLACEHOLDER = -1  # a token sampled by a step still in flight


def _sampled_row(prev: LaunchedStep | None, seq: Sequence, index: int) -> int:
    """The row of prev's tokens that will hold seq's placeholder token at `index`."""
    if prev is None:
        raise RuntimeError(f"sequence {seq.request_id} has an unsampled token but no step in flight")
    return prev.row_of(seq, index)


class LaunchedStep:
    """A step queued on the device. Its sampled tokens are copied to pinned host memory behind the
    step, so reading them waits for this step only, not for one launched after it."""

    def __init__(self, plan: StepPlan, sampled: list[Sequence], index: list[int], tokens: torch.Tensor | None,
                 readback: TokenReadback | None = None) -> None:
        self.plan = plan
        self.sampled = sampled  # sequences whose next token this step samples, in row order
        self.index = index  # where each sampled token goes in its sequence's token_ids
        self.tokens = tokens  # [len(sampled)] on the device
        self.launched_at = time.perf_counter()
        self._rows = {(id(s), i): r for r, (s, i) in enumerate(zip(sampled, index))}
        self._readback = readback
        self._ticket: tuple[int, int] | None = None
        self._host: torch.Tensor | None = None
        self._done: torch.cuda.Event | None = None
        self._read: list[int] | None = None
        if tokens is not None and tokens.is_cuda:
            if readback is not None and tokens.dtype == torch.int64:
                self._ticket = readback.start(tokens)
            if self._ticket is None:
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
        if self._read is None:
            if self.tokens is None:
                self._read = []
            elif self._ticket is not None:
                self._read = self._readback.read(self._ticket, self.tokens.shape[0])
            elif self._done is not None:
                self._done.synchronize()
                self._read = self._host.tolist()
            else:
                self._read = self.tokens.tolist()
        return self._read
