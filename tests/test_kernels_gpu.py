"""The Triton kernels against the torch reference on the GPU, at real model shapes, fp16 and bf16.

Errors are relative, ||out - ref|| / ||ref||, against the reference run in float32 on the same inputs.
`edged bench kernels` prints their bandwidth figures.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from edged.kernels import reference
from edged.kernels.weights import LinearWeight, dequantize, quantize_w4, quantize_w8, to_mma_order  # noqa: F401

from edged.kernels import triton_attention as tattn
from edged.kernels import triton_linear as tlin
from edged.kernels import triton_ops as ops
from edged.kernels import triton_sampling as tsamp
from edged.kernels.triton_w4_dot import shuffle_w4_tiles, w4_dot_linear
from helpers import kernel_inputs

# Marked, not skipped at import: on a CPU machine these show in the count as skipped.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = torch.device("cuda")


def make_weight(*args, **kwargs):
    return kernel_inputs.make_weight(*args, device=DEV, **kwargs)


def paged_cache(*args, **kwargs):
    return kernel_inputs.paged_cache(*args, device=DEV, **kwargs)
DTYPES = [torch.float16, torch.bfloat16]
# relative-error bounds: bf16 keeps 8 mantissa bits, fp16 11
REL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape
    assert torch.isfinite(got).all()
    g, w = got.double(), want.double()
    return ((g - w).norm() / w.norm().clamp(min=1e-12)).item()




def ref_linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    """The reference in float32 on the weight's exact values (the oracle, without its rounding)."""
    from edged.kernels.weights import dequantize

    out = x.float() @ dequantize(w, torch.float32).T
    return out if w.bias is None else out + w.bias.float()


# ---------------------------------------------------------------------------------------------- linear

SHAPES = [(4096, 14336), (14336, 4096), (2048, 8192)]  # (out, in): Llama-3-8B down / gate, Llama-3.2-1B


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["dense", "w8", "w8sym", "w4", "w8sym+mma"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_real_shapes(n: int, k: int, fmt: str, dtype: torch.dtype) -> None:
    w = make_weight(fmt, n, k, dtype, bias=(n == 2048), group=32 if k != 8192 else 128, seed=n + k)
    for m in (1, 5, 16, 48, 200):
        x = torch.randn(m, k, device=DEV).to(dtype)
        got = ops.linear(x, w)
        assert got.dtype == dtype
        err = rel_err(got, ref_linear(x, w))
        assert err < REL[dtype], (m, err)


@pytest.mark.parametrize("fmt", ["w4"])
@pytest.mark.parametrize("group", [64, 128])
def test_linear_w4_groups(fmt: str, group: int) -> None:
    w = make_weight(fmt, 3072, 3072, torch.bfloat16, bias=True, group=group, seed=group)
    for m in (1, 9, 130):
        x = torch.randn(m, 3072, device=DEV).to(torch.bfloat16)
        assert rel_err(ops.linear(x, w), ref_linear(x, w)) < REL[torch.bfloat16]


@pytest.mark.parametrize("n,k,group", [(6144, 4096, 32), (4099, 14336, 32), (2048, 8192, 128), (960, 576, 32),
                                         (3072, 3072, 64)])
def test_w4_tensor_core_gemv_ptx_pairs_equal_the_reference(n: int, k: int, group: int) -> None:
    """kernels/triton_w4_dot.py on sm_90 (PTX nibble pairs, the relabelled register tile, wgmma) and its portable
    form: within the GEMV's bound of the reference, with K splits, a bias and the residual."""
    w = make_weight("w4", n, k, torch.bfloat16, bias=True, group=group, seed=n + k)
    words = shuffle_w4_tiles(w.data)
    x = torch.randn(1, k, device=DEV).bfloat16()
    res = torch.randn(1, n, device=DEV).bfloat16()
    want = ref_linear(x, w)
    for split in (1, 3, 8):
        for asm in (True, False):
            got = w4_dot_linear(x, words, w.scale, w.minimum, n, group, bias=w.bias, split=split, asm=asm)
            assert rel_err(got, want) < REL[torch.bfloat16], (split, asm)
    got = w4_dot_linear(x, words, w.scale, w.minimum, n, group, bias=w.bias, residual=res, split=2)
    assert rel_err(got - res, want) < REL[torch.bfloat16]


@pytest.mark.parametrize("fmt", ["dense", "w8", "w8sym", "w4", "w8sym+mma"])
def test_linear_gemv_variants(fmt: str) -> None:
    """Every GEMV shape of program the sweeps consider, on a ragged N, with K splits."""
    w = make_weight(fmt, 4099, 14336, torch.bfloat16, bias=True, seed=7)
    x = torch.randn(1, 14336, device=DEV).bfloat16()
    want = ref_linear(x, w)
    for rows in (1, 2, 4):
        for block_k, split in ((1024, 1), (2048, 3), (4096, 2)):
            for warps in (2, 4 if block_k < 4096 else 8):
                cfg = tlin.LinearConfig("gemv", 1, rows, block_k, split, num_warps=warps)
                assert rel_err(tlin.linear(x, w, cfg), want) < REL[torch.bfloat16], (rows, block_k, split, warps)


@pytest.mark.parametrize("fmt", ["w8", "w8sym", "w4", "w8sym+mma"])
@pytest.mark.parametrize("n,k", [(28672, 4096), (4096, 14336)])
def test_a_register_cap_leaves_the_decode_gemv_bit_for_bit(n: int, k: int, fmt: str) -> None:
    """LinearConfig.max_registers (ptxas' maxnreg) at the 8B's gate_up and down, with the residual: the same
    result bit for bit as the launch rule's GEMV (capped at LARGE_GEMV_W8_MAX_REGISTERS for w8's gate_up), with
    no cap, at a cap that makes it spill and one that does not."""
    w = make_weight(fmt, n, k, torch.bfloat16, bias=False, seed=n + k + 2)
    x = torch.randn(1, k, device=DEV).bfloat16()
    res = torch.randn(1, n, device=DEV).bfloat16()
    cfg = tlin.choose_config(1, n, k, w.format, torch.device(DEV))
    want = tlin.linear(x, w, cfg, residual=res)
    for cap in (None, 96, 64):
        assert torch.equal(tlin.linear(x, w, replace(cfg, max_registers=cap), residual=res), want), cap


@pytest.mark.parametrize("fmt", ["w8", "w8sym", "w4", "w8sym+mma"])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (4099, 2048), (960, 576), (576, 1536)])
def test_gemv_of_several_x_rows_at_real_shapes_gives_the_single_row_gemvs_bits(n: int, k: int, fmt: str) -> None:
    """A few sequences of grouped w8 or w4 through the GEMV of several x rows (the launch choose_config gives 2
    rows, for 2-8 rows of x; SmolLM2's short rows among the shapes): each row's result the one-row GEMV's bit
    for bit, with the residual, and within bfloat16's error of the reference. x spans 2**-20 to 2**2, so that
    its chunk sums are inexact in float32 and a kernel that summed them in another order would differ."""
    w = make_weight(fmt, n, k, torch.bfloat16, bias=False, seed=n + k)
    cfg = tlin.choose_config(2, n, k, w.format, torch.device(DEV))
    assert cfg.kind == "gemv", cfg
    gen = torch.Generator(device=DEV).manual_seed(n * k)
    for m in (2, 3, 4, 5, 8):
        spread = 2.0 ** torch.randint(-20, 1, (m, k), device=DEV, generator=gen)
        x = (torch.randn(m, k, device=DEV, generator=gen) * spread).bfloat16()
        res = torch.randn(m, n, device=DEV, generator=gen).bfloat16()
        got = tlin.linear(x, w, cfg, residual=res)
        rows = torch.cat([tlin.linear(x[i:i + 1], w, cfg, residual=res[i:i + 1]) for i in range(m)])
        assert torch.equal(got, rows), m
        assert rel_err(got, ref_linear(x, w).float() + res.float()) < REL[torch.bfloat16], m


@pytest.mark.parametrize("fmt", ["w8", "w8sym", "w4", "w8sym+mma"])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (6144, 4096), (4096, 14336)])
def test_decode_batches_through_the_launch_rule_match_the_reference(n: int, k: int, fmt: str) -> None:
    """Decode batches (M = 2-64) at SmolLM2's short rows and the 8B's long ones, through whatever form
    choose_config picks for each M (the GEMV of several x rows, the swap matmul, the plain one), with the
    residual: within bfloat16's error of the reference."""
    w = make_weight(fmt, n, k, torch.bfloat16, bias=False, seed=n + k + 1)
    kinds = set()
    for m in (2, 3, 4, 5, 8, 16, 17, 32, 64):
        cfg = tlin.choose_config(m, n, k, w.format, torch.device(DEV), mma_order=w.mma_order)
        kinds.add((cfg.kind, cfg.swap, cfg.asm_dequant))
        x = torch.randn(m, k, device=DEV).bfloat16()
        res = torch.randn(m, n, device=DEV).bfloat16()
        got = tlin.linear(x, w, residual=res)
        assert rel_err(got, ref_linear(x, w).float() + res.float()) < REL[torch.bfloat16], (m, cfg)
    assert ("gemv", False, False) in kinds, kinds
    if fmt != "w4":
        assert ("matmul", True, False) in kinds, kinds
        # the plain form, bytes to floats by PTX: longer rows at 16 rows in column order (short ones, and the MMA
        # order, take the swap form)
        assert (("matmul", False, True) in kinds) == (k > tlin.SHORT_K and not w.mma_order), kinds


@pytest.mark.parametrize("fmt", ["w8", "w8sym", "w4", "w8sym+mma"])
@pytest.mark.parametrize("hidden,inter", [(576, 1536), (2048, 8192), (4096, 14336)])
def test_decode_batches_sum_their_splits_into_the_norm_after_and_the_gate_bit_for_bit(hidden: int, inter: int,
                                                                                     fmt: str) -> None:
    """SmolLM2's, the 1B's and the 8B's output projections (o, down) and gate_up at decode batches of 2-64
    through the launch rule: linear_add_norm's h and norm, and the gated result, are what linear then rms_norm
    or silu_and_mul give, bit for bit; the split-K sums make them in SmolLM2's short rows only."""
    from edged.kernels import triton_activation as tact
    from edged.kernels import triton_norm as tnorm

    o = make_weight(fmt, hidden, hidden, torch.bfloat16, bias=False, seed=hidden)
    down = make_weight(fmt, hidden, inter, torch.bfloat16, bias=False, seed=inter)
    gate_up = make_weight(fmt, 2 * inter, hidden, torch.bfloat16, bias=False, seed=hidden + inter)
    norm_w = (1.0 + 0.2 * torch.randn(hidden, device=DEV)).bfloat16()
    fused = set()
    for m in (2, 5, 16, 33, 64):
        res = torch.randn(m, hidden, device=DEV).bfloat16()
        for w in (o, down):
            x = torch.randn(m, w.in_features, device=DEV).bfloat16()
            h, normed = tlin.linear_add_norm(x, w, res, norm_w, 1e-5)
            want = tlin.linear(x, w, residual=res)
            assert torch.equal(h, want), (m, w.in_features)
            if normed is not None:
                fused.add(("norm", m))
                assert torch.equal(normed, tnorm.rms_norm(want, norm_w, 1e-5)[0]), (m, w.in_features)
        x = torch.randn(m, hidden, device=DEV).bfloat16()
        cfg = tlin.choose_config(m, 2 * inter, hidden, gate_up.format, DEV)
        if tlin._split_count(cfg, hidden, tlin._FORMATS[gate_up.format]) > 1:
            fused.add(("split gate", m))
        gated = tlin.linear(x, gate_up, silu_mul_out=True)
        assert torch.equal(gated, tact.silu_and_mul(tlin.linear(x, gate_up))), m
    assert ("split gate", 64) in fused, fused
    assert (("norm", 64) in fused) == (hidden <= tlin.SUM_FUSES_MAX_HIDDEN), fused


MATMUL_FORMS = [  # (swap, prefetch, block_n, block_k, split, asm_dequant): every form the sweeps consider
    (True, False, 128, 64, 3, False), (True, True, 128, 64, 1, False), (True, False, 64, 64, 2, False),
    (False, True, 64, 128, 5, False), (False, False, 64, 128, 1, False), (True, False, 128, 64, 3, True),
    (False, False, 128, 64, 2, True), (False, True, 64, 128, 1, True)]


@pytest.mark.parametrize("fmt", ["w8", "w8sym", "w4", "w8+mma", "w8sym+mma"])
def test_linear_matmul_variants(fmt: str) -> None:
    """Every form of the batched (M = 2-64) grouped w8 and w4 matmul the sweeps consider (w4: the swap form
    or not; prefetch and bytes to floats by PTX are w8's; w8 in the MMA order, as a model's are on a GPU, too),
    on a ragged N, with K splits, fused residual and bias: each equal to the reference within bfloat16's error."""
    w = make_weight(fmt, 4099, 14336, torch.bfloat16, bias=True, seed=8)
    for m in (3, 16, 40, 64):
        x = torch.randn(m, 14336, device=DEV).bfloat16()
        res = torch.randn(m, 4099, device=DEV).bfloat16()
        want = ref_linear(x, w)
        for swap, prefetch, block_n, block_k, split, asm in MATMUL_FORMS:
            cfg = tlin.LinearConfig("matmul", 16 if m <= 16 else 64, block_n, block_k, split, swap=swap,
                                    prefetch=prefetch, asm_dequant=asm)
            assert rel_err(tlin.linear(x, w, cfg), want) < REL[torch.bfloat16], (m, cfg)
            got = tlin.linear(x, w, cfg, residual=res)
            assert rel_err(got, (want.float() + res.float())) < REL[torch.bfloat16], (m, cfg)


@pytest.mark.parametrize("fmt", ["w8", "w8sym"])
def test_batched_w8_matmul_rounds_each_weight_once_to_the_activation_dtype(fmt: str) -> None:
    """Rows of x that each pick one column read the dequantized weights back through every form of the
    batched grouped w8 matmul: each equals the exact weight rounded once to bfloat16, bit for bit (the
    one-FMA forms of q * scale + minimum, symmetric w8's (32768 + q) * s - 32896 * s from PTX's bytes included,
    round nowhere else), in column order and in the MMA order. Rows of scales from 1e-6 to 10."""
    n, k = 1031, 1024
    g = torch.Generator(device=DEV).manual_seed(5)
    dense = torch.randn(n, k, device=DEV, generator=g) * 10 ** (torch.rand(n, 1, device=DEV, generator=g) * 7 - 6)
    w = quantize_w8(dense, symmetric=fmt == "w8sym").astype(torch.bfloat16)
    want = dequantize(w, torch.float32).to(torch.bfloat16).float().T  # [k, n]: column j's weights
    eye = torch.eye(k, device=DEV, dtype=torch.bfloat16)
    for weight in (w, to_mma_order(w)):
        for swap, prefetch, block_n, block_k, split, asm in MATMUL_FORMS:
            cfg = tlin.LinearConfig("matmul", 64, block_n, block_k, split, swap=swap, prefetch=prefetch,
                                    asm_dequant=asm)
            for first in range(0, k, 64):
                got = tlin.linear(eye[first:first + 64], weight, cfg, out_dtype=torch.float32)
                assert torch.equal(got, want[first:first + 64]), (cfg, weight.mma_order, first)


@pytest.mark.parametrize("fmt", ["w8", "w4"])
def test_linear_of_prompt_steps_with_the_chosen_launch(fmt: str) -> None:
    """Prompt-step shapes (M = 65-300: split K, and for w8 up to 128 rows the swapped form over two M
    tiles) through choose_config's launch, equal to the reference within bfloat16's error."""
    for n, k in ((576, 1536), (4099, 2048)):
        w = make_weight(fmt, n, k, torch.bfloat16, bias=False, seed=n)
        for m in (65, 100, 128, 200, 300):
            x = torch.randn(m, k, device=DEV).bfloat16()
            cfg = tlin.choose_config(m, n, k, fmt, torch.device(DEV))
            assert cfg.split > 1 or m > 128, (m, n, cfg)
            assert rel_err(tlin.linear(x, w), ref_linear(x, w)) < REL[torch.bfloat16], (m, n, cfg)


@pytest.mark.parametrize("fmt", ["w8", "w8sym", "w4", "w8sym+mma"])
def test_gemv_inline_ptx_conversions_give_the_portable_kernels_result_bit_for_bit(fmt: str, monkeypatch) -> None:
    """The prmt conversions of sm_80+ (triton_convert's *_asm) and the portable ones the interpreter
    runs produce the same floats, so the decode GEMV's result is identical, fused forms included."""
    assert tlin.asm_conversions(torch.device(DEV))
    cases = [(576, 1536, {}), (4096, 4096, {"residual": True}), (960, 576, {"norm": True}),
             (576, 1536, {"silu": True}), (4099, 14336, {})]
    outs = {}
    for asm in (True, False):
        monkeypatch.setattr(tlin, "asm_conversions", lambda device, asm=asm: asm)
        outs[asm] = []
        for n, k, form in cases:
            w = make_weight(fmt, n, k, torch.bfloat16, bias=False, group=32, seed=n + k)
            gen = torch.Generator(device=DEV).manual_seed(k)
            x = torch.randn(1, 2 * k if form.get("silu") else k, device=DEV, generator=gen).bfloat16()
            kw = {}
            if form.get("residual"):
                kw["residual"] = torch.randn(1, n, device=DEV, generator=gen).bfloat16()
            if form.get("norm"):
                kw.update(norm_weight=torch.rand(k, device=DEV, generator=gen).bfloat16() + 0.5, norm_eps=1e-5)
            outs[asm].append(tlin.linear(x, w, silu_mul=bool(form.get("silu")), fuse_input=True, **kw))
    for (n, k, form), fast, portable in zip(cases, outs[True], outs[False]):
        assert torch.equal(fast, portable), (n, k, form)


def test_linear_odd_shapes() -> None:
    # N not a multiple of any block, K not a multiple of the K step (SmolLM2's 576 / 1536)
    for fmt in ("dense", "w8", "w8sym", "w4"):
        w = make_weight(fmt, 1536 + 7 * (fmt != "w4"), 576, torch.float16, bias=True, group=32, seed=3)
        for m in (1, 3, 70):
            x = torch.randn(m, 576, device=DEV).half()
            assert rel_err(ops.linear(x, w), ref_linear(x, w)) < REL[torch.float16], (fmt, m)


def large_offset_w8(n: int, k: int, seed: int) -> LinearWeight:
    """Q4_1-like groups (minimums ~100x the step) requantized to w8 groups, on the GPU."""
    from edged.kernels.weights import dequantize, pack_w4

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=g) * 0.002 + 0.001
    m = torch.randn(n, k // 32, generator=g).sign() * (0.15 + 0.05 * torch.rand(n, k // 32, generator=g))
    return quantize_w8(dequantize(pack_w4(q, d, m, 32))).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(4096, 14336), (1536 + 7, 576), (49152, 576)])
def test_linear_w8_groups_with_large_offsets(n: int, k: int, dtype: torch.dtype) -> None:
    """Grouped w8 in bf16 and fp16, groups whose offsets dwarf their spread: float32 logits from the GEMV
    (dequantized in float32 registers) carry float32 rounding only; from the GEMM (its dequantized tile
    rounded to the activation dtype for the tensor cores) no more than holding the weight in that dtype."""
    from edged.kernels.weights import dequantize

    w = large_offset_w8(n, k, seed=n + k).astype(dtype)
    exact = dequantize(w)
    for m in (1, 5, 16, 48, 200):
        x = torch.randn(m, k, device=DEV).to(dtype)
        want = ref_linear(x, w)
        weight_in_dtype = rel_err(x.float() @ exact.to(dtype).float().T, want)
        bound = 1e-5 if m == 1 else 1e-5 + 1.2 * weight_in_dtype
        assert rel_err(ops.linear(x, w, out_dtype=torch.float32), want) < bound, (m, weight_in_dtype)
        assert rel_err(ops.linear(x, w), want) < REL[dtype], m


def test_linear_w8_rows_of_one_group() -> None:
    """in_features not a multiple of 32 (one group per row): GEMV and GEMM, bf16."""
    w = make_weight("w8", 1000, 1000, torch.bfloat16, bias=True, seed=11)
    assert w.group_size == 1000
    for m in (1, 7, 100):
        x = torch.randn(m, 1000, device=DEV).bfloat16()
        assert rel_err(ops.linear(x, w), ref_linear(x, w)) < REL[torch.bfloat16], m


def test_linear_is_deterministic() -> None:
    w = make_weight("w8", 4096, 14336, torch.bfloat16)
    x = torch.randn(1, 14336, device=DEV).bfloat16()
    first = ops.linear(x, w)
    for _ in range(3):
        assert torch.equal(ops.linear(x, w), first)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["dense", "w8", "w4", "w8sym+mma"])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("n,k", [(576, 1536), (2048, 8192), (4096, 4096)])
def test_linear_fused_forms(n: int, k: int, rows: int, fmt: str, dtype: torch.dtype) -> None:
    """RMSNorm in, silu(gate) * up in, residual add out, RMSNorm in with silu(gate) * up out, at decode
    shapes (split over K by the last split of each row block, small N; whole rows, large N): the
    composed reference ops' values, deterministic, and the arrival counters back at zero."""
    from edged.kernels.triton_counters import split_counters

    torch.manual_seed(n + k + rows)
    w = make_weight(fmt, n, k, dtype)
    norm_w = (1.0 + 0.2 * torch.randn(k, device=DEV)).to(dtype)
    residual = torch.randn(rows, n, device=DEV).to(dtype)
    cases = [(torch.randn(rows, k, device=DEV).to(dtype), dict(norm_weight=norm_w, norm_eps=1e-5)),
             (torch.randn(rows, 2 * k, device=DEV).to(dtype), dict(silu_mul=True, residual=residual)),
             (torch.randn(rows, k, device=DEV).to(dtype), dict(residual=residual)),
             (torch.randn(rows, k, device=DEV).to(dtype), dict(norm_weight=norm_w, norm_eps=1e-5, silu_mul_out=True))]
    for (x, kw), fuse in [(case, None) for case in cases] + [(cases[-1], True)]:  # silu out fused at any size
        got = ops.linear(x, w, **kw, fuse_input=fuse)
        assert torch.equal(ops.linear(x, w, **kw, fuse_input=fuse), got)
        assert rel_err(got, reference.linear(x.float(), w, **{key: (v.float() if torch.is_tensor(v) else v)
                                                              for key, v in kw.items()})) < REL[dtype], kw.keys()
        assert int(split_counters(DEV).abs().sum()) == 0


# ------------------------------------------------------------------------------------- norm and friends

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [2048, 4096, 8192])
def test_rms_norm(hidden: int, dtype: torch.dtype) -> None:
    x = torch.randn(37, hidden, device=DEV).to(dtype)
    r = torch.randn(37, hidden, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    out, h = ops.rms_norm(x, w, 1e-5, r)
    ref_out, ref_h = reference.rms_norm(x, w, 1e-5, r)
    assert torch.equal(h, ref_h)
    assert rel_err(out, ref_out) < REL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = (2 * torch.randn(33, 2 * 14336, device=DEV)).to(dtype)
    assert rel_err(ops.silu_and_mul(x), reference.silu_and_mul(x)) < REL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,hq,hk", [(128, 32, 8), (64, 32, 8), (64, 9, 3)])
def test_rope(dtype: torch.dtype, head_dim: int, hq: int, hk: int) -> None:
    t = 300
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, device=DEV).to(dtype)
    pos = torch.randint(0, 8192, (t,), device=DEV)
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    f = torch.outer(torch.arange(8192, dtype=torch.float64), inv)
    cs = torch.cat((f.cos(), f.sin()), -1).float().to(DEV)
    ref = qkv.clone()
    for buf, fn in ((qkv, ops.rope), (ref, reference.rope)):
        q = buf[:, :hq * head_dim].view(t, hq, head_dim)
        k = buf[:, hq * head_dim:(hq + hk) * head_dim].view(t, hk, head_dim)
        fn(q, k, pos, cs)
    assert rel_err(qkv, ref) < REL[dtype] / 4


# -------------------------------------------------------------------------------------------- KV cache



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("int8", [False, True])
def test_write_kv_exact(dtype: torch.dtype, int8: bool) -> None:
    """Bit-exact with the reference run on the CPU. (The reference run on the GPU is not: PyTorch's
    CUDA division by the scalar 127.0 multiplies by its reciprocal, so its scales can differ by an ulp.)"""
    n, s, h, d, t = 64, 16, 8, 128, 333
    k = (3 * torch.randn(t, h, d, device=DEV)).to(dtype)
    k[:, :, 7] *= 20  # an outlier channel, as real keys have: it sets the scale of channels 0-31 only
    v = torch.randn(t, h, d, device=DEV).to(dtype)
    slots = torch.randperm(n * s, device=DEV)[:t]
    slots[::7] = -1
    store = torch.int8 if int8 else dtype
    caches = [torch.full((n, s, h, d), 3, dtype=store) for _ in range(4)]
    groups = [reference.k_scale_groups(d), reference.v_scale_groups(d)] * 2
    scales = [torch.full((n, s, h, g), -1.0) if int8 else None for g in groups]
    got = [c.to(DEV) for c in caches[:2]]
    got_s = [None if x is None else x.to(DEV) for x in scales[:2]]
    ops.write_kv(k, v, got[0], got[1], slots, got_s[0], got_s[1])
    reference.write_kv(k.cpu(), v.cpu(), caches[2], caches[3], slots.cpu(), scales[2], scales[3])
    assert torch.equal(got[0].cpu(), caches[2]) and torch.equal(got[1].cpu(), caches[3])
    if int8:
        assert torch.equal(got_s[0].cpu(), scales[2]) and torch.equal(got_s[1].cpu(), scales[3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("head_dim,hq,hk", [(128, 32, 8), (64, 32, 8), (64, 9, 3)])
def test_rope_write_kv(dtype: torch.dtype, int8: bool, head_dim: int, hq: int, hk: int) -> None:
    """rope and write_kv in one launch, on q, k, v split from one qkv buffer: q and k bit for bit as
    ops.rope leaves them (so within test_rope's bound of the reference), v untouched, and the caches
    bit-exact with the reference's write_kv of the rotated k run on the CPU (see test_write_kv_exact).
    The reference's own rotation may differ from the kernel's by an ulp (FMA), hence the kernel's k."""
    n, s, t = 64, 16, 333
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, device=DEV).to(dtype)
    pos = torch.randint(0, 8192, (t,), device=DEV)
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    f = torch.outer(torch.arange(8192, dtype=torch.float64), inv)
    cs = torch.cat((f.cos(), f.sin()), -1).float().to(DEV)
    slots = torch.randperm(n * s, device=DEV)[:t]
    slots[::7] = -1
    store = torch.int8 if int8 else dtype
    groups = [reference.k_scale_groups(head_dim), reference.v_scale_groups(head_dim)] * 2
    caches = [torch.full((n, s, hk, head_dim), 3, dtype=store) for _ in range(4)]
    scales = [torch.full((n, s, hk, g), -1.0) if int8 else None for g in groups]
    got = [c.to(DEV) for c in caches[:2]]
    got_s = [None if x is None else x.to(DEV) for x in scales[:2]]
    bufs = [qkv.clone() for _ in range(3)]  # rope_write_kv, ops.rope, reference.rope
    views = [[x.reshape(t, -1, head_dim) for x in b.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)]
             for b in bufs]
    q, k, v = views[0]
    ops.rope_write_kv(q, k, v, pos, cs, got[0], got[1], slots, got_s[0], got_s[1])
    ops.rope(views[1][0], views[1][1], pos, cs)
    reference.rope(views[2][0], views[2][1], pos, cs)
    assert torch.equal(bufs[0], bufs[1])
    assert rel_err(bufs[0], bufs[2]) < REL[dtype] / 4
    reference.write_kv(k.cpu(), v.cpu(), caches[2], caches[3], slots.cpu(), scales[2], scales[3])
    assert torch.equal(got[0].cpu(), caches[2]) and torch.equal(got[1].cpu(), caches[3])
    if int8:
        assert torch.equal(got_s[0].cpu(), scales[2]) and torch.equal(got_s[1].cpu(), scales[3])


# ------------------------------------------------------------------------------------------- attention

def _attn_rel(dtype: torch.dtype, int8: bool) -> float:
    return REL[dtype] * (3 if int8 else 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("head_dim,hq,hkv", [(128, 32, 8), (64, 32, 8), (64, 9, 3), (96, 12, 4)])
def test_attention_decode(dtype: torch.dtype, int8: bool, head_dim: int, hq: int, hkv: int) -> None:
    ctx = [1, 17, 500, 1024, 4096, 2049, 33, 3000]
    kc, vc, ks, vs, tables = paged_cache(ctx, hkv, head_dim, 16, dtype, int8)
    q = torch.randn(len(ctx), hq, head_dim, device=DEV).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    scale = head_dim ** -0.5
    want = reference.attention_decode(q.float(), kc, vc, tables, lens, scale, ks, vs) if int8 else \
        reference.attention_decode(q.float(), kc.float(), vc.float(), tables, lens, scale)
    for splits, block_t in ((None, None), (1, 64), (7, 128)):
        got = tattn.attention_decode(q, kc, vc, tables, lens, scale, ks, vs, num_splits=splits, block_t=block_t)
        assert rel_err(got, want) < _attn_rel(dtype, int8), splits


def test_attention_decode_batch32_ctx1024() -> None:
    ctx = [1024] * 32
    kc, vc, _, _, tables = paged_cache(ctx, 8, 128, 16, torch.bfloat16, False, seed=1)
    q = torch.randn(32, 32, 128, device=DEV).bfloat16()
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    want = reference.attention_decode(q.float(), kc.float(), vc.float(), tables, lens, 128 ** -0.5)
    assert rel_err(ops.attention_decode(q, kc, vc, tables, lens, 128 ** -0.5), want) < REL[torch.bfloat16]


@pytest.mark.parametrize("vocab", [49152, 128256, 151936])
def test_argmax_equals_torch_argmax(vocab: int) -> None:
    """Greedy tokens of 1 and 64 rows, a tie across pieces resolved to the lowest index."""
    from edged.kernels.triton_counters import split_counters

    x = torch.randn(64, vocab, device=DEV)
    x[5, vocab - 1] = x[5, 100] = 30.0
    for rows in (1, 64):
        assert torch.equal(tsamp.argmax(x[:rows]), x[:rows].argmax(dim=-1))
    assert int(split_counters(DEV).abs().sum()) == 0


@pytest.mark.parametrize("batch", [1, 5])
def test_attention_decode_split_merge_is_deterministic(batch: int) -> None:
    """8 context splits, many of them empty, merged in split order: bit-identical across calls."""
    ctx = [3000, 1, 17, 1024, 515][:batch]  # batch 5: splits of 32+ tokens, many of them empty
    kc, vc, _, _, tables = paged_cache(ctx, 8, 128, 16, torch.bfloat16, False, seed=3)
    q = torch.randn(batch, 32, 128, device=DEV).bfloat16()
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    want = reference.attention_decode(q.float(), kc.float(), vc.float(), tables, lens, 128 ** -0.5)
    outs = [tattn.attention_decode(q, kc, vc, tables, lens, 128 ** -0.5, num_splits=8) for _ in range(3)]
    assert rel_err(outs[0], want) < REL[torch.bfloat16]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_prefill(dtype: torch.dtype, int8: bool, head_dim: int) -> None:
    hq, hkv = 32, 8
    ctx = [700, 1500, 64, 2048, 300]
    new = [700, 200, 1, 2048, 0]  # full prompt, a chunk after a prefix, one token, long prompt, none
    kc, vc, ks, vs, tables = paged_cache(ctx, hkv, head_dim, 16, dtype, int8, seed=2)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = torch.randn(sum(new), hq, head_dim, device=DEV).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    scale = head_dim ** -0.5
    want = reference.attention_prefill(q.float(), kc, vc, tables, cu, lens, scale, ks, vs) if int8 else \
        reference.attention_prefill(q.float(), kc.float(), vc.float(), tables, cu, lens, scale)
    got = ops.attention_prefill(q, kc, vc, tables, cu, lens, scale, ks, vs)
    assert rel_err(got, want) < _attn_rel(dtype, int8)


# -------------------------------------------------------------------------------------------- sampling

def test_sampling_uniform_bit_exact() -> None:
    seeds = torch.tensor([0, 1, 2**31 + 5, -7, 2**40 + 3, 12345], dtype=torch.int64)
    offsets = torch.tensor([0, 9, 2**32 - 1, 3, 123456, 77], dtype=torch.int64)
    got = tsamp.sampling_uniform(seeds.to(DEV), offsets.to(DEV), 128256).cpu()
    assert torch.equal(got, reference.sampling_uniform(seeds, offsets, 128256))


def test_sample_same_tokens_as_cpu() -> None:
    b, v = 8, 128256
    logits = torch.randn(b, v, generator=torch.Generator().manual_seed(0)) * 4
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0, 0.9, 0.6, 1.0])
    top_k = torch.tensor([0, 0, 50, 5, 3, 0, 0, 1000])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 0.95, 1.0, 0.8])
    seeds = torch.arange(b) * 7919
    for step in range(4):
        offsets = torch.full((b,), step)
        args = [t.to(DEV) for t in (logits, temperature, top_k, top_p, seeds, offsets)]
        got = ops.sample(*args)
        assert torch.equal(got, reference.sample(*args))  # same torch ops on the GPU: exact
        cpu = reference.sample(logits, temperature, top_k, top_p, seeds, offsets)
        assert torch.equal(got.cpu(), cpu)


# ---------------------------------------------------------------------------------------- whole model

def test_llama_forward_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small random Llama through the dispatcher: Triton vs EDGED_KERNELS=reference, prefill then decode."""
    from edged.models.batch import AttentionMetadata, KVCache
    from edged.models.config import ModelConfig
    from edged.models.llama import LayerWeights, LlamaModel, LlamaWeights

    cfg = ModelConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                      num_kv_heads=2, head_dim=64)
    g = torch.Generator(device=DEV).manual_seed(0)
    dt = torch.bfloat16

    def lin(n: int, k: int) -> LinearWeight:
        return make_weight("w4", n, k, dt, group=64, seed=n * 3 + k)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(cfg.hidden_size, generator=g, device=DEV)).to(dt)

    layers = [LayerWeights(norm(), lin(cfg.q_size + 2 * cfg.kv_size, 512), lin(512, cfg.q_size), norm(),
                           lin(2 * 1024, 512), lin(512, 1024)) for _ in range(cfg.num_layers)]
    weights = LlamaWeights((torch.randn(1000, 512, generator=g, device=DEV) * 0.5).to(dt), layers, norm(),
                           lin(1000, 512))
    model = LlamaModel(cfg, weights, max_positions=256)
    prompt = [37, 21]
    ids = torch.randint(0, 1000, (sum(prompt),), generator=g, device=DEV)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32, device=DEV)
    pos = torch.cat([torch.arange(n) for n in prompt]).to(DEV)
    slots = torch.cat([tables[b, torch.arange(n) // 16].long().cpu() * 16 + torch.arange(n) % 16
                       for b, n in enumerate(prompt)]).to(DEV)
    prefill = AttentionMetadata(False, slots, tables, torch.tensor(prompt, dtype=torch.int32, device=DEV),
                                torch.tensor([0, 37, 58], dtype=torch.int32, device=DEV))
    decode = AttentionMetadata(True, torch.tensor([2 * 16 + 5, 5 * 16 + 5], device=DEV), tables,
                               torch.tensor([38, 22], dtype=torch.int32, device=DEV),
                               torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV))
    outs = {}
    for backend in ("reference", "auto"):
        monkeypatch.setenv("EDGED_KERNELS", backend)
        for int8 in (False, True):
            kv = KVCache.allocate(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, dt, DEV, int8=int8)
            h1 = model.forward(ids, pos, prefill, kv)
            h2 = model.forward(ids[[36, 57]], torch.tensor([37, 21], device=DEV), decode, kv)
            outs[backend, int8] = (model.logits(h1), model.logits(h2))
    for int8 in (False, True):
        for got, want in zip(outs["auto", int8], outs["reference", int8]):
            assert rel_err(got, want) < 3e-2, int8


def test_kernels_launched_with_pdl_replay_in_a_cuda_graph_to_the_eager_result() -> None:
    """Step kernels launch with programmatic dependent launch on sm_90 and later (each waits for the
    kernel before it first): a chain of dependent norms and GEMVs captured in a CUDA graph replays
    bit-exactly to the same chain run eagerly."""
    from edged.kernels.triton_pdl import pdl_enabled
    assert pdl_enabled(DEV) == (torch.cuda.get_device_capability(DEV)[0] >= 9 and os.environ.get("EDGED_PDL") != "0")
    w = make_weight("w8", 576, 576, torch.bfloat16, seed=3)
    nw = torch.ones(576, device=DEV, dtype=torch.bfloat16)
    x0 = torch.randn(1, 576, device=DEV, dtype=torch.bfloat16)

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(40):  # each output feeds the next kernel: a race would show as a changed value
            x = tlin.linear(ops.rms_norm(x, nw, 1e-5)[0], w)
        return x

    want = chain(x0)
    static_x = x0.clone()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        chain(static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_reads_the_token_rope_write_kv_wrote_just_before_in_a_replayed_graph(dtype: torch.dtype) -> None:
    """The decode chain qkv GEMV -> rope_write_kv -> attention, replayed from one CUDA graph for contexts of
    500 to 540 tokens (PDL on sm_90: each kernel loads its constants, and attention its first K/V tile but
    for the newest token, before waiting on the kernel before): equal to the reference ops on the same
    inputs. The cache starts at 100 everywhere, so a stale read of the newest token would be far off."""
    torch.manual_seed(5)
    hq, hk, d, block, width = 9, 3, 64, 16, 64  # SmolLM2's heads; room for 1,024 tokens
    hidden = 576
    w = make_weight("w8", (hq + 2 * hk) * d, hidden, dtype, seed=6)
    kc = torch.full((width, block, hk, d), 100.0, dtype=dtype, device=DEV)
    vc = torch.full_like(kc, 100.0)
    tables = torch.arange(width, dtype=torch.int32, device=DEV).view(1, width)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    angles = torch.arange(2048, device=DEV).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    x, pos = torch.zeros(1, hidden, dtype=dtype, device=DEV), torch.zeros(1, dtype=torch.long, device=DEV)
    lens, slot = torch.zeros(1, dtype=torch.int32, device=DEV), torch.zeros(1, dtype=torch.long, device=DEV)

    def step() -> torch.Tensor:
        qkv = tlin.linear(x, w)
        q, k, v = (t.reshape(1, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
        ops.rope_write_kv(q, k, v, pos, cos_sin, kc, vc, slot)
        return tattn.attention_decode(q, kc, vc, tables, lens, d ** -0.5)

    ref_kc, ref_vc = kc.clone(), vc.clone()
    history = torch.randn(500, hk, d, device=DEV).to(dtype)  # tokens 0..499, as earlier steps left them
    for cache_k, cache_v in ((kc, vc), (ref_kc, ref_vc)):
        reference.write_kv(history, history.flip(0), cache_k, cache_v, torch.arange(500, device=DEV))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture (it writes slot 0: rewritten below)
    torch.cuda.synchronize()
    for cache_k, cache_v in ((kc, vc), (ref_kc, ref_vc)):
        reference.write_kv(history[:1], history.flip(0)[:1], cache_k, cache_v, torch.zeros(1, dtype=torch.long,
                                                                                             device=DEV))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for p in range(500, 541):
        x.copy_(torch.randn(1, hidden, device=DEV).to(dtype))
        pos.fill_(p)
        lens.fill_(p + 1)
        slot.fill_(p)
        graph.replay()
        qkv = ref_linear(x, w).to(dtype)
        q, k, v = (t.reshape(1, -1, d).clone() for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
        reference.rope(q, k, pos, cos_sin)
        reference.write_kv(k, v, ref_kc, ref_vc, slot)
        want = reference.attention_decode(q, ref_kc, ref_vc, tables, lens, d ** -0.5)
        torch.cuda.synchronize()
        assert rel_err(out, want) < REL[dtype], p
