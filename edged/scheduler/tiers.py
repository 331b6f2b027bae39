"""SLA tiers: per-tier queues, earliest deadline first within a tier, weighted fair share between
tiers, SLA attainment over a sliding window, and the adaptive batch window.

Two objects:

`TierBoard` is shared by the engine thread (the batcher) and the event loop (admission control,
metrics). It holds each tier's config and everything observable about it: queue depth, requests
admitted at the door but not yet at the engine, running sequences, counters, TTFT observations,
attainment and the current batch window. Every method takes its lock.

`TierScheduler` belongs to the engine thread. It keeps the waiting sequences of each tier in a
heap ordered by deadline (arrival + the tier's TTFT target; a preempted sequence keeps its original
deadline, so it resumes first) and offers two candidates to start: the weighted-fair choice (the
head of the tier with the least virtual time) and the most important urgent head (one about to
miss its target); the batcher takes the urgent one only if its tier is at least as important.
Starting a sequence charges its tier 1/weight of virtual time, so backlogged tiers start requests
in proportion to their weights; a tier that was idle re-enters at the current virtual clock rather
than with banked credit; a higher tier that preempts a lower one pays for the victim's restart.

Attainment is the fraction of first tokens within the target over the last `AdaptPolicy.window_s`
seconds, counting requests still waiting past their deadline as misses.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from edged.config import SchedulerConfig, TierConfig, default_tiers
from edged.engine.sequence import Sequence
from edged.log import fields

log = logging.getLogger("edged.scheduler")

Clock = Callable[[], float]
# Upper bounds (seconds) of the cumulative TTFT histogram in snapshots (Prometheus `le` buckets).
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, math.inf)
REJECT_REASONS = ("queue_full", "deadline", "kv_capacity")
EWMA = 0.05  # weight of a new sample in the per-tier output-length averages


def tier_ranks(tiers: dict[str, TierConfig]) -> dict[str, int]:
    """0 = the most important tier: highest weight, then the tightest TTFT target, then the name."""
    order = sorted(tiers, key=lambda n: (-tiers[n].weight, tiers[n].ttft_target_ms, n))
    return {name: i for i, name in enumerate(order)}


@dataclass(slots=True)
class AdaptPolicy:
    """How the batch window follows the SLA. Shrink wins over grow: missing the target matters more."""

    sla_goal: float = 0.95  # shrink while attainment is below this
    backlog_high: float = 0.70  # grow while queue depth / max_queue is above this
    interval_s: float = 0.2  # at most one adjustment per tier per interval
    shrink: float = 0.5  # multiplicative decrease
    grow: float = 1.5  # multiplicative increase ...
    grow_step_frac: float = 0.05  # ... of at least this fraction of (max - min), so it leaves 0
    window_s: float = 30.0  # attainment is measured over the last window_s seconds ...
    min_samples: int = 5  # ... and only counts with at least this many requests in it


class DecayingRate:
    """Events per second, exponentially weighted with time constant tau_s (no timers, no history)."""

    __slots__ = ("tau_s", "_value", "_t", "_t0")

    def __init__(self, tau_s: float = 5.0) -> None:
        self.tau_s = tau_s
        self._value = 0.0
        self._t: float | None = None
        self._t0: float | None = None

    def add(self, now: float, n: float = 1.0) -> None:
        self._value = self._decayed(now) + n / self.tau_s
        self._t = now
        if self._t0 is None:
            self._t0 = now

    def _decayed(self, now: float) -> float:
        if self._t is None:
            return 0.0
        return self._value * math.exp(-max(0.0, now - self._t) / self.tau_s)

    def get(self, now: float) -> float:
        """The rate, corrected for the short history right after the first event."""
        if self._t0 is None:
            return 0.0
        seen = max(now - self._t0, self.tau_s / 10)
        return self._decayed(now) / (1.0 - math.exp(-seen / self.tau_s))


@dataclass(slots=True)
class TierState:
    name: str
    config: TierConfig
    rank: int
    window_ms: float
    waiting: int = 0  # in the engine's queue (never started or preempted)
    waiting_tokens: int = 0  # tokens those still have to compute
    running: int = 0
    overdue: int = 0  # waiting past their deadline without a first token (at the last adaptation)
    pending: dict[str, tuple[float, int]] = field(default_factory=dict)  # admitted, not yet at the engine
    admitted: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    started: int = 0
    finished: int = 0
    cancelled: int = 0
    preempted: int = 0
    ttft_count: int = 0
    ttft_sum_s: float = 0.0
    ttft_met: int = 0
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS_S))
    recent: deque[tuple[float, float, bool]] = field(default_factory=deque)  # (time, ttft_s, met)
    last_adapt: float = -math.inf
    admit_rate: DecayingRate = field(default_factory=DecayingRate)  # admitted requests per second
    backlog_rate: float | None = None  # starts per second while backlogged (measured; None: too little data)
    # Output tokens a request of this tier generates: the mean max_tokens asked at the door times the
    # measured share of it actually generated (EOS, stop strings). Admission's slot-time estimate.
    asked_tokens: float = 0.0
    asked_n: int = 0
    generated_share: float = 1.0
    generated_n: int = 0
    last_seen: float = -math.inf  # last admission or arrival at the engine: the tier is "in use" for a while
    # Pace: per finished sequence, mean time per output token after the first, against tpot_target_ms.
    tpot_count: int = 0
    tpot_sum_s: float = 0.0
    tpot_met: int = 0
    tpot_recent: deque[tuple[float, float, bool]] = field(default_factory=deque)  # (time, tpot_s, met)
    # Admission's predicted TTFT vs the one observed (observed - predicted), per request.
    predicted: dict[str, float] = field(default_factory=dict)  # request id -> predicted TTFT (s)
    prediction_count: int = 0
    prediction_error_sum_s: float = 0.0  # signed: > 0 when admission was optimistic
    prediction_abs_error_sum_s: float = 0.0

    @property
    def depth(self) -> int:
        return self.waiting + len(self.pending)

    @property
    def target_s(self) -> float:
        return self.config.ttft_target_ms / 1000.0

    def expected_output(self) -> float | None:
        return self.asked_tokens * self.generated_share if self.asked_n else None

    @property
    def tpot_target_s(self) -> float | None:
        t = self.config.tpot_target_ms
        return None if t is None else t / 1000.0


class TierBoard:
    """Tier configs and observable state, shared between the engine thread and the event loop."""

    def __init__(self, tiers: dict[str, TierConfig] | None = None, default_tier: str | None = None, *,
                 clock: Clock = time.monotonic, policy: AdaptPolicy | None = None) -> None:
        self.clock = clock
        self.policy = policy or AdaptPolicy()
        self.lock = threading.RLock()
        self.tiers: dict[str, TierState] = {}
        self.default_tier = ""
        self._observers: list[Callable[[str, float, bool], None]] = []
        self._recording = True  # False inside warming_up()
        # What the engine last published: usable batch slots (the cap, or fewer while KV blocks bind),
        # the per-step token budget and the running sequences.
        self.engine_slots = 0
        self.engine_budget = 0
        self.engine_running = 0
        # The configured batch cap, and the most important tier in use: it (and tiers above it) may
        # start beyond engine_slots, the step-time cap that holds lower tiers.
        self.engine_cap = 0
        self.engine_protected_rank = 0
        self.engine_protected_budget = 0
        # The sequences a protected prompt's step carries besides it: only its own tier's and those above
        # while lower tiers give such steps up (batcher: yield_share_max), else every running one.
        self.engine_protected_beside = 0
        self.reconfigure(tiers if tiers is not None else default_tiers(),
                         default_tier if default_tier is not None else SchedulerConfig().default_tier)

    # --- configuration ---
    def reconfigure(self, tiers: dict[str, TierConfig], default_tier: str) -> list[str]:
        """Apply new tier configs; returns the names of tiers that no longer exist. Counters and the
        current window of a tier that stays are kept (the window clamped to its new bounds)."""
        if not tiers:
            raise ValueError("at least one tier is required")
        if default_tier not in tiers:
            raise ValueError(f"default tier {default_tier!r} is not one of {', '.join(tiers)}")
        ranks = tier_ranks(tiers)
        with self.lock:
            removed = [n for n in self.tiers if n not in tiers]
            new: dict[str, TierState] = {}
            for name, cfg in tiers.items():
                bw = cfg.batch_window_ms
                st = self.tiers.get(name)
                if st is None:
                    st = TierState(name, cfg, ranks[name], _initial_window_ms(cfg))
                else:
                    st.config, st.rank = cfg, ranks[name]
                    st.window_ms = _clamp(st.window_ms, bw.min, bw.max)
                new[name] = st
            # Requests admitted for a removed tier count against the default tier from now on.
            for name in removed:
                new[default_tier].pending.update(self.tiers[name].pending)
            self.tiers = new
            self.default_tier = default_tier
        return removed

    @contextmanager
    def warming_up(self) -> Iterator[None]:
        """Steps run inside it are not the service's (the daemon's warm-up): they record no TTFT or pace (nor
        log a miss), and on leaving every tier starts afresh, with no counts and its initial batch window."""
        self._recording = False
        try:
            yield
        finally:
            with self.lock:
                self.tiers = {name: TierState(name, st.config, st.rank, _initial_window_ms(st.config))
                              for name, st in self.tiers.items()}
                self._recording = True

    def resolve(self, tier: str | None) -> str:
        """A request's tier name -> a configured tier ("default", unknown or empty: the default)."""
        with self.lock:
            return tier if tier in self.tiers else self.default_tier

    def config(self, tier: str) -> TierConfig:
        with self.lock:
            return self.tiers[self.resolve(tier)].config

    def rank(self, tier: str) -> int:
        with self.lock:
            return self.tiers[self.resolve(tier)].rank

    def names(self) -> list[str]:
        """Tier names, most important first."""
        with self.lock:
            return sorted(self.tiers, key=lambda n: self.tiers[n].rank)

    def window_s(self, tier: str) -> float:
        with self.lock:
            return self.tiers[tier].window_ms / 1000.0

    def add_ttft_observer(self, fn: Callable[[str, float, bool], None]) -> None:
        """fn(tier, ttft_seconds, met_target) for every first token, called on the engine thread
        (e.g. a Prometheus histogram's observe)."""
        self._observers.append(fn)

    # --- admission side (event loop) ---
    def note_admitted(self, tier: str, request_id: str, tokens: int, now: float,
                      predicted_ttft_s: float | None = None, max_tokens: int | None = None) -> None:
        with self.lock:
            st = self.tiers[tier]
            if max_tokens is not None and max_tokens > 0:
                st.asked_n += 1
                st.asked_tokens += max(EWMA, 1.0 / st.asked_n) * (max_tokens - st.asked_tokens)
            st.pending[request_id] = (now, tokens)
            st.admitted += 1
            st.admit_rate.add(now)
            st.last_seen = now
            if predicted_ttft_s is not None and math.isfinite(predicted_ttft_s):
                st.predicted[request_id] = predicted_ttft_s

    def note_rejected(self, tier: str, reason: str) -> None:
        with self.lock:
            rej = self.tiers[tier].rejected
            rej[reason] = rej.get(reason, 0) + 1

    def release_pending(self, request_id: str) -> None:
        """Forget an admitted request that never reached the engine (idempotent)."""
        with self.lock:
            for st in self.tiers.values():
                if st.pending.pop(request_id, None) is not None:
                    st.predicted.pop(request_id, None)
                    return

    def release_pending_keep_prediction(self, request_id: str) -> None:
        """The admitted request reached the engine: it no longer counts as pending (its predicted TTFT
        stays until its first token)."""
        with self.lock:
            for st in self.tiers.values():
                if st.pending.pop(request_id, None) is not None:
                    return

    def forget_prediction(self, request_id: str) -> None:
        """The request left without a first token (cancelled, rejected): no prediction error to record."""
        with self.lock:
            for st in self.tiers.values():
                if st.predicted.pop(request_id, None) is not None:
                    return

    def expire_pending(self, now: float, ttl_s: float) -> None:
        with self.lock:
            for st in self.tiers.values():
                stale = [rid for rid, (t, _) in st.pending.items() if now - t > ttl_s]
                for rid in stale:
                    del st.pending[rid]
                    st.predicted.pop(rid, None)

    # --- engine side ---
    def note_enqueued(self, tier: str, request_id: str, tokens: int, first_time: bool) -> None:
        with self.lock:
            st = self.tiers[tier]
            if first_time:
                self.release_pending_keep_prediction(request_id)
                st.last_seen = max(st.last_seen, self.clock())
            st.waiting += 1
            st.waiting_tokens += tokens

    def note_dequeued(self, tier: str, tokens: int) -> None:
        with self.lock:
            st = self.tiers[tier]
            st.waiting = max(0, st.waiting - 1)
            st.waiting_tokens = max(0, st.waiting_tokens - tokens)

    def note_started(self, tier: str, first_time: bool) -> None:
        with self.lock:
            st = self.tiers[tier]
            st.running += 1
            if first_time:
                st.started += 1

    def note_stopped(self, tier: str, *, finished: bool = False, cancelled: bool = False,
                     preempted: bool = False) -> None:
        """A running sequence left the batch."""
        with self.lock:
            st = self.tiers[tier]
            st.running = max(0, st.running - 1)
            st.finished += finished
            st.cancelled += cancelled
            st.preempted += preempted

    def note_cancelled_waiting(self, tier: str) -> None:
        with self.lock:
            self.tiers[tier].cancelled += 1

    def publish_engine(self, slots: int, budget: int, running: int, cap: int | None = None,
                       protected_rank: int = 0, protected_budget: int | None = None,
                       protected_beside: int | None = None) -> None:
        with self.lock:
            self.engine_slots, self.engine_budget, self.engine_running = slots, budget, running
            self.engine_cap = slots if cap is None else cap
            self.engine_protected_rank = protected_rank
            self.engine_protected_budget = budget if protected_budget is None else protected_budget
            self.engine_protected_beside = running if protected_beside is None else protected_beside

    def move_queued(self, src: str, dst: str, count: int, tokens: int) -> None:
        """Account for waiting sequences of a removed tier now queued in another tier."""
        with self.lock:
            st = self.tiers[dst]
            st.waiting += count
            st.waiting_tokens += tokens

    def record_ttft(self, tier: str, ttft_s: float, now: float, request_id: str | None = None) -> bool:
        """A first token was produced ttft_s after the request arrived; returns whether it met the target."""
        if not self._recording:
            return True
        with self.lock:
            st = self.tiers[tier]
            met = ttft_s <= st.target_s
            predicted = None
            if request_id is not None:
                for other in self.tiers.values():  # a reload may have moved it to another tier
                    if (predicted := other.predicted.pop(request_id, None)) is not None:
                        break
            if predicted is not None:
                err = ttft_s - predicted
                st.prediction_count += 1
                st.prediction_error_sum_s += err
                st.prediction_abs_error_sum_s += abs(err)
            st.ttft_count += 1
            st.ttft_sum_s += ttft_s
            st.ttft_met += met
            for i, le in enumerate(TTFT_BUCKETS_S):
                if ttft_s <= le:
                    st.ttft_buckets[i] += 1
                    break
            st.recent.append((now, ttft_s, met))
            self._prune(st, now)
            observers = list(self._observers)
        for fn in observers:
            try:
                fn(tier, ttft_s, met)
            except Exception:  # a metrics hook must never break a step
                log.exception("ttft observer failed")
        return met

    def note_generated(self, tier: str, generated: int, max_tokens: int) -> None:
        """A finished sequence generated this many of the max_tokens it asked for."""
        if max_tokens <= 0:
            return
        with self.lock:
            st = self.tiers[tier]
            st.generated_n += 1
            # The prior (1.0: all of it) counts as one sample until there are enough real ones.
            st.generated_share += max(EWMA, 1.0 / (st.generated_n + 1)) * (
                min(1.0, generated / max_tokens) - st.generated_share)

    def expected_output(self, default: float) -> float:
        """Mean output tokens of the sequences running or queued now (default where a tier has no
        history): how long a batch slot stays taken."""
        with self.lock:
            n = tot = 0.0
            for st in self.tiers.values():
                k = st.running + st.depth
                if k:
                    e = st.expected_output()
                    tot += k * (default if e is None else e)
                    n += k
            return tot / n if n else default

    def record_tpot(self, tier: str, tpot_s: float, now: float) -> bool | None:
        """A sequence finished at a mean of tpot_s per output token after its first; returns whether it
        met the tier's pace target (None: the tier has none, or nothing is recorded now)."""
        if not self._recording:
            return None
        with self.lock:
            st = self.tiers[tier]
            target = st.tpot_target_s
            met = target is None or tpot_s <= target
            st.tpot_count += 1
            st.tpot_sum_s += tpot_s
            st.tpot_met += met
            st.tpot_recent.append((now, tpot_s, met))
            self._prune(st, now)
            return None if target is None else met

    def in_use(self, now: float, horizon_s: float) -> list[TierState]:
        """Tiers with requests queued, running or pending, or seen within horizon_s: the promises a step
        must keep (a tier idle for longer does not hold the others' steps short)."""
        with self.lock:
            return [st for st in self.tiers.values()
                    if st.depth or st.running or now - st.last_seen <= horizon_s]

    # --- attainment and the adaptive window ---
    def _prune(self, st: TierState, now: float) -> None:
        horizon = now - self.policy.window_s
        while st.recent and st.recent[0][0] < horizon:
            st.recent.popleft()
        while st.tpot_recent and st.tpot_recent[0][0] < horizon:
            st.tpot_recent.popleft()

    def _attainment(self, st: TierState) -> tuple[float, int]:
        """(fraction of recent first tokens within target, counting overdue waiters as misses; samples)."""
        n = len(st.recent) + st.overdue
        if n == 0:
            return 1.0, 0
        met = sum(1 for _, _, m in st.recent if m)
        return met / n, n

    def attainment(self, tier: str) -> float:
        with self.lock:
            st = self.tiers[tier]
            self._prune(st, self.clock())
            return self._attainment(st)[0]

    def adapt(self, now: float, overdue: dict[str, int] | None = None,
              backlog_rates: dict[str, float | None] | None = None) -> None:
        """Move each tier's batch window one notch: shrink while attainment < goal, else grow while
        the backlog is above backlog_high of max_queue; always within [min, max]."""
        p = self.policy
        with self.lock:
            for st in self.tiers.values():
                if overdue is not None:
                    st.overdue = overdue.get(st.name, 0)
                if backlog_rates is not None:
                    st.backlog_rate = backlog_rates.get(st.name)
                if now - st.last_adapt < p.interval_s:
                    continue
                st.last_adapt = now
                self._prune(st, now)
                bw = st.config.batch_window_ms
                att, n = self._attainment(st)
                backlog = st.depth / st.config.max_queue
                old = st.window_ms
                if n >= p.min_samples and att < p.sla_goal:
                    new = st.window_ms * p.shrink
                    if new - bw.min < 0.01:
                        new = bw.min
                    why = "attainment"
                elif backlog > p.backlog_high:
                    new = max(st.window_ms * p.grow, st.window_ms + p.grow_step_frac * (bw.max - bw.min))
                    why = "backlog"
                else:
                    continue
                st.window_ms = _clamp(new, bw.min, bw.max)
                if st.window_ms != old and log.isEnabledFor(logging.DEBUG):
                    log.debug("batch window %s", fields(tier=st.name, window_ms=round(st.window_ms, 3),
                                                        was_ms=round(old, 3), reason=why,
                                                        attainment=round(att, 4), backlog=round(backlog, 3)))

    # --- metrics ---
    def snapshot(self) -> dict[str, dict]:
        """Per tier: everything the metrics endpoint exports (plain numbers, safe to serialize)."""
        now = self.clock()
        out: dict[str, dict] = {}
        with self.lock:
            for name in sorted(self.tiers, key=lambda n: self.tiers[n].rank):
                st = self.tiers[name]
                self._prune(st, now)
                att, n = self._attainment(st)
                recent = sorted(t for _, t, _ in st.recent)
                cum, buckets = 0, []
                for le, c in zip(TTFT_BUCKETS_S, st.ttft_buckets):
                    cum += c
                    buckets.append((le, cum))
                cfg, bw = st.config, st.config.batch_window_ms
                out[name] = {
                    "rank": st.rank,
                    "weight": cfg.weight,
                    "ttft_target_ms": cfg.ttft_target_ms,
                    "max_queue": cfg.max_queue,
                    "queue_depth": st.depth,
                    "queued_engine": st.waiting,
                    "queued_tokens": st.waiting_tokens,
                    "pending_admitted": len(st.pending),
                    "running": st.running,
                    "backlog_ratio": st.depth / cfg.max_queue,
                    "admitted": st.admitted,
                    "rejected": dict(st.rejected),
                    "rejected_total": sum(st.rejected.values()),
                    "started": st.started,
                    "finished": st.finished,
                    "cancelled": st.cancelled,
                    "preempted": st.preempted,
                    "sla_attainment": att,
                    "sla_samples": n,
                    "overdue": st.overdue,
                    "backlog_start_rate": st.backlog_rate,
                    "batch_window_ms": st.window_ms,
                    "batch_window_min_ms": bw.min,
                    "batch_window_max_ms": bw.max,
                    "ttft_count": st.ttft_count,
                    "ttft_sum_s": st.ttft_sum_s,
                    "ttft_met": st.ttft_met,
                    "ttft_missed": st.ttft_count - st.ttft_met,
                    "ttft_buckets": buckets,
                    "ttft_recent_p50_s": _quantile(recent, 0.50),
                    "ttft_recent_p90_s": _quantile(recent, 0.90),
                    "ttft_recent_p99_s": _quantile(recent, 0.99),
                    "tpot_target_ms": cfg.tpot_target_ms,
                    "tpot_count": st.tpot_count,
                    "tpot_sum_s": st.tpot_sum_s,
                    "tpot_met": st.tpot_met,
                    "tpot_missed": st.tpot_count - st.tpot_met,
                    "tpot_attainment": (sum(1 for _, _, m in st.tpot_recent if m) / len(st.tpot_recent)
                                        if st.tpot_recent else 1.0),
                    "tpot_samples": len(st.tpot_recent),
                    "ttft_prediction_count": st.prediction_count,
                    "ttft_prediction_error_sum_s": st.prediction_error_sum_s,
                    "ttft_prediction_abs_error_sum_s": st.prediction_abs_error_sum_s,
                }
        return out


def _clamp(v: float, lo: float, hi: float) -> float:
    return min(max(v, lo), max(lo, hi))


def _initial_window_ms(cfg: TierConfig) -> float:
    bw = cfg.batch_window_ms
    return _clamp(bw.initial, bw.min, bw.max)


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


# ------------------------------------------------------------------------------- engine-thread queues


@dataclass(slots=True, eq=False)
class Entry:
    """The scheduler's bookkeeping for one sequence, from add() until it leaves the engine."""

    seq: Sequence
    tier: str
    deadline: float  # arrival + the tier's TTFT target when it was added
    enqueued_at: float
    serial: int = 0  # order of arrival at the engine: the final tie-break between equal deadlines
    order: int = 0  # heap tie-break, renewed at each push (stale heap items are skipped)
    preemptions: int = 0
    tokens: int = 0  # uncomputed tokens when pushed
    queued: bool = False
    started: bool = False  # has run at least once (charged, not held by the window again)
    running: bool = False
    ttft_recorded: bool = False
    started_at: float | None = None  # when it first joined the batch (batcher clock)
    restart_paid: bool = False  # preempted for a higher tier, which paid for its restart

    @property
    def request_id(self) -> str:
        return self.seq.request_id


class TierScheduler:
    """Per-tier EDF heaps and the weighted-fair choice between tiers (engine thread only)."""

    def __init__(self, board: TierBoard) -> None:
        self.board = board
        self.entries: dict[Sequence, Entry] = {}
        self._heaps: dict[str, list[tuple[float, int, Entry]]] = {n: [] for n in board.tiers}
        self._count: dict[str, int] = {n: 0 for n in board.tiers}  # live entries per heap
        self._vtime: dict[str, float] = {n: 0.0 for n in board.tiers}
        self._vclock = 0.0
        self._order = itertools.count()
        # Starts per second while a tier has a queue: decayed sums of starts and of backlogged time.
        self.rate_tau_s = 5.0
        self._bl_starts: dict[str, float] = {n: 0.0 for n in board.tiers}
        self._bl_time: dict[str, float] = {n: 0.0 for n in board.tiers}
        self._bl_now: dict[str, bool] = {n: False for n in board.tiers}
        self._bl_last: float | None = None

    # --- membership ---
    def add(self, seq: Sequence, now: float) -> Entry:
        tier = self.board.resolve(seq.request.tier)
        target = self.board.tiers[tier].target_s
        e = Entry(seq, tier, seq.request.arrival_time + target, now, serial=next(self._order))
        self.entries[seq] = e
        self.push(e, first_time=True)
        return e

    def push(self, e: Entry, first_time: bool = False) -> None:
        """Queue e (new, or preempted back) in its tier's heap."""
        heap = self._heaps[e.tier]
        if not first_time and self._bl_now.get(e.tier):
            self._bl_starts[e.tier] -= 1.0  # a preempted sequence back in the queue undoes a start
        if self._count[e.tier] == 0:  # the tier becomes backlogged: no banked credit
            self._vtime[e.tier] = max(self._vtime[e.tier], self._vclock)
        e.order = next(self._order)
        e.tokens = e.seq.num_uncomputed
        e.queued = True
        heapq.heappush(heap, (e.deadline, e.order, e))
        self._count[e.tier] += 1
        self.board.note_enqueued(e.tier, e.request_id, e.tokens, first_time)

    def unqueue(self, e: Entry) -> None:
        """Take e out of its heap (lazily: its heap item becomes stale)."""
        if e.queued:
            e.queued = False
            self._count[e.tier] -= 1
            self.board.note_dequeued(e.tier, e.tokens)

    def forget(self, seq: Sequence) -> Entry | None:
        e = self.entries.pop(seq, None)
        if e is not None:
            self.unqueue(e)
        return e

    def waiting(self) -> Iterable[Entry]:
        """Queued entries, tier by tier (most important first), each in deadline order."""
        for name in self.board.names():
            for item in sorted((item for item in self._heaps[name] if self._live(item)), key=lambda i: i[:2]):
                yield item[2]

    def num_waiting(self) -> int:
        return sum(self._count.values())

    @staticmethod
    def _live(item: tuple[float, int, Entry]) -> bool:
        return item[2].queued and item[2].order == item[1]

    def head(self, tier: str) -> Entry | None:
        heap = self._heaps[tier]
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def tier_waiting(self, tier: str) -> int:
        return self._count[tier]

    # --- choosing ---
    def candidates(self, *, eligible: Callable[[str, Entry], bool], urgent: Callable[[Entry], bool],
                   skip: set[str] | frozenset[str] = frozenset()) -> tuple[Entry | None, Entry | None]:
        """(the most important urgent head - about to miss its TTFT target -, the weighted-fair choice:
        the head of the eligible tier with the least virtual time, ties to the more important tier)."""
        best_urgent: tuple[int, float, Entry] | None = None
        best_fair: tuple[float, int, Entry] | None = None
        for name, st in self.board.tiers.items():
            if name in skip:
                continue
            e = self.head(name)
            if e is None:
                continue
            if urgent(e):
                if best_urgent is None or (st.rank, e.deadline) < best_urgent[:2]:
                    best_urgent = (st.rank, e.deadline, e)
            if eligible(name, e) or urgent(e):
                if best_fair is None or (self._vtime[name], st.rank) < best_fair[:2]:
                    best_fair = (self._vtime[name], st.rank, e)
        return (best_urgent[2] if best_urgent else None), (best_fair[2] if best_fair else None)

    def charge(self, tier: str, starts: float = 1.0) -> None:
        self._vtime[tier] += starts / self.board.tiers[tier].config.weight

    def rank_of(self, e: Entry) -> int:
        return self.board.tiers[e.tier].rank

    def start(self, e: Entry) -> None:
        """e leaves its queue for the batch, charging its tier 1/weight of virtual time (a restart after
        preemption too: it takes a slot like any start - unless the higher tier that preempted it
        paid for the restart)."""
        self.unqueue(e)
        first = not e.started
        e.started = True
        self._vclock = max(self._vclock, self._vtime[e.tier])
        if e.restart_paid:
            e.restart_paid = False
        else:
            self.charge(e.tier)
        if self._bl_now.get(e.tier):
            self._bl_starts[e.tier] += 1.0
        e.running = True
        self.board.note_started(e.tier, first)

    def tick(self, now: float) -> None:
        """Account the time since the last tick to the tiers that had a queue (call once per step)."""
        last, self._bl_last = self._bl_last, now
        if last is None:
            for name in self._count:
                self._bl_now[name] = self._count[name] > 0
            return
        dt = max(0.0, now - last)
        decay = math.exp(-dt / self.rate_tau_s)
        for name in self._count:
            self._bl_starts[name] *= decay
            self._bl_time[name] = self._bl_time[name] * decay + (dt if self._bl_now[name] else 0.0)
            self._bl_now[name] = self._count[name] > 0

    def backlog_rates(self, min_time_s: float = 1.0) -> dict[str, float | None]:
        """Per tier, how fast its queue drained while it had one: starts, less preempted sequences put
        back, per second (None until it was backlogged for min_time_s)."""
        return {n: (max(0.0, self._bl_starts[n]) / t if (t := self._bl_time[n]) >= min_time_s else None)
                for n in self._count}

    def overdue(self, now: float) -> dict[str, int]:
        """Waiting sequences past their deadline without a first token, per tier."""
        out = {}
        for name, heap in self._heaps.items():
            out[name] = sum(1 for item in heap if self._live(item) and item[0] < now
                            and item[2].seq.first_token_at is None)
        return out

    def vtimes(self) -> dict[str, float]:
        return dict(self._vtime)

    # --- live reconfiguration ---
    def reconfigure(self, removed: list[str]) -> None:
        """After TierBoard.reconfigure: new tiers get empty heaps; sequences queued in removed tiers
        move to the default tier with their deadlines (and places) unchanged."""
        default = self.board.default_tier
        for name in self.board.tiers:
            if name not in self._heaps:
                self._heaps[name] = []
                self._count[name] = 0
                self._vtime[name] = self._vclock
                self._bl_starts[name] = self._bl_time[name] = 0.0
                self._bl_now[name] = False
        for name in removed:
            for d in (self._bl_starts, self._bl_time, self._bl_now):
                d.pop(name, None)
            heap = self._heaps.pop(name, [])
            self._count.pop(name, None)
            self._vtime.pop(name, None)
            moved = [item[2] for item in heap if self._live(item)]
            running = 0
            for e in self.entries.values():
                if e.tier == name:
                    e.tier = default
                    running += e.running
            for e in moved:
                heapq.heappush(self._heaps[default], (e.deadline, e.order, e))
                self._count[default] += 1
            if moved:
                self.board.move_queued(name, default, len(moved), sum(e.tokens for e in moved))
            if running:
                with self.board.lock:
                    self.board.tiers[default].running += running
            log.info("tier removed %s", fields(tier=name, moved_to=default, queued=len(moved), running=running))


__all__ = ["AdaptPolicy", "Entry", "TierBoard", "TierScheduler", "TierState", "TTFT_BUCKETS_S", "tier_ranks"]
