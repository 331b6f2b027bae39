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
from .staged_inputs import StagedInputs
from .step_inputs import StepInputs
from .token_readback import READBACK_TOKENS, TokenReadback


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self.block_size = kv.block_size
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        # sampled tokens come back through a ring of pinned buffers (a larger step pins its own)
        self.readback = TokenReadback(READBACK_TOKENS, self.device) if self.device.type == "cuda" else None

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

    def host_inputs(self, plan: StepPlan, prev: LaunchedStep | None = None) -> StepInputs:
        """The step's inputs as lists. A token that `prev` is still computing (PLACEHOLDER) is 0 here,
        with its row in fill_rows and prev's row that will hold it in fill_from."""
        step = StepInputs()
        ids, positions, slots, cu = step.ids, step.positions, step.slots, step.cu_seqlens
        bs = self.block_size
        for chunk in plan.chunks:
            seq, start = chunk.seq, chunk.seq.num_computed
            end = start + chunk.num_new_tokens
            new = seq.token_ids[start:end]
            if PLACEHOLDER in new:
                for i, t in enumerate(new):
                    if t == PLACEHOLDER:
                        step.fill_rows.append(len(ids) + i)
                        step.fill_from.append(_sampled_row(prev, seq, start + i))
                        new[i] = 0
            ids.extend(new)
            table = seq.block_table
            if end - start == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu.append(cu[-1] + chunk.num_new_tokens)
            step.context_lens.append(end)
            step.tables.append(table)
            if chunk.completes_prompt:
                step.sample_rows.append(cu[-1] - 1)
        return step

    def prepare(self, plan: StepPlan, prev: LaunchedStep | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """input ids, positions, attention metadata, and the rows whose logits are sampled, as tensors
        of their own (the eager path). Placeholder tokens are filled on the device."""
        step = self.host_inputs(plan, prev)
        width = max(len(t) for t in step.tables)
        meta = AttentionMetadata(
            is_decode=plan.is_decode,
            slot_mapping=self._tensor(step.slots, torch.int64),
            block_tables=self._tensor([t + [0] * (width - len(t)) for t in step.tables], torch.int32),
            context_lens=self._tensor(step.context_lens, torch.int32),
            cu_seqlens_q=self._tensor(step.cu_seqlens, torch.int32),
        )
        input_ids = self._tensor(step.ids, torch.int64)
        if step.fill_rows:
            rows, source = self._tensor(step.fill_rows, torch.int64), self._tensor(step.fill_from, torch.int64)
            input_ids[rows] = prev.tokens[source]
        return input_ids, self._tensor(step.positions, torch.int64), meta, step.sample_rows

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: LaunchedStep | None = None,
               between_layers: Callable[[], None] | None = None) -> LaunchedStep:
        """Queue one step on the device and return at once; its tokens reach the host when asked.
        between_layers goes to the model's eager forward (LlamaModel.forward), not into graphs.
        Graph steps stage their inputs in one copy (StagedInputs); the eager path builds tensors."""
        sampled = [c.seq for c in plan.chunks if c.completes_prompt]
        index = [c.seq.num_tokens for c in plan.chunks if c.completes_prompt]
        n, s = plan.num_tokens, len(plan.chunks)
        decode, mixed = self.graphs, self.mixed_graphs
        # a decode graph when every row samples (a one-token chunk that does not end its prompt runs eagerly)
        if len(sampled) == s and plan.is_decode and decode is not None and decode.bucket_for(s):
            step = self.host_inputs(plan, prev)
            decode.stage(step)
            self._fill(decode.inputs, step, prev)
            logits = decode.replay_staged(s)
            if _greedy(sampled):
                return LaunchedStep(plan, sampled, index, decode.greedy_tokens(s), self.readback)
        elif not plan.is_decode and mixed is not None and mixed.bucket_for(n, s):
            step = self.host_inputs(plan, prev)
            b, _ = mixed.stage(step)
            self._fill(mixed.inputs, step, prev)
            logits = mixed.replay_staged(b, s)  # each sequence's last token
            if not sampled:
                return LaunchedStep(plan, [], [], None)
            if len(sampled) < s:  # keep the sequences whose prompt this step completes
                logits = logits[self._tensor([i for i, c in enumerate(plan.chunks) if c.completes_prompt],
                                             torch.int64)]
        else:
            input_ids, positions, meta, rows = self.prepare(plan, prev)
            hidden = self.model.forward(input_ids, positions, meta, self.kv, between_layers)
            if not rows:
                return LaunchedStep(plan, [], [], None)
            logits = self.model.logits(hidden[self._tensor(rows, torch.int64)])
        return LaunchedStep(plan, sampled, index, self._sample(logits, sampled), self.readback)

    @staticmethod
    def _fill(inputs: StagedInputs, step: StepInputs, prev: LaunchedStep | None) -> None:
        if step.fill_rows:
            inputs.fill_placeholders(len(step.fill_rows), prev.tokens, step.fills_in_order)

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence]) -> torch.Tensor:
        if _greedy(sampled):
            return kernels.argmax(logits)  # decided on the host: no device sync before the next launch
        sp = [s.request.sampling for s in sampled]
        return kernels.sample(
            logits,
            self._tensor([p.temperature for p in sp], torch.float32),
            self._tensor([p.top_k for p in sp], torch.int64),
            self._tensor([p.top_p for p in sp], torch.float32),
            self._tensor([s.seed for s in sampled], torch.int64),
            self._tensor([s.num_generated for s in sampled], torch.int64),
        )


PLACEHOLDER = -1  # a token sampled by a step still in flight


def _greedy(sampled: list[Sequence]) -> bool:
    return all(s.request.sampling.temperature <= 0 for s in sampled)


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
        if tokens is not None:
            if readback is not None and tokens.dtype == torch.int64:
                self._ticket = readback.start(tokens)
            if self._ticket is None and tokens.is_cuda:
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
