"""The numerics policy (kernels/__init__.py) on real weights and on the Q4_1 case that broke bf16.

- w4 scales and minimums survive the conversion to a bfloat16 model exactly (GGUF stores them in fp16);
- `linear` in bfloat16 on Q4_1-like weights whose offsets are large compared with their spread stays
  within bf16 rounding of the float32 product, for every implementation on the device;
- the embedded model in bfloat16 answers what transformers bfloat16 answers (greedy, 3 chat prompts);
- teacher-forced top-1 agreement with float32 over > 500 positions has a floor per dtype and format,
  on the CPU here and on the GPU with the real GGUF (`EDGED_TEST_GGUF=/tmp/smollm2.gguf pytest -m gpu`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from edged import kernels
from edged.bench.accuracy import (Agreement, Variant, agreement, reference_kernels, reference_top1, text_ids,
                                  transformers_agreement)
from edged.engine.setup import EngineSettings, build_engine
from edged.kernels import reference
from edged.kernels.weights import W4_PARAM_DTYPE, W8_PARAM_DTYPE, LinearWeight, concat_out, dequantize, pack_w4, quantize_w8
from edged.models.loader import LoadedModel, load_model
from edged.models.runtime_weights import to_runtime_linear
from helpers.tiny_engine import request, run_to_completion

CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


def q4_1_like(n: int, k: int, seed: int = 0) -> LinearWeight:
    """A GGUF Q4_1-shaped weight (groups of 32, fp16 d and m) whose minimums are ~100x its step d:
    a bf16 minimum is off by up to m * 2^-9, about the size of d itself, shared by the whole group."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) * 0.002 + 0.001).half().float()
    m = (torch.randn(n, k // 32, generator=g).sign() * (0.15 + 0.05 * torch.rand(n, k // 32, generator=g)))
    return pack_w4(q, d, m.half().float(), 32)


def test_w4_scales_and_minimums_keep_their_fp16_values_in_a_bf16_model() -> None:
    src = q4_1_like(64, 256)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = to_runtime_linear(src, None, "w4", dtype, torch.device("cpu"))
        assert w.scale.dtype == W4_PARAM_DTYPE and w.minimum.dtype == W4_PARAM_DTYPE
        assert torch.equal(dequantize(w), dequantize(src))


def test_w8_scales_and_minimums_stay_float16_in_a_bf16_model() -> None:
    """Float weights become symmetric w8 (GGUF Q8_0's rounding, no minimums); a requantized Q4_1 weight
    asymmetric w8, which holds it almost exactly; both keep float16 parameters in a bfloat16 model."""
    dense = torch.randn(32, 64) * 0.05 + 0.3
    w = to_runtime_linear(dense, None, "w8", torch.bfloat16, torch.device("cpu"))
    assert w.scale.dtype == W8_PARAM_DTYPE and w.minimum is None and w.group_size == 32
    assert torch.equal(dequantize(w), dequantize(quantize_w8(dense, symmetric=True)))
    err = (dequantize(w) - dense).abs() / dense.abs().view(32, 2, 32).amax(-1).repeat_interleave(32, 1)
    assert err.max() <= 0.5 / 127 + 1e-3  # half a step of max |w| / 127 (plus the float16 scale's rounding)
    src = q4_1_like(32, 64)
    w4_to_w8 = to_runtime_linear(src, None, "w8", torch.bfloat16, torch.device("cpu"))
    assert w4_to_w8.minimum.dtype == W8_PARAM_DTYPE
    assert (dequantize(w4_to_w8) - dequantize(src)).abs().max() < 1e-3


def q8_0_like(n: int, k: int, seed: int = 0) -> LinearWeight:
    """A GGUF Q8_0-shaped w8 weight (q + 128, scale d, no minimum), as the GGUF loader makes it."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(1, 256, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) * 0.002 + 0.0005).half()
    return LinearWeight("w8", q, d, None, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_q8_0_source_stays_w8_where_w8_is_asked_for(dtype: torch.dtype) -> None:
    """auto (on the CPU) and w8 keep GGUF Q8_0 as stored; none dequantizes it; w4 requantizes it."""
    src, cpu = q8_0_like(64, 128), torch.device("cpu")
    for quant in ("auto", "w8"):
        w = to_runtime_linear(src, None, quant, dtype, cpu)
        assert w.format == "w8" and w.data is src.data and torch.equal(dequantize(w), dequantize(src))
    none = to_runtime_linear(src, None, "none", torch.float32, cpu)
    assert none.format == "dense" and torch.equal(none.data, dequantize(src))
    assert to_runtime_linear(src, None, "w4", dtype, cpu).format == "w4"


def test_a_fused_weight_of_symmetric_and_asymmetric_w8_parts_keeps_every_parts_values() -> None:
    """q from GGUF Q8_0 (symmetric w8) fused with k requantized from Q4_1 (asymmetric w8): the fused weight
    gives the minimum the symmetric part implies, so each part dequantizes as before."""
    q_part = q8_0_like(64, 128, seed=5)
    k_part = to_runtime_linear(q4_1_like(32, 128, seed=6), None, "w8", torch.float32, torch.device("cpu"))
    assert q_part.minimum is None and k_part.minimum is not None
    fused = concat_out([q_part, k_part])
    assert torch.equal(dequantize(fused), torch.cat([dequantize(q_part), dequantize(k_part)]))
    assert concat_out([q_part, q_part]).minimum is None  # all symmetric: still no minimums to read


def test_only_w8_weights_may_come_without_minimums() -> None:
    """Symmetric w8 has no minimums; a w4 weight without them is refused where it is made."""
    q8 = q8_0_like(4, 32)
    assert dequantize(q8).shape == (4, 32)
    with pytest.raises(ValueError, match="w4 weight needs its minimums"):
        LinearWeight("w4", torch.zeros(4, 16, dtype=torch.uint8), q8.scale, None, 32)


def _linear_impls() -> list:
    return [pytest.param("cpu", reference.linear, id="reference-cpu"),
            pytest.param("cpu", kernels.linear, id="default-cpu"),
            pytest.param("cuda", None, id="triton-cuda", marks=gpu)]


@pytest.mark.parametrize("device,impl", _linear_impls())
def test_bf16_linear_on_q4_1_with_large_offsets_dequantizes_and_accumulates_in_fp32(device: str, impl) -> None:
    """float32 logits (out_dtype) from bf16 activations carry no error but the products' own: exact where
    the weight is dequantized in float32 registers (GEMV, reference, CPU); where a dequantized tile is
    rounded to bf16 for the tensor cores (Triton's M > 1 GEMM), no more than holding the weight in bf16."""
    triton_gemm = impl is None
    if impl is None:
        from edged.kernels import triton_ops
        impl = triton_ops.linear
    src = q4_1_like(384, 1024, seed=1)
    exact = dequantize(src)  # float32, the GGUF values
    w = to_runtime_linear(src, None, "w4", torch.bfloat16, torch.device(device))

    def rel(y: torch.Tensor, want: torch.Tensor) -> float:
        return ((y.float().cpu() - want).norm() / want.norm()).item()

    for m in (1, 7, 64):
        x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        want = x.float() @ exact.T
        weight_in_bf16 = rel(x.float() @ exact.bfloat16().float().T, want)  # ~1.6e-3: what bf16 scales cost too
        logits = impl(x.to(device), w, out_dtype=torch.float32)
        assert logits.dtype == torch.float32
        bound = 1.2 * weight_in_bf16 if (triton_gemm and m > 1) else 1e-4
        assert rel(logits, want) < bound, (m, rel(logits, want), weight_in_bf16)
        out = impl(x.to(device), w)
        assert out.dtype == torch.bfloat16
        assert rel(out, want) < 2.5 * weight_in_bf16, (m, rel(out, want))


@pytest.mark.parametrize("device,impl", _linear_impls())
def test_bf16_linear_on_w8_groups_with_large_offsets_dequantizes_and_accumulates_in_fp32(device: str, impl) -> None:
    """w8 holding Q4_1's large offsets (requantized) and GGUF Q8_0, bf16 activations: as for w4, float32
    logits carry float32 rounding only where the weight is dequantized in float32 registers (GEMV,
    reference, CPU), and no more than holding the weight in bf16 where Triton's GEMM rounds its tile."""
    triton_gemm = impl is None
    if impl is None:
        from edged.kernels import triton_ops
        impl = triton_ops.linear
    for src in (quantize_w8(dequantize(q4_1_like(384, 1024, seed=2))), q8_0_like(384, 1024, seed=3)):
        exact = dequantize(src)
        w = to_runtime_linear(src, None, "w8", torch.bfloat16, torch.device(device))

        def rel(y: torch.Tensor, want: torch.Tensor) -> float:
            return ((y.float().cpu() - want).norm() / want.norm()).item()

        for m in (1, 7, 64):
            x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
            want = x.float() @ exact.T
            weight_in_bf16 = rel(x.float() @ exact.bfloat16().float().T, want)
            logits = impl(x.to(device), w, out_dtype=torch.float32)
            assert logits.dtype == torch.float32
            bound = 1.2 * weight_in_bf16 if (triton_gemm and m > 1) else 1e-5
            assert rel(logits, want) < bound, (m, rel(logits, want), weight_in_bf16)
            out = impl(x.to(device), w)
            assert out.dtype == torch.bfloat16
            assert rel(out, want) < 2.5 * weight_in_bf16, (m, rel(out, want))


# ------------------------------------------------------------------------------- the embedded model


@pytest.fixture(scope="module")
def real_model() -> LoadedModel:
    """The real GGUF: $EDGED_TEST_GGUF (the GPU machine's copy), else the embedded wheel's."""
    path = os.environ.get("EDGED_TEST_GGUF")
    return load_model(Path(path) if path else None)


CHATS = ["What is the capital of France?", "Write a short poem about the sea.",
         ("You are a helpful coding assistant.", "How do I reverse a list in Python?")]


def _chat_ids(loaded: LoadedModel, chat) -> list[int]:
    msgs = ([{"role": "system", "content": chat[0]}, {"role": "user", "content": chat[1]}]
            if isinstance(chat, tuple) else [{"role": "user", "content": chat}])
    return loaded.tokenizer.encode(loaded.chat_template.render(msgs))


def _edged_greedy(loaded: LoadedModel, dtype: str, quant: str, ids: list[list[int]], tokens: int) -> list[list[int]]:
    ae = build_engine(loaded, EngineSettings(dtype=dtype, quant=quant, num_kv_blocks=64, max_num_seqs=4,
                                             cuda_graphs=False))
    out = run_to_completion(ae.engine, [request(f"r{i}", p, tokens) for i, p in enumerate(ids)])
    return [out[f"r{i}"] for i in range(len(ids))]


GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def chat_ids(real_model: LoadedModel) -> list[list[int]]:
    return [_chat_ids(real_model, c) for c in CHATS]


@pytest.fixture(scope="module")
def hf_models(real_model: LoadedModel, hf_gguf_model) -> dict[torch.dtype, object]:
    return {dt: hf_gguf_model(real_model.source_path, dt) for dt in (torch.float32, torch.bfloat16)}


def _divergence(hf, prompt: list[int], tokens: list[int]) -> tuple[int, float]:
    """Where `hf`'s greedy decoding would part from `tokens` (its teacher-forced argmax over prompt + tokens
    first differs from the token given; one forward pass instead of a generation), and hf's margin there
    between its own choice and the token given."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    differ = (logits.argmax(dim=-1) != torch.tensor(tokens)).nonzero()
    if not len(differ):
        return len(tokens), float("inf")
    i = int(differ[0])
    return i, float(logits[i].max() - logits[i, tokens[i]])


# Below this float32 margin a choice is a tie to bf16 (8 bits of mantissa at logits ~ 26 are 0.125 apart):
# "Write a short poem about the sea." starts with 'The' 26.295 vs 'In' 26.283 in float32, and
# transformers bf16 takes 'The' only because the two tie exactly and the lower id wins. What counts as
# a tie for bfloat16 activations is measured, not fixed: the largest float32 margin at which
# transformers' own bf16 picks another top-1 over the accuracy text on this machine (0.116 on an
# AVX-512 box, 23 flips in 555 positions; its bf16 logits sit a median 0.078 from float32's). A fixed
# 0.05 failed there: edged's default CPU kernels in bf16 answer the France prompt with 'L' (25.243)
# instead of 'The' (25.325), a margin bf16 cannot resolve, while the reference kernels' rounding keeps 'The'.
TIE_FLOOR = 0.05


@pytest.fixture(scope="module")
def bf16_tie(real_model: LoadedModel, hf_models) -> float:
    """The largest float32 margin at which transformers bf16 parts from float32's top-1 over the
    accuracy text (teacher-forced), at least TIE_FLOOR."""
    ids = torch.tensor([text_ids(real_model)])
    with torch.inference_mode():
        f32 = hf_models[torch.float32](ids).logits[0].float()
        b16 = hf_models[torch.bfloat16](ids).logits[0].float()
    top, theirs = f32.argmax(-1), b16.argmax(-1)
    margins = (f32.gather(1, top[:, None]) - f32.gather(1, theirs[:, None])).flatten()[top != theirs]
    return max([TIE_FLOOR, *margins.tolist()])


@pytest.fixture(scope="module")
def hf_bf16_greedy(real_model: LoadedModel, chat_ids, hf_models) -> list[tuple[list[int], int]]:
    """transformers bfloat16's greedy tokens per prompt, and where they part from transformers float32's."""
    eos = list(real_model.config.eos_token_ids)
    out = []
    for p in chat_ids:
        toks = hf_models[torch.bfloat16].generate(torch.tensor([p]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                                  eos_token_id=eos)[0, len(p):].tolist()
        out.append((toks, _divergence(hf_models[torch.float32], p, toks)[0]))
    return out


# dense bf16 weights (the reference would dequantize packed ones at every call), through the oracle and
# through the kernels this machine dispatches to
@pytest.mark.parametrize("kernels_path,quant", [("reference", "none"), ("default", "none")])
def test_bf16_greedy_answers_like_transformers_bf16(real_model: LoadedModel, chat_ids, hf_models, hf_bf16_greedy,
                                                   bf16_tie: float, kernels_path: str, quant: str) -> None:
    """Equal text to transformers bf16, or, where transformers' own bf16 drifts from its fp32, no earlier
    divergence from fp32 than transformers bf16 has, unless edged parts from fp32 at a bf16 tie (a
    float32 margin at which transformers bf16 itself flips tokens); and the capital of France is Paris
    unless the answer parts from float32's at such a tie."""
    if kernels_path == "reference":
        with reference_kernels():
            ours = _edged_greedy(real_model, "bfloat16", quant, chat_ids, GREEDY_TOKENS)
    else:
        ours = _edged_greedy(real_model, "bfloat16", quant, chat_ids, GREEDY_TOKENS)
    text = real_model.tokenizer.decode
    if "The capital of France is Paris." not in text(ours[0]):
        at, margin = _divergence(hf_models[torch.float32], chat_ids[0], ours[0])
        assert margin < bf16_tie, (text(ours[0]), at, margin, bf16_tie)
    for prompt, mine, (theirs, theirs_from_fp32) in zip(chat_ids, ours, hf_bf16_greedy):
        if mine == theirs:
            continue
        mine_from_fp32, margin = _divergence(hf_models[torch.float32], prompt, mine)
        assert mine_from_fp32 >= theirs_from_fp32 or margin < bf16_tie, (
            text(mine), text(theirs), mine_from_fp32, theirs_from_fp32, margin, bf16_tie)


# Floors on the fraction of > 500 teacher-forced positions whose top-1 equals float32's. bf16's floor is
# transformers bf16's own agreement minus half a point, measured in the same test. w8 (uint8 groups of 32,
# float16 scale and minimum: Q4_1 layers requantized almost exactly, the Q8_0 head held exactly) meets the
# issue's 98% (100.0% float32 on the CPU, docs/BENCHMARKS.md). int8 KV (keys one scale per 32 channels,
# values one per head) meets it too: 98.4% float32 on the CPU (96.8% with one key scale per head). Its
# 12-18 differing positions all sit where float32's top two logits are < 0.05 apart.
CPU_FLOORS = {Variant(torch.float32, "w8"): 0.98, Variant(torch.float32, "none", "int8"): 0.98}


@pytest.fixture(scope="module")
def cpu_reference(real_model: LoadedModel) -> tuple[list[int], torch.Tensor]:
    ids = text_ids(real_model)
    return ids, reference_top1(real_model, ids, "cpu")


def test_teacher_forced_agreement_on_cpu(real_model: LoadedModel, cpu_reference, hf_models) -> None:
    ids, ref = cpu_reference
    assert len(ids) >= 500
    hf_bf16 = transformers_agreement(real_model, ids, ref, torch.bfloat16, "cpu", hf_models[torch.bfloat16])
    rows: list[tuple[Agreement, float]] = [(agreement(real_model, v, ids, ref, "cpu"), f) for v, f in CPU_FLOORS.items()]
    rows.append((agreement(real_model, Variant(torch.bfloat16, "none"), ids, ref, "cpu"), hf_bf16.top1 - 0.005))
    below = [(r.label, r.top1, floor) for r, floor in rows if r.top1 < floor]
    assert not below, (below, hf_bf16, [(r.label, r.top1) for r, _ in rows])


@dataclass(frozen=True)
class NearBf16:
    """The floor of a bf16 row: what its quantization may cost over `base`, the same bf16 model without
    it, in the same run: base's agreement minus half a point, and the issue's 98% where that is higher.
    bf16 activations alone stay near 98% (H200: bf16 none 98.0%, bf16 auto 97.8%), so a flat 98% would
    pass or fail by which side of it bf16 itself lands on."""

    base: Variant


GPU_VARIANTS = {Variant(torch.bfloat16, "auto"): None, Variant(torch.bfloat16, "none"): None,
                Variant(torch.float16, "auto"): 0.97,
                Variant(torch.bfloat16, "w8"): NearBf16(Variant(torch.bfloat16, "none")),
                Variant(torch.float16, "w8"): 0.98,
                Variant(torch.bfloat16, "auto", "int8"): NearBf16(Variant(torch.bfloat16, "auto")),
                Variant(torch.float16, "none", "int8"): 0.98, Variant(torch.float32, "auto"): 0.99}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_teacher_forced_agreement_on_gpu(real_model: LoadedModel) -> None:
    """None floors: transformers bf16's agreement (same GPU, same file) minus half a point; NearBf16: see
    there."""
    ids = text_ids(real_model)
    ref = reference_top1(real_model, ids, "cuda")
    hf_bf16 = transformers_agreement(real_model, ids, ref, torch.bfloat16, "cuda")
    measured = {v: agreement(real_model, v, ids, ref, "cuda") for v in GPU_VARIANTS}

    def floor(f: float | NearBf16 | None) -> float:
        if f is None:
            return hf_bf16.top1 - 0.005
        if isinstance(f, NearBf16):
            return min(0.98, measured[f.base].top1 - 0.005)
        return f

    rows = [(measured[v], floor(f)) for v, f in GPU_VARIANTS.items()]
    below = [(r.label, r.top1, least) for r, least in rows if r.top1 < least]
    assert not below, (below, hf_bf16, [(r.label, r.top1) for r, _ in rows])
