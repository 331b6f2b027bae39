"""An independent statement of what temperature / top-k / top-p sampling may draw, in float64 numpy.

Written from the OpenAI/vLLM semantics, not from edged's code: divide the logits by the temperature,
keep the top_k most likely tokens (0 = all), then keep the smallest prefix of those (by probability,
renormalized over the top k) whose mass reaches top_p; the first token is always kept. A draw is
one of the kept tokens with probability proportional to its softmax probability.
"""
from __future__ import annotations

import math

import numpy as np


def allowed_tokens(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, their probabilities) for one row of logits; temperature > 0."""
    z = np.asarray(logits, dtype=np.float64) / float(temperature)
    order = np.argsort(-z, kind="stable")
    k = len(z) if top_k <= 0 else min(top_k, len(z))
    kept = order[:k]
    p = np.exp(z[kept] - z[kept].max())
    p /= p.sum()
    cum = np.cumsum(p)
    n = int(np.searchsorted(cum, top_p, side="left")) + 1  # smallest n with cum[n-1] >= top_p
    n = max(1, min(n, k))
    return kept[:n], p[:n] / p[:n].sum()


def nucleus_margin(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> float:
    """How far top_p is from every cumulative mass of the row (a row near a boundary could round
    either way in float32; tests pick rows where this is comfortably large)."""
    z = np.asarray(logits, dtype=np.float64) / float(temperature)
    k = len(z) if top_k <= 0 else min(top_k, len(z))
    kept = np.sort(z)[::-1][:k]
    p = np.exp(kept - kept.max())
    p /= p.sum()
    return float(np.abs(np.cumsum(p) - top_p).min())


def chi_square(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """(Pearson's statistic, degrees of freedom) of observed counts against probabilities; the
    categories expected fewer than `min_expected` times are pooled into one."""
    counts = np.asarray(counts, dtype=np.float64)
    expected = np.asarray(probs, dtype=np.float64) * counts.sum()
    small = expected < min_expected
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(((counts - expected) ** 2 / expected).sum()), len(counts) - 1


def chi_square_bound(df: int, z: float = 3.719) -> float:
    """The chi-square quantile with `df` degrees of freedom at the normal quantile z (3.719: one-sided
    1e-4), by the Wilson-Hilferty approximation (no scipy needed)."""
    if df <= 0:
        return 0.0
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3
