"""Batch selection: which sequences run in the next engine step, and how many tokens each.

Every running sequence decodes one token; waiting sequences are admitted in queue order and their
prompts prefilled in chunks within the per-step token budget, so a long prompt never stalls the
running decodes. When KV blocks run out, the newest running sequence is preempted (its blocks
freed, its tokens recomputed later), which leaves its output unchanged.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from edged.engine.block_manager import BlockManager
from edged.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class BatchLimits:
    max_num_seqs: int = 64  # the batch cap (PCIe topology may lower it)
    max_batch_tokens: int = 2048  # new tokens per step: decodes plus prefill chunks


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this chunk every token of seq is computed, so a next token is sampled."""
        return self.seq.num_computed + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)  # larger than the whole KV pool

    @property
    def is_decode(self) -> bool:
        return all(c.num_new_tokens == 1 for c in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Batcher:
    def __init__(self, blocks: BlockManager, limits: BatchLimits) -> None:
        self.blocks = blocks
        self.limits = limits
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)

    def _preempt_newest(self, plan: StepPlan, keep: Sequence) -> bool:
        for victim in reversed(self.running):
            if victim is keep:
                continue
            self.running.remove(victim)
            plan.chunks = [c for c in plan.chunks if c.seq is not victim]
            self.blocks.release(victim)
            victim.status = SequenceStatus.WAITING
            self.waiting.appendleft(victim)
            plan.preempted.append(victim)
            return True
        return False

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.limits.max_batch_tokens
        # Running sequences first: each needs room for one more token (or the rest of its prompt).
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted while making room for an earlier one
            n = min(seq.num_uncomputed, budget)
            if n <= 0:
                continue
            while not self.blocks.allocate(seq, seq.num_computed + n):
                if not self._preempt_newest(plan, keep=seq):
                    break
            else:
                plan.chunks.append(ScheduledChunk(seq, n))
                budget -= n
                continue
            # Not even alone does it fit: give it back to the queue (nothing else holds blocks).
            self.running.remove(seq)
            self.blocks.release(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        # Then admit waiting sequences while the batch cap, token budget and blocks allow.
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            self.blocks.attach_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            if not self.blocks.allocate(seq, seq.num_computed + n):
                self.blocks.release(seq)
                if self.running:
                    break
                # Alone and still too big: the pool is smaller than this one request.
                self.waiting.popleft()
                plan.rejected.append(seq)
                continue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return plan
