"""Sampling semantics (temperature, top-k, top-p, seed), checked against an independent statement of
them (helpers/sampling.py, float64 numpy) rather than against another copy of the same code.

Every implementation the dispatcher can pick is checked: the plain-torch reference and the CPU
dispatch here, the Triton path on CUDA with `pytest -m gpu`. Draws are fixed by their seeds, so the
statistical checks are deterministic: a bound at p = 1e-4 never flickers, it only catches a wrong
distribution.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import edged.kernels as kernels
from edged.kernels import reference
from helpers.sampling import allowed_tokens, chi_square, chi_square_bound, nucleus_margin
from helpers.tiny_engine import request, run_to_completion, tiny_engine

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
IMPLEMENTATIONS = [
    pytest.param(("reference", "cpu"), id="reference"),
    pytest.param(("dispatch", "cpu"), id="cpu"),
    pytest.param(("dispatch", "cuda"), id="cuda", marks=[pytest.mark.gpu, CUDA]),
]


@pytest.fixture(params=IMPLEMENTATIONS)
def sample(request):
    """sample(logits [B,V], temperature, top_k, top_p, seeds, offsets) -> token ids on the CPU, with
    the inputs given as Python lists or CPU tensors and moved to the implementation's device."""
    kind, device = request.param
    fn = reference.sample if kind == "reference" else kernels.sample

    def run(logits, temperature, top_k, top_p, seeds, offsets) -> torch.Tensor:
        dev = torch.device(device)
        return fn(torch.as_tensor(logits, dtype=torch.float32).to(dev),
                  torch.as_tensor(temperature, dtype=torch.float32).to(dev),
                  torch.as_tensor(top_k, dtype=torch.int64).to(dev),
                  torch.as_tensor(top_p, dtype=torch.float32).to(dev),
                  torch.as_tensor(seeds, dtype=torch.int64).to(dev),
                  torch.as_tensor(offsets, dtype=torch.int64).to(dev)).cpu()

    return run


def row(rng: np.random.Generator, vocab: int, temperature: float, top_k: int, top_p: float,
        scale: float = 2.5) -> np.ndarray:
    """Random float32 logits whose nucleus boundary is not within rounding of top_p."""
    while True:
        logits = (rng.standard_normal(vocab) * scale).astype(np.float32)
        if top_p >= 1.0 or nucleus_margin(logits, temperature, top_k, top_p) > 1e-3:
            return logits


def repeat(logits: np.ndarray, n: int) -> np.ndarray:
    return np.repeat(logits[None, :], n, axis=0)


# (temperature, top_k, top_p): each filter alone, both together, extremes
SETTINGS = [(1.0, 1, 1.0), (1.0, 5, 1.0), (0.7, 20, 1.0), (1.0, 0, 0.5), (1.3, 0, 0.9), (1.0, 0, 0.05),
            (0.5, 10, 0.8), (2.0, 40, 0.3), (1.0, 300, 0.95), (1.5, 3, 0.99)]


def test_every_draw_is_inside_its_rows_allowed_set(sample) -> None:
    rng = np.random.default_rng(0)
    vocab, draws = 300, 300
    rows, allowed, settings = [], [], []
    for t, k, p in SETTINGS:
        logits = row(rng, vocab, t, k, p)
        rows.append(repeat(logits, draws))
        allowed.append(set(allowed_tokens(logits, t, k, p)[0].tolist()))
        settings += [(t, k, p)] * draws
    temperature, top_k, top_p = (list(x) for x in zip(*settings))
    n = len(settings)
    got = sample(np.concatenate(rows), temperature, top_k, top_p, list(range(n)), [i % 7 for i in range(n)])
    for i, (setting, ok) in enumerate(zip(SETTINGS, allowed)):
        drawn = got[i * draws:(i + 1) * draws].tolist()
        outside = sorted(set(drawn) - ok)
        assert not outside, f"{setting}: drew {outside[:5]} outside the allowed {sorted(ok)[:10]}"
        if len(ok) >= 3:  # a real draw, not a constant
            assert len(set(drawn)) >= 2, f"{setting}: always {drawn[0]}"


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 8, 1.0), (0.6, 0, 0.8), (1.5, 30, 0.9),
                                                       (0.5, 0, 1.0), (2.0, 12, 0.7)])
def test_many_draws_follow_the_renormalized_probabilities(sample, temperature: float, top_k: int,
                                                          top_p: float) -> None:
    rng = np.random.default_rng(int(temperature * 10) + top_k)
    vocab, n = 64, 20_000
    logits = row(rng, vocab, temperature, top_k, top_p, scale=1.5)
    ids, probs = allowed_tokens(logits, temperature, top_k, top_p)
    got = sample(repeat(logits, n), [temperature] * n, [top_k] * n, [top_p] * n, list(range(n)), [3] * n)
    counts = np.bincount(got.numpy(), minlength=vocab)
    assert counts.sum() - counts[ids].sum() == 0, "draws outside the allowed set"
    stat, df = chi_square(counts[ids], probs)
    assert stat < chi_square_bound(df), (stat, df, chi_square_bound(df))
    # The bound has power: the same draws do not fit the distribution at another temperature.
    other, _ = allowed_tokens(logits, temperature * 2, top_k, top_p)
    if len(other) == len(ids) and set(other) == set(ids.tolist()):
        _, wrong = allowed_tokens(logits, temperature * 2, top_k, top_p)
        order = {t: j for j, t in enumerate(other.tolist())}
        wrong = np.array([wrong[order[t]] for t in ids.tolist()])
        stat_wrong, df_wrong = chi_square(counts[ids], wrong)
        assert stat_wrong > chi_square_bound(df_wrong), "the check cannot tell temperatures apart"


def test_greedy_rows_take_the_argmax_whatever_the_other_settings(sample) -> None:
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((6, 200)) * 3).astype(np.float32)
    got = sample(logits, [0.0] * 6, [0, 1, 5, 0, 50, 3], [1.0, 0.1, 0.5, 0.9, 1.0, 0.01], [1, 2, 3, 4, 5, 6],
                 [0, 9, 4, 2, 7, 1])
    assert got.tolist() == np.argmax(logits, axis=1).tolist()
    # A batch mixing greedy and sampled rows: the greedy rows are still the argmax.
    mixed = sample(logits, [0.0, 1.0, 0.0, 1.0, 0.0, 1.0], [0] * 6, [1.0] * 6, [1, 2, 3, 4, 5, 6], [0] * 6)
    assert mixed[0::2].tolist() == np.argmax(logits, axis=1)[0::2].tolist()


def test_a_draw_depends_only_on_its_seed_and_offset(sample) -> None:
    rng = np.random.default_rng(9)
    logits = (rng.standard_normal((8, 100)) * 0.5).astype(np.float32)  # flat: many tokens likely
    t, k, p = [0.9] * 8, [0] * 8, [1.0] * 8
    seeds, offsets = [11, 12, 13, 14, 15, 16, 17, 18], [0, 1, 2, 3, 4, 5, 6, 7]
    first = sample(logits, t, k, p, seeds, offsets)
    assert torch.equal(first, sample(logits, t, k, p, seeds, offsets))  # reproducible
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    shuffled = sample(logits[perm], t, k, p, [seeds[i] for i in perm], [offsets[i] for i in perm])
    assert shuffled.tolist() == [first[i].item() for i in perm]  # not its row or its neighbours
    alone = sample(logits[3:4], t[:1], k[:1], p[:1], seeds[3:4], offsets[3:4])
    assert alone.item() == first[3].item()
    # Another seed, or the same seed at other offsets (steps), draws differently.
    many = 200
    by_seed = sample(repeat(logits[0], many), [0.9] * many, [0] * many, [1.0] * many, list(range(many)), [0] * many)
    by_step = sample(repeat(logits[0], many), [0.9] * many, [0] * many, [1.0] * many, [11] * many, list(range(many)))
    assert len(set(by_seed.tolist())) > 20 and len(set(by_step.tolist())) > 20


# ------------------------------------------------------------------------------ through the engine

def test_top_k_1_and_a_tiny_top_p_give_the_greedy_tokens_through_the_engine() -> None:
    prompt = [5, 17, 33, 2, 90, 41, 7]
    greedy = run_to_completion(tiny_engine(), [request("g", prompt, max_tokens=16)])["g"]
    for i, kw in enumerate([dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5)]):
        for seed in (1, 2, 3):
            got = run_to_completion(tiny_engine(), [request("s", prompt, max_tokens=16, temperature=1.5, seed=seed,
                                                            **kw)])["s"]
            assert got == greedy, (kw, seed)


def test_seeded_requests_sample_inside_top_k_through_the_engine() -> None:
    """Each sampled token is among the top_k of the model's own logits at that position."""
    from helpers.tiny_engine import tiny_model

    model = tiny_model()
    prompt = [9, 8, 7, 6, 5, 4, 3]
    out = run_to_completion(tiny_engine(), [request("s", prompt, max_tokens=12, temperature=2.0, top_k=3, seed=4)])
    tokens = out["s"]
    assert len(tokens) == 12
    logits = full_sequence_logits(model, prompt + tokens)
    for j, tok in enumerate(tokens):
        top3 = torch.topk(logits[len(prompt) - 1 + j], 3).indices.tolist()
        assert tok in top3, (j, tok, top3)
    greedy = run_to_completion(tiny_engine(), [request("g", prompt, max_tokens=12)])["g"]
    assert tokens != greedy  # temperature 2 over three choices: it did sample


def full_sequence_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids`, from one prefill of the tiny model on a fresh KV cache."""
    from edged.models.batch import AttentionMetadata, KVCache

    c = model.config
    block = 4
    n_blocks = -(-len(ids) // block)
    kv = KVCache.allocate(c.num_layers, n_blocks, block, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    n = len(ids)
    meta = AttentionMetadata(False, torch.arange(n), torch.arange(n_blocks, dtype=torch.int32)[None, :],
                             torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32))
    hidden = model.forward(torch.tensor(ids), torch.arange(n), meta, kv)
    return model.logits(hidden).float()
