"""SLA admission: refuse early rather than miss late.

Runs on the event loop before a request goes to the engine. For a request of tier T:

* T's queue (admitted, not yet started) is at its `max_queue`: 429 with Retry-After;
* its predicted time to first token exceeds T's target: 429 with Retry-After (code
  deadline_unreachable): a burst beyond what the tier can serve in time is refused at the door
  rather than admitted and served late.

The prediction counts what starts before it - all of T's queue (earliest deadline first) and of
every other tier the share weighted-fair queueing gives it meanwhile - and how fast T's queue
drains: T's weighted max-min fair share of the batch slots (slots / mean slot time, with the tiers
that have a queue taking their full share and the others what they asked for lately, counted in
slot time: a tier of short answers holds its slots for less), or the drain rate measured while T
was backlogged if that is lower. To the slot wait it adds the prefill time of what is ahead plus its
own prompt (the part the prefix cache does not hold), from the engine's recent step times
(step_stats.py): for the protected tier (the most important in use), in the step of its own its
prompt gets, beside only its tier's decodes (batcher.py). The estimate must stay under `headroom` x target.

A request whose tier can preempt running sequences of lower tiers has a firm bound as well: the
batcher preempts for it once it is urgent, a quarter of its target before its deadline. If the
slots free now, those held by lower tiers and those its tier gets meanwhile cover everything with
precedence over it, it is admitted when that bound is within the target. So higher tiers see
short queues and cheap slots and lower tiers long ones: under overload the lower tiers are
refused first, and gold only when even preempting everything below it would not do.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from edged.engine.request import GenerationRequest
from edged.log import fields

from .step_stats import StepStats
from .tiers import TierBoard

log = logging.getLogger("edged.scheduler")


def weighted_fair_shares(demand: dict[str, float], weights: dict[str, float], capacity: float) -> dict[str, float]:
    """Weighted max-min fair split of capacity (water filling): a tier asking for less than its
    weighted share gets what it asks; the rest is split among the others by weight. Demand may be inf."""
    alloc = dict.fromkeys(demand, 0.0)
    active = {k for k, v in demand.items() if v > 0}
    left = capacity
    while active and left > 1e-12:
        wsum = sum(weights[k] for k in active)
        share = {k: left * weights[k] / wsum for k in active}
        sated = {k for k in active if demand[k] - alloc[k] <= share[k]}
        if not sated:
            for k in active:
                alloc[k] += share[k]
            break
        for k in sated:
            left -= demand[k] - alloc[k]
            alloc[k] = demand[k]
        active -= sated
    return alloc


class AdmissionError(Exception):
    """A refused request: status 429 (code tier_queue_full or deadline_unreachable), with the seconds
    a client should wait (`retry_after_s`; also `retry_after`/`http_status`, which the router maps to an
    OpenAI-style error with a Retry-After header)."""

    def __init__(self, status: int, message: str, retry_after_s: float, *, tier: str | None = None,
                 reason: str | None = None, predicted_ttft_s: float | None = None) -> None:
        super().__init__(message)
        seconds = max(1, math.ceil(retry_after_s))
        self.status = status
        self.message = message
        self.code = "deadline_unreachable" if reason == "deadline" else "tier_queue_full"
        self.headers = [("retry-after", str(seconds))]
        self.retry_after_s = float(retry_after_s)
        self.retry_after = seconds
        self.http_status = status
        self.tier = tier
        self.reason = reason
        self.predicted_ttft_s = predicted_ttft_s


class AdmissionController:
    """Thread-safe (everything runs under the board's lock); `admit` costs a few dozen arithmetic
    operations per tier.

    headroom: admit while the queue-drain estimate of TTFT is <= headroom * target. The estimate is a
    mean; 0.7 keeps the tail inside the target in the simulated overload tests (a firm preemption
    bound, where there is one, is held to the target itself).
    preemption: whether the engine preempts lower tiers for an urgent request (Batcher.preemption).
    urgency_fraction: the batcher's; a request relying on preemption starts by then at the latest.
    pending_ttl_s: an admitted request that never reached the engine stops counting after this long.
    cached_prefix: how many leading tokens of a prompt the engine's prefix cache holds now; a prompt is
    charged only for the rest, which is what its prefill computes (a shared system prompt is free).
    """

    def __init__(self, board: TierBoard, step_stats: StepStats, limits, *, clock: Callable[[], float] = time.monotonic,
                 headroom: float = 0.7, preemption: bool = True, urgency_fraction: float = 0.25,
                 pending_ttl_s: float = 10.0, max_retry_after_s: float = 60.0, enabled: bool = True,
                 cached_prefix: Callable[[list[int]], int] | None = None) -> None:
        self.board = board
        self.stats = step_stats
        self.limits = limits
        self.clock = clock
        self.headroom = headroom
        self.preemption = preemption
        self.urgency_fraction = urgency_fraction
        self.pending_ttl_s = pending_ttl_s
        self.max_retry_after_s = max_retry_after_s
        self.enabled = enabled
        self.cached_prefix = cached_prefix
        self._last_expiry = -math.inf

    @classmethod
    def for_batcher(cls, batcher, **kwargs) -> "AdmissionController":
        kwargs.setdefault("preemption", batcher.preemption != "off")
        kwargs.setdefault("urgency_fraction", batcher.urgency_fraction)
        kwargs.setdefault("cached_prefix", batcher.blocks.cached_prefix_tokens)
        return cls(batcher.board, batcher.step_stats, batcher.limits, clock=batcher.clock, **kwargs)

    # --- the door ---
    def admit(self, request: GenerationRequest) -> float:
        """Admit request (it then counts in its tier's queue until the engine starts it) and return its
        predicted TTFT in seconds; raise AdmissionError if it must be refused."""
        now = self.clock()
        board = self.board
        tokens = self._tokens_to_compute(request.prompt_token_ids)
        with board.lock:
            if now - self._last_expiry >= 1.0:
                self._last_expiry = now
                board.expire_pending(now, self.pending_ttl_s)
            tier = board.resolve(request.tier)
            st = board.tiers[tier]
            cfg = st.config
            natural, bound = self._predict(tier, tokens, now)
            waited = max(0.0, now - request.arrival_time)
            natural += waited
            predicted = natural if bound is None else min(natural, bound + waited)
            if self.enabled:
                if st.depth >= cfg.max_queue:
                    board.note_rejected(tier, "queue_full")
                    retry = self._retry(predicted)
                    self._log_reject(request, tier, "queue_full", predicted, retry, st.depth)
                    raise AdmissionError(
                        429, f"The '{tier}' tier queue is full ({cfg.max_queue} requests waiting); "
                             f"retry in {max(1, math.ceil(retry))} s.",
                        retry, tier=tier, reason="queue_full", predicted_ttft_s=predicted)
                target = st.target_s
                # The drain estimate must leave headroom; the preemption bound is firm. A prompt too
                # long for the target even on an idle engine is not refused for that alone: only when
                # the queue ahead would more than double what it costs alone.
                alone = self.stats.prefill_s(tokens, max(1, board.engine_protected_budget or
                                                         self.limits.max_batch_tokens), 1)
                if (natural > max(target * self.headroom, 2 * alone)
                        and (bound is None or bound + waited > max(target, 2 * alone))):
                    board.note_rejected(tier, "deadline")
                    retry = self._retry(predicted - target)
                    self._log_reject(request, tier, "deadline", predicted, retry, st.depth,
                                     natural=natural, bound=None if bound is None else bound + waited,
                                     waited=waited)
                    raise AdmissionError(
                        429, f"The server is overloaded: the '{tier}' tier's time-to-first-token target of "
                             f"{cfg.ttft_target_ms:g} ms cannot be met now (predicted "
                             f"{predicted * 1000:.0f} ms); retry in {max(1, math.ceil(retry))} s.",
                        retry, tier=tier, reason="deadline", predicted_ttft_s=predicted)
            board.note_admitted(tier, request.request_id, tokens, now, predicted_ttft_s=predicted,
                                max_tokens=request.sampling.max_tokens)
            depth = st.depth
        if log.isEnabledFor(logging.DEBUG):
            log.debug("admitted %s", fields(request_id=request.request_id, tier=tier, tokens=tokens,
                                            predicted_ttft_ms=round(predicted * 1000, 1), depth=depth))
        return predicted

    def _tokens_to_compute(self, prompt: list[int]) -> int:
        """The prompt tokens its prefill will compute: those after the prefix the cache holds (at least
        one: the step needs its logits)."""
        cached = self.cached_prefix(prompt) if self.cached_prefix is not None and prompt else 0
        return max(1, len(prompt) - cached)

    def release(self, request_id: str) -> None:
        """The request will not reach the engine after all (idempotent; the engine's own bookkeeping
        releases every request that does reach it)."""
        self.board.release_pending(request_id)

    def predict_ttft(self, tier: str, prompt_tokens: int) -> float:
        """Seconds from now until a request of `tier` with this prompt would get its first token."""
        with self.board.lock:
            natural, bound = self._predict(self.board.resolve(tier), prompt_tokens, self.clock())
            return natural if bound is None else min(natural, bound)

    def snapshot(self) -> dict[str, dict]:
        return self.board.snapshot()

    # --- the model ---
    def _predict(self, tier: str, tokens: int, now: float) -> tuple[float, float | None]:
        """Seconds to the first token: (the estimate from queue drain, the firm bound that preempting a
        lower tier gives, or None if there is nothing to preempt)."""
        board, stats = self.board, self.stats
        me = board.tiers[tier]
        # The step-time cap holds tiers below the protected one; the protected tier and those above it
        # may start up to the configured cap (lower tiers' decodes give way instead).
        slots = max(1, board.engine_slots or self.limits.max_num_seqs)
        budget = max(1, board.engine_budget or self.limits.max_batch_tokens)
        running = sum(st.running for st in board.tiers.values())
        beside = running  # the decodes its prompt's steps carry
        if board.engine_cap and me.rank <= board.engine_protected_rank:
            slots = max(slots, board.engine_cap)
            budget = max(budget, board.engine_protected_budget)
            beside = min(running, board.engine_protected_beside)
        # Who starts first: my tier's whole queue (EDF), and of each other tier what weighted fair
        # sharing lets it start while mine works through its queue.
        mine = me.depth
        ahead = float(mine)
        ahead_tokens = float(me.waiting_tokens + sum(t for _, t in me.pending.values()))
        higher = mine  # what can start before me even if I turn urgent
        precedence_tokens = ahead_tokens
        preemptable = 0
        demand: dict[str, float] = {}
        weights: dict[str, float] = {}
        my_out = me.expected_output() or stats.mean_output_tokens
        for name, st in board.tiers.items():
            weights[name] = st.config.weight
            # A backlogged tier takes all its share; an idle one what it has been asking for lately, in
            # slots held as long as mine are (a tier of short answers takes fewer slot-seconds a start).
            demand[name] = math.inf if (st is me or st.depth) else \
                st.admit_rate.get(now) * (st.expected_output() or my_out) / max(1.0, my_out)
            if st is me:
                continue
            depth = st.depth
            if st.rank < me.rank:
                higher += depth
                precedence_tokens += st.waiting_tokens + sum(t for _, t in st.pending.values())
            elif st.running:
                preemptable += st.running
            if depth:
                n = min(float(depth), (mine + 1) * st.config.weight / me.config.weight)
                ahead += n
                ahead_tokens += n * (st.waiting_tokens + sum(t for _, t in st.pending.values())) / depth
        free = max(0, slots - running)
        # A slot is held for the mean output of what runs and waits (per tier, from what it asks and
        # generates), one step of a full batch per token; or as long as measured, if longer.
        batch = max(running, min(slots, running + int(ahead) + 1))
        out_tokens = board.expected_output(stats.mean_output_tokens)
        slot_s = max(1e-6, stats.mean_service_s(batch), out_tokens * stats.predict_step(0, max(1, batch)))
        capacity = slots / slot_s  # starts per second with the batch full
        # How fast my tier's queue drains: its weighted fair share of the slots, or what was measured
        # while it was backlogged if that is less (preemption, recompute, a slower phase).
        rate = weighted_fair_shares(demand, weights, capacity)[tier]
        if me.backlog_rate is not None:
            rate = min(rate, me.backlog_rate)
        wait_slots = max(max(0.0, ahead + 1 - free) / capacity,
                         max(0.0, mine + 1 - free) / rate if rate > 0 else math.inf)
        own = stats.prefill_s(tokens, budget, beside + 1)
        everything = stats.prefill_s(int(ahead_tokens) + tokens, budget, beside + 1)
        natural = max(wait_slots + own, everything)
        first = stats.prefill_s(int(precedence_tokens) + tokens, budget, beside + 1)
        # Once urgent (urgency_fraction of the target before its deadline) it preempts a lower tier:
        # a firm bound if, by then, the slots free now, those of lower tiers and those its tier gets
        # meanwhile cover everything with precedence over it.
        until_urgent = me.target_s * (1 - self.urgency_fraction)
        if self.preemption and preemptable and higher + 1 <= free + preemptable + rate * until_urgent:
            return natural, until_urgent + first
        return natural, None

    def _retry(self, seconds: float) -> float:
        return min(self.max_retry_after_s, max(1.0, seconds))

    @staticmethod
    def _log_reject(request: GenerationRequest, tier: str, reason: str, predicted: float, retry: float,
                    depth: int, **parts: float | None) -> None:
        # parts: the estimate's pieces (natural, bound, waited), in ms, for an operator to see which one refused
        log.info("admission refused %s", fields(
            request_id=request.request_id, tier=tier, reason=reason, status=429,
            predicted_ttft_ms=round(predicted * 1000, 1), retry_after_s=max(1, math.ceil(retry)), depth=depth,
            **{f"{k}_ms": round(v * 1000, 1) for k, v in parts.items() if v is not None}))
