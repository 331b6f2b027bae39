"""Batch selection: which sequences run in the next engine step, and how many tokens each.

Step time is bounded. A GPU step cannot be interrupted, so a request arriving during one waits for it
(a CPU step gives way between layers to a more important tier: llm_engine.StepYielded):
each step, from the learned step cost (step_stats.py: a + b * prompt tokens + c * sequences), the
batcher derives
- the bound: `step_fraction` (0.1) of the tightest TTFT target among tiers in use (queued, running or
  seen in the last minute), and `pace_fraction` (0.75) of the TPOT target of a tier decoding now;
- the batch cap for starting sequences of tiers below the protected one (the most important tier in
  use): what fits the bound; the protected tier may start up to the configured cap;
- the prompt-token budget: what the bound leaves after the decodes (lower tiers), or a quarter of
  the protected tier's TTFT target (its own prompt, computed in one step rather than in pieces).
`BatchLimits` (scheduler.batch_cap, scheduler.step_token_budget) stay the upper bounds. The same
code runs on CPU and GPU: only the measured costs differ.

Each step, in this order, within those limits and the free KV blocks:

1. every running sequence that is decoding gets its one token (most important tier first); a
   lower tier's decode waits a step when it would push the step past the bound, and, while the
   protected tier decodes, past `pace_vs_alone` (1.6) times what a step of the protected tier's
   decodes alone takes (measured per batch size: step_stats.decode_step_s), so gold never decodes at
   bronze's pace however much slack its TPOT target leaves. A step in which the protected tier has a
   prompt to compute is its own: lower tiers' decodes and prompts wait, and its waiting requests
   skip their batch window, so its first token costs what it would on an idle engine; lower tiers
   give at most about a tenth of steps this way (`yield_share_max`; only steps that hold a lower
   tier's work back count, not those of a tier alone), so a stream of protected arrivals cannot
   starve them;
2. waiting sequences about to miss their TTFT target ("urgent": a quarter of the target left, or
   less than the time to prefill their tier's queue) start, preempting running sequences of
   *lower* tiers if slots or blocks are short (a free slot goes to an urgent request only if no
   more important tier is waiting for it);
3. running sequences still prefilling get their next prompt chunk (chunked prefill: a long prompt
   never stalls the decodes of step 1);
4. other waiting sequences start in weighted-fair order between tiers, earliest deadline first
   within a tier (see tiers.py). While other work runs, a tier's new requests may be held for its
   batch window so that they start together rather than one prefill per step (never when the
   engine is idle, or once the held requests fill the free slots or the token budget).

Preemption is by recompute: the victim's blocks are released and it is queued again with its
original deadline; recomputing its prompt and generated tokens leaves its output unchanged. When
KV blocks run out for a running sequence, the least important running sequence gives way.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edged.config import TierConfig
from edged.engine.block_manager import BlockManager
from edged.engine.sequence import Sequence, SequenceStatus
from edged.log import fields

from .step_stats import StepModel, StepStats
from .tiers import AdaptPolicy, Entry, TierBoard, TierScheduler

log = logging.getLogger("edged.scheduler")


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

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens beyond one per sequence: what prompt (or recompute) chunks add to a decode step."""
        return sum(c.num_new_tokens for c in self.chunks if c.num_new_tokens > 1)


class Batcher:
    """Continuous batcher with SLA tiers. Engine thread only, except `board` (shared, locked).

    tiers / default_tier: the config's tiers (None: the built-in gold/silver/bronze, default silver).
    clock: monotonic seconds, the same clock as `GenerationRequest.arrival_time` (a simulated one in tests).
    preemption: "recompute" (lower tiers give way to a higher tier about to miss its target), "off"
    (only KV-block pressure preempts), "swap" (not implemented yet: behaves as recompute).
    urgency_fraction: a waiting request is urgent once less than this fraction of its TTFT target (or
    its predicted prefill plus two steps, if more) is left before its deadline.
    max_preemptions: a sequence preempted this often for a higher tier is not preempted for one again.
    """

    def __init__(self, blocks: BlockManager, limits: BatchLimits, tiers: dict[str, TierConfig] | None = None,
                 default_tier: str | None = None, *, clock: Callable[[], float] = time.monotonic,
                 step_stats: StepStats | None = None, board: TierBoard | None = None,
                 preemption: str = "recompute", urgency_fraction: float = 0.25, max_preemptions: int = 3,
                 policy: AdaptPolicy | None = None, step_fraction: float = 0.1, pace_fraction: float = 0.75,
                 pace_vs_alone: float = 1.6, min_prefill_tokens: int = 8, in_use_s: float = 60.0) -> None:
        self.blocks = blocks
        self.limits = limits
        self.clock = clock
        self.board = board if board is not None else TierBoard(tiers, default_tier, clock=clock, policy=policy)
        self.step_stats = step_stats if step_stats is not None else StepStats()
        self.queues = TierScheduler(self.board)
        self.running: list[Sequence] = []
        self.preemption = preemption
        if preemption == "swap":
            log.warning("scheduler.preemption=swap is not implemented yet; preempting by recompute")
        self.urgency_fraction = urgency_fraction
        self.max_preemptions = max_preemptions
        self.step_fraction = step_fraction
        self.pace_fraction = pace_fraction
        self.pace_vs_alone = pace_vs_alone
        self.min_prefill_tokens = min_prefill_tokens
        self.in_use_s = in_use_s
        # This step's derived limits (see _derive_limits); also read by tests and admission.
        self.step_bound_s = float("inf")
        self.decode_bound_s = float("inf")  # the bound lower tiers' decodes keep (see _derive_limits)
        self.seq_cap = limits.max_num_seqs
        self.admission_cap = limits.max_num_seqs  # the lower tiers' batch cap admission counts on
        self.pace_share = 0.0  # decaying share of recent steps bounded by the protected tier's pace
        self.prefill_budget = limits.max_batch_tokens  # prompt tokens per step for tiers below the protected one
        self.protected_budget = limits.max_batch_tokens  # ... for the protected tier and above
        self.protected_step_fraction = 0.25  # its prompt may take a step up to this share of its TTFT target
        self.yield_share = 0.0  # decaying share of recent steps that lower tiers gave to a protected prompt
        self.yield_share_max = 0.1
        self.protected_rank = 0
        self.protected_ttft_s = float("inf")
        self.pace_bound = False  # this step's bound is the protected tier's pace
        self.deferred_decodes = 0  # decodes held back a step to keep a higher tier's pace (total)
        self.max_batch_seen = 0  # the largest batch any step ran (tests: never above the cap)
        self.steps_planned = 0
        self._rejects: list[Sequence] = []
        self._admissions: list = []  # AdmissionControllers made by admission(), kept in step on reconfigure
        self._last_adapt = float("-inf")
        # per-schedule state
        self._plan = StepPlan()
        self._chunks: dict[Sequence, ScheduledChunk] = {}
        self._budget = 0
        self._lower_left = 0  # prompt tokens left this step for tiers below the protected one
        self._now = 0.0
        self._kv_blocked = False
        self._hold = False  # this step is a protected prompt's: lower tiers wait

    # --- membership ---
    @property
    def waiting(self) -> list[Sequence]:
        """Waiting sequences, most important tier first, each tier in deadline order."""
        return [e.seq for e in self.queues.waiting()]

    def add(self, seq: Sequence) -> None:
        now = self.clock()
        if -(-seq.num_tokens // self.blocks.block_size) > self.blocks.num_blocks:
            tier = self.board.resolve(seq.request.tier)
            self.board.release_pending(seq.request_id)
            self.board.note_rejected(tier, "kv_capacity")
            self._rejects.append(seq)
            log.info("request too large for the KV cache %s", fields(
                request_id=seq.request_id, tier=tier, tokens=seq.num_tokens,
                kv_tokens=self.blocks.num_blocks * self.blocks.block_size))
            return
        e = self.queues.add(seq, now)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("queued %s", fields(request_id=seq.request_id, tier=e.tier, tokens=seq.num_tokens,
                                          deadline_in_ms=round((e.deadline - now) * 1000, 1),
                                          depth=self.queues.tier_waiting(e.tier)))

    def has_work(self) -> bool:
        return bool(self.running or self._rejects or self.queues.num_waiting())

    def remove(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out and free its blocks."""
        if seq in self._rejects:
            self._rejects.remove(seq)
        e = self.queues.forget(seq)
        if seq in self.running:
            self.running.remove(seq)
        if e is not None:
            if e.running:
                e.running = False
                self.board.note_stopped(e.tier, finished=seq.finish_reason is not None,
                                        cancelled=seq.finish_reason is None)
            elif seq.finish_reason is None:
                self.board.note_cancelled_waiting(e.tier)
            if seq.finish_reason is not None:
                self.board.note_generated(e.tier, seq.num_generated, seq.request.sampling.max_tokens)
                self.step_stats.record_finished(seq.num_generated,
                                                None if e.started_at is None else self.clock() - e.started_at)
            self._maybe_record_ttft(e, self.clock())
            self._maybe_record_tpot(e, self.clock())
            if not e.ttft_recorded:
                self.board.forget_prediction(seq.request_id)
        self.blocks.release(seq)

    def tier_rank(self, tier: str) -> int:
        """Rank (smaller: more important) of the tier a request naming `tier` is queued in; any thread."""
        with self.board.lock:
            return self.board.tiers[self.board.resolve(tier)].rank

    def plan_rank(self, plan: StepPlan) -> int:
        """The most important tier among a plan's sequences."""
        return min(self.queues.rank_of(self.queues.entries[c.seq]) for c in plan.chunks)

    # --- the step plan ---
    def _prio(self, seq: Sequence) -> tuple[int, float, int]:
        """Smaller is more important: tier rank, then deadline, then arrival at the engine."""
        e = self.queues.entries[seq]
        return (self.board.tiers[e.tier].rank, e.deadline, e.serial)

    def _add_chunk(self, seq: Sequence, n: int, decode: bool = False) -> None:
        chunk = ScheduledChunk(seq, n)
        self._plan.chunks.append(chunk)
        self._chunks[seq] = chunk
        self._budget -= n
        # a lower tier's prompt chunk, even of one token, uses the room the bound left them
        if not decode and self.queues.rank_of(self.queues.entries[seq]) > self.protected_rank:
            self._lower_left -= n

    def _room(self, seq: Sequence) -> int:
        """Prompt tokens seq may compute this step: the protected tier's prompt may fill its longer
        step; lower tiers' chunks stay within the step bound."""
        if self.queues.rank_of(self.queues.entries[seq]) <= self.protected_rank:
            return self._budget
        return min(self._budget, self._lower_left)

    def _preempt(self, victim: Sequence, why: str, for_seq: Sequence | None = None) -> None:
        """Release victim's blocks and queue it again (recompute later, same deadline)."""
        chunk = self._chunks.pop(victim, None)
        if chunk is not None:
            self._plan.chunks.remove(chunk)
            self._budget += chunk.num_new_tokens
        self.running.remove(victim)
        self.blocks.release(victim)
        victim.status = SequenceStatus.WAITING
        e = self.queues.entries[victim]
        e.running = False
        if for_seq is not None:  # the higher tier pays for the victim's restart in fair-share terms
            e.preemptions += 1
            if not e.restart_paid:
                e.restart_paid = True
                self.queues.charge(self.queues.entries[for_seq].tier)
        self.board.note_stopped(e.tier, preempted=True)
        self.queues.push(e)
        self._plan.preempted.append(victim)
        log.info("preempted %s", fields(
            request_id=victim.request_id, tier=e.tier, reason=why, generated=victim.num_generated,
            recompute_tokens=victim.num_tokens,
            **({"for_request_id": for_seq.request_id, "for_tier": self.queues.entries[for_seq].tier}
               if for_seq is not None else {})))

    def _reject_running(self, seq: Sequence) -> None:
        """seq cannot fit even alone: the pool is smaller than this one request."""
        chunk = self._chunks.pop(seq, None)
        if chunk is not None:
            self._plan.chunks.remove(chunk)
            self._budget += chunk.num_new_tokens
        self.running.remove(seq)
        self.blocks.release(seq)
        e = self.queues.forget(seq)
        if e is not None:
            e.running = False
            self.board.note_stopped(e.tier)
            self.board.note_rejected(e.tier, "kv_capacity")
        self._plan.rejected.append(seq)
        log.info("request too large for the KV cache %s", fields(request_id=seq.request_id,
                                                                  tokens=seq.num_tokens))

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Blocks for n more tokens of running seq, preempting less important running sequences
        (least important first); if none is less important, seq itself goes back to the queue."""
        while not self.blocks.allocate(seq, seq.num_computed + n):
            mine = self._prio(seq)
            lower = [s for s in self.running if s is not seq and self._prio(s) > mine]
            if lower:
                self._preempt(max(lower, key=self._prio), "kv_blocks")
                continue
            if len(self.running) == 1:
                self._reject_running(seq)
            else:
                self._preempt(seq, "kv_blocks")
            return False
        return True

    def _preempt_for(self, e: Entry) -> bool:
        """Make room for urgent waiting e by preempting the least important running sequence of a
        lower tier; False if there is none (or preemption is off)."""
        if self.preemption == "off":
            return False
        rank = self.board.tiers[e.tier].rank
        victims = [s for s in self.running
                   if self.board.tiers[self.queues.entries[s].tier].rank > rank
                   and self.queues.entries[s].preemptions < self.max_preemptions]
        if not victims:
            return False
        self._preempt(max(victims, key=self._prio), "higher_tier_deadline", for_seq=e.seq)
        return True

    def _urgent_fn(self, running_before: int) -> Callable[[Entry], bool]:
        m = self.step_stats.model
        now, budget, frac = self._now, max(1, self.prefill_budget, self.protected_budget), self.urgency_fraction
        step = m.a + m.c * (running_before + 1)

        def urgent(e: Entry) -> bool:
            if e.seq.first_token_at is not None:
                return False
            slack = e.deadline - now
            st = self.board.tiers[e.tier]
            if slack > st.target_s * frac:
                # Time to prefill the tier's whole queue (the head goes first, the rest follow it
                # closely when they arrived in a burst) plus two steps.
                toks = max(e.seq.num_uncomputed, st.waiting_tokens)
                need = m.b * toks + (-(-toks // budget) + 2) * step
                return slack <= need
            return True

        return urgent

    def _eligible_fn(self, idle: bool) -> Callable[[str, Entry], bool]:
        """The batch window: may tier start its head now?"""
        now = self._now
        free = max(0, min(self.limits.max_num_seqs, self.seq_cap) - len(self.running))

        def eligible(tier: str, head: Entry) -> bool:
            if idle or head.started or (self._hold and self.board.tiers[tier].rank <= self.protected_rank):
                return True  # the step is the protected prompt's anyway: no reason to wait for more
            window = self.board.tiers[tier].window_ms / 1000.0
            if window <= 0 or now - head.enqueued_at >= window:
                return True
            st = self.board.tiers[tier]  # a full batch is waiting: no reason to hold it
            return st.waiting >= free or st.waiting_tokens >= self._budget

        return eligible

    def _start_waiting(self, urgent_only: bool, idle: bool, urgent: Callable[[Entry], bool]) -> None:
        """Start waiting sequences. The weighted-fair choice goes first unless an urgent head is of the
        same or a more important tier; an urgent head may preempt lower tiers when slots or blocks are
        short. urgent_only: start only urgent heads, and into a free slot only when no more important
        tier is waiting for it."""
        cap = max(1, self.limits.max_num_seqs)
        eligible = self._eligible_fn(idle)
        rank = self.queues.rank_of
        skip: set[str] = set()
        while self._budget > 0:
            u, f = self.queues.candidates(eligible=eligible, urgent=urgent, skip=skip)
            full = len(self.running) >= cap
            if u is not None and (f is None or rank(u) <= rank(f) or (urgent_only and full)):
                e, is_urgent = u, True
            elif not urgent_only and f is not None:
                e, is_urgent = f, False
            else:
                return
            seq = e.seq
            # The step-time cap on the batch holds back tiers below the protected one; a more
            # important arrival may exceed it (lower tiers' decodes are then deferred instead).
            if not full and len(self.running) >= self.seq_cap and rank(e) > self.protected_rank:
                if is_urgent:
                    skip.add(e.tier)
                    continue
                return
            if full:
                if is_urgent and self._preempt_for(e):
                    continue
                if is_urgent:
                    skip.add(e.tier)  # nothing below it to preempt
                    continue
                return
            if self._room(seq) <= 0:
                skip.add(e.tier)  # no prompt room left for this tier this step
                continue
            self.blocks.attach_prefix(seq)
            n = min(seq.num_uncomputed, self._room(seq))
            if not self.blocks.allocate(seq, seq.num_computed + n):
                self.blocks.release(seq)  # drop the prefix references taken above
                if is_urgent and self._preempt_for(e):
                    continue
                if is_urgent:
                    skip.add(e.tier)
                    continue
                self._kv_blocked = True
                return  # wait for blocks in queue order
            if e.started_at is None:
                e.started_at = self._now
            self.queues.start(e)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_chunk(seq, n)

    def schedule(self) -> StepPlan:
        now = self._now = self.clock()
        self._plan = plan = StepPlan()
        self._chunks = {}
        self._budget = self.limits.max_batch_tokens
        self._kv_blocked = False
        cap = max(1, self.limits.max_num_seqs)
        if self._rejects:
            plan.rejected.extend(self._rejects)
            self._rejects.clear()
        self._adapt(now)
        idle = not self.running
        running_before = len(self.running)
        # The cap may have been lowered live: the least important sequences give way.
        while len(self.running) > cap:
            self._preempt(max(self.running, key=self._prio), "batch_cap")
        m = self._derive_limits(now)
        # 1. Decodes, most important first. Those of the protected tier (the most important in use) and
        # above always run; a lower tier's decode waits a step if it would push the step past the bound.
        # When a prompt of the protected tier is to be computed, lower tiers give it the step: their
        # decodes and prompts wait, so its first token costs what it costs on an idle engine (they lose
        # one step per such arrival); in at most yield_share_max of recent steps, so that a stream of
        # protected arrivals cannot starve them.
        self._hold = hold = self.yield_share < self.yield_share_max and self._protected_prefill_waiting() \
            and self._lower_tier_present()
        self.yield_share += 0.1 * (float(hold) - self.yield_share)
        decodes = 0
        for seq in sorted(self.running, key=self._prio):
            if self._budget <= 0:
                break
            if seq not in self.running or seq.num_uncomputed != 1:
                continue
            if (hold or decodes >= self.seq_cap) and \
                    self.queues.rank_of(self.queues.entries[seq]) > self.protected_rank:
                self.deferred_decodes += 1
                continue
            if self._grow(seq, 1):
                self._add_chunk(seq, 1, decode=True)
                decodes += 1
        # Prompt tokens this step: what the bound leaves after the decodes (at least a small chunk, so
        # prefill always progresses), within the configured budget.
        # Lower tiers' prompts always progress by a small chunk, except while a pace is protected:
        # then they wait for room, as their decodes do; and not at all in a held step (nor, through this
        # budget, the decodes held back above).
        self.prefill_budget = self._prefill_tokens(m, len(plan.chunks), self.step_bound_s,
                                                   0 if self.pace_bound else None)
        self._lower_left = 0 if hold else self.prefill_budget
        self.protected_budget = self._prefill_tokens(m, len(plan.chunks), self._protected_prompt_bound_s())
        self._budget = min(self._budget, max(self.prefill_budget, self.protected_budget))
        # 2. Urgent waiting requests (may preempt lower tiers).
        urgent = self._urgent_fn(running_before)
        self._start_waiting(True, idle, urgent)
        # 3. Prefill chunks of running sequences. One token left is step 1's to run or defer: a decode
        # held back there must not come back here as a one-token chunk.
        for seq in sorted(self.running, key=self._prio):
            if self._budget <= 0:
                break
            if seq in self.running and seq not in self._chunks and seq.num_uncomputed > 1:
                n = min(seq.num_uncomputed, self._room(seq))
                if n <= 0:
                    continue
                if self._grow(seq, n):
                    self._add_chunk(seq, n)
        # 4. Weighted-fair starts.
        self._start_waiting(False, idle, urgent)
        self.max_batch_seen = max(self.max_batch_seen, len(plan.chunks))
        self.steps_planned += 1
        # While KV blocks rather than the cap bound the batch, admission counts the slots actually usable.
        kv_bound = self._kv_blocked and len(self.running) < cap
        slots = max(1, len(self.running)) if kv_bound else min(cap, self.admission_cap)
        # A new prompt of the protected tier gets a step of its own while lower tiers may still give
        # one up: admission judges it by that step (its tier's decodes beside it), not by this one.
        if self.yield_share < self.yield_share_max:
            beside = sum(1 for s in self.running if self.queues.rank_of(self.queues.entries[s]) <= self.protected_rank)
            own_budget = self._prefill_tokens(m, beside, self._protected_prompt_bound_s())
        else:
            beside, own_budget = len(self.running), self.protected_budget
        # Admission sees at least the small chunk: the pace hold that may stop lower tiers' prompts
        # lasts only while a higher tier decodes.
        self.board.publish_engine(slots=slots, budget=max(1, self.min_prefill_tokens, self.prefill_budget),
                                  running=len(self.running),
                                  cap=max(1, len(self.running)) if kv_bound else cap,
                                  protected_rank=self.protected_rank,
                                  protected_budget=max(1, own_budget), protected_beside=beside)
        return plan

    def _derive_limits(self, now: float) -> StepModel:
        """This step's time bound and the batch size it allows, from the learned step model.

        A GPU step cannot be interrupted, so a request arriving during it waits for it: the bound is
        step_fraction of the tightest TTFT target among the tiers in use (queued, running or seen in
        the last in_use_s), and pace_fraction of the tightest TPOT target among tiers decoding now.
        Lower tiers' decodes also keep `decode_bound_s`: while the protected tier (the most important
        in use) decodes beside them, pace_vs_alone times its decodes' own step. The batch cap for
        starting sequences of lower tiers is the batch of decodes that fits that bound; the configured
        cap stays the limit."""
        m = self.step_stats.model
        tiers = self.board.in_use(now, self.in_use_s) or list(self.board.tiers.values())
        bound = ttft_bound = min(st.target_s for st in tiers) * self.step_fraction
        self.pace_bound = False
        top = min(t.rank for t in tiers)
        protected_running = sum(t.running for t in tiers if t.rank == top)
        # the protected tier's decodes alone, times pace_vs_alone: lower tiers' decodes keep within it
        paced_alone = self.pace_vs_alone * self.step_stats.decode_step_s(max(1, protected_running))
        for st in tiers:
            if st.running and st.tpot_target_s is not None and st.tpot_target_s * self.pace_fraction < bound:
                bound = st.tpot_target_s * self.pace_fraction
                self.pace_bound = st.rank == top
        self.step_bound_s = bound
        protected_paced = any(t.running and t.tpot_target_s is not None for t in tiers if t.rank == top)
        lower_running = any(t.running for t in tiers if t.rank > top)
        self.decode_bound_s = min(bound, paced_alone) if protected_paced and lower_running else bound
        self.protected_rank = top
        self.protected_ttft_s = min(st.target_s for st in tiers if st.rank == self.protected_rank)
        cap = max(1, self.limits.max_num_seqs)
        within = self.step_stats.decodes_within
        self.seq_cap = within(self.decode_bound_s, cap)
        # What admission counts on for lower tiers: the cap with the protected tier's pace held, in the
        # share of recent steps that held it, and at least half the time (its requests may decode at
        # any time while a lower tier's queue drains: a burst is judged before they show).
        self.pace_share += 0.02 * (float(self.pace_bound) - self.pace_share)
        paced = min([ttft_bound, paced_alone]
                    + [st.tpot_target_s * self.pace_fraction for st in tiers
                       if st.tpot_target_s is not None and st.rank == self.protected_rank])
        free_cap, paced_cap = within(ttft_bound, cap), within(paced, cap)
        share = max(self.pace_share, 0.5)  # the floor: fewer of a burst served late (issue 14's runs)
        self.admission_cap = max(1, round(share * paced_cap + (1 - share) * free_cap))
        return m

    def _protected_prefill_waiting(self) -> bool:
        """Does a sequence of the protected tier (or above) wait to start or have prompt left?"""
        for name, st in self.board.tiers.items():
            if st.rank <= self.protected_rank and self.queues.tier_waiting(name):
                return True
        return any(s.num_uncomputed > 1 and self.queues.rank_of(self.queues.entries[s]) <= self.protected_rank
                   for s in self.running)

    def _protected_prompt_bound_s(self) -> float:
        """How long a step with a protected-tier prompt may take: the step bound, or a share of that
        tier's TTFT target if longer (its prompt computed in one step rather than in pieces)."""
        return max(self.step_bound_s, self.protected_ttft_s * self.protected_step_fraction)

    def _lower_tier_present(self) -> bool:
        """Is there a sequence below the protected tier, i.e. one that a held step makes wait? (Without
        one a hold gives nothing up and must not use up yield_share_max.)"""
        return any(st.rank > self.protected_rank and (st.depth or st.running) for st in self.board.tiers.values())

    def _prefill_tokens(self, m: StepModel, batch: int, bound_s: float, floor: int | None = None) -> int:
        left = bound_s - m.a - max(m.c, m.b) * (batch + 1)
        n = self.limits.max_batch_tokens if m.b <= 0 else int(left / m.b)
        return max(self.min_prefill_tokens if floor is None else floor, min(n, self.limits.max_batch_tokens))

    def step_done(self, plan: StepPlan, duration_s: float) -> None:
        """The engine ran `plan` in duration_s: update the step-time model and record first tokens."""
        if plan.chunks:
            self.step_stats.record_step(duration_s, plan.num_prefill_tokens, len(plan.chunks))
        now = self.clock()
        for chunk in plan.chunks:
            e = self.queues.entries.get(chunk.seq)
            if e is not None:
                self._maybe_record_ttft(e, now)

    def _maybe_record_ttft(self, e: Entry, now: float) -> None:
        seq = e.seq
        if e.ttft_recorded or seq.first_token_at is None:
            return
        e.ttft_recorded = True
        ttft = seq.first_token_at - seq.request.arrival_time
        if not self.board.record_ttft(e.tier, ttft, now, seq.request_id):
            log.info("ttft target missed %s", fields(
                request_id=seq.request_id, tier=e.tier, ttft_ms=round(ttft * 1000, 1),
                target_ms=self.board.tiers[e.tier].config.ttft_target_ms))

    def _maybe_record_tpot(self, e: Entry, now: float) -> None:
        """A finished sequence's pace: mean time per output token after its first."""
        seq = e.seq
        if seq.finish_reason is None or seq.first_token_at is None or seq.num_generated < 2:
            return
        tpot = max(0.0, now - seq.first_token_at) / (seq.num_generated - 1)
        if self.board.record_tpot(e.tier, tpot, now) is False:
            log.info("tpot target missed %s", fields(
                request_id=seq.request_id, tier=e.tier, tpot_ms=round(tpot * 1000, 1),
                target_ms=self.board.tiers[e.tier].config.tpot_target_ms))

    def _adapt(self, now: float) -> None:
        self.queues.tick(now)
        if now - self._last_adapt >= self.board.policy.interval_s:
            self._last_adapt = now
            self.board.adapt(now, self.queues.overdue(now), self.queues.backlog_rates())

    # --- live reconfiguration and metrics ---
    def reconfigure(self, tiers: dict[str, TierConfig], default_tier: str, limits: BatchLimits | None = None,
                    preemption: str | None = None) -> None:
        """Apply reloaded tier configs, limits and preemption mode (engine thread, between steps:
        `LLMEngine.call`; or before the engine starts). Queued requests keep their deadlines and
        places; tiers that disappear hand their queue to the default tier; a tier that stays keeps
        its counters and current batch window (clamped to the new bounds); a lowered batch cap takes
        effect at the next step. An AdmissionController made by `admission()` sees it all at once."""
        removed = self.board.reconfigure(tiers, default_tier)
        self.queues.reconfigure(removed)
        if limits is not None:
            self.limits.max_num_seqs = limits.max_num_seqs
            self.limits.max_batch_tokens = limits.max_batch_tokens
        if preemption is not None and preemption != self.preemption:
            if preemption == "swap":
                log.warning("scheduler.preemption=swap is not implemented yet; preempting by recompute")
            self.preemption = preemption
            for adm in self._admissions:
                adm.preemption = preemption != "off"
        log.info("scheduler reconfigured %s", fields(
            tiers=",".join(self.board.names()), default_tier=default_tier, removed=",".join(removed) or "-",
            max_num_seqs=self.limits.max_num_seqs, max_batch_tokens=self.limits.max_batch_tokens,
            preemption=self.preemption))

    def snapshot(self) -> dict[str, dict]:
        return self.board.snapshot()

    def admission(self, **kwargs):
        """An AdmissionController on this batcher's board, step model, limits, clock and preemption
        settings (for the event loop: `router.admission = batcher.admission()`)."""
        from .admission import AdmissionController

        adm = AdmissionController.for_batcher(self, **kwargs)
        self._admissions.append(adm)
        return adm
