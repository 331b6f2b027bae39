"""A deterministic simulated clock and engine for the scheduler: no model, no threads, no wall time.

`SimEngine` drives the real `Batcher` (tiers, EDF, weighted fair share, preemption, adaptive
windows), the real `BlockManager` and the real `AdmissionController` exactly as the engine thread
and the event loop do, but a step costs `a + b * prefill_tokens + c * batch_size` seconds of
simulated time and every sampled token is 0. `Workload` makes seeded Poisson arrivals with a tier
mix and uniform prompt/output lengths. Same seed, same result, in well under a second per simulated
minute: tests/test_scheduler_sla.py proves the SLA behaviour with it, and it is handy for tuning
(`SimEngine(...).run(Workload(rate_rps=...)).table()`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from edged.config import TierConfig, default_tiers
from edged.engine.block_manager import BlockManager
from edged.engine.request import GenerationRequest, SamplingParams
from edged.engine.sequence import Sequence

from .admission import AdmissionController, AdmissionError, weighted_fair_shares
from .batcher import BatchLimits, Batcher, StepPlan
from .step_stats import StepModel, StepStats


class SimClock:
    """Monotonic simulated seconds; pass the instance where a `clock()` callable is expected."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError("the simulated clock only moves forward")
        self.t += dt

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)


@dataclass(frozen=True, slots=True)
class StepCost:
    """Simulated step time: a + b * prefill_tokens + c * batch_size seconds."""

    a: float = 0.008
    b: float = 0.00005
    c: float = 0.00025

    def __call__(self, prefill_tokens: int, batch_size: int) -> float:
        return self.a + self.b * prefill_tokens + self.c * batch_size


@dataclass(slots=True)
class Workload:
    """Seeded Poisson arrivals at rate_rps for duration_s, tiers drawn from tier_mix (weights)."""

    rate_rps: float
    duration_s: float = 30.0
    tier_mix: dict[str, float] = field(default_factory=lambda: {"gold": 0.2, "silver": 0.3, "bronze": 0.5})
    prompt_tokens: tuple[int, int] = (32, 256)  # uniform, inclusive
    output_tokens: tuple[int, int] = (16, 64)
    seed: int = 0

    @property
    def mean_prompt(self) -> float:
        return sum(self.prompt_tokens) / 2

    @property
    def mean_output(self) -> float:
        return sum(self.output_tokens) / 2

    def requests(self) -> list[GenerationRequest]:
        rng = random.Random(self.seed)
        names = list(self.tier_mix)
        weights = [self.tier_mix[n] for n in names]
        out: list[GenerationRequest] = []
        t = 0.0
        while True:
            t += rng.expovariate(self.rate_rps)
            if t >= self.duration_s:
                return out
            tier = rng.choices(names, weights)[0]
            prompt = [rng.randrange(1, 30000) for _ in range(rng.randint(*self.prompt_tokens))]
            n_out = rng.randint(*self.output_tokens)
            sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
            out.append(GenerationRequest(f"{tier}-{len(out)}", prompt, sp, tier=tier, arrival_time=t))


def capacity_rps(cost: StepCost, limits: BatchLimits, mean_prompt: float, mean_output: float) -> float:
    """Requests per second the simulated engine sustains with a full batch: each step decodes one token
    for each of max_num_seqs sequences and prefills the prompts of the max_num_seqs / mean_output
    sequences that start per step on average."""
    b = limits.max_num_seqs
    starts_per_step = b / mean_output
    step = cost(starts_per_step * mean_prompt, b)
    per_step_tokens = b + starts_per_step * mean_prompt
    if per_step_tokens > limits.max_batch_tokens:  # the token budget binds first
        step *= per_step_tokens / limits.max_batch_tokens
    return starts_per_step / step


@dataclass(slots=True)
class TierResult:
    target_s: float
    offered: int = 0
    admitted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    first_tokens: int = 0
    met: int = 0
    completed: int = 0
    ttfts: list[float] = field(default_factory=list)

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    @property
    def attainment(self) -> float:
        """Fraction of admitted requests whose first token came within the target."""
        return self.met / self.first_tokens if self.first_tokens else 1.0

    def ttft_quantile(self, q: float) -> float | None:
        if not self.ttfts:
            return None
        s = sorted(self.ttfts)
        return s[min(len(s) - 1, int(q * len(s)))]


@dataclass(slots=True)
class SimReport:
    tiers: dict[str, TierResult]
    sim_time_s: float
    steps: int
    max_batch: int
    preemptions: int
    capacity_rps: float
    snapshot: dict[str, dict]
    window_history: dict[str, list[tuple[float, float]]]  # tier -> [(time, window_ms)] at each change

    def table(self) -> str:
        lines = [f"{'tier':8} {'offered':>7} {'admit':>6} {'full':>5} {'late':>5} {'done':>6} {'attain':>7} "
                 f"{'p50ms':>7} {'p99ms':>7}"]
        for name, r in self.tiers.items():
            p50, p99 = r.ttft_quantile(0.5), r.ttft_quantile(0.99)
            lines.append(f"{name:8} {r.offered:7d} {r.admitted:6d} {r.rejected.get('queue_full', 0):5d} "
                         f"{r.rejected.get('deadline', 0):5d} {r.completed:6d} {r.attainment:7.3f} "
                         f"{(p50 or 0) * 1000:7.1f} {(p99 or 0) * 1000:7.1f}")
        lines.append(f"steps={self.steps} max_batch={self.max_batch} preemptions={self.preemptions} "
                     f"capacity_rps={self.capacity_rps:.1f} sim_time_s={self.sim_time_s:.1f}")
        return "\n".join(lines)


class SimEngine:
    """The real scheduler objects on a simulated clock. `run(workload)` plays a whole workload;
    `submit` and `step` drive it by hand."""

    def __init__(self, tiers: dict[str, TierConfig] | None = None, default_tier: str | None = None, *,
                 limits: BatchLimits | None = None, cost: StepCost | None = None, num_blocks: int = 8192,
                 block_size: int = 16, admission: bool = True, preemption: str = "recompute",
                 max_model_len: int = 8192, prior: StepModel | None = None, clock: SimClock | None = None,
                 admission_kw: dict | None = None, **batcher_kw) -> None:
        self.clock = clock or SimClock()
        self.cost = cost or StepCost()
        self.limits = limits or BatchLimits(max_num_seqs=32, max_batch_tokens=512)
        self.tier_configs = tiers if tiers is not None else default_tiers()
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=False)
        self.stats = StepStats(prior=prior or StepModel(self.cost.a, self.cost.b, self.cost.c))
        self.batcher = Batcher(self.blocks, self.limits, self.tier_configs, default_tier, clock=self.clock,
                               step_stats=self.stats, preemption=preemption, **batcher_kw)
        self.admission = AdmissionController.for_batcher(self.batcher, enabled=admission, **(admission_kw or {}))
        self.max_model_len = max_model_len
        self.steps = 0
        self.max_batch = 0
        self.preemptions = 0
        self.results: dict[str, TierResult] = {}
        self.finished: dict[str, Sequence] = {}
        self.start_order: list[str] = []  # request ids in the order they first joined a batch
        self.window_history: dict[str, list[tuple[float, float]]] = {}
        self._started: set[str] = set()

    def _result(self, tier: str) -> TierResult:
        name = self.batcher.board.resolve(tier)
        if name not in self.results:
            self.results[name] = TierResult(self.batcher.board.tiers[name].target_s)
        return self.results[name]

    def submit(self, request: GenerationRequest) -> str | None:
        """Admission then the engine; returns None if admitted, else the refusal reason."""
        r = self._result(request.tier)
        r.offered += 1
        try:
            self.admission.admit(request)
        except AdmissionError as e:
            r.rejected[e.reason] = r.rejected.get(e.reason, 0) + 1
            return e.reason
        r.admitted += 1
        self.batcher.add(Sequence.from_request(request, 0, frozenset()))
        return None

    def step(self) -> float:
        """One engine step; returns its simulated duration (0: nothing ran)."""
        plan: StepPlan = self.batcher.schedule()
        self.preemptions += len(plan.preempted)
        for seq in plan.rejected:
            r = self._result(seq.request.tier)
            r.rejected["kv_capacity"] = r.rejected.get("kv_capacity", 0) + 1
        if not plan.chunks:
            return 0.0
        if len(plan.chunks) > self.limits.max_num_seqs:
            raise AssertionError(f"a step ran {len(plan.chunks)} sequences, above the cap {self.limits.max_num_seqs}")
        self.max_batch = max(self.max_batch, len(plan.chunks))
        dt = self.cost(plan.num_prefill_tokens, len(plan.chunks))
        samples = [c.completes_prompt for c in plan.chunks]
        start = self.clock()
        self.clock.advance(dt)
        now = self.clock()
        for chunk, sampled in zip(plan.chunks, samples):
            seq = chunk.seq
            if seq.first_scheduled_at is None:
                seq.first_scheduled_at = start
            if seq.request_id not in self._started:
                self._started.add(seq.request_id)
                self.start_order.append(seq.request_id)
            seq.num_computed += chunk.num_new_tokens
            if not sampled:
                continue
            if seq.first_token_at is None:
                seq.first_token_at = now
                r = self._result(seq.request.tier)
                ttft = now - seq.request.arrival_time
                r.first_tokens += 1
                r.ttfts.append(ttft)
                r.met += ttft <= r.target_s
            seq.append(0, self.max_model_len)
            if seq.finish_reason is not None:
                self.batcher.remove(seq)
                self._result(seq.request.tier).completed += 1
                self.finished[seq.request_id] = seq
        self.batcher.step_done(plan, dt)
        self.steps += 1
        self._note_windows(now)
        return dt

    def _note_windows(self, now: float) -> None:
        for name, st in self.batcher.board.tiers.items():
            hist = self.window_history.setdefault(name, [])
            if not hist or hist[-1][1] != st.window_ms:
                hist.append((now, st.window_ms))

    def run(self, workload: Workload, drain: bool = True, max_extra_s: float = 600.0) -> SimReport:
        """Play the workload; with drain, keep stepping after the last arrival until all work is done."""
        arrivals = workload.requests()
        for name in self.tier_configs:
            self._result(name)
        i = 0
        limit = workload.duration_s + max_extra_s
        while self.clock() < limit:
            now = self.clock()
            while i < len(arrivals) and arrivals[i].arrival_time <= now:
                self.submit(arrivals[i])
                i += 1
            if self.batcher.has_work():
                if self.step() == 0.0:
                    nxt = arrivals[i].arrival_time if i < len(arrivals) else now + 0.001
                    self.clock.advance_to(min(nxt, now + 0.001))
            elif i < len(arrivals):
                self.clock.advance_to(arrivals[i].arrival_time)
            else:
                break
            if not drain and self.clock() >= workload.duration_s:
                break
        cap = capacity_rps(self.cost, self.limits, workload.mean_prompt, workload.mean_output)
        return SimReport(self.results, self.clock(), self.steps, self.max_batch, self.preemptions, cap,
                         self.batcher.snapshot(), self.window_history)


__all__ = ["SimClock", "StepCost", "Workload", "SimEngine", "SimReport", "TierResult", "capacity_rps",
           "weighted_fair_shares"]
