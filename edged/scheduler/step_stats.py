"""What recent engine steps cost: the model admission control predicts time-to-first-token with.

The engine reports every step (wall time, prompt tokens computed, sequences in the batch); a
least-squares fit with forgetting and non-negative coefficients keeps
`step_s = a + b * prefill_tokens + c * batch_size` current, so a slower or faster phase (thermal
throttling, a busy PCIe link) shows up within a few dozen steps; steps that only decode are also
averaged per batch size (`decode_step_s`). Finished sequences report how many tokens they generated,
which gives the mean time a sequence holds a batch slot. Written on the engine thread, read on the
event loop: thread-safe.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

# Feature scales: the fit runs on (1, prefill_tokens / P_SCALE, batch_size / N_SCALE) so that the
# ridge prior weighs each coefficient alike. Small scales, so that a few short prompts or small
# batches (a CPU, or a quiet GPU) already outweigh the fading prior: a first burst is then judged with
# measured costs, not the prior's.
P_SCALE = 16.0
N_SCALE = 4.0
# A step more than this many times slower than the model predicts is counted at this multiple: a
# one-off stall (a kernel compiled on its first use, a page fault storm) must not teach admission
# that every step is slow, while a device that really is slower still moves the fit 4x per step.
OUTLIER_FACTOR = 4.0
# Weight of a new pure-decode step in the per-batch-size average (`decode_step_s`).
DECODE_EWMA = 0.2


@dataclass(frozen=True, slots=True)
class StepModel:
    """step_s = a + b * prefill_tokens + c * batch_size (seconds)."""

    a: float = 0.02  # fixed cost of a step (launches, sampling, host work)
    b: float = 0.0002  # per prompt token computed
    c: float = 0.001  # per sequence in the batch (decode attention, KV reads)

    def __call__(self, prefill_tokens: float, batch_size: float) -> float:
        # A sequence in the batch computes at least one token: never cheaper than a prompt token
        # (guards a fit that has seen only one batch size, where c is not identifiable).
        return max(0.0, self.a + self.b * prefill_tokens + max(self.c, self.b) * batch_size)


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-12:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                for k in range(col, n + 1):
                    a[r][k] -= f * a[col][k]
    return [a[i][n] / a[i][i] for i in range(n)]


def _solve_nonnegative(m: list[list[float]], v: list[float]) -> list[float] | None:
    """argmin over x >= 0 of x'Mx - 2v'x (least squares with non-negative coefficients), M positive
    definite: the best of the unconstrained solutions on each subset of free coefficients. Clipping a
    negative coefficient of the full solution instead would leave the others fitted to it, and every
    prediction off by what was clipped."""
    n = len(v)
    best, best_cost = None, math.inf
    for mask in range(1, 1 << n):
        free = [i for i in range(n) if mask >> i & 1]
        sub = _solve([[m[i][j] for j in free] for i in free], [v[i] for i in free])
        if sub is None or min(sub) < 0:
            continue
        x = [0.0] * n
        for i, xi in zip(free, sub):
            x[i] = xi
        cost = sum(x[i] * m[i][j] * x[j] for i in range(n) for j in range(n)) - 2 * sum(v[i] * x[i] for i in range(n))
        if cost < best_cost:
            best, best_cost = x, cost
    return best


class StepStats:
    """Recent step-time model plus per-sequence service figures; every method is thread-safe.

    forget: weight kept by the past at each new step (0.98: the last ~50 steps dominate).
    prior_weight: how many pseudo-steps the prior `StepModel` is worth at first (it fades with each step).
    """

    def __init__(self, prior: StepModel | None = None, forget: float = 0.98, prior_weight: float = 2.0,
                 mean_output_tokens: float = 128.0, ewma: float = 0.05) -> None:
        if not 0 < forget <= 1:
            raise ValueError("forget must be in (0, 1]")
        self.prior = prior or StepModel()
        self.forget = forget
        self.prior_weight = prior_weight
        self.ewma = ewma
        self._lock = threading.Lock()
        self._mean_output_prior = mean_output_tokens
        self.reset()

    def reset(self, *, steps: bool = True, service: bool = True) -> None:
        """Forget what was recorded: `steps` the step-time fit (back to the prior), `service` the
        per-sequence figures. The daemon's warm-up steps compile kernels and its sequences are a few
        tokens long: neither says what serving costs."""
        with self._lock:
            if steps:
                self._xx = [[0.0] * 3 for _ in range(3)]
                self._xy = [0.0] * 3
                self._model = self.prior
                self._dirty = False
                self.steps = 0
                self.last_step_s = 0.0
                self._decode: dict[int, float] = {}
            if service:
                self._mean_output = self._mean_output_prior
                self._finished = 0
                self._slot_s = 0.0
                self._slot_n = 0

    # --- written by the engine thread ---
    def record_step(self, duration_s: float, prefill_tokens: int, batch_size: int) -> None:
        if not math.isfinite(duration_s) or duration_s < 0 or batch_size <= 0:
            return
        expected = self.predict_step(prefill_tokens, batch_size)
        if expected > 0:
            duration_s = min(duration_s, OUTLIER_FACTOR * expected)
        x = (1.0, prefill_tokens / P_SCALE, batch_size / N_SCALE)
        with self._lock:
            lam = self.forget
            for i in range(3):
                self._xy[i] = lam * self._xy[i] + x[i] * duration_s
                for j in range(3):
                    self._xx[i][j] = lam * self._xx[i][j] + x[i] * x[j]
            self.steps += 1
            self.last_step_s = duration_s
            self._dirty = True
            if prefill_tokens == 0:
                prev = self._decode.get(batch_size)
                self._decode[batch_size] = duration_s if prev is None else prev + DECODE_EWMA * (duration_s - prev)

    def record_finished(self, generated_tokens: int, slot_s: float | None = None) -> None:
        """A sequence finished (not cancelled) after generating this many tokens, having held a batch
        slot for slot_s seconds since it first started."""
        if generated_tokens <= 0:
            return
        with self._lock:
            self._finished += 1
            # A plain mean (the prior counting as one sample) until the EWMA has enough samples, so a
            # single short warm-up request does not set the figure alone.
            w = max(self.ewma, 1.0 / (self._finished + 1))
            self._mean_output += w * (generated_tokens - self._mean_output)
            if slot_s is not None and math.isfinite(slot_s) and slot_s >= 0:
                self._slot_n += 1
                w = max(self.ewma, 1.0 / self._slot_n)
                self._slot_s += w * (slot_s - self._slot_s)

    # --- read anywhere ---
    @property
    def model(self) -> StepModel:
        with self._lock:
            if self._dirty:
                self._model = self._fit()
                self._dirty = False
            return self._model

    def _fit(self) -> StepModel:
        p = self.prior
        theta0 = (p.a, p.b * P_SCALE, p.c * N_SCALE)
        # The prior fades twice as fast as old steps, down to a floor that keeps the fit well posed
        # when recent steps all look alike (same batch size, no prefill).
        k = max(self.prior_weight * self.forget ** (2 * self.steps), 1e-4)
        m = [[self._xx[i][j] + (k if i == j else 0.0) for j in range(3)] for i in range(3)]
        v = [self._xy[i] + k * theta0[i] for i in range(3)]
        sol = _solve_nonnegative(m, v)
        if sol is None:
            return self._model
        a, b, c = sol
        return StepModel(a, b / P_SCALE, c / N_SCALE)

    def predict_step(self, prefill_tokens: float, batch_size: float) -> float:
        return self.model(prefill_tokens, batch_size)

    def decode_step_s(self, batch_size: int) -> float:
        """A step of `batch_size` decodes and no prompt: as measured at that size (a moving average),
        else the fit's prediction. Decode cost is not linear in the batch on every device (a CPU reads
        the weights once for a few rows, then computes per row), and the pace of a tier is set by it."""
        with self._lock:
            measured = self._decode.get(batch_size)
        return measured if measured is not None else self.predict_step(0, batch_size)

    def measured_decode_sizes(self) -> list[int]:
        """The batch sizes decode_step_s has measurements for."""
        with self._lock:
            return sorted(self._decode)

    def decodes_within(self, bound_s: float, cap: int) -> int:
        """The largest batch of decodes, 1 to cap, whose step (decode_step_s) fits in bound_s; a binary
        search, taking the step time as growing with the batch."""
        m = self.model
        with self._lock:
            table = self._decode
            lo, hi = 1, max(1, cap)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                t = table.get(mid)
                if (t if t is not None else m(0, mid)) <= bound_s:
                    lo = mid
                else:
                    hi = mid - 1
            return lo

    @property
    def prefill_s_per_token(self) -> float:
        return self.model.b

    @property
    def mean_output_tokens(self) -> float:
        with self._lock:
            return self._mean_output

    def mean_service_s(self, batch_size: int) -> float:
        """Mean time a sequence holds a batch slot with `batch_size` sequences in the batch: the measured
        time, or the step model's decode time for the mean output if that is longer (a batch that fills
        up runs slower steps than the ones measured so far)."""
        modeled = self.mean_output_tokens * self.predict_step(0, max(1, batch_size))
        with self._lock:
            measured = self._slot_s if self._slot_n else 0.0
        return max(measured, modeled)

    def prefill_s(self, tokens: int, step_token_budget: int, batch_size: int) -> float:
        """Time to compute `tokens` prompt tokens in chunks of the step budget beside `batch_size` decodes."""
        if tokens <= 0:
            return 0.0
        m = self.model
        steps = -(-tokens // max(1, step_token_budget))
        return m.b * tokens + steps * (m.a + m.c * max(1, batch_size))

    def snapshot(self) -> dict:
        m = self.model
        with self._lock:
            return {"steps": self.steps, "last_step_s": self.last_step_s, "fixed_s": m.a,
                    "prefill_s_per_token": m.b, "per_seq_s": m.c, "mean_output_tokens": self._mean_output,
                    "mean_slot_s": self._slot_s}
