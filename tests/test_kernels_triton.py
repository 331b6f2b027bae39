"""Every Triton kernel against its plain-torch reference, on the CPU under Triton's interpreter.

Small shapes, float16 and float32 (the interpreter computes bfloat16 wrongly).

The interpreter has to be on before `import triton` (triton's own tl.zeros, tl.sum, ... are jit
functions too), and it must stay off for the GPU tests in the same pytest process. So unless this
process already runs interpreted (TRITON_INTERPRET=1 from the start), this file runs once in a child
pytest with TRITON_INTERPRET=1 (helpers/interpreted_child.py; conftest starts it when collection ends),
and every test here reports its own result from that run. Run `TRITON_INTERPRET=1 pytest
tests/test_kernels_triton.py` to see tracebacks directly.
"""
from __future__ import annotations

import os
from typing import Callable

import pytest
import torch

from edged.kernels import reference
from edged.kernels.weights import LinearWeight, dequantize, pack_w4, quantize_w4, quantize_w8
from helpers.interpreted_child import interpreted_child
from helpers.kernel_inputs import make_weight
from helpers.sampling import allowed_tokens

pytest.importorskip("triton")


def _interpreter_active() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)  # False if triton was imported before the variable


INTERPRETED = _interpreter_active()
if INTERPRETED:
    import triton
    import triton.language as tl

    from edged.kernels import triton_activation as tact
    from edged.kernels import triton_attention as tattn
    from edged.kernels import triton_linear as tlin
    from edged.kernels import triton_norm as tnorm
    from edged.kernels import triton_ops as ops
    from edged.kernels import triton_sampling as tsamp
    from edged.kernels.triton_convert import magic_nibbles_f32, magic_u8_f32
    from edged.kernels.triton_w4_dot import shuffle_w4_tiles, w4_dot_linear

    @triton.jit
    def _magic_floats_kernel(b_ptr, u8_ptr, lo_ptr, hi_ptr):
        i = tl.arange(0, 256)
        b = tl.load(b_ptr + i)
        tl.store(u8_ptr + i, magic_u8_f32(b))
        lo, hi = magic_nibbles_f32(b)
        tl.store(lo_ptr + i, lo)
        tl.store(hi_ptr + i, hi)

def _replay(outcome: str, detail: str) -> Callable[..., None]:
    def run(**_: object) -> None:
        if outcome != "passed":
            pytest.fail(f"in the interpreted child run: {outcome}\n{detail}", pytrace=False)

    return run


@pytest.fixture(autouse=True)
def _interpreted_run(request: pytest.FixtureRequest) -> None:
    """Outside the interpreter, swap each test's body for its outcome in the child run."""
    if INTERPRETED:
        return
    results = interpreted_child(__file__).results()
    outcome, detail = results.get(request.node.name, ("missing", results[""][1]))
    if outcome == "skipped":
        pytest.skip(detail.strip().splitlines()[0] if detail.strip() else "skipped in the child run")
    request.node.obj = _replay(outcome, detail)


DTYPES = [torch.float16, torch.float32]
TOL = {torch.float16: dict(atol=2e-2, rtol=2e-2), torch.float32: dict(atol=1e-4, rtol=1e-4)}


def test_kernels_are_interpreted() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(tlin._gemv_kernel, InterpretedFunction)


def test_programmatic_dependent_launch_is_off_in_the_interpreter() -> None:
    """PDL's griddepcontrol instructions exist on sm_90+ only: interpreted kernels launch without it."""
    from edged.kernels.triton_pdl import pdl_enabled, pdl_launch

    assert not pdl_enabled(torch.device("cpu"))
    assert pdl_launch(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


def test_inline_ptx_conversions_are_off_in_the_interpreter() -> None:
    """The prmt conversions are PTX: interpreted GEMVs take the portable ones (same floats)."""
    from edged.kernels.triton_convert import asm_conversions

    assert not asm_conversions(torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- linear

def _weight(fmt: str, n: int, k: int, dtype: torch.dtype, bias: bool, group: int = 32) -> LinearWeight:
    return make_weight(fmt, n, k, dtype, bias, group, seed=n * 131 + k, device="cpu", std=0.1, bias_std=1.0)


def _check_linear(x: torch.Tensor, w: LinearWeight, config=None) -> None:
    got = tlin.linear(x, w, config)
    want = reference.linear(x.to(torch.float32), _as_f32(w)).to(x.dtype)
    assert got.shape == want.shape and got.dtype == x.dtype
    scale = want.abs().max().item() + 1e-3
    tol = 4e-3 if x.dtype == torch.float16 else 2e-5
    assert (got.float() - want.float()).abs().max().item() <= tol * scale * max(1.0, x.shape[-1] / 256) ** 0.5


def _as_f32(w: LinearWeight) -> LinearWeight:
    def f(t):
        return None if t is None else (t.to(torch.float32) if t.is_floating_point() else t)

    return LinearWeight(w.format, f(w.data), f(w.scale), f(w.minimum), w.group_size, f(w.bias), w.mma_order)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["dense", "w8", "w8sym", "w4", "w8sym+mma"])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_linear_formats(fmt: str, m: int, dtype: torch.dtype) -> None:
    torch.manual_seed(m)
    w = _weight(fmt, 72, 256, dtype, bias=(m != 5))
    x = torch.randn(m, 256).to(dtype)
    _check_linear(x, w)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_linear_w4_groups_gemv_split(group: int) -> None:
    torch.manual_seed(group)
    w = _weight("w4", 12, 512, torch.float16, bias=True, group=group)
    x = torch.randn(1, 512).to(torch.float16)
    # three row blocks; two groups per step, three K splits with a ragged last split
    cfg = tlin.LinearConfig("gemv", 1, 4, 2 * group, split=3)
    _check_linear(x, w, cfg)
    _check_linear(x, w, tlin.LinearConfig("gemv", 1, 2, group, split=1))


def test_linear_w4_ragged_k() -> None:
    torch.manual_seed(3)
    w = _weight("w4", 24, 224, torch.float32, bias=False)  # 7 groups: the K step does not divide K
    x = torch.randn(1, 224)
    _check_linear(x, w, tlin.LinearConfig("gemv", 1, 4, 64, split=2))
    _check_linear(torch.randn(20, 224), w, tlin.LinearConfig("matmul", 16, 16, 64, split=1))


def test_linear_w4_gemv_bf16_x_words() -> None:
    # the w4 GEMV reads bf16 x as 32-bit words (integer ops only, so the interpreter gets them right);
    # this x starts at an odd element, off the word boundary
    torch.manual_seed(2)
    w = _weight("w4", 40, 256, torch.bfloat16, bias=True)
    x = torch.randn(1, 300).to(torch.bfloat16)[:, 1:257]
    got = tlin.linear(x, w).float()
    want = reference.linear(x.float(), _as_f32(w))
    assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()


# the tensor-core w4 GEMV (kernels/triton_w4_dot.py): measured, not launched by linear; its portable form here
@pytest.mark.parametrize("n,k,group,dtype,split,bias,residual", [
    (128, 512, 32, torch.float16, 1, False, False),  # one tile, one cycle
    (200, 1024, 32, torch.float32, 2, True, False),  # a part tile of rows, two K splits
    (130, 576, 32, torch.float16, 1, False, True),  # a cycle's tail: steps past K read against zeros of x
    (64, 224, 32, torch.float32, 1, False, False),  # K not a whole step
    (128, 2048, 64, torch.float16, 2, False, True),
    (96, 2048, 128, torch.float32, 1, True, True),
])
def test_w4_tensor_core_gemv_equals_the_reference(n: int, k: int, group: int, dtype: torch.dtype, split: int,
                                                   bias: bool, residual: bool) -> None:
    torch.manual_seed(n + k)
    w = _weight("w4", n, k, torch.float32, bias, group)
    x = torch.randn(1, k).to(dtype)
    res = torch.randn(1, n).to(dtype) if residual else None
    got = w4_dot_linear(x, shuffle_w4_tiles(w.data), w.scale, w.minimum, n, group,
                        bias=None if w.bias is None else w.bias.to(dtype), residual=res, split=split)
    want = reference.linear(x.float(), _as_f32(w))
    if residual:
        want = want.to(dtype).float() + res.float()
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


def test_w4_tensor_core_gemv_refuses_what_it_cannot_compute() -> None:
    w = _weight("w4", 128, 256, torch.float32, False)
    words = shuffle_w4_tiles(w.data)
    with pytest.raises(ValueError, match="not the tiles"):
        w4_dot_linear(torch.randn(1, 512), words, w.scale, w.minimum, 128, 32)
    with pytest.raises(ValueError, match="PTX nibble pairs are bfloat16"):
        w4_dot_linear(torch.randn(1, 256).half(), words, w.scale, w.minimum, 128, 32, asm=True)


@pytest.mark.parametrize("fmt", ["dense", "w8", "w8sym"])
def test_linear_gemv_ragged_k(fmt: str) -> None:
    torch.manual_seed(0)
    w = _weight(fmt, 9, 200, torch.float32, bias=True)  # K not a multiple of the block, N of the rows
    x = torch.randn(1, 200)
    _check_linear(x, w, tlin.LinearConfig("gemv", 1, 4, 64, split=2))
    _check_linear(x, w, tlin.LinearConfig("gemv", 1, 1, 64, split=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_w8_groups_with_large_offsets(dtype: torch.dtype) -> None:
    """w8 groups whose minimums are ~100x their step (Q4_1 requantized), float32 logits, K splits too:
    the GEMV dequantizes in float32 (float32 rounding only); the GEMM rounds its dequantized tile to
    x's dtype (no more error than holding the weight in that dtype)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (40, 256), generator=g, dtype=torch.uint8)
    d = (torch.rand(40, 8, generator=g) * 0.002 + 0.001).half()
    m = (torch.randn(40, 8, generator=g).sign() * (0.15 + 0.05 * torch.rand(40, 8, generator=g))).half()
    w = quantize_w8(dequantize(pack_w4(q, d, m, 32)))
    exact = dequantize(w)
    for rows, cfg in ((1, tlin.LinearConfig("gemv", 1, 4, 64, split=3)),
                      (7, tlin.LinearConfig("matmul", 16, 32, 64, split=2))):
        x = torch.randn(rows, 256, generator=g).to(dtype)
        want = x.float() @ exact.T
        weight_in_dtype = ((x.float() @ exact.to(dtype).float().T - want).norm() / want.norm()).item()
        got = tlin.linear(x, w, cfg, out_dtype=torch.float32)
        err = ((got - want).norm() / want.norm()).item()
        assert err < (1e-6 if rows == 1 else 1e-6 + 1.2 * weight_in_dtype), (rows, cfg, err, weight_in_dtype)


@pytest.mark.parametrize("fmt", ["w8", "w8sym"])
def test_linear_w8_rows_of_one_group(fmt: str) -> None:
    """in_features not a multiple of 32: one group per row (its parameters applied once, after the dot)."""
    torch.manual_seed(5)
    w = _weight(fmt, 33, 200, torch.float16, bias=True)
    assert w.group_size == 200 and (w.minimum is None) == (fmt == "w8sym")
    x = torch.randn(9, 200).to(torch.float16)
    _check_linear(x, w, tlin.LinearConfig("matmul", 16, 32, 64, split=2))
    _check_linear(x, w)


def test_gemv_weight_floats_are_each_integer_plus_its_constant() -> None:
    """The decode GEMV reads a byte as 32768 + q and a nibble as 128 + q (low) or 2048 + q (high), exactly,
    for every byte (the inline-PTX forms equal these bit for bit: tests/test_kernels_gpu.py)."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    u8, lo, hi = torch.empty(256), torch.empty(256), torch.empty(256)
    _magic_floats_kernel[(1,)](b, u8, lo, hi)
    q = torch.arange(256, dtype=torch.float32)
    assert torch.equal(u8, 32768 + q)
    assert torch.equal(lo, 128 + q % 16) and torch.equal(hi, 2048 + torch.div(q, 16, rounding_mode="floor"))


@pytest.mark.parametrize("fmt", ["w8", "w8sym", "w4"])
def test_gemv_constants_taken_off_once_a_chunk_cost_under_2_to_the_minus_16_of_the_dot(fmt: str,
                                                                                        monkeypatch) -> None:
    """bfloat16 GEMVs carry each weight's constant (32768, 128, 2048) through the dot and take it off once
    a chunk. That form, forced here with float16 x and a float32 result (which the interpreter computes
    right), against the exact one: each output within 2**-16 of sum |x * w| (measured 2**-18 to 2**-20;
    the bf16 rounding of x alone allows 2**-9 of it)."""
    torch.manual_seed(11)
    w = _weight(fmt, 64, 2048, torch.float16, bias=False)
    x = (3 * torch.randn(1, 2048)).to(torch.float16)
    cfg = tlin.LinearConfig("gemv", 1, 4, 256, 1)  # 8 chunks a row (64-wide chunks: 4x the interpreter's time)
    exact = tlin.linear(x, w, cfg, out_dtype=torch.float32)
    monkeypatch.setattr(tlin, "exact_gemv", lambda x_dtype, out_dtype: False)
    fast = tlin.linear(x, w, cfg, out_dtype=torch.float32)
    size = x.float().abs() @ dequantize(w).float().abs().T
    err = ((fast - exact).abs() / size).max().item()
    assert 0 < err < 2 ** -16, err  # 0: the forced form did not run


@pytest.mark.parametrize("swap,prefetch", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("fmt", ["dense", "w8", "w8sym", "w4", "w8+mma", "w8sym+mma"])
def test_linear_matmul_split_and_3d(fmt: str, swap: bool, prefetch: bool) -> None:
    """Every form of the batched matmul (grouped w8 and w4: weights as the dots' first operands; grouped w8:
    the next weight tile loaded ahead; dense ignores both; grouped w8 stored in the MMA order too), split over K
    or not, ragged K (192 = 1.5 steps of 128), leading dims and strided rows."""
    torch.manual_seed(1)
    w = _weight(fmt, 48, 192, torch.float16, bias=True, group=64)
    forms = dict(swap=swap, prefetch=prefetch)
    x = torch.randn(2, 9, 192).to(torch.float16)  # leading dims flatten to M = 18
    _check_linear(x, w, tlin.LinearConfig("matmul", 16, 32, 64, split=2, **forms))
    xs = torch.randn(3, 400).to(torch.float16)[:, :192]  # strided rows
    _check_linear(xs, w, tlin.LinearConfig("matmul", 16, 32, 128, split=1, **forms))


@pytest.mark.parametrize("fmt", ["w8", "w8sym"])
def test_batched_w8_matmul_rounds_each_weight_once_to_the_activation_dtype(fmt: str) -> None:
    """Rows of x that each pick one column read the dequantized weights back through the batched grouped w8
    matmul's portable forms: each the exact weight rounded once to float16, bit for bit (the PTX forms: the GPU
    twin in test_kernels_gpu.py). Rows of scales from 1e-4 to 10."""
    g = torch.Generator().manual_seed(5)
    n, k = 40, 128
    dense = torch.randn(n, k, generator=g) * 10 ** (torch.rand(n, 1, generator=g) * 5 - 4)
    w = quantize_w8(dense, symmetric=fmt == "w8sym").astype(torch.float16)
    want = dequantize(w, torch.float32).to(torch.float16).float().T
    eye = torch.eye(k, dtype=torch.float16)
    for swap, prefetch in ((False, False), (True, False), (False, True)):
        cfg = tlin.LinearConfig("matmul", 64, 32, 64, split=2, swap=swap, prefetch=prefetch)
        for first in range(0, k, 64):
            got = tlin.linear(eye[first:first + 64], w, cfg, out_dtype=torch.float32)
            assert torch.equal(got, want[first:first + 64]), (cfg, first)


_FUSED_FORMS = {"norm": dict(norm=True), "silu": dict(silu_mul=True), "residual": dict(residual=True),
                "silu+residual": dict(silu_mul=True, residual=True), "silu out": dict(silu_mul_out=True),
                "norm+silu out": dict(norm=True, silu_mul_out=True)}


_GEMV, _MATMUL = ("gemv", 1, 4, 32, 3), ("matmul", 16, 32, 32, 2)


@pytest.mark.parametrize("fmt,form,dtype,rows,cfg",
                         [(fmt, form, torch.float16, 1, _GEMV) for fmt in ("dense", "w8", "w4") for form in _FUSED_FORMS]
                         + [("w4", "norm", torch.float32, 1, _GEMV), ("w8", "silu+residual", torch.float32, 1, _GEMV)]
                         + [("w4", "silu+residual", torch.float16, 1, ("gemv", 1, 2, 64, 2))]  # 2 rows a program
                         + [(fmt, "norm+silu out", torch.float16, 1, cfg) for fmt in ("w8", "w4")
                            for cfg in (("gemv", 1, 2, 64, 2), ("gemv", 1, 1, 32, 1))]  # 1 row: runs as 2
                         # one step holds the whole row (block_k >= K), its first weights loaded before the wait
                         + [(fmt, "norm", torch.float16, 1, ("gemv", 1, 4, 64, 1)) for fmt in ("dense", "w8", "w4")]
                         + [(fmt, form, dt, 1, ("gemv", 1, 4, 128, 1)) for fmt, form, dt in
                            (("w4", "norm+silu out", torch.float16), ("w8", "norm", torch.float32))]
                         + [(fmt, "residual", torch.float16, 6, _MATMUL) for fmt in ("w8", "w4")]
                         + [("w8", "silu+residual", torch.float32, 6, _MATMUL), ("w4", "norm", torch.float16, 6, _MATMUL)]
                         + [("w8", "silu out", torch.float16, 6, _MATMUL)]
                         # the batched matmul with the weights as the dot's first operand, loaded a step ahead (w4 ignores both)
                         + [(fmt, "residual", torch.float16, 6, _MATMUL + (True, True)) for fmt in ("w8", "w4")]
                         # symmetric w8 (GGUF Q8_0, no minimums) in the GEMV's fused forms and the batched matmul
                         + [("w8sym", form, torch.float16, 1, _GEMV) for form in ("norm+silu out", "silu+residual")]
                         + [("w8sym", "residual", torch.float16, 6, _MATMUL + (True, True))]
                         # w8 in the MMA order: x put in the weights' order after the fused prologue (GEMV), the
                         # weight tile put back in column order (swap form) or x in the weights' (plain form)
                         + [("w8sym+mma", form, torch.float16, 1, _GEMV) for form in ("norm+silu out", "silu+residual")]
                         + [("w8+mma", "norm", torch.float32, 1, ("gemv", 1, 4, 128, 1))]
                         + [("w8sym+mma", "residual", torch.float16, 6, _MATMUL + forms)
                            for forms in ((True, True), (True, False), (False, False))])
def test_linear_fused_forms_equal_the_composed_ops(fmt: str, form: str, rows: int, cfg, dtype: torch.dtype) -> None:
    """RMSNorm in, silu(gate) * up in, the residual add out, silu(gate) * up out: the same values as
    reference.linear's composition of the separate ops (each rounded to the activation dtype), split or
    not, and a split launch leaves its arrival counters at zero and repeats bit for bit."""
    from edged.kernels.triton_counters import split_counters

    torch.manual_seed(len(form) * 7 + rows)
    spec = _FUSED_FORMS[form]
    gated = spec.get("silu_mul_out", False)
    # two w4 groups; the GEMV config below splits K in two; three row blocks of 4; gated: 7 outputs,
    # so the last program of two outputs has one
    k, n = 64, (14 if gated else 12)
    w = _weight(fmt, n, k, dtype, bias=True)
    x = torch.randn(rows, 2 * k if spec.get("silu_mul") else k).to(dtype)
    kw = dict(silu_mul=spec.get("silu_mul", False), silu_mul_out=gated)
    if spec.get("norm"):
        kw.update(norm_weight=(1.0 + 0.3 * torch.randn(k)).to(dtype), norm_eps=1e-5)
    if spec.get("residual"):
        kw.update(residual=(4 * torch.randn(rows, n)).to(dtype))
    config = tlin.LinearConfig(*cfg[:4], split=cfg[4], swap=cfg[5:6] == (True,), prefetch=cfg[6:7] == (True,))
    got = tlin.linear(x, w, config, **kw)
    again = tlin.linear(x, w, config, **kw)
    want = reference.linear(x, w, **kw)
    assert got.shape == want.shape == (rows, n // 2 if gated else n) and got.dtype == dtype
    assert torch.equal(got, again)
    assert int(split_counters(x.device).abs().sum()) == 0
    scale = want.float().abs().max().item()
    tol = 8e-3 if dtype == torch.float16 else 2e-5
    assert (got.float() - want.float()).abs().max().item() <= tol * scale, (got, want)


@pytest.mark.parametrize("fmt", ["dense", "w8", "w8sym", "w4", "w8sym+mma"])
@pytest.mark.parametrize("m,k,rows,split", [(2, 224, 1, 1), (3, 256, 2, 2), (4, 192, 2, 1), (7, 160, 1, 3),
                                             (8, 96, 2, 1), (11, 128, 2, 2)])
def test_gemv_of_several_x_rows_gives_each_rows_single_row_gemv_bit_for_bit(fmt: str, m: int, k: int, rows: int,
                                                                            split: int) -> None:
    """The GEMV of a few sequences (each weight converted once, summed against every row of x; up to 8 rows
    of x a launch, 4 for w4, so 11 rows run as 8 + 3 or 4 + 4 + 3) computes what the one-row GEMV computes
    for each row, bit for bit: several K steps (7 and 5 of 32 columns: 224 and 160), K splits summed after,
    1 or 2 weight rows a program over a ragged N, bias and residual."""
    torch.manual_seed(m * k)
    w = _weight(fmt, 9, k, torch.float16, bias=True)
    x = torch.randn(m, k).to(torch.float16)
    res = (4 * torch.randn(m, 9)).to(torch.float16)
    cfg = tlin.LinearConfig("gemv", 1, rows, 32, split)
    got = tlin.linear(x, w, cfg, residual=res)
    one_by_one = torch.cat([tlin.linear(x[i:i + 1], w, cfg, residual=res[i:i + 1]) for i in range(m)])
    assert torch.equal(got, one_by_one)
    want = reference.linear(x, w, residual=res)
    assert (got.float() - want.float()).abs().max().item() <= 8e-3 * want.float().abs().max().item()


@pytest.mark.parametrize("fmt", ["dense", "w8", "w8sym", "w4"])
@pytest.mark.parametrize("cfg", [("matmul", 16, 32, 32, 2), ("matmul", 16, 32, 32, 3, True), ("gemv", 1, 2, 32, 2)])
def test_the_split_k_sum_of_several_rows_makes_the_norm_after_and_the_gate_bit_for_bit(fmt: str, cfg) -> None:
    """Several rows of x split over K (the batched matmul, plain or swap form, and the GEMV of several x
    rows, 11 rows: 8 + 3 a launch): linear_add_norm's sum also writes the norm of the residual stream it
    makes, and a [gate | up] weight's sum writes silu(gate) * up, each what linear then rms_norm or
    silu_and_mul write, bit for bit, with a bias, over a ragged N (13 columns and 7 gated outputs)."""
    torch.manual_seed(len(fmt) + cfg[4])
    m, k = 11, 128
    config = tlin.LinearConfig(*cfg[:4], split=cfg[4], swap=cfg[5:6] == (True,))
    x = torch.randn(m, k).to(torch.float16)
    w = _weight(fmt, 13, k, torch.float16, bias=True)
    res = (4 * torch.randn(m, 13)).to(torch.float16)
    norm_w = (1.0 + 0.3 * torch.randn(13)).to(torch.float16)
    h, normed = tlin.linear_add_norm(x, w, res, norm_w, 1e-5, config)
    want_h = tlin.linear(x, w, config, residual=res)
    assert torch.equal(h, want_h)
    assert normed is not None and torch.equal(normed, tnorm.rms_norm(want_h, norm_w, 1e-5)[0])
    gate_up = _weight(fmt, 14, k, torch.float16, bias=True)
    gated = tlin.linear(x, gate_up, config, silu_mul_out=True)
    assert torch.equal(gated, tact.silu_and_mul(tlin.linear(x, gate_up, config)))
    want = reference.linear(x, gate_up, silu_mul_out=True)
    assert (gated.float() - want.float()).abs().max().item() <= 8e-3 * want.float().abs().max().item()


def test_dense_output_projection_of_several_rows_makes_the_norm_after_bit_for_bit() -> None:
    """Dense weights at several rows go through cuBLAS (torch here): linear_add_norm's h and norm are linear's
    residual add then rms_norm, bit for bit, made by rms_norm's residual form instead of left to the next
    linear (one kernel after the matmul, not an add and a norm)."""
    torch.manual_seed(5)
    config = tlin.LinearConfig("torch")
    x = torch.randn(11, 128).to(torch.float16)
    w = _weight("dense", 13, 128, torch.float16, bias=True)
    res = (4 * torch.randn(11, 13)).to(torch.float16)
    norm_w = (1.0 + 0.3 * torch.randn(13)).to(torch.float16)
    h, normed = tlin.linear_add_norm(x, w, res, norm_w, 1e-5, config)
    want_h = tlin.linear(x, w, config, residual=res)
    assert torch.equal(h, want_h)
    assert normed is not None and torch.equal(normed, tnorm.rms_norm(want_h, norm_w, 1e-5)[0])


@pytest.mark.parametrize("rows,split", [(1, 2), (6, 1)])
def test_linear_add_norm_leaves_the_norm_to_the_next_linear_where_no_split_sum_runs(rows: int, split: int) -> None:
    """One row (the decode GEMV norms its input in its prologue) or an unsplit K: no norm, the same h."""
    x = torch.randn(rows, 64).to(torch.float16)
    w = _weight("w8", 12, 64, torch.float16, bias=False)
    res = torch.randn(rows, 12).to(torch.float16)
    kind = ("gemv", 1, 4, 32) if rows == 1 else ("matmul", 16, 32, 32)
    config = tlin.LinearConfig(*kind, split=split)
    h, normed = tlin.linear_add_norm(x, w, res, torch.ones(12, dtype=torch.float16), 1e-5, config)
    assert normed is None and torch.equal(h, tlin.linear(x, w, config, residual=res))


@pytest.mark.parametrize("fmt", ["w8", "w4"])
def test_gemv_of_several_x_rows_refuses_four_weight_rows_a_program(fmt: str) -> None:
    x = torch.randn(3, 64).to(torch.float16)
    with pytest.raises(ValueError, match="1 or 2 weight rows a program, not 4"):
        tlin.linear(x, _weight(fmt, 8, 64, torch.float16, bias=False), tlin.LinearConfig("gemv", 1, 4, 32, 1))


@pytest.mark.parametrize("vocab", [1, 37, 4096, 10000])
def test_argmax_takes_the_first_index_of_each_rows_maximum(vocab: int) -> None:
    """Many pieces a row (10000: three of 4096), ties across and inside pieces go to the lowest index,
    a NaN wins as in torch.argmax, and the arrival counters end at zero."""
    from edged.kernels.triton_counters import split_counters

    torch.manual_seed(vocab)
    x = torch.randn(4, vocab)
    if vocab > 1:
        x[1, vocab - 1] = x[1, vocab // 3] = 50.0  # a tie across pieces
        x[2, 1] = x[2, 0] = 50.0  # a tie inside one piece
        x[3, vocab // 2] = float("nan")
    got = tsamp.argmax(x)
    assert torch.equal(got, x.argmax(dim=-1)) and got.dtype == torch.int64
    assert torch.equal(ops.argmax(x[:, :vocab]), reference.argmax(x))
    assert int(split_counters(x.device).abs().sum()) == 0


# ------------------------------------------------------------------------------------- norm and friends

@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 96).to(dtype)
    r = torch.randn(5, 96).to(dtype)
    w = (1 + 0.1 * torch.randn(96)).to(dtype)
    out, h = ops.rms_norm(x, w, 1e-5, r)
    ref_out, ref_h = reference.rms_norm(x, w, 1e-5, r)
    assert torch.equal(h, ref_h)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    out, h = ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-6)[0], **TOL[dtype])
    assert h is x


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = (3 * torch.randn(3, 2, 2 * 80)).to(dtype)
    torch.testing.assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_strided_views(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hq, hk, d, t = 4, 2, 32, 6
    qkv = torch.randn(t, (hq + 2 * hk) * d).to(dtype)
    pos = torch.tensor([0, 1, 2, 7, 8, 30])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    f = torch.outer(torch.arange(64, dtype=torch.float64), inv)
    cs = torch.cat((f.cos(), f.sin()), -1).float()
    ref = qkv.clone()
    for buf, fn in ((qkv, ops.rope), (ref, reference.rope)):
        q = buf[:, :hq * d].view(t, hq, d)
        k = buf[:, hq * d:(hq + hk) * d].view(t, hk, d)
        fn(q, k, pos, cs)
    torch.testing.assert_close(qkv, ref, **TOL[dtype])


# -------------------------------------------------------------------------------------------- KV cache

def _paged(ctx_lens: list[int], hkv: int, d: int, block: int, dtype: torch.dtype, int8: bool, seed: int = 0):
    """A cache holding random K/V for sequences of ctx_lens tokens, in shuffled blocks, written by the
    reference; returns (k_cache, v_cache, k_scale, v_scale, block_tables)."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-c // block) for c in ctx_lens) + 1
    n_blocks = sum(-(-c // block) for c in ctx_lens) + 3
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.int32)
    store = torch.int8 if int8 else dtype
    kc = torch.zeros(n_blocks, block, hkv, d, dtype=store)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(n_blocks, block, hkv, reference.k_scale_groups(d)) if int8 else None
    vs = torch.zeros(n_blocks, block, hkv, reference.v_scale_groups(d)) if int8 else None
    used = 0
    for b, c in enumerate(ctx_lens):
        nb = -(-c // block)
        tables[b, :nb] = torch.tensor(perm[used:used + nb], dtype=torch.int32)
        used += nb
        slots = torch.tensor([int(tables[b, p // block]) * block + p % block for p in range(c)], dtype=torch.int64)
        k = torch.randn(c, hkv, d, generator=g).to(dtype)
        v = torch.randn(c, hkv, d, generator=g).to(dtype)
        reference.write_kv(k, v, kc, vc, slots, ks, vs)
    return kc, vc, ks, vs, tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("int8", [False, True])
def test_write_kv(dtype: torch.dtype, int8: bool) -> None:
    torch.manual_seed(0)
    n, s, h, d, t = 4, 8, 2, 64, 7  # int8: two key scales per head (groups of 32 channels), one value scale
    k = (3 * torch.randn(t, h, d)).to(dtype)
    v = torch.randn(t, h, d).to(dtype)
    k[2, 1] = 0  # all-zero head: the scale clamps to 1e-6 / 127
    k[4, 0, 32:] = 0  # one all-zero group beside a nonzero one
    k[3, 0, 5] = 127 * 0.5 / 127  # exact halves exercise round-half-to-even
    k[6, 1, 40] = 50.0  # an outlier channel: its group's scale only
    slots = torch.tensor([0, 5, -1, 9, 31, -1, 17], dtype=torch.int64)
    store = torch.int8 if int8 else dtype
    caches = [torch.full((n, s, h, d), 3, dtype=store) for _ in range(4)]
    scales = [torch.full((n, s, h, g), -1.0) if int8 else None for g in (2, 1, 2, 1)]  # K: 2 groups, V: 1
    ops.write_kv(k, v, caches[0], caches[1], slots, scales[0], scales[1])
    reference.write_kv(k, v, caches[2], caches[3], slots, scales[2], scales[3])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    if int8:
        assert torch.equal(scales[0], scales[2]) and torch.equal(scales[1], scales[3])


def test_write_kv_int8_exact_on_ties() -> None:
    # values that land exactly on .5 after scaling: amax 127 -> scale 1.0
    k = torch.tensor([[[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.49, -126.5]]])
    kc, vc = torch.zeros(1, 2, 1, 8, dtype=torch.int8), torch.zeros(1, 2, 1, 8, dtype=torch.int8)
    ks, vs = torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1, 1)
    ops.write_kv(k, k, kc, vc, torch.tensor([1]), ks, vs)
    want, scale = reference.quantize_kv_int8(k)
    assert torch.equal(kc[0, 1], want[0]) and torch.equal(ks[0, 1], scale[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("d", [64, 96])  # 96: odd half (48) and a key scale group (32..63) across both halves
def test_rope_write_kv_equals_rope_then_write_kv(d: int, int8: bool, dtype: torch.dtype) -> None:
    """One launch on q, k, v split from one qkv row, as the model splits it: q and k end as after rope
    (bit for bit as after ops.rope), v untouched, and the caches (int8 data and scales too) equal
    reference.rope then reference.write_kv run on a clone, bit for bit; -1 slots are not written but
    their q and k are still rotated."""
    torch.manual_seed(0)
    hq, hk, t, n, s = 6, 3, 7, 4, 8
    qkv = (3 * torch.randn(t, (hq + 2 * hk) * d)).to(dtype)
    qkv[3, (hq + 1) * d:(hq + 2) * d] = 0  # an all-zero key head: its int8 scales clamp to 1e-6 / 127
    pos = torch.tensor([0, 1, 2, 7, 8, 30, 63])
    slots = torch.tensor([0, 5, -1, 9, 31, -1, 17], dtype=torch.int64)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    f = torch.outer(torch.arange(64, dtype=torch.float64), inv)
    cs = torch.cat((f.cos(), f.sin()), -1).float()
    store = torch.int8 if int8 else dtype
    groups = (reference.k_scale_groups(d), reference.v_scale_groups(d))
    runs = []
    for fused in (True, False):
        buf = qkv.clone()
        q, k, v = (x.reshape(t, -1, d) for x in buf.split([hq * d, hk * d, hk * d], dim=-1))
        caches = [torch.full((n, s, hk, d), 3, dtype=store) for _ in range(2)]
        scales = [torch.full((n, s, hk, g), -1.0) if int8 else None for g in groups]
        if fused:
            ops.rope_write_kv(q, k, v, pos, cs, *caches, slots, *scales)
        else:
            reference.rope(q, k, pos, cs)
            reference.write_kv(k, v, *caches, slots, *scales)
        runs.append((buf, caches, scales))
    (got, got_c, got_s), (want, want_c, want_s) = runs
    torch.testing.assert_close(got, want, **TOL[dtype])
    rope_only = qkv.clone()
    ops.rope(rope_only[:, :hq * d].view(t, hq, d), rope_only[:, hq * d:(hq + hk) * d].view(t, hk, d), pos, cs)
    assert torch.equal(got, rope_only)
    assert torch.equal(got_c[0], want_c[0]) and torch.equal(got_c[1], want_c[1])
    if int8:
        assert torch.equal(got_s[0], want_s[0]) and torch.equal(got_s[1], want_s[1])


# ------------------------------------------------------------------------------------------- attention

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 1)])
def test_attention_decode(dtype: torch.dtype, int8: bool, hq: int, hkv: int) -> None:
    torch.manual_seed(0)
    d, block = (64 if int8 else 32), 8  # int8: two key scale groups per head
    ctx = [1, 13, 40]
    kc, vc, ks, vs, tables = _paged(ctx, hkv, d, block, dtype, int8)
    q = torch.randn(len(ctx), hq, d).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32)
    want = reference.attention_decode(q, kc, vc, tables, lens, d ** -0.5, ks, vs)
    for splits in (1, 3):
        got = tattn.attention_decode(q, kc, vc, tables, lens, d ** -0.5, ks, vs, num_splits=splits)
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("d", [96, 48])
def test_int8_attention_reads_scale_groups_that_leave_the_padded_head_or_are_not_powers_of_two(d: int) -> None:
    """96 channels: three 32-channel key groups in a 128-wide tile (the fourth masked) and a 96-channel value
    scale, read a channel at a time; 48: one scale a head for both (48 % 32 != 0). Decode and prefill."""
    torch.manual_seed(5)
    hq, hkv = 4, 2
    ctx = [1, 19, 40]
    kc, vc, ks, vs, tables = _paged(ctx, hkv, d, 8, torch.float32, True, seed=6)
    lens = torch.tensor(ctx, dtype=torch.int32)
    q = torch.randn(len(ctx), hq, d)
    want = reference.attention_decode(q, kc, vc, tables, lens, d ** -0.5, ks, vs)
    torch.testing.assert_close(tattn.attention_decode(q, kc, vc, tables, lens, d ** -0.5, ks, vs), want,
                               **TOL[torch.float32])
    cu = torch.tensor([0, 1, 3, 5], dtype=torch.int32)
    qp = torch.randn(5, hq, d)
    torch.testing.assert_close(tattn.attention_prefill(qp, kc, vc, tables, cu, lens, d ** -0.5, ks, vs),
                               reference.attention_prefill(qp, kc, vc, tables, cu, lens, d ** -0.5, ks, vs),
                               **TOL[torch.float32])


def test_attention_decode_default_splits_and_strided_q() -> None:
    torch.manual_seed(1)
    hq, hkv, d = 4, 1, 64
    kc, vc, _, _, tables = _paged([70, 5], hkv, d, 16, torch.float32, False, seed=3)
    qkv = torch.randn(2, (hq + 2 * hkv) * d)
    q = qkv[:, :hq * d].view(2, hq, d)  # a view into the fused qkv projection
    lens = torch.tensor([70, 5], dtype=torch.int32)
    got = ops.attention_decode(q, kc, vc, tables, lens, 0.125)
    want = reference.attention_decode(q, kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype,int8", [(torch.float16, True), (torch.float32, False)])
def test_attention_decode_splits_merge_in_split_order(dtype: torch.dtype, int8: bool) -> None:
    """8 splits of 16 tokens over contexts of 1, 13 and 40 tokens (most splits empty) and 3 splits:
    the reference's values, and two calls agree bit for bit."""
    torch.manual_seed(2)
    hq, hkv, d = 4, 2, (64 if int8 else 32)
    ctx = [1, 13, 40]
    kc, vc, ks, vs, tables = _paged(ctx, hkv, d, 8, dtype, int8, seed=4)
    q = torch.randn(len(ctx), hq, d).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32)
    want = reference.attention_decode(q, kc, vc, tables, lens, d ** -0.5, ks, vs)
    for splits in (3, 8):
        got = [tattn.attention_decode(q, kc, vc, tables, lens, d ** -0.5, ks, vs, num_splits=splits)
               for _ in range(2)]
        torch.testing.assert_close(got[0], want, **TOL[dtype])
        assert torch.equal(got[0], got[1]), splits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("int8", [False, True])
def test_attention_prefill_with_cached_prefix(dtype: torch.dtype, int8: bool) -> None:
    torch.manual_seed(0)
    hq, hkv, d, block = 4, 2, (64 if int8 else 32), 8  # int8: two key scale groups per head
    ctx = [19, 5, 12, 33]  # cached prefix + new tokens
    new = [19, 3, 0, 20]  # a full prompt, two chunks with a prefix, and a sequence without new tokens
    kc, vc, ks, vs, tables = _paged(ctx, hkv, d, block, dtype, int8, seed=2)
    cu = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(new), hq, d).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32)
    want = reference.attention_prefill(q, kc, vc, tables, cu, lens, d ** -0.5, ks, vs)
    got = tattn.attention_prefill(q, kc, vc, tables, cu, lens, d ** -0.5, ks, vs)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("int8", [False, True])
def test_attention_prefill_gqa_odd_group_and_head_dim(int8: bool) -> None:
    torch.manual_seed(0)
    hq, hkv, d, block = 6, 2, 40, 4  # group 3, head_dim not a power of two (int8: nor a multiple of 32)
    ctx, new = [9, 17], [9, 6]
    kc, vc, ks, vs, tables = _paged(ctx, hkv, d, block, torch.float32, int8, seed=5)
    cu = torch.tensor([0, new[0], new[0] + new[1]], dtype=torch.int32)
    q = torch.randn(sum(new), hq, d)
    lens = torch.tensor(ctx, dtype=torch.int32)
    want = reference.attention_prefill(q, kc, vc, tables, cu, lens, 0.2, ks, vs)
    got = tattn.attention_prefill(q, kc, vc, tables, cu, lens, 0.2, ks, vs, block_m=16)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


# -------------------------------------------------------------------------------------------- sampling

def test_sampling_uniform_bit_exact() -> None:
    seeds = torch.tensor([0, 1, 2**31 + 5, -7, 2**40 + 3], dtype=torch.int64)
    offsets = torch.tensor([0, 9, 2**32 - 1, 3, 123456], dtype=torch.int64)
    got = tsamp.sampling_uniform(seeds, offsets, 1000)
    want = reference.sampling_uniform(seeds, offsets, 1000)
    assert torch.equal(got, want)


def test_sample_matches_reference() -> None:
    torch.manual_seed(0)
    b, v = 6, 500
    logits = torch.randn(b, v) * 3
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0, 0.9])
    top_k = torch.tensor([0, 0, 20, 5, 3, 0])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 0.3])
    seeds = torch.tensor([1, 2, 3, 4, 5, 6])
    for step in range(3):
        offsets = torch.full((b,), step)
        got = ops.sample(logits, temperature, top_k, top_p, seeds, offsets)
        want = reference.sample(logits, temperature, top_k, top_p, seeds, offsets)
        assert torch.equal(got, want)
        for i in range(b):  # and each draw is one the settings allow (an independent statement of them)
            if temperature[i] > 0:
                ids, _ = allowed_tokens(logits[i].numpy(), temperature[i].item(), int(top_k[i]), top_p[i].item())
                assert got[i].item() in ids.tolist(), (i, got[i].item(), ids.tolist())
    assert got[0].item() == logits[0].argmax().item() and got[4].item() == logits[4].argmax().item()
    greedy = torch.zeros(b)
    half = logits.half()
    assert ops.sample(half, greedy, top_k, top_p, seeds, offsets).tolist() == half.float().argmax(-1).tolist()


# ----------------------------------------------------------------------------------------- whole model

def test_llama_forward_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny random Llama on the Triton ops (strided q/k/v views of the fused qkv, int8 KV, a prefill
    with two sequences, then a decode step) against the same model on the reference ops."""
    import edged.kernels as kernels
    from edged.models.batch import AttentionMetadata, KVCache
    from edged.models.config import ModelConfig
    from edged.models.llama import LayerWeights, LlamaModel, LlamaWeights

    cfg = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(0)

    def lin(n: int, k: int, fmt: str) -> LinearWeight:
        dense = torch.randn(n, k, generator=g) * 0.1
        return LinearWeight("dense", dense) if fmt == "dense" else quantize_w8(dense) if fmt == "w8" \
            else quantize_w4(dense, 32)

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(64, generator=g)

    layers = [LayerWeights(norm(), lin(128, 64, "w4"), lin(64, 64, "w8"), norm(), lin(192, 64, "dense"),
                           lin(64, 96, "w4")) for _ in range(2)]
    model = LlamaModel(cfg, LlamaWeights(torch.randn(50, 64, generator=g), layers, norm(), lin(50, 64, "w8")),
                       max_positions=64)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    ids = torch.randint(0, 50, (13,), generator=g)
    pos = torch.tensor(list(range(9)) + list(range(4)))
    slots = torch.tensor([p for p in range(9)] + [4 * 8 - 8 + p for p in range(4)])  # block 3 starts at slot 24
    prefill = AttentionMetadata(False, slots, tables, torch.tensor([9, 4], dtype=torch.int32),
                                torch.tensor([0, 9, 13], dtype=torch.int32))
    decode = AttentionMetadata(True, torch.tensor([9, 28]), tables, torch.tensor([10, 5], dtype=torch.int32),
                               torch.tensor([0, 1, 2], dtype=torch.int32))
    for int8 in (False, True):
        outs = []
        for backend in (reference, ops):
            monkeypatch.setattr(kernels, "backend_for", lambda t, b=backend: b)
            kv = KVCache.allocate(2, 6, 8, 2, 16, torch.float32, "cpu", int8=int8)
            h1 = model.forward(ids, pos, prefill, kv)
            h2 = model.forward(ids[[8, 12]], torch.tensor([9, 4]), decode, kv)
            outs.append(torch.cat([model.logits(h1), model.logits(h2)]))
        torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=2e-4)
