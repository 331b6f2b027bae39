"""`linear` on the GPU: y = x @ W^T + b for dense, w8 and w4 weights, dequantizing inside the loop.

Paths, by the number of rows M of x:
- M == 1 (decode of one sequence): a GEMV; each program streams up to 4 weight rows against one x
  tile, optionally split over K (partials in float32, summed in split order by the last split of
  each row block to arrive: deterministic, one launch; kernels/triton_counters.py). This is the
  memory-bound path that must run at DRAM bandwidth. A w8 / w4 chunk (16 weights of one group) is
  reduced in float32 as scale * sum(x * q) + minimum * sum(x): one FMA a weight, one accumulator a
  chunk (sum(x) once for all rows of the program), q read as the float "magic + q" that a byte or
  nibble makes under an exponent, the constant taken off once a chunk (kernels/triton_convert.py;
  on sm_80+ through inline PTX, the same floats in fewer instructions). Small
  GEMVs also take the RMSNorm or the SiLU of their input in their prologue, or (a [gate | up] weight)
  make silu(gate) * up in their epilogue, each program taking gate rows and the matching up rows;
  every GEMV can add the residual in its epilogue.
- M = 2-3 (where rows are short: w8 to 4, w4 to 8), w8 and w4: the GEMV of several x rows (_gemv_x_rows_kernel, up to 8
  a launch; _gemv_w4_x_rows_kernel, up to 4), each weight converted once and summed against every row of
  x, each row's result the one-row GEMV's bit for bit.
- Otherwise M > 1, w8 / w4: a tiled tl.dot kernel with dequantization in the loop, split over K while
  the output tiles alone cannot fill the GPU (decode batches); grouped w8 batches of 4-128
  rows take the weight tile as the dot's first operand (_matmul_kernel's SWAP), except 4-16 rows of
  long rows (K > SHORT_K), which keep the plain form and make bytes floats by PTX (ASM); w4 takes the
  swap form at 9-16 short rows. Dense weights from M = 2 on go to cuBLAS.
  Split K, both sum their float32 partials in split order in a kernel after them, which in models of short
  rows (SmolLM2) also makes silu(gate) * up of a [gate | up] weight, and the norm after an output
  projection (linear_add_norm): two kernels a layer fewer.
  Both dequantize their weight tile in float32 (q * scale + minimum per group) and round it to the
  activation dtype for the dot; a w8 row that is one group (in_features not a multiple of 32) dots
  the raw q (exact in any dtype) and applies scale * dot + minimum * sum(x) after the K loop.

Byte j of a w4 row holds columns 2j (low nibble) and 2j+1 (high nibble); the group of both is
(2j) // group_size. They are never interleaved in registers: the kernels multiply the low nibbles
with x[0::2] and the high ones with x[1::2].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .triton_convert import (asm_conversions, magic_nibbles_f32, magic_nibbles_f32_asm, magic_u8_f32,
                             magic_u8_f32_asm, small_uint_to_f32)
from .triton_activation import silu_and_mul
from .triton_counters import arrive, check_groups, split_counters
from .triton_norm import norm_warps, rms_norm, rms_row
from .reference import check_silu_mul_out
from .triton_pdl import pdl_begin, pdl_launch
from .weights import LinearWeight

_FORMATS = {"dense": 0, "w8": 1, "w4": 2}


@triton.jit
def _rows_result(y0, y1, y2, y3):
    """The ROWS (<= 4) row results as one vector, for a masked vector store."""
    r = tl.arange(0, 4)
    y = tl.where(r == 0, y0, 0.0)
    y = tl.where(r == 1, y1, y)
    y = tl.where(r == 2, y2, y)
    return tl.where(r == 3, y3, y)


@triton.jit
def _epilogue(y, n_ld, mask, out_ptrs, bias_ptr, res_ptrs, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr):
    """Bias, the result rounded once to the output dtype, then (RESIDUAL) the residual stream's add,
    rounded again: what linear followed by the residual add of rms_norm computes, in one store."""
    bias, res = _epilogue_inputs(n_ld, mask, bias_ptr, res_ptrs, HAS_BIAS, RESIDUAL)
    _epilogue_store(y, mask, out_ptrs, bias, res, HAS_BIAS, RESIDUAL)


@triton.jit
def _epilogue_inputs(n_ld, mask, bias_ptr, res_ptrs, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr):
    """_epilogue's bias and residual values (float32; 0.0 where the form has none)."""
    bias = 0.0
    res = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + n_ld).to(tl.float32)
    if RESIDUAL:
        res = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
    return bias, res


@triton.jit
def _epilogue_store(y, mask, out_ptrs, bias, res, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr):
    """_epilogue on values loaded beforehand (the decode GEMV loads them before its PDL wait)."""
    tl.store(out_ptrs, _epilogue_value(y, bias, res, out_ptrs.dtype.element_ty, HAS_BIAS, RESIDUAL), mask=mask)


@triton.jit
def _epilogue_value(y, bias, res, dtype: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr):
    """What _epilogue_store stores: y + bias rounded to dtype, then + res rounded again."""
    if HAS_BIAS:
        y += bias
    yo = y.to(dtype)
    if RESIDUAL:
        yo = (yo.to(tl.float32) + res).to(dtype)
    return yo


@triton.jit
def _gemv_rows(pid_n, N, ROWS: tl.constexpr, GATED: tl.constexpr):
    """The weight rows (i0..i3, clamped to valid rows) of GEMV program pid_n, and their output indices
    as a 4-vector (N where a slot is unused: masked). GATED: the rows are [gate | up] halves and the
    program takes ROWS // 2 gate rows and the up rows of the same outputs."""
    r = tl.arange(0, 4)
    if GATED:
        half = N // 2
        n0 = pid_n * (ROWS // 2)
        g = n0 + r % (ROWS // 2)  # slots: gates, then their ups
        idx = tl.where(r < ROWS // 2, g, half + g)
        idx = tl.where((r < ROWS) & (g < half), idx, N)
        i0 = tl.minimum(n0, half - 1)
        if ROWS == 2:
            i1 = half + i0
            i2 = i0
            i3 = i0
        else:
            i1 = tl.minimum(n0 + 1, half - 1)
            i2 = half + i0
            i3 = half + i1
    else:
        n0 = pid_n * ROWS
        idx = tl.where(r < ROWS, n0 + r, N)
        i0 = tl.minimum(n0, N - 1)
        i1 = tl.minimum(n0 + 1, N - 1)
        i2 = tl.minimum(n0 + 2, N - 1)
        i3 = tl.minimum(n0 + 3, N - 1)
    return i0.to(tl.int64), i1.to(tl.int64), i2.to(tl.int64), i3.to(tl.int64), idx


@triton.jit
def _row_ptrs(base, i0, i1, i2, i3, stride):
    """Pointers to rows i0..i3 of a row-major tensor (weights, scales, minimums)."""
    return base + i0 * stride, base + i1 * stride, base + i2 * stride, base + i3 * stride


@triton.jit
def _program_rows(pid_n, N, w_ptr, scale_ptr, min_ptr, stride_wn, stride_sn, ROWS: tl.constexpr, GATED: tl.constexpr):
    """GEMV program pid_n's output indices (_gemv_rows) and pointers to its weight, scale and minimum rows
    (slots past ROWS point at valid rows and go unused)."""
    i0, i1, i2, i3, n = _gemv_rows(pid_n, N, ROWS, GATED)
    r0, r1, r2, r3 = _row_ptrs(w_ptr, i0, i1, i2, i3, stride_wn)
    s0, s1, s2, s3 = _row_ptrs(scale_ptr, i0, i1, i2, i3, stride_sn)
    m0, m1, m2, m3 = _row_ptrs(min_ptr, i0, i1, i2, i3, stride_sn)
    return n, r0, r1, r2, r3, s0, s1, s2, s3, m0, m1, m2, m3


@triton.jit
def _gated_epilogue(y, idx, N, pid_n, bias_ptr, out_ptr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr):
    """silu(gate) * up of the program's ROWS // 2 outputs from its [gates, ups] row results: each rounded
    to the output dtype first (linear's output), as silu_and_mul reads them."""
    if HAS_BIAS:
        y += tl.load(bias_ptr + tl.minimum(idx, N - 1)).to(tl.float32)
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    r = tl.arange(0, 4)
    g0 = tl.sum(tl.where(r == 0, y, 0.0), axis=0)
    u0 = tl.sum(tl.where(r == ROWS // 2, y, 0.0), axis=0)
    o = tl.where(r == 0, _silu_mul(g0, u0), 0.0)
    if ROWS == 4:
        g1 = tl.sum(tl.where(r == 1, y, 0.0), axis=0)
        u1 = tl.sum(tl.where(r == 3, y, 0.0), axis=0)
        o = tl.where(r == 1, _silu_mul(g1, u1), o)
    n = pid_n * (ROWS // 2) + r
    tl.store(out_ptr + n, o.to(out_ptr.dtype.element_ty), mask=(r < ROWS // 2) & (idx < N))


@triton.jit
def _gemv_store(y, n, N, pid_n, pid_k, num_splits, bias_ptr, out_ptr, part_ptr, counters_ptr, bias, res,
                HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr,
                ROWS: tl.constexpr):
    """The row results y at output indices n (_gemv_rows), summed over K splits by the last split to
    arrive, through the epilogue: _epilogue's (bias, res: _gemv_epilogue_inputs' values), or GATED's
    silu(gate) * up."""
    mask = n < N
    n_ld = tl.minimum(n, N - 1)
    if SPLIT:
        # partials in float32; the last split of this row block sums them in split order
        tl.store(part_ptr + pid_k * N + n, y, mask=mask)
        if arrive(counters_ptr, pid_n, num_splits):
            acc = tl.zeros_like(y)
            for s in range(num_splits):
                acc += tl.load(part_ptr + s * N + n_ld, cache_modifier=".cg")
            if GATED:
                _gated_epilogue(acc, n, N, pid_n, bias_ptr, out_ptr, HAS_BIAS, ROWS)
            else:
                _epilogue_store(acc, mask, out_ptr + n, bias, res, HAS_BIAS, RESIDUAL)
    elif GATED:
        _gated_epilogue(y, n, N, pid_n, bias_ptr, out_ptr, HAS_BIAS, ROWS)
    else:
        _epilogue_store(y, mask, out_ptr + n, bias, res, HAS_BIAS, RESIDUAL)


@triton.jit
def _gemv_epilogue_inputs(n, N, bias_ptr, res_ptr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                          GATED: tl.constexpr):
    """The bias and residual at output indices n, for _gemv_store, loaded before the PDL wait, off the
    chain of loads after the row reduction (GATED loads its bias in its own epilogue)."""
    n_ld = tl.minimum(n, N - 1)
    return _epilogue_inputs(n_ld, n < N, bias_ptr, res_ptr + n_ld, HAS_BIAS and not GATED, RESIDUAL)


@triton.jit
def _round_as(v, dtype: tl.constexpr):
    """v (float32) rounded to the activation dtype and back: an op's output as the next op reads it."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def _rms_inv(x_ptr, K, eps, BLOCK: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) over the K values of one row (the prologue of a norm-fused GEMV)."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        c = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + c, mask=c < K, other=0.0).to(tl.float32)
        acc += v * v
    return tl.rsqrt(tl.sum(acc, axis=0) / K + eps)


@triton.jit
def _silu_mul(g, u):
    """silu(g) * u in float32, triton_activation's formula."""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _quarters(v, C: tl.constexpr, V: tl.constexpr):
    """A [C, V] tile as four [C, V // 4] tiles of the same thread's registers (a free reshape)."""
    a, b = tl.split(tl.reshape(v, (C, V // 4, 2, 2)))
    v0, v1 = tl.split(a)
    v2, v3 = tl.split(b)
    return v0, v1, v2, v3


@triton.jit
def _chunk_dot(q0, q1, q2, q3, x0, x1, x2, x3):
    """sum over each chunk of q * x: a multiply and three FMAs for every four weights, then a sum of
    four (tl.sum of the products would be an add tree: a multiply and an add for every weight)."""
    return tl.sum(q0 * x0 + q1 * x1 + q2 * x2 + q3 * x3, axis=1)


@triton.jit
def _load_row(row_ptr, s_row_ptr, m_row_ptr, k, grp, km, cm, FORMAT: tl.constexpr, EVEN_K: tl.constexpr,
              SYM: tl.constexpr):
    """One weight row's step: its [chunks, VEC] weights, and (w8) each chunk's scale and minimum (SYM: no
    minimum stored, the scale stands in for it)."""
    if EVEN_K:
        wv = tl.load(row_ptr + k, eviction_policy="evict_first")
    else:
        wv = tl.load(row_ptr + k, mask=km, other=0, eviction_policy="evict_first")
    if FORMAT == 1:
        if EVEN_K:
            s = tl.load(s_row_ptr + grp).to(tl.float32)
        else:
            s = tl.load(s_row_ptr + grp, mask=cm, other=0.0).to(tl.float32)
        mn = s
        if not SYM:
            if EVEN_K:
                mn = tl.load(m_row_ptr + grp).to(tl.float32)
            else:
                mn = tl.load(m_row_ptr + grp, mask=cm, other=0.0).to(tl.float32)
        return wv, s, mn
    else:
        return wv, 0.0, 0.0


@triton.jit
def _dot_loaded(acc, wv, s, mn, x0, x1, x2, x3, xsum, magic_xsum, FORMAT: tl.constexpr, C: tl.constexpr,
                VEC: tl.constexpr, ASM: tl.constexpr, EXACT: tl.constexpr, SYM: tl.constexpr):
    """acc [chunks] += the dot of one weight row's loaded step (_load_row) with x (x0..x3: its quarters).
    A w8 chunk lies in one group, so sum(x * (q * scale + minimum)) is computed as scale * sum(x * q) +
    minimum * sum(x) (xsum: the chunk sums of x, shared by every row): one FMA a weight instead of two,
    and one accumulator a chunk instead of one a column, which leaves registers for more loads in flight.
    q comes as the float 32768 + q (ASM: magic_u8_f32_asm, one prmt a byte), its constant taken off
    once a chunk (magic_xsum = 32768 * xsum): no conversion or subtraction a weight. The constant is
    ~256x a typical q, so the dot loses ~8 of float32's 24 bits: about 1/8 ulp of a bfloat16 result
    (up to 2 ulps of a float16 one). So only bfloat16 takes it; float16, float32 and float32 results
    (EXACT: the logits) take the constant off each weight instead (exact; one add a weight).
    SYM (GGUF Q8_0: w = (q - 128) * scale, no minimum): the 128 leaves with the constant, 32896 = 32768 + 128,
    and the dot is only scaled."""
    q0, q1, q2, q3 = _weight_floats(wv, FORMAT, C, VEC, ASM, EXACT, SYM)
    return _chunk_sums(acc, q0, q1, q2, q3, s, mn, x0, x1, x2, x3, xsum, magic_xsum, FORMAT, EXACT, SYM)


@triton.jit
def _weight_floats(wv, FORMAT: tl.constexpr, C: tl.constexpr, VEC: tl.constexpr, ASM: tl.constexpr,
                   EXACT: tl.constexpr, SYM: tl.constexpr):
    """One weight row's loaded step as the floats _dot_loaded multiplies (its quarters): w8 as magic + q
    (EXACT: q, or q - 128 where SYM), dense as they are."""
    if FORMAT == 1:
        if ASM:
            q = magic_u8_f32_asm(wv)
        else:
            q = magic_u8_f32(wv)
        if EXACT:
            q -= 32896.0 if SYM else 32768.0
        return _quarters(q, C, VEC)
    else:
        return _quarters(wv.to(tl.float32), C, VEC)


@triton.jit
def _chunk_sums(acc, q0, q1, q2, q3, s, mn, x0, x1, x2, x3, xsum, magic_xsum, FORMAT: tl.constexpr,
                EXACT: tl.constexpr, SYM: tl.constexpr):
    """acc [chunks] += one row's _weight_floats against x's quarters, through _dot_loaded's w8 algebra."""
    dot = _chunk_dot(q0, q1, q2, q3, x0, x1, x2, x3)
    if FORMAT == 1:
        if not EXACT:
            dot -= magic_xsum
            if SYM:
                dot -= 128.0 * xsum
        if SYM:
            return acc + dot * s
        return acc + dot * s + xsum * mn
    else:
        return acc + dot


@triton.jit
def _norm_weights(nw_ptr, k, km, NORM: tl.constexpr):
    """The norm weight at one step's columns k (NORM), loaded apart from x: for the first step, before
    the PDL wait (a weight, never written during a step)."""
    nwv = 0.0
    if NORM:
        nwv = tl.load(nw_ptr + k, mask=km, other=0.0)
    return nwv


@triton.jit
def _x_step(x_ptr, nwv, K, k, km, inv, dt: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr,
            EVEN_K: tl.constexpr, C: tl.constexpr, VEC: tl.constexpr, QUARTER_XSUM: tl.constexpr,
            MMA: tl.constexpr):
    """x at one step's columns k, through the fused prologue (NORM: nwv the step's _norm_weights; SILU):
    its quarters, its chunk sums (QUARTER_XSUM: summed from the quarters, quarter_xsum), and 32768 times them
    (the w8 constant's share). MMA: x's columns in the order of weights stored in the MMA order (w8, VEC 16)."""
    if EVEN_K:
        xv = tl.load(x_ptr + k).to(tl.float32)
    else:
        xv = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
    if NORM:
        xv = _round_as(nwv.to(tl.float32) * (xv * inv), dt)
    if SILU:
        xv = _round_as(_silu_mul(xv, tl.load(x_ptr + K + k, mask=km, other=0.0).to(tl.float32)), dt)
    if QUARTER_XSUM:
        q0, q1, q2, q3 = _quarters(xv, C, VEC)
        xsum = tl.sum(q0 + q1 + q2 + q3, axis=1)
    else:
        xsum = tl.sum(xv, axis=1)
    if MMA:  # after the sums, which do not depend on the order (Triton 3.6 summed the permuted x by 28 more FADDs)
        xv = _mma_order_columns(xv, C, 16)
    x0, x1, x2, x3 = _quarters(xv, C, VEC)
    return x0, x1, x2, x3, xsum, xsum * 32768.0  # the last unused (and not computed) where EXACT


@triton.jit
def _mma_order_columns(v, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] columns in the MMA order (kernels/weights.py MMA_COLUMNS): position 4c + 2b + d of every 16 takes
    column 8b + 2c + d. Where a thread holds a 16-column chunk whole (the GEMVs' VEC), this only renames registers."""
    return tl.reshape(tl.permute(tl.reshape(v, (ROWS, COLS // 16, 2, 4, 2)), (0, 1, 3, 2, 4)), (ROWS, COLS))


@triton.jit
def _natural_columns(w, ROWS: tl.constexpr, COLS: tl.constexpr):
    """A [ROWS, COLS] tile of weights stored in the MMA order with its columns back in order: column 8b + 2c + d of
    every 16 takes stored position 4c + 2b + d. Where the tile is the swap form's register operand, a thread's 4
    bytes of each 16 columns then come from shared memory as one word (ldmatrix), not as two halves."""
    return tl.reshape(tl.permute(tl.reshape(w, (ROWS, COLS // 16, 4, 2, 2)), (0, 1, 3, 2, 4)), (ROWS, COLS))


@triton.jit
def _split_columns(pid_k, k_per_split, K, C: tl.constexpr, VEC: tl.constexpr):
    """A GEMV program's K split: each chunk's first column, a step's columns [C, VEC] from 0, and the
    split's columns [k_lo, k_hi) (splits are never empty: k_lo < k_hi)."""
    chunk = tl.arange(0, C) * VEC
    k_lo = pid_k * k_per_split
    return chunk, chunk[:, None] + tl.arange(0, VEC)[None, :], k_lo, tl.minimum(k_lo + k_per_split, K)


@triton.jit
def _step_columns(k0, k_hi, col, chunk, GROUP_SIZE: tl.constexpr):
    """A K step from column k0: its columns [chunks, VEC] and their mask, each chunk's group and mask."""
    k = k0 + col
    return k, k < k_hi, (k0 + chunk) // GROUP_SIZE, k0 + chunk < k_hi


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr, nw_ptr, res_ptr, eps,
                 N, K, k_per_split, num_splits, stride_wn, stride_sn, FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SPLIT: tl.constexpr, EVEN_K: tl.constexpr, GROUP_SIZE: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_K: tl.constexpr, VEC: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr,
                 RESIDUAL: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, GATED: tl.constexpr,
                 EXACT: tl.constexpr, SYM: tl.constexpr, QUARTER_XSUM: tl.constexpr, MMA: tl.constexpr):
    """One row of x against ROWS (1, 2 or 4) rows of dense or w8 weights (SYM: w8 without minimums);
    program (row block, k split). Each step loads one [BLOCK_K // VEC, VEC] tile of x (a thread owns VEC
    consecutive columns, one 16-byte weight load) and uses it for every weight row: x is read and
    converted once per ROWS rows, all tiles share one layout (no shuffles), and each thread keeps ROWS
    independent loads in flight. Accumulation is elementwise; the reduction happens once at the end. A w8 chunk of VEC
    columns lies inside one group (GROUP_SIZE is a multiple of VEC, or the whole row): one scale and
    one minimum per chunk and row.
    The first step's weights load before the wait on the previous kernel (pdl_begin): weights are
    never written during a step, and under PDL their latency then overlaps that kernel's tail instead
    of following it (a small layer is a single step: all its weights).
    Fused around it (decode of one sequence): NORM, x is RMSNorm(x) * nw (inverse RMS over the whole
    row first); SILU, x holds [gate | up] (2K values) and is silu(gate) * up; each rounded to the
    activation dtype as its own op would be. RESIDUAL adds res to the rounded result (_epilogue);
    GATED, the weight holds [gate | up] rows and the output is silu(gate) * up (_gated_epilogue)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # rows past N are clamped to valid rows (valid loads) and masked at the store
    n, r0, r1, r2, r3, s0, s1, s2, s3, m0, m1, m2, m3 = _program_rows(pid_n, N, w_ptr, scale_ptr, min_ptr, stride_wn,
                                                                       stride_sn, ROWS, GATED)
    C: tl.constexpr = BLOCK_K // VEC
    chunk, col, k_lo, k_hi = _split_columns(pid_k, k_per_split, K, C, VEC)
    a0 = tl.zeros([C], dtype=tl.float32)
    a1 = tl.zeros([C], dtype=tl.float32)
    a2 = tl.zeros([C], dtype=tl.float32)
    a3 = tl.zeros([C], dtype=tl.float32)
    dt = x_ptr.dtype.element_ty
    k, km, grp, cm = _step_columns(k_lo, k_hi, col, chunk, GROUP_SIZE)
    w0, sc0, mn0 = _load_row(r0, s0, m0, k, grp, km, cm, FORMAT, EVEN_K, SYM)
    if ROWS > 1:
        w1, sc1, mn1 = _load_row(r1, s1, m1, k, grp, km, cm, FORMAT, EVEN_K, SYM)
    if ROWS > 2:
        w2, sc2, mn2 = _load_row(r2, s2, m2, k, grp, km, cm, FORMAT, EVEN_K, SYM)
        w3, sc3, mn3 = _load_row(r3, s3, m3, k, grp, km, cm, FORMAT, EVEN_K, SYM)
    bias, res = _gemv_epilogue_inputs(n, N, bias_ptr, res_ptr, HAS_BIAS, RESIDUAL, GATED)
    nwv = _norm_weights(nw_ptr, k, km, NORM)
    pdl_begin(PDL)
    inv = 1.0
    if NORM:
        inv = _rms_inv(x_ptr, K, eps, BLOCK_K)
    x0, x1, x2, x3, xsum, magic_xsum = _x_step(x_ptr, nwv, K, k, km, inv, dt, NORM, SILU, EVEN_K, C, VEC, QUARTER_XSUM,
                                               MMA)
    a0 = _dot_loaded(a0, w0, sc0, mn0, x0, x1, x2, x3, xsum, magic_xsum, FORMAT, C, VEC, ASM, EXACT, SYM)
    if ROWS > 1:
        a1 = _dot_loaded(a1, w1, sc1, mn1, x0, x1, x2, x3, xsum, magic_xsum, FORMAT, C, VEC, ASM, EXACT, SYM)
    if ROWS > 2:
        a2 = _dot_loaded(a2, w2, sc2, mn2, x0, x1, x2, x3, xsum, magic_xsum, FORMAT, C, VEC, ASM, EXACT, SYM)
        a3 = _dot_loaded(a3, w3, sc3, mn3, x0, x1, x2, x3, xsum, magic_xsum, FORMAT, C, VEC, ASM, EXACT, SYM)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k, km, grp, cm = _step_columns(k0, k_hi, col, chunk, GROUP_SIZE)
        nwv = _norm_weights(nw_ptr, k, km, NORM)
        x0, x1, x2, x3, xsum, magic_xsum = _x_step(x_ptr, nwv, K, k, km, inv, dt, NORM, SILU, EVEN_K, C, VEC,
                                                   QUARTER_XSUM, MMA)
        w0, sc0, mn0 = _load_row(r0, s0, m0, k, grp, km, cm, FORMAT, EVEN_K, SYM)
        a0 = _dot_loaded(a0, w0, sc0, mn0, x0, x1, x2, x3, xsum, magic_xsum, FORMAT, C, VEC, ASM, EXACT, SYM)
        if ROWS > 1:
            w1, sc1, mn1 = _load_row(r1, s1, m1, k, grp, km, cm, FORMAT, EVEN_K, SYM)
            a1 = _dot_loaded(a1, w1, sc1, mn1, x0, x1, x2, x3, xsum, magic_xsum, FORMAT, C, VEC, ASM, EXACT, SYM)
        if ROWS > 2:
            w2, sc2, mn2 = _load_row(r2, s2, m2, k, grp, km, cm, FORMAT, EVEN_K, SYM)
            a2 = _dot_loaded(a2, w2, sc2, mn2, x0, x1, x2, x3, xsum, magic_xsum, FORMAT, C, VEC, ASM, EXACT, SYM)
            w3, sc3, mn3 = _load_row(r3, s3, m3, k, grp, km, cm, FORMAT, EVEN_K, SYM)
            a3 = _dot_loaded(a3, w3, sc3, mn3, x0, x1, x2, x3, xsum, magic_xsum, FORMAT, C, VEC, ASM, EXACT, SYM)
    y = _rows_result(tl.sum(a0, axis=0), tl.sum(a1, axis=0), tl.sum(a2, axis=0), tl.sum(a3, axis=0))
    _gemv_store(y, n, N, pid_n, pid_k, num_splits, bias_ptr, out_ptr, part_ptr, counters_ptr, bias, res, HAS_BIAS,
                SPLIT, RESIDUAL, GATED, ROWS)


@triton.jit
def _x_row_sums(a0, a1, p00, p01, p02, p03, p10, p11, p12, p13, sc0, mn0, sc1, mn1, x_ptr, K, k, km,
                dt: tl.constexpr, FORMAT: tl.constexpr, ROWS: tl.constexpr, EVEN_K: tl.constexpr, C: tl.constexpr,
                VEC: tl.constexpr, EXACT: tl.constexpr, SYM: tl.constexpr, QUARTER_XSUM: tl.constexpr,
                MMA: tl.constexpr):
    """One row of x (at x_ptr) at one step, loaded once, against the program's converted weight rows: a0 and
    a1 (weight rows 0 and 1) accumulate in the single-row GEMV's arithmetic."""
    x0, x1, x2, x3, xs, mxs = _x_step(x_ptr, 0.0, K, k, km, 1.0, dt, False, False, EVEN_K, C, VEC, QUARTER_XSUM,
                                      MMA)
    a0 = _chunk_sums(a0, p00, p01, p02, p03, sc0, mn0, x0, x1, x2, x3, xs, mxs, FORMAT, EXACT, SYM)
    if ROWS > 1:
        a1 = _chunk_sums(a1, p10, p11, p12, p13, sc1, mn1, x0, x1, x2, x3, xs, mxs, FORMAT, EXACT, SYM)
    return a0, a1


@triton.jit
def _x_rows_step(a00, a01, a02, a03, a10, a11, a12, a13, p00, p01, p02, p03, p10, p11, p12, p13, sc0, mn0, sc1, mn1,
                 x_ptr, stride_xm, K, k, km, dt: tl.constexpr, FORMAT: tl.constexpr, ROWS: tl.constexpr,
                 XROWS: tl.constexpr, EVEN_K: tl.constexpr, C: tl.constexpr, VEC: tl.constexpr,
                 EXACT: tl.constexpr, SYM: tl.constexpr, QUARTER_XSUM: tl.constexpr, MMA: tl.constexpr):
    """One K step of up to 4 rows of x (XROWS, from x_ptr) against the program's converted weight rows
    (p0*: row 0's _weight_floats, p1*: row 1's when ROWS == 2) by _x_row_sums; a{r}{m} accumulates weight
    row r against x row m."""
    a00, a10 = _x_row_sums(a00, a10, p00, p01, p02, p03, p10, p11, p12, p13, sc0, mn0, sc1, mn1, x_ptr, K, k, km,
                           dt, FORMAT, ROWS, EVEN_K, C, VEC, EXACT, SYM, QUARTER_XSUM, MMA)
    if XROWS > 1:
        a01, a11 = _x_row_sums(a01, a11, p00, p01, p02, p03, p10, p11, p12, p13, sc0, mn0, sc1, mn1,
                               x_ptr + stride_xm, K, k, km, dt, FORMAT, ROWS, EVEN_K, C, VEC, EXACT, SYM,
                               QUARTER_XSUM, MMA)
    if XROWS > 2:
        a02, a12 = _x_row_sums(a02, a12, p00, p01, p02, p03, p10, p11, p12, p13, sc0, mn0, sc1, mn1,
                               x_ptr + 2 * stride_xm, K, k, km, dt, FORMAT, ROWS, EVEN_K, C, VEC, EXACT, SYM,
                               QUARTER_XSUM, MMA)
    if XROWS > 3:
        a03, a13 = _x_row_sums(a03, a13, p00, p01, p02, p03, p10, p11, p12, p13, sc0, mn0, sc1, mn1,
                               x_ptr + 3 * stride_xm, K, k, km, dt, FORMAT, ROWS, EVEN_K, C, VEC, EXACT, SYM,
                               QUARTER_XSUM, MMA)
    return a00, a01, a02, a03, a10, a11, a12, a13


@triton.jit
def _x_rows_step8(a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13, w0, sc0, mn0, w1,
                  sc1, mn1, x_ptr, stride_xm, K, k, km, dt: tl.constexpr, FORMAT: tl.constexpr, ROWS: tl.constexpr,
                  XROWS: tl.constexpr, EVEN_K: tl.constexpr, C: tl.constexpr, VEC: tl.constexpr, ASM: tl.constexpr,
                  EXACT: tl.constexpr, SYM: tl.constexpr, QUARTER_XSUM: tl.constexpr, MMA: tl.constexpr):
    """One K step of _gemv_x_rows_kernel: the step's weights (w0, and w1 when ROWS == 2) converted once,
    then summed against x rows 0-3 (accumulators a) and 4-7 (b) by _x_rows_step."""
    XA: tl.constexpr = 4 if XROWS > 4 else XROWS
    p00, p01, p02, p03 = _weight_floats(w0, FORMAT, C, VEC, ASM, EXACT, SYM)
    p10, p11, p12, p13 = p00, p01, p02, p03
    if ROWS > 1:
        p10, p11, p12, p13 = _weight_floats(w1, FORMAT, C, VEC, ASM, EXACT, SYM)
    a00, a01, a02, a03, a10, a11, a12, a13 = _x_rows_step(
        a00, a01, a02, a03, a10, a11, a12, a13, p00, p01, p02, p03, p10, p11, p12, p13, sc0, mn0, sc1, mn1, x_ptr,
        stride_xm, K, k, km, dt, FORMAT, ROWS, XA, EVEN_K, C, VEC, EXACT, SYM, QUARTER_XSUM, MMA)
    if XROWS > 4:
        b00, b01, b02, b03, b10, b11, b12, b13 = _x_rows_step(
            b00, b01, b02, b03, b10, b11, b12, b13, p00, p01, p02, p03, p10, p11, p12, p13, sc0, mn0, sc1, mn1,
            x_ptr + 4 * stride_xm, stride_xm, K, k, km, dt, FORMAT, ROWS, XROWS - 4, EVEN_K, C, VEC, EXACT, SYM,
            QUARTER_XSUM, MMA)
    return a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13


@triton.jit
def _x_row_store(a0, a1, m, n, N, pid_k, M, out_ptr, part_ptr, bias, res_ptr, stride_om, stride_rm,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, RESIDUAL: tl.constexpr):
    """x row m's results of the program's weight rows (a0, a1: their accumulators) at output indices n:
    float32 partials (SPLIT, summed by _splitk_reduce_kernel), or _epilogue_store's bias, rounding and
    residual add."""
    y = _rows_result(tl.sum(a0, axis=0), tl.sum(a1, axis=0), 0.0, 0.0)
    mask = n < N
    if SPLIT:
        tl.store(part_ptr + (pid_k * M + m) * N + n, y, mask=mask)
    else:
        res = 0.0
        if RESIDUAL:
            res = tl.load(res_ptr + m * stride_rm + n, mask=mask, other=0.0).to(tl.float32)
        _epilogue_store(y, mask, out_ptr + m * stride_om + n, bias, res, HAS_BIAS, RESIDUAL)


@triton.jit
def _x_rows_store(a00, a01, a02, a03, a10, a11, a12, a13, m0, n, N, pid_k, M, out_ptr, part_ptr, bias, res_ptr,
                  stride_om, stride_rm, XROWS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                  RESIDUAL: tl.constexpr):
    """_x_row_store for x rows m0 .. m0 + XROWS - 1 (XROWS <= 4; a{r}{m}: weight row r, x row m0 + m)."""
    _x_row_store(a00, a10, m0, n, N, pid_k, M, out_ptr, part_ptr, bias, res_ptr, stride_om, stride_rm, HAS_BIAS,
                 SPLIT, RESIDUAL)
    if XROWS > 1:
        _x_row_store(a01, a11, m0 + 1, n, N, pid_k, M, out_ptr, part_ptr, bias, res_ptr, stride_om, stride_rm,
                     HAS_BIAS, SPLIT, RESIDUAL)
    if XROWS > 2:
        _x_row_store(a02, a12, m0 + 2, n, N, pid_k, M, out_ptr, part_ptr, bias, res_ptr, stride_om, stride_rm,
                     HAS_BIAS, SPLIT, RESIDUAL)
    if XROWS > 3:
        _x_row_store(a03, a13, m0 + 3, n, N, pid_k, M, out_ptr, part_ptr, bias, res_ptr, stride_om, stride_rm,
                     HAS_BIAS, SPLIT, RESIDUAL)


@triton.jit
def _gemv_x_rows_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, bias_ptr, out_ptr, part_ptr, res_ptr, M, N, K, k_per_split,
                        stride_xm, stride_wn, stride_sn, stride_om, stride_rm, FORMAT: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
                        ROWS: tl.constexpr, XROWS: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                        RESIDUAL: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, EXACT: tl.constexpr,
                        SYM: tl.constexpr, QUARTER_XSUM: tl.constexpr, MMA: tl.constexpr):
    """XROWS (1-8) rows of x against ROWS (1 or 2) rows of dense or w8 weights; program (row block, k split).
    The decode GEMV for a few sequences: each weight is loaded and converted once and summed against every
    row of x (XROWS FMAs a weight), where the tiled matmul dequantizes whole tiles for the tensor cores and
    is bound by that. Row m of the result is what the single-row GEMV gives for x[m], bit for bit (the same
    chunks, the same order). Its first step's weights load before the PDL wait, as there; no fused forms
    but the bias and the residual add (the norm and the SiLUs run as their own kernels, as for the matmul)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n, r0, r1, _, _, s0, s1, _, _, m0, m1, _, _ = _program_rows(pid_n, N, w_ptr, scale_ptr, min_ptr, stride_wn,
                                                                 stride_sn, ROWS, False)
    C: tl.constexpr = BLOCK_K // VEC
    chunk, col, k_lo, k_hi = _split_columns(pid_k, k_per_split, K, C, VEC)
    # a{r}{m}: weight row r against x row m; b{r}{m}: against x row 4 + m
    a00 = tl.zeros([C], dtype=tl.float32)
    a01, a02, a03, a10, a11, a12, a13 = a00, a00, a00, a00, a00, a00, a00
    b00, b01, b02, b03, b10, b11, b12, b13 = a00, a00, a00, a00, a00, a00, a00, a00
    dt = x_ptr.dtype.element_ty
    k, km, grp, cm = _step_columns(k_lo, k_hi, col, chunk, GROUP_SIZE)
    w0, sc0, mn0 = _load_row(r0, s0, m0, k, grp, km, cm, FORMAT, EVEN_K, SYM)
    w1, sc1, mn1 = w0, sc0, mn0
    if ROWS > 1:
        w1, sc1, mn1 = _load_row(r1, s1, m1, k, grp, km, cm, FORMAT, EVEN_K, SYM)
    bias = 0.0
    if HAS_BIAS and not SPLIT:
        bias = tl.load(bias_ptr + tl.minimum(n, N - 1)).to(tl.float32)
    pdl_begin(PDL)
    a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13 = _x_rows_step8(
        a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13, w0, sc0, mn0, w1, sc1, mn1,
        x_ptr, stride_xm, K, k, km, dt, FORMAT, ROWS, XROWS, EVEN_K, C, VEC, ASM, EXACT, SYM, QUARTER_XSUM, MMA)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k, km, grp, cm = _step_columns(k0, k_hi, col, chunk, GROUP_SIZE)
        w0, sc0, mn0 = _load_row(r0, s0, m0, k, grp, km, cm, FORMAT, EVEN_K, SYM)
        if ROWS > 1:
            w1, sc1, mn1 = _load_row(r1, s1, m1, k, grp, km, cm, FORMAT, EVEN_K, SYM)
        a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13 = _x_rows_step8(
            a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13, w0, sc0, mn0, w1, sc1,
            mn1, x_ptr, stride_xm, K, k, km, dt, FORMAT, ROWS, XROWS, EVEN_K, C, VEC, ASM, EXACT, SYM, QUARTER_XSUM,
            MMA)
    XA: tl.constexpr = 4 if XROWS > 4 else XROWS
    _x_rows_store(a00, a01, a02, a03, a10, a11, a12, a13, 0, n, N, pid_k, M, out_ptr, part_ptr, bias, res_ptr,
                  stride_om, stride_rm, XA, HAS_BIAS, SPLIT, RESIDUAL)
    if XROWS > 4:
        _x_rows_store(b00, b01, b02, b03, b10, b11, b12, b13, 4, n, N, pid_k, M, out_ptr, part_ptr, bias, res_ptr,
                      stride_om, stride_rm, XROWS - 4, HAS_BIAS, SPLIT, RESIDUAL)


@triton.jit
def _x_pairs(v, X_KIND: tl.constexpr):
    """(x[2j], x[2j+1]) in float32 from word j of x: bf16 / fp16 pairs in uint32, fp32 pairs in uint64."""
    if X_KIND == 0:
        u = v.to(tl.uint32, bitcast=True)
        return (u << 16).to(tl.float32, bitcast=True), (u & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif X_KIND == 1:
        u = v.to(tl.uint32, bitcast=True)
        even = (u & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        odd = (u >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return even, odd
    else:
        u = v.to(tl.uint64, bitcast=True)
        even = (u & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        odd = (u >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
        return even, odd


@triton.jit
def _round_words(v, X_KIND: tl.constexpr):
    """_round_as for the dtype that _x_pairs unpacked (X_KIND)."""
    if X_KIND == 0:
        return v.to(tl.bfloat16).to(tl.float32)
    elif X_KIND == 1:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _rms_inv_words(xw_ptr, KB, eps, X_KIND: tl.constexpr, BLOCK: tl.constexpr):
    """_rms_inv over the 2 * KB values held as KB words."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, KB, BLOCK):
        c = k0 + tl.arange(0, BLOCK)
        e, o = _x_pairs(tl.load(xw_ptr + c, mask=c < KB, other=0), X_KIND)
        acc += e * e + o * o
    return tl.rsqrt(tl.sum(acc, axis=0) / (2 * KB) + eps)


@triton.jit
def _load_row_w4(row_ptr, s_row_ptr, m_row_ptr, byte, grp, cm, EVEN_K: tl.constexpr):
    """One w4 row's step: its [chunks, 16] bytes, each chunk's scale and minimum."""
    if EVEN_K:
        b = tl.load(row_ptr + byte, eviction_policy="evict_first")
        s = tl.load(s_row_ptr + grp).to(tl.float32)
        mn = tl.load(m_row_ptr + grp).to(tl.float32)
    else:
        b = tl.load(row_ptr + byte, mask=cm[:, None], other=0, eviction_policy="evict_first")
        s = tl.load(s_row_ptr + grp, mask=cm, other=0.0).to(tl.float32)
        mn = tl.load(m_row_ptr + grp, mask=cm, other=0.0).to(tl.float32)
    return b, s, mn


@triton.jit
def _dot_loaded_w4(acc, b, s, mn, e0, e1, e2, e3, o0, o1, o2, o3, xsum, magic_xsum, C: tl.constexpr,
                   ASM: tl.constexpr, EXACT: tl.constexpr):
    """acc [chunks] += one w4 row's loaded step (_load_row_w4) against x, as _dot_loaded's w8:
    scale * sum(x * q) + minimum * sum(x). A nibble comes as the float 128 + q (low) or 2048 + q (high),
    with no conversion or subtraction (ASM: magic_nibbles_f32_asm, 1.5 instructions a weight before its
    FMA, against 2.5 for q itself); the constants come off once a chunk, magic_xsum being
    128 * sum(x[even]) + 2048 * sum(x[odd]) (shared by every row). Bits 12-19 are the highest a nibble
    can sit under float32's exponent; the constants, up to ~270x a typical q, cost the dot ~8 bits, as in
    _dot_loaded, and EXACT takes them off each weight instead. e0..e3, o0..o3: the quarters of x[even],
    x[odd]."""
    l0, l1, l2, l3, h0, h1, h2, h3 = _nibble_floats(b, C, ASM, EXACT)
    return _chunk_sums_w4(acc, l0, l1, l2, l3, h0, h1, h2, h3, s, mn, e0, e1, e2, e3, o0, o1, o2, o3, xsum,
                          magic_xsum, EXACT)


@triton.jit
def _nibble_floats(b, C: tl.constexpr, ASM: tl.constexpr, EXACT: tl.constexpr):
    """One w4 row's loaded step as the floats _dot_loaded_w4 multiplies: the quarters of its low nibbles
    (128 + q) and of its high ones (2048 + q); EXACT: q."""
    if ASM:
        lo, hi = magic_nibbles_f32_asm(b)
    else:
        lo, hi = magic_nibbles_f32(b)
    if EXACT:
        lo -= 128.0
        hi -= 2048.0
    l0, l1, l2, l3 = _quarters(lo, C, 16)
    h0, h1, h2, h3 = _quarters(hi, C, 16)
    return l0, l1, l2, l3, h0, h1, h2, h3


@triton.jit
def _chunk_sums_w4(acc, l0, l1, l2, l3, h0, h1, h2, h3, s, mn, e0, e1, e2, e3, o0, o1, o2, o3, xsum, magic_xsum,
                   EXACT: tl.constexpr):
    """acc [chunks] += one w4 row's _nibble_floats against x's even and odd quarters (_dot_loaded_w4)."""
    dot = tl.sum(l0 * e0 + h0 * o0 + l1 * e1 + h1 * o1 + l2 * e2 + h2 * o2 + l3 * e3 + h3 * o3, axis=1)
    if not EXACT:
        dot -= magic_xsum
    return acc + dot * s + xsum * mn


@triton.jit
def _norm_words(nw_ptr, byte, cm, NORM: tl.constexpr):
    """The norm weight's words at one step's bytes (NORM), as _norm_weights."""
    nww = 0
    if NORM:
        nww = tl.load(nw_ptr + byte, mask=cm[:, None], other=0)
    return nww


@triton.jit
def _x_step_w4(xw_ptr, nww, KB, byte, cm, inv, X_KIND: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr,
               EVEN_K: tl.constexpr, C: tl.constexpr):
    """x at one step's bytes (the words of its pairs), through the fused prologue (NORM: nww the step's
    _norm_words; SILU): the quarters of x[even] and x[odd], the chunk sums, and the constants' share
    (_dot_loaded_w4)."""
    if EVEN_K:
        xv = tl.load(xw_ptr + byte)
    else:
        xv = tl.load(xw_ptr + byte, mask=cm[:, None], other=0)
    xe, xo = _x_pairs(xv, X_KIND)
    if NORM:
        we, wo = _x_pairs(nww, X_KIND)
        xe = _round_words(we * (xe * inv), X_KIND)
        xo = _round_words(wo * (xo * inv), X_KIND)
    if SILU:
        ue, uo = _x_pairs(tl.load(xw_ptr + KB + byte, mask=cm[:, None], other=0), X_KIND)
        xe = _round_words(_silu_mul(xe, ue), X_KIND)
        xo = _round_words(_silu_mul(xo, uo), X_KIND)
    even_sum = tl.sum(xe, axis=1)
    odd_sum = tl.sum(xo, axis=1)
    e0, e1, e2, e3 = _quarters(xe, C, 16)
    o0, o1, o2, o3 = _quarters(xo, C, 16)
    # the last unused (and not computed) where EXACT
    return e0, e1, e2, e3, o0, o1, o2, o3, even_sum + odd_sum, even_sum * 128.0 + odd_sum * 2048.0


@triton.jit
def _w4_step_bytes(b0, chunk, b_hi, GROUP_SIZE: tl.constexpr):
    """A w4 K step from byte b0: its bytes [chunks, 16], each chunk's group, and the chunks' mask (chunks never
    straddle b_hi: rows and splits are whole chunks)."""
    start = b0 + chunk  # first byte of each chunk
    return start[:, None] + tl.arange(0, 16)[None, :], start // (GROUP_SIZE // 2), start < b_hi


@triton.jit
def _gemv_w4_kernel(xw_ptr, w_ptr, scale_ptr, min_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr, nw_ptr, res_ptr,
                    eps, N, KB, kb_per_split, num_splits, stride_wn, stride_sn,
                    X_KIND: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                    GROUP_SIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_KB: tl.constexpr, NORM: tl.constexpr,
                    SILU: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr,
                    GATED: tl.constexpr, EXACT: tl.constexpr):
    """One row of x against ROWS (1, 2 or 4) rows of w4 weights (KB bytes a row), as _gemv_kernel
    (its first step's weights also load before the wait on the previous kernel).
    Tiles are [BLOCK_KB // 16, 16] bytes: a 16-byte chunk lies inside one group (groups are >= 16
    bytes), so it takes one scale and one minimum. x comes as words holding the pair
    (x[2j], x[2j+1]) of byte j, unpacked once per step for all rows; NORM / SILU / RESIDUAL as in
    _gemv_kernel (nw_ptr: the norm weight as words too; SILU: gate words, then KB up words; GATED)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n, r0, r1, r2, r3, s0, s1, s2, s3, m0, m1, m2, m3 = _program_rows(pid_n, N, w_ptr, scale_ptr, min_ptr, stride_wn,
                                                                       stride_sn, ROWS, GATED)
    C: tl.constexpr = BLOCK_KB // 16
    chunk, _, b_lo, b_hi = _split_columns(pid_k, kb_per_split, KB, C, 16)
    a0 = tl.zeros([C], dtype=tl.float32)
    a1 = tl.zeros([C], dtype=tl.float32)
    a2 = tl.zeros([C], dtype=tl.float32)
    a3 = tl.zeros([C], dtype=tl.float32)
    byte, grp, cm = _w4_step_bytes(b_lo, chunk, b_hi, GROUP_SIZE)
    w0, sc0, mn0 = _load_row_w4(r0, s0, m0, byte, grp, cm, EVEN_K)
    if ROWS > 1:
        w1, sc1, mn1 = _load_row_w4(r1, s1, m1, byte, grp, cm, EVEN_K)
    if ROWS > 2:
        w2, sc2, mn2 = _load_row_w4(r2, s2, m2, byte, grp, cm, EVEN_K)
        w3, sc3, mn3 = _load_row_w4(r3, s3, m3, byte, grp, cm, EVEN_K)
    bias, res = _gemv_epilogue_inputs(n, N, bias_ptr, res_ptr, HAS_BIAS, RESIDUAL, GATED)
    nww = _norm_words(nw_ptr, byte, cm, NORM)
    pdl_begin(PDL)
    inv = 1.0
    if NORM:
        inv = _rms_inv_words(xw_ptr, KB, eps, X_KIND, BLOCK_KB)
    e0, e1, e2, e3, o0, o1, o2, o3, xsum, magic_xsum = _x_step_w4(xw_ptr, nww, KB, byte, cm, inv, X_KIND, NORM,
                                                                  SILU, EVEN_K, C)
    a0 = _dot_loaded_w4(a0, w0, sc0, mn0, e0, e1, e2, e3, o0, o1, o2, o3, xsum, magic_xsum, C, ASM, EXACT)
    if ROWS > 1:
        a1 = _dot_loaded_w4(a1, w1, sc1, mn1, e0, e1, e2, e3, o0, o1, o2, o3, xsum, magic_xsum, C, ASM, EXACT)
    if ROWS > 2:
        a2 = _dot_loaded_w4(a2, w2, sc2, mn2, e0, e1, e2, e3, o0, o1, o2, o3, xsum, magic_xsum, C, ASM, EXACT)
        a3 = _dot_loaded_w4(a3, w3, sc3, mn3, e0, e1, e2, e3, o0, o1, o2, o3, xsum, magic_xsum, C, ASM, EXACT)
    for kb0 in range(b_lo + BLOCK_KB, b_hi, BLOCK_KB):
        byte, grp, cm = _w4_step_bytes(kb0, chunk, b_hi, GROUP_SIZE)
        nww = _norm_words(nw_ptr, byte, cm, NORM)
        e0, e1, e2, e3, o0, o1, o2, o3, xsum, magic_xsum = _x_step_w4(xw_ptr, nww, KB, byte, cm, inv, X_KIND,
                                                                      NORM, SILU, EVEN_K, C)
        w0, sc0, mn0 = _load_row_w4(r0, s0, m0, byte, grp, cm, EVEN_K)
        a0 = _dot_loaded_w4(a0, w0, sc0, mn0, e0, e1, e2, e3, o0, o1, o2, o3, xsum, magic_xsum, C, ASM, EXACT)
        if ROWS > 1:
            w1, sc1, mn1 = _load_row_w4(r1, s1, m1, byte, grp, cm, EVEN_K)
            a1 = _dot_loaded_w4(a1, w1, sc1, mn1, e0, e1, e2, e3, o0, o1, o2, o3, xsum, magic_xsum, C, ASM, EXACT)
        if ROWS > 2:
            w2, sc2, mn2 = _load_row_w4(r2, s2, m2, byte, grp, cm, EVEN_K)
            a2 = _dot_loaded_w4(a2, w2, sc2, mn2, e0, e1, e2, e3, o0, o1, o2, o3, xsum, magic_xsum, C, ASM, EXACT)
            w3, sc3, mn3 = _load_row_w4(r3, s3, m3, byte, grp, cm, EVEN_K)
            a3 = _dot_loaded_w4(a3, w3, sc3, mn3, e0, e1, e2, e3, o0, o1, o2, o3, xsum, magic_xsum, C, ASM, EXACT)
    y = _rows_result(tl.sum(a0, axis=0), tl.sum(a1, axis=0), tl.sum(a2, axis=0), tl.sum(a3, axis=0))
    _gemv_store(y, n, N, pid_n, pid_k, num_splits, bias_ptr, out_ptr, part_ptr, counters_ptr, bias, res, HAS_BIAS,
                SPLIT, RESIDUAL, GATED, ROWS)


@triton.jit
def _x_rows_w4_sums(a0, a1, l00, l01, l02, l03, h00, h01, h02, h03, l10, l11, l12, l13, h10, h11, h12, h13, sc0,
                    mn0, sc1, mn1, xw_ptr, byte, cm, X_KIND: tl.constexpr, ROWS: tl.constexpr,
                    EVEN_K: tl.constexpr, C: tl.constexpr, EXACT: tl.constexpr):
    """One row of x (its words at xw_ptr) at one step against the program's converted w4 rows: a0 and a1
    (weight rows 0 and 1) accumulate in the one-row GEMV's arithmetic."""
    e0, e1, e2, e3, o0, o1, o2, o3, xs, mxs = _x_step_w4(xw_ptr, 0, 0, byte, cm, 1.0, X_KIND, False, False, EVEN_K,
                                                         C)
    a0 = _chunk_sums_w4(a0, l00, l01, l02, l03, h00, h01, h02, h03, sc0, mn0, e0, e1, e2, e3, o0, o1, o2, o3, xs,
                        mxs, EXACT)
    if ROWS > 1:
        a1 = _chunk_sums_w4(a1, l10, l11, l12, l13, h10, h11, h12, h13, sc1, mn1, e0, e1, e2, e3, o0, o1, o2, o3,
                            xs, mxs, EXACT)
    return a0, a1


@triton.jit
def _x_rows_w4_step(a00, a01, a02, a03, a10, a11, a12, a13, w0, sc0, mn0, w1, sc1, mn1, xw_ptr, stride_xw, byte, cm,
                    X_KIND: tl.constexpr, ROWS: tl.constexpr, XROWS: tl.constexpr, EVEN_K: tl.constexpr,
                    C: tl.constexpr, ASM: tl.constexpr, EXACT: tl.constexpr):
    """One K step of _gemv_w4_x_rows_kernel: the step's nibbles (w0, and w1 when ROWS == 2) converted once,
    then summed against each of XROWS (1-4) rows of x; a{r}{m}: weight row r against x row m."""
    l00, l01, l02, l03, h00, h01, h02, h03 = _nibble_floats(w0, C, ASM, EXACT)
    l10, l11, l12, l13, h10, h11, h12, h13 = l00, l01, l02, l03, h00, h01, h02, h03
    if ROWS > 1:
        l10, l11, l12, l13, h10, h11, h12, h13 = _nibble_floats(w1, C, ASM, EXACT)
    a00, a10 = _x_rows_w4_sums(a00, a10, l00, l01, l02, l03, h00, h01, h02, h03, l10, l11, l12, l13, h10, h11, h12,
                               h13, sc0, mn0, sc1, mn1, xw_ptr, byte, cm, X_KIND, ROWS, EVEN_K, C, EXACT)
    if XROWS > 1:
        a01, a11 = _x_rows_w4_sums(a01, a11, l00, l01, l02, l03, h00, h01, h02, h03, l10, l11, l12, l13, h10, h11,
                                   h12, h13, sc0, mn0, sc1, mn1, xw_ptr + stride_xw, byte, cm, X_KIND, ROWS, EVEN_K,
                                   C, EXACT)
    if XROWS > 2:
        a02, a12 = _x_rows_w4_sums(a02, a12, l00, l01, l02, l03, h00, h01, h02, h03, l10, l11, l12, l13, h10, h11,
                                   h12, h13, sc0, mn0, sc1, mn1, xw_ptr + 2 * stride_xw, byte, cm, X_KIND, ROWS,
                                   EVEN_K, C, EXACT)
    if XROWS > 3:
        a03, a13 = _x_rows_w4_sums(a03, a13, l00, l01, l02, l03, h00, h01, h02, h03, l10, l11, l12, l13, h10, h11,
                                   h12, h13, sc0, mn0, sc1, mn1, xw_ptr + 3 * stride_xw, byte, cm, X_KIND, ROWS,
                                   EVEN_K, C, EXACT)
    return a00, a01, a02, a03, a10, a11, a12, a13


@triton.jit
def _gemv_w4_x_rows_kernel(xw_ptr, w_ptr, scale_ptr, min_ptr, bias_ptr, out_ptr, part_ptr, res_ptr, M, N, KB,
                           kb_per_split, stride_xw, stride_wn, stride_sn, stride_om, stride_rm,
                           X_KIND: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                           GROUP_SIZE: tl.constexpr, ROWS: tl.constexpr, XROWS: tl.constexpr,
                           BLOCK_KB: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr,
                           EXACT: tl.constexpr):
    """_gemv_x_rows_kernel for w4 weights (KB bytes a row): XROWS (1-4) rows of x, as words of pairs
    (stride_xw words apart), against ROWS (1 or 2) weight rows. Row m of the result is what _gemv_w4_kernel
    gives for x[m], bit for bit; the bias and the residual add, no other fused form."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n, r0, r1, _, _, s0, s1, _, _, m0, m1, _, _ = _program_rows(pid_n, N, w_ptr, scale_ptr, min_ptr, stride_wn,
                                                                 stride_sn, ROWS, False)
    C: tl.constexpr = BLOCK_KB // 16
    chunk, _, b_lo, b_hi = _split_columns(pid_k, kb_per_split, KB, C, 16)
    a00 = tl.zeros([C], dtype=tl.float32)
    a01, a02, a03, a10, a11, a12, a13 = a00, a00, a00, a00, a00, a00, a00
    byte, grp, cm = _w4_step_bytes(b_lo, chunk, b_hi, GROUP_SIZE)
    w0, sc0, mn0 = _load_row_w4(r0, s0, m0, byte, grp, cm, EVEN_K)
    w1, sc1, mn1 = w0, sc0, mn0
    if ROWS > 1:
        w1, sc1, mn1 = _load_row_w4(r1, s1, m1, byte, grp, cm, EVEN_K)
    bias = 0.0
    if HAS_BIAS and not SPLIT:
        bias = tl.load(bias_ptr + tl.minimum(n, N - 1)).to(tl.float32)
    pdl_begin(PDL)
    a00, a01, a02, a03, a10, a11, a12, a13 = _x_rows_w4_step(
        a00, a01, a02, a03, a10, a11, a12, a13, w0, sc0, mn0, w1, sc1, mn1, xw_ptr, stride_xw, byte, cm,
        X_KIND, ROWS, XROWS, EVEN_K, C, ASM, EXACT)
    for kb0 in range(b_lo + BLOCK_KB, b_hi, BLOCK_KB):
        byte, grp, cm = _w4_step_bytes(kb0, chunk, b_hi, GROUP_SIZE)
        w0, sc0, mn0 = _load_row_w4(r0, s0, m0, byte, grp, cm, EVEN_K)
        if ROWS > 1:
            w1, sc1, mn1 = _load_row_w4(r1, s1, m1, byte, grp, cm, EVEN_K)
        a00, a01, a02, a03, a10, a11, a12, a13 = _x_rows_w4_step(
            a00, a01, a02, a03, a10, a11, a12, a13, w0, sc0, mn0, w1, sc1, mn1, xw_ptr, stride_xw, byte, cm,
            X_KIND, ROWS, XROWS, EVEN_K, C, ASM, EXACT)
    _x_rows_store(a00, a01, a02, a03, a10, a11, a12, a13, 0, n, N, pid_k, M, out_ptr, part_ptr, bias, res_ptr,
                  stride_om, stride_rm, XROWS, HAS_BIAS, SPLIT, RESIDUAL)


@triton.jit
def _u8_to(q, dtype: tl.constexpr):
    """uint8 -> dtype, exact (0..255 fit every dot operand type), without the integer-to-float unit:
    float16 as 1024 + q - 1024, the others through small_uint_to_f32."""
    if dtype == tl.float16:
        return ((q.to(tl.int16) & 0xFF) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    else:
        return small_uint_to_f32(q.to(tl.int32)).to(dtype)


@triton.jit
def _load_chunks(w_tile, s_rows, m_rows, k0, k_hi, ci, GROUP_SIZE: tl.constexpr, MASKED: tl.constexpr,
                 SYM: tl.constexpr):
    """The w8 bytes of K columns k0.. as [rows, chunks of 32, 32], and each chunk's scale and minimum
    [rows, chunks] (SYM: no minimum stored, the scale stands in for it). MASKED: chunks from k_hi on
    read as zeros (a chunk never straddles it: groups are whole chunks)."""
    start = k0 + ci * 32
    grp = (start // GROUP_SIZE)[None, :]
    b_ptrs = w_tile + k0
    if MASKED:
        cm = (start < k_hi)[None, :]
        b = tl.load(b_ptrs, mask=cm[:, :, None], other=0)
        s = tl.load(s_rows + grp, mask=cm, other=0.0)
        mn = s
        if not SYM:
            mn = tl.load(m_rows + grp, mask=cm, other=0.0)
    else:
        b = tl.load(b_ptrs)
        s = tl.load(s_rows + grp)
        mn = s
        if not SYM:
            mn = tl.load(m_rows + grp)
    return b, s, mn


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, bias_ptr, out_ptr, part_ptr, res_ptr, M, N, K,
                   k_per_split, stride_xm, stride_wn, stride_sn, stride_om, stride_rm,
                   FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                   GROUP_SIZE: tl.constexpr, ROW_GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, RESIDUAL: tl.constexpr,
                   SWAP: tl.constexpr, PREFETCH: tl.constexpr, SYM: tl.constexpr, PDL: tl.constexpr,
                   ASM: tl.constexpr, PART_EVICT: tl.constexpr, MMA: tl.constexpr):
    """x [M, K] @ W^T with W dequantized per tile to x's dtype; program (output tile, k split).
    Grouped w8: tiles of 32-weight chunks, one scale and minimum each (SYM: w = (q - 128) * scale). SWAP: the dot is
    W_tile @ x_tile^T, so the dequantized weights (already in registers) are its first operand, which
    Hopper's MMA reads from registers, and x^T the one it reads from shared memory (the other way the
    weight tile makes a round trip through shared memory each step). PREFETCH: the next step's weight
    tile is loaded before this step's dot (by hand: the pipeliner does not stage loads that are not
    dot operands). w8 whose row is one group (ROW_GROUP): the float32 dot of the raw q, scaled once at
    the end. PART_EVICT: the split partials' L2 eviction policy. MMA: grouped w8 stored in the MMA order
    (kernels/weights.py), its tiles put back in column order after the conversion (_natural_columns)."""
    pdl_begin(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # grouped tile order: neighbouring programs share weight tiles in L2
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm_ld = tl.minimum(rm, M - 1)
    rn64 = tl.minimum(rn, N - 1).to(tl.int64)
    # output coordinates as the accumulator holds them: [BLOCK_N, BLOCK_M] when SWAP
    if SWAP:
        om = rm[None, :]
        on = rn[:, None]
        om_ld = rm_ld.to(tl.int64)[None, :]
        on_ld = rn64[:, None]
    else:
        om = rm[:, None]
        on = rn[None, :]
        om_ld = rm_ld.to(tl.int64)[:, None]
        on_ld = rn64[None, :]
    x_rows = x_ptr + rm_ld.to(tl.int64)[:, None] * stride_xm
    dt = x_ptr.dtype.element_ty
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if SWAP:
        # every split has K steps (_k_split); told so, the loop loses its zero-trip path, whose zeroing of the
        # accumulator made ptxas serialize the swap form's wgmmas (C7515; H200, 1B w8 batch 32 20,4xx -> 20,8xx tok/s)
        tl.assume(k_lo < k_hi)
    if FORMAT == 2:
        # dequantize [BLOCK_N, BLOCK_K // 32, 16]-byte tiles (one scale per 16-byte chunk, as in the
        # GEMV), then two dots: low nibbles with x's even columns, high nibbles with its odd ones
        # (SWAP: the weight halves as the dots' first operands, x's even and odd columns loaded apart)
        chunk = tl.arange(0, BLOCK_K // 32) * 16
        v = tl.arange(0, 16)
        kx = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + rn64[:, None, None] * stride_wn
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            kh2 = 2 * tl.arange(0, BLOCK_K // 2)
            xe_tile = x_ptr + rm_ld.to(tl.int64)[None, :] * stride_xm + kh2[:, None]
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            start = k0 // 2 + chunk
            byte = (start[:, None] + v[None, :])[None, :, :]
            grp = (start // (GROUP_SIZE // 2))[None, :]
            s_ptrs = scale_ptr + rn64[:, None] * stride_sn + grp
            m_ptrs = min_ptr + rn64[:, None] * stride_sn + grp
            if EVEN_K:
                b = tl.load(w_rows + byte)
                s = tl.load(s_ptrs).to(tl.float32)
                mn = tl.load(m_ptrs).to(tl.float32)
                if SWAP:
                    xe = tl.load(xe_tile + k0)
                    xo = tl.load(xe_tile + k0 + 1)
                else:
                    xt = tl.load(x_rows + k0 + kx[None, :])
            else:
                cm = (2 * start < k_hi)[None, :]  # chunks never straddle k_hi
                b = tl.load(w_rows + byte, mask=cm[:, :, None], other=0)
                s = tl.load(s_ptrs, mask=cm, other=0.0).to(tl.float32)
                mn = tl.load(m_ptrs, mask=cm, other=0.0).to(tl.float32)
                if SWAP:
                    xm = (k0 + kh2[:, None]) < k_hi  # k_hi is even: an even column's odd neighbour goes with it
                    xe = tl.load(xe_tile + k0, mask=xm, other=0.0)
                    xo = tl.load(xe_tile + k0 + 1, mask=xm, other=0.0)
                else:
                    xt = tl.load(x_rows + k0 + kx[None, :], mask=(k0 + kx[None, :]) < k_hi, other=0.0)
            bi = b.to(tl.int32)
            s3 = s[:, :, None]
            m3 = mn[:, :, None]
            lo = tl.reshape((small_uint_to_f32(bi & 0x0F) * s3 + m3).to(dt), (BLOCK_N, BLOCK_K // 2))
            hi = tl.reshape((small_uint_to_f32(bi >> 4) * s3 + m3).to(dt), (BLOCK_N, BLOCK_K // 2))
            if SWAP:
                acc += tl.dot(lo, xe)
                acc += tl.dot(hi, xo)
            else:
                xe, xo = tl.split(tl.reshape(xt, (BLOCK_M, BLOCK_K // 2, 2)))
                acc += tl.dot(xe, tl.trans(lo))
                acc += tl.dot(xo, tl.trans(hi))
    elif FORMAT == 1 and not ROW_GROUP:
        ci = tl.arange(0, BLOCK_K // 32)  # 32-weight chunks, one scale and minimum each
        w_tile = w_ptr + rn64[:, None, None] * stride_wn + (ci[:, None] * 32 + tl.arange(0, 32)[None, :])[None, :, :]
        s_rows = scale_ptr + rn64[:, None] * stride_sn
        m_rows = min_ptr + rn64[:, None] * stride_sn
        kx = tl.arange(0, BLOCK_K)
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            x_tile = x_ptr + rm_ld.to(tl.int64)[None, :] * stride_xm + kx[:, None]
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            x_tile = x_rows + kx[None, :]
        if PREFETCH:
            b, s, mn = _load_chunks(w_tile, s_rows, m_rows, k_lo, k_hi, ci, GROUP_SIZE, not EVEN_K, SYM)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if PREFETCH:
                b_next, s_next, mn_next = _load_chunks(w_tile, s_rows, m_rows, k0 + BLOCK_K, k_hi, ci,
                                                       GROUP_SIZE, True, SYM)
            else:
                b, s, mn = _load_chunks(w_tile, s_rows, m_rows, k0, k_hi, ci, GROUP_SIZE, not EVEN_K, SYM)
            if EVEN_K:
                xt = tl.load(x_tile + k0)
            elif SWAP:
                xt = tl.load(x_tile + k0, mask=(k0 + kx[:, None]) < k_hi, other=0.0)
            else:
                xt = tl.load(x_tile + k0, mask=(k0 + kx[None, :]) < k_hi, other=0.0)
            # q * scale + minimum (SYM: (q - 128) * scale) in float32, rounded once
            s3 = s.to(tl.float32)[:, :, None]
            if ASM and SYM:
                # the float 32768 + q that one prmt makes of a byte, in one FMA: (32768 + q) * s - 32896 * s is
                # (q - 128) * s exactly (32896 * s holds 9 + 11 bits, and the FMA rounds once). H200 decode graph
                # (session 27), SmolLM2 w8 tok/s at batch 48 / 64: 30,646 / 38,372 -> 30,903 / 38,743. Not in the
                # portable form: there it made 1B batch 64 slower (28,960 -> 28,637)
                w = tl.fma(magic_u8_f32_asm(b), s3, -32896.0 * s3)
            else:
                if SYM:  # the chunk's implied minimum: one FMA a weight, as with a stored one (exact either way)
                    m3 = -128.0 * s3
                else:
                    m3 = mn.to(tl.float32)[:, :, None]
                if ASM:  # q exactly: the float 32768 + q that one prmt makes of a byte, less 32768
                    q = magic_u8_f32_asm(b) - 32768.0
                else:
                    q = small_uint_to_f32(b.to(tl.int32))
                w = q * s3 + m3
            wt = tl.reshape(w.to(dt), (BLOCK_N, BLOCK_K))
            if SWAP:
                if MMA:
                    wt = _natural_columns(wt, BLOCK_N, BLOCK_K)
                acc += tl.dot(wt, xt)
            else:
                if MMA:  # x to the weights' order: the weight tile goes through shared memory as it is
                    xt = _mma_order_columns(xt, BLOCK_M, BLOCK_K)
                acc += tl.dot(xt, tl.trans(wt))
            if PREFETCH:
                b = b_next
                s = s_next
                mn = mn_next
    else:
        w_cols = w_ptr + rn64[None, :] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        xs = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                xv = tl.load(x_rows + k[None, :])
                wv = tl.load(w_cols + k[:, None])
            else:
                km = k < k_hi
                xv = tl.load(x_rows + k[None, :], mask=km[None, :], other=0.0)
                wv = tl.load(w_cols + k[:, None], mask=km[:, None], other=0)
            if FORMAT == 1:
                acc += tl.dot(xv, _u8_to(wv, dt))
                xs += tl.sum(xv.to(tl.float32), axis=1)
            else:
                acc += tl.dot(xv, wv.to(dt))
        if FORMAT == 1:  # one group per row
            s = tl.load(scale_ptr + rn64 * stride_sn).to(tl.float32)
            if SYM:
                mn = -128.0 * s
            else:
                mn = tl.load(min_ptr + rn64 * stride_sn).to(tl.float32)
            acc = acc * s[None, :] + xs[:, None] * mn[None, :]
    mask = (om < M) & (on < N)
    if SPLIT:
        # partials in float32, summed by _splitk_reduce_kernel: a tile's partials are too large for one
        # program to sum after the others (measured 1.2-2.3x slower than the separate reduce on an H200)
        tl.store(part_ptr + pid_k * M * N + om * N + on, acc, mask=mask, eviction_policy=PART_EVICT)
    else:
        _epilogue(acc, on_ld, mask, out_ptr + om.to(tl.int64) * stride_om + on, bias_ptr,
                  res_ptr + om_ld * stride_rm + on_ld, HAS_BIAS, RESIDUAL)


@triton.jit
def _split_sum(ptrs, part_stride, mask, SPLITS: tl.constexpr, PART_EVICT: tl.constexpr):
    """The SPLITS partials at ptrs summed in split order, the loop unrolled so that every split's load is in
    flight at once, not one L2 round trip after another (H200 decode step, session 31, tok/s at batch 64, w8:
    1B 33,094 -> 34,551, SmolLM2 43,294 -> 44,805, 8B 7,339 -> 7,482; 1B w4 26,800 -> 29,036)."""
    acc = tl.zeros(ptrs.shape, dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(ptrs + s * part_stride, mask=mask, other=0.0, eviction_policy=PART_EVICT)
    return acc


@triton.jit
def _splitk_reduce_kernel(part_ptr, bias_ptr, res_ptr, out_ptr, n_out, N, part_stride,
                          HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr,
                          SPLITS: tl.constexpr, PDL: tl.constexpr, PART_EVICT: tl.constexpr):
    """out[m, n] = sum over the SPLITS splits of part[s, m, n] (+ bias[n], + res[m, n]: _epilogue), in a fixed
    order (deterministic). GATED: part's rows are [gate | up] and out [M, N / 2] is silu(gate) * up of
    the sums, each rounded to the output dtype first, as silu_and_mul reads linear's output.
    PART_EVICT: the partials' L2 eviction policy."""
    pdl_begin(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_out
    if GATED:
        half = N // 2
        col = offs % half
        at = part_ptr + (offs // half) * N + col
        g = _split_sum(at, part_stride, mask, SPLITS, PART_EVICT)
        u = _split_sum(at + half, part_stride, mask, SPLITS, PART_EVICT)
        if HAS_BIAS:
            g += tl.load(bias_ptr + col).to(tl.float32)
            u += tl.load(bias_ptr + half + col).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        tl.store(out_ptr + offs, _silu_mul(_round_as(g, dt), _round_as(u, dt)).to(dt), mask=mask)
    else:
        acc = _split_sum(part_ptr + offs, part_stride, mask, SPLITS, PART_EVICT)
        _epilogue(acc, offs % N, mask, out_ptr + offs, bias_ptr, res_ptr + offs, HAS_BIAS, RESIDUAL)


@triton.jit
def _splitk_reduce_norm_kernel(part_ptr, bias_ptr, res_ptr, out_ptr, nw_ptr, normed_ptr, N, part_stride, eps,
                               HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                               SPLITS: tl.constexpr, PDL: tl.constexpr, PART_EVICT: tl.constexpr):
    """_splitk_reduce_kernel's sum of one row m (out[m] = the residual stream after the linear), then
    normed[m] = rms_norm(out[m]) * nw: triton_norm's kernel on the rounded row, without its launch."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    # the norm weight is never written during a step: under PDL its load overlaps the previous kernel
    w = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_begin(PDL)
    at = row * N + cols
    acc = _split_sum(part_ptr + at, part_stride, mask, SPLITS, PART_EVICT)
    bias, res = _epilogue_inputs(tl.minimum(cols, N - 1), mask, bias_ptr, res_ptr + at, HAS_BIAS, RESIDUAL)
    h = _epilogue_value(acc, bias, res, out_ptr.dtype.element_ty, HAS_BIAS, RESIDUAL)
    tl.store(out_ptr + at, h, mask=mask)
    normed = rms_row(tl.where(mask, h.to(tl.float32), 0.0), w, N, eps)
    tl.store(normed_ptr + at, normed.to(normed_ptr.dtype.element_ty), mask=mask)


_X_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _x_words(x: torch.Tensor) -> torch.Tensor:
    """One row of x viewed as words holding (x[2j], x[2j+1]), for the w4 GEMV."""
    word = torch.int64 if x.dtype == torch.float32 else torch.int32
    try:
        return x.view(word)
    except RuntimeError:  # a row that does not start on a word boundary
        return x.clone().view(word)


@dataclass(frozen=True)
class LinearConfig:
    """Launch parameters. GEMV: block_n (1, 2 or 4) weight rows per program, block_k weights a step.
    Matmul: block_m x block_n tiles over block_k. split: K splits. swap, prefetch: the grouped w8
    matmul's forms (_matmul_kernel); other weights ignore them. asm_dequant: the grouped w8 matmul's bytes
    to floats by inline PTX (on a GPU that takes it; the interpreter never does). max_registers: a cap on
    the registers a thread (ptxas' maxnreg), so that an SM keeps more of a launch's programs."""

    kind: str  # "gemv" | "matmul" | "torch"
    block_m: int = 16
    block_n: int = 16
    block_k: int = 256
    split: int = 1
    num_warps: int = 4
    num_stages: int = 2
    swap: bool = False
    prefetch: bool = False
    asm_dequant: bool = False
    max_registers: int | None = None


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: small grids, but still exercise the split path
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _pick_split(tiles: int, k_steps: int, target: int, min_steps: int) -> int:
    """Split K until there are `target` programs, keeping >= min_steps K steps per split."""
    want = max(1, -(-target // tiles))
    return max(1, min(want, k_steps // min_steps, 16))


def _one_wave_split(tiles: int, k_steps: int, slots: int, min_steps: int) -> int:
    """Split K so that the programs fill one wave of `slots` (floor: no second, partial wave); where even one
    program a tile fills more than half a wave, about two waves of shorter programs instead."""
    want = slots // tiles if 2 * tiles <= slots else -(-2 * slots // tiles)
    return max(1, min(want, k_steps // min_steps, 16))


def _decode_batch_split(tiles: int, k_steps: int, sms: int, one_wave: bool) -> int:
    """A decode batch's K split: one wave of 3 programs an SM with >= 8 K steps each (one_wave: the 8B's rows, see
    choose_config), else 2 programs an SM with >= 4."""
    return _one_wave_split(tiles, k_steps, 3 * sms, 8) if one_wave else _pick_split(tiles, k_steps, 2 * sms, 4)


def _short_w8_warps(fmt: str, block_k: int) -> int:
    """Warps of a w8 GEMV program: 4, or fewer where a K step has fewer 16-column chunks than 4 warps have
    threads, so that each thread holds a chunk whole and its sums need no shuffles (SmolLM2's 576-column rows, 1024
    columns a step: 2 warps; H100 decode graph, session 39, SmolLM2 batch 1 / 2 tok/s 2,314 / 3,502 against 2,263 /
    3,268 in the MMA order, 2,343 / 3,458 against 2,298 / 3,304 in column order)."""
    if fmt != "w8":
        return 4
    return max(1, min(4, block_k // (16 * 32)))


def choose_config(m: int, n: int, k: int, fmt: str, device: torch.device,
                  sm_count: int | None = None, mma_order: bool = False) -> LinearConfig:
    """Shape heuristics (no autotuning: it must also run under the CPU interpreter). GPU numbers come
    from sweeps on an H200 (`edged bench kernels --sweep`). sm_count: a CUDA device's SMs, given rather
    than asked for (`edged bench sass` compiles for a GPU that is not there). mma_order: w8 stored in the
    MMA order (LinearWeight.mma_order, as prepacked weights are on CUDA)."""
    sms = sm_count or _sm_count(device)
    if device.type != "cuda":
        if m == 1:
            split = _pick_split(-(-n // 4), -(-k // 64), 2 * sms, 1)
            return LinearConfig("gemv", 1, 4, 64, split, num_warps=4, num_stages=1)
        block_m = 16 if m <= 16 else 32
        split = _pick_split(-(-m // block_m) * -(-n // 32), -(-k // 64), 2 * sms, 2)
        return LinearConfig("matmul", block_m, 32, 64, split, num_warps=4, num_stages=1)
    if m == 1:
        # From the H200 sweeps over the SmolLM2 / 1B / 8B decode shapes (`edged bench kernels --sweep`;
        # the last one after the weights became "magic + q" floats, 2026-12-02): 4 weight rows a
        # program (quantized: 2 in layers of at most 2048 x 2048, and w8 layers of at most 8192 rows
        # and K >= 4096: more programs for them; 8B w8 down 21.1 -> 18.1 us), 1024 columns a step
        # where rows are short (K <= 1024, else lanes idle), 2048 from there, and 4096 for w4 rows
        # longer than 4096 in at most 2048 rows (the 1B's down; the 8B's is a long-rows layer below) and
        # w8 layers of more than 8192 rows (the 8B lm_head 160.7 -> 152.8 us). Split K only while the
        # rows alone leave SMs idle.
        quantized = fmt in ("w4", "w8")
        # long rows in 2049-8192 of them (8B qkv, o, down): 2048-column steps over 2 warps, so that twice the
        # programs fit an SM and the 8B's 2048 programs run in one wave, not 1.29 (w8) or 1.94 (w4's down at
        # 4096 columns); H200 decode graph (session 26), 8B batch 1, tok/s: w8 385 -> 403, w4 430 -> 447. The
        # 1B's down (2048 rows, under one wave either way) lost with it: w8 1,618 -> 1,595, w4 1,684 -> 1,624
        long_rows = quantized and 2048 < n <= 8192 and k >= 4096
        if (fmt == "w8" and n > 8192 and k >= 4096) or (fmt == "w4" and k > 4096 and not long_rows):
            block_k = 4096
        else:
            block_k = 2048 if quantized and k > 1024 else 1024
        rows = 2 if (quantized and n <= 2048 and k <= 2048) or (fmt == "w8" and n <= 8192 and k >= 4096) else 4
        split = _pick_split(-(-n // rows), -(-k // block_k), 2 * sms, 2)
        # the large w8 GEMVs of 4096-column steps (8B gate_up, lm_head) compile to 124 registers, 4 programs an
        # SM; capped at 104, 5 an SM without spills: H200 decode graph (session 25), 8B w8 batch 1 370.7 -> 383.6
        # tok/s (cap 96 377.3, 88 381.5, 112 368.3); the 1B's 2048-column steps and w4 over 4 warps lose with a cap
        # the large w4 GEMVs of 1025-4096 columns (gate_up, lm_head) over 2 warps hold 121 registers, 8 programs an
        # SM; capped at 80, 12 without spills: H200 decode graph (session 27), batch 1, tok/s: 8B 447-449 -> 477-482, 1B
        # 1,681-1,684 -> 1,797-1,799 (SmolLM2's 576-column rows at 2048-column steps did not gain: 2,335 -> 2,327)
        large_w4 = fmt == "w4" and n > 8192 and 1024 < k <= 4096
        if fmt == "w8" and block_k == 4096:
            cap = LARGE_GEMV_W8_MAX_REGISTERS
        else:
            cap = LARGE_GEMV_W4_MAX_REGISTERS if large_w4 else None
        warps = LONG_ROW_GEMV_WARPS if long_rows else LARGE_GEMV_W4_WARPS if large_w4 else _short_w8_warps(fmt, block_k)
        return LinearConfig("gemv", 1, rows, block_k, split, num_warps=warps, num_stages=1, max_registers=cap)
    if fmt == "dense":
        return LinearConfig("torch")  # cuBLAS is at bandwidth for dense weights from M = 2 on
    short = k <= SHORT_K
    if fmt in ("w8", "w4") and m <= (X_ROWS_GEMV_MAX if not short else
                                     X_ROWS_GEMV_MAX_SHORT_K_W4 if fmt == "w4" else X_ROWS_GEMV_MAX_SHORT_K):
        # a few sequences: the GEMV of several x rows (_gemv_x_rows_kernel), each weight converted once. H200,
        # in-graph decode steps (docs/BENCHMARKS.md, session 23), tok/s against the swap matmul below: 2 rows
        # SmolLM2 3,566 / 1,943, 1B 2,255 / 1,513, 8B 579 / 352; 4 rows SmolLM2 5,000 / 3,815 but 1B 2,552 /
        # 3,000 and 8B 621 / 695 (a row of x costs it ~0.7 ms a step at 8B: it is bound by issuing FMAs).
        # w4 (session 24, against its 16-row tiles): 2 rows SmolLM2 3,603 / 1,505, 1B 2,228 / 1,361, 8B 448 /
        # 286; 3 rows 8B 503 / 427, 4 rows 8B 523 / 565; SmolLM2 up to 8 rows (7,720 / 5,692)
        # w4: a whole 16-byte chunk a thread, so its sums need no shuffles (sm_90 SASS): 2048 bytes a step at
        # K >= 4096 over 4 warps, fewer warps where the rows are shorter
        block_k = 4096 if fmt == "w4" and k >= 4096 else 2048 if k > 1024 else 1024
        warps = max(1, min(4, block_k // 1024)) if fmt == "w4" else _short_w8_warps(fmt, block_k)
        return LinearConfig("gemv", 1, 2, block_k, _pick_split(-(-n // 2), -(-k // block_k), 2 * sms, 2),
                            num_warps=warps, num_stages=1)
    if m <= 64:
        # decode batches: still weight-bandwidth bound; split K to fill the SMs (w4 wants more
        # programs: its dequantization is the slower part)
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        if fmt == "w8" and block_m <= 32:
            # the swap form (below) at 16 and 32 rows: same sweep, tok/s against the former 16 x 64 x 256 and
            # 32 x 64 x 128 tiles, batch 8 / 16 / 32: SmolLM2 7,226 / 13,607 / 21,459 against 5,192 / 9,902 /
            # 21,072, 1B 5,601 / 10,479 / 18,739 against 4,319 / 8,569 / 15,095, 8B 1,344 / 2,568 / 4,646
            # against 928 / 1,815 / 3,260. Short rows want narrower tiles and fewer programs
            block_n, target = (64, 2 * sms) if short else (128, 4 * sms)
            # longer rows at 16 rows: the plain form with bytes made floats by one prmt each beats the swap
            # form (same sweep, session 24, tok/s at batch 4 / 8 / 16: 1B 3,152 / 5,870 / 10,956 against
            # 2,987 / 5,577 / 10,400, 8B 754 / 1,460 / 2,749 against 689 / 1,321 / 2,518); not at 32 rows
            # (1B 17,797 against 18,715, 8B 4,436 against 4,636) nor for SmolLM2 (12,921 against 13,800 at 16)
            # In the MMA order the swap form reads its bytes by ldmatrix and converts them by one prmt, and wins
            # there too (H100 decode graph, session 39, tok/s at batch 8 / 16: 1B 6,374 / 12,001 against
            # 6,256 / 11,842, 8B 1,417 / 2,672 against 1,375 / 2,654)
            plain = block_m == 16 and not short and not mma_order
            return LinearConfig("matmul", block_m, block_n, 64,
                                _pick_split(-(-m // block_m) * -(-n // block_n), -(-k // 64), target, 4),
                                num_warps=4, num_stages=3, swap=not plain, asm_dequant=plain)
        if fmt == "w8" and block_m == 64 and short:
            # SmolLM2's short rows at 33-64 rows: the swap form over 64 x 64 tiles, 2 programs an SM. H200 decode
            # graph (session 34), tok/s at batch 40 / 48 / 56 / 64 against the plain form with bytes made floats
            # by one prmt each (which won while the swap form's wgmmas were serialized, session 25): 33,015 /
            # 37,723 / 42,932 / 48,027 against 32,383 / 37,133 / 42,184 / 46,911; the 64 x 128 swap tiles below
            # 33,747 / 42,770 at 48 / 64; 1 or 3 programs an SM the same, one wave of 3 slower
            return LinearConfig("matmul", 64, 64, 64, _pick_split(-(-n // 64), -(-k // 64), 2 * sms, 4),
                                num_warps=4, num_stages=3, swap=True)
        if block_m == 64:
            # w8 (H200 sweep over the 1B / 8B decode linears at M = 64, docs/BENCHMARKS.md, session 16): the
            # weight tile as the dot's first operand, 128 x 64 tiles, 0.73x the time of w4's form summed over
            # the shapes. Rows of K >= 4096 (the 8B): w8's programs fit 3 an SM (sm_90: 150 registers, 41.5 KB
            # shared), so splits fill one wave of them, >= 8 K steps each. H200, session 32, every split swept
            # (as `edged bench kernels --split-sweep` does), the 8B's matmuls summed over a step at M = 64: w8
            # 6.90 -> 6.13 ms (the best split per linear: 6.13), w4 9.42 -> 8.37 (8.09); decode graph, batch
            # 64, tok/s: w8 7,437 -> 8,035, w4 5,718 -> 6,306.
            # Shorter rows keep 2 programs an SM (SmolLM2 w4's lm_head lost 1% with one wave of 3)
            split = _decode_batch_split(-(-n // 128), -(-k // 64), sms, one_wave=k >= 4096)
            return LinearConfig("matmul", 64, 128, 64, split, num_warps=4, num_stages=3, swap=fmt == "w8")
        if block_m == 16 and short:
            # w4's swap form, SmolLM2 at 9-16 rows (session 24 sweep, batch 16: 12,115 tok/s against 10,653)
            return LinearConfig("matmul", 16, 64, 64, _pick_split(-(-n // 64), -(-k // 64), 2 * sms, 4),
                                num_warps=4, num_stages=3, swap=True)
        # w4. At 17-32 rows over K >= 4096 (the 8B), splits for one wave of 3 programs an SM as at 33-64 rows:
        # H200 decode graph (session 32), 8B w4 batch 32: 3,614 -> 4,103 tok/s
        block_n, block_k = 128, (128 if block_m == 16 else 64)
        split = _decode_batch_split(-(-m // block_m) * -(-n // block_n), -(-k // block_k), sms,
                                    one_wave=block_m == 32 and k >= 4096)
        return LinearConfig("matmul", block_m, block_n, block_k, split, num_warps=4, num_stages=3)
    # prompt steps: split K too. Without it SmolLM2's 128-token step had 10-48 programs a linear for 132
    # SMs; H200, a prompt-step graph of 128 / 256 tokens (docs/BENCHMARKS.md, session 17): SmolLM2 w8
    # 2.92 / 3.62 -> 1.52 / 1.92 ms, 1B w8 7.20 / 7.57 -> 2.83 / 3.83 ms, 1B w4 6.77 / 8.76 -> 3.20 / 4.89 ms
    if fmt == "w8" and m <= 128:
        tiles = -(-m // 64) * -(-n // 128)
        return LinearConfig("matmul", 64, 128, 64, _pick_split(tiles, -(-k // 64), 2 * sms, 4), num_warps=4,
                            num_stages=3, swap=True)
    block_m = 64 if m <= 128 else 128
    tiles = -(-m // block_m) * -(-n // 128)
    return LinearConfig("matmul", block_m, 128, 64, _pick_split(tiles, -(-k // 64), 2 * sms, 4),
                        num_warps=8 if block_m == 128 else 4, num_stages=3)


def _torch_linear(x: torch.Tensor, w: LinearWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """Dense weights through cuBLAS: float32 accumulation, the result rounded once to out_dtype."""
    if out_dtype == x.dtype:
        return F.linear(x, w.data.to(x.dtype), None if w.bias is None else w.bias.to(x.dtype))
    # float32 logits from half-precision operands without a float32 copy of the weight
    y = torch.mm(x.reshape(-1, x.shape[-1]), w.data.to(x.dtype).t(), out_dtype=out_dtype)
    if w.bias is not None:
        y += w.bias.to(out_dtype)
    return y.reshape(*x.shape[:-1], -1)


FUSED_INPUT_MAX_WEIGHTS = 1 << 23
X_ROWS_GEMV_MAX = 3  # rows of x up to which grouped w8 and w4 take the GEMV of several x rows (choose_config)
X_ROWS_GEMV_MAX_SHORT_K = 4  # the same where rows are short (SmolLM2: K <= SHORT_K)
X_ROWS_GEMV_MAX_SHORT_K_W4 = 8  # and for w4 where rows are short
SHORT_K = 1536
# the hidden sizes up to which a split-K sum of several rows makes silu(gate) * up and the norm after, saving two
# kernels a layer. H200 decode step (session 31), tok/s at batch 64, w8: SmolLM2 (576) 44,805 -> 47,411; the
# 1B (2048) 34,551 -> 33,643 and 1B w4 29,036 -> 28,089 (a row norm a program: 64 programs at batch 64), 8B
# (4096) 7,482 -> 7,469; the gate alone: 1B 33,533, 8B 7,524
SUM_FUSES_MAX_HIDDEN = 1024
LONG_ROW_GEMV_WARPS = 2  # warps a program of the one-row GEMVs of long rows in 2049-8192 rows (choose_config)
LARGE_GEMV_W4_WARPS = 2  # and of the one-row w4 GEMVs of more than 8192 rows (choose_config)
# ptxas cap on the one-row w8 GEMVs of 4096-column steps (choose_config): 104 kept 5 programs an SM in column order;
# the MMA order's x permutation holds 101 there (4 an SM), 96 keeps 5 without spills (sm_90 SASS, Triton 3.9)
LARGE_GEMV_W8_MAX_REGISTERS = 96
LARGE_GEMV_W4_MAX_REGISTERS = 80  # the same on the one-row w4 GEMVs of more than 8192 rows, over 2 warps
X_ROWS_PER_LAUNCH = 8  # rows of x one _gemv_x_rows_kernel launch takes (at most 8)
X_ROWS_PER_LAUNCH_W4 = 4  # and one _gemv_w4_x_rows_kernel launch (at most 4)


def _gemv_counters(device: torch.device, rows: int, split: int, unused: torch.Tensor) -> torch.Tensor:
    """The arrival counters of a GEMV split over K (one per row block), or any tensor when unsplit."""
    if split == 1:
        return unused
    check_groups(rows)
    return split_counters(device)


def exact_gemv(x_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Does the decode GEMV take each weight's constant off (EXACT) rather than once a chunk? The
    "magic + q" weights cost the dot about 2**-16 of its size: ~1/8 ulp of a bfloat16 result, up to 2
    ulps of a float16 one; so everything but bfloat16 in and out (the logits are float32) is exact."""
    return not (x_dtype == torch.bfloat16 and out_dtype == torch.bfloat16)


def quarter_xsum(k: int) -> bool:
    """Whether the w8 GEMVs of rows of k columns sum x's chunks from its quarters (_x_step). Under Triton 3.6 a sum
    of the whole tile compiled through a lane exchange in the one-row GEMV of SmolLM2's short rows (960x576), in
    another order than the x-rows GEMV's, so that the two differed in the last bit where the sums are inexact. From
    the quarters they agree and SmolLM2 decodes faster (H200, w8 batch 1: 2,344-2,396 -> 2,399-2,440 tok/s); long
    rows keep the tile's sum, which both kernels take alike, because there the quarters cost the 8B 3% (402.6 ->
    389.7) and gained the 1B nothing."""
    return k <= SHORT_K


def _k_split(row: int, step: int, split: int) -> tuple[int, int]:
    """A row of `row` columns (w4: bytes) cut into at most `split` pieces of whole steps: (a piece's
    columns, the pieces)."""
    per = -(-(-(-row // max(1, split))) // step) * step
    return per, -(-row // per)


def _x_rows_steps(k: int, fmt: int, cfg: LinearConfig) -> tuple[int, int]:
    """The GEMV of several x rows' row length and K step, both in bytes for w4 (two weights a byte)."""
    return (k // 2, max(16, cfg.block_k // 2)) if fmt == 2 else (k, max(cfg.block_k, 32))


@dataclass(frozen=True)
class NormAfter:
    """An RMSNorm of the linear's result (the residual stream), made by the split-K sum (linear_add_norm)."""
    weight: torch.Tensor
    eps: float
    out: torch.Tensor  # [M, N], written by the sum


def _sum_splits(part: torch.Tensor, bias: torch.Tensor, res: torch.Tensor, out: torch.Tensor, split: int,
                has_bias: bool, residual: bool, stream: bool = False, gated: bool = False,
                norm: NormAfter | None = None) -> None:
    """out = the split-K partials [split, m, n] summed in split order, through the bias and residual
    (stream: the partials are read for the last time: evict them first). gated: out [m, n / 2] is
    silu(gate) * up of the sums. norm: its out is also rms_norm(out) * its weight, from the same kernel."""
    _, m, n = part.shape
    evict = "evict_first" if stream else ""
    if norm is not None:
        block = triton.next_power_of_2(n)
        _splitk_reduce_norm_kernel[(m,)](part, bias, res, out, norm.weight, norm.out, n, m * n, norm.eps,
                                         HAS_BIAS=has_bias, RESIDUAL=residual, BLOCK=block, SPLITS=split,
                                         PART_EVICT=evict, num_warps=norm_warps(block), **pdl_launch(out.device))
        return
    block = 512  # 4 outputs a thread: with every split's load in flight (_split_sum), 64 registers at 16 splits
    _splitk_reduce_kernel[(triton.cdiv(out.numel(), block),)](part, bias, res, out, out.numel(), n, m * n,
                                                              HAS_BIAS=has_bias, RESIDUAL=residual, GATED=gated,
                                                              BLOCK=block, SPLITS=split, PART_EVICT=evict,
                                                              **pdl_launch(out.device))


def _gemv_x_rows(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor,
                 out: torch.Tensor, res: torch.Tensor | None, w: LinearWeight, fmt: int, sym: bool, exact: bool,
                 cfg: LinearConfig, gated: bool = False, norm: NormAfter | None = None) -> None:
    """Launch the GEMV of several x rows (_gemv_x_rows_kernel: dense or w8, 1-8 rows; _gemv_w4_x_rows_kernel:
    1-4), and the split-K sum after it (gated, norm: _sum_splits', when K is split)."""
    m, k = x.shape
    n = w.out_features
    row, step = _x_rows_steps(k, fmt, cfg)
    per, split = _k_split(row, step, cfg.split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    resid = res if res is not None else out
    common = dict(HAS_BIAS=w.bias is not None, SPLIT=split > 1, EVEN_K=row % step == 0,
                  GROUP_SIZE=max(w.group_size, 1), ROWS=cfg.block_n, XROWS=m, RESIDUAL=res is not None,
                  ASM=asm_conversions(x.device), EXACT=exact, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  **pdl_launch(x.device))
    grid = (triton.cdiv(n, cfg.block_n), split)
    if fmt == 2:
        xw = _x_words(x)
        _gemv_w4_x_rows_kernel[grid](
            xw, data, scale, minimum, bias, out, part, resid, m, n, row, per, xw.stride(0), data.stride(0),
            scale.stride(0), out.stride(0), resid.stride(0), X_KIND=_X_KINDS[x.dtype], BLOCK_KB=step, **common)
    else:
        _gemv_x_rows_kernel[grid](
            x, data, scale, minimum, bias, out, part, resid, m, n, k, per, x.stride(0), data.stride(0),
            scale.stride(0) if fmt else 0, out.stride(0), resid.stride(0), FORMAT=fmt, BLOCK_K=step,
            VEC=16 // data.element_size(), SYM=sym, QUARTER_XSUM=quarter_xsum(k), MMA=w.mma_order, **common)
    if split > 1:
        _sum_splits(part, bias, resid, out, split, w.bias is not None, res is not None, gated=gated, norm=norm)


def linear(x: torch.Tensor, w: LinearWeight, config: LinearConfig | None = None,
           out_dtype: torch.dtype | None = None, *, norm_weight: torch.Tensor | None = None,
           norm_eps: float = 0.0, silu_mul: bool = False, residual: torch.Tensor | None = None,
           silu_mul_out: bool = False, fuse_input: bool | None = None) -> torch.Tensor:
    """y = x @ W^T + b for x [..., K], accumulated in float32, returned in out_dtype (default x's).

    Fused forms (reference.linear says what each computes): norm_weight, x is RMSNorm(x) * norm_weight
    first; silu_mul, x [..., 2K] holds [gate | up] and the input is silu(gate) * up; residual, the
    rounded result plus residual; silu_mul_out, W's rows are [gate | up] and the result is
    silu(gate) * up [..., N / 2]. One kernel for a single row (the decode GEMV) whatever the form;
    several rows run the norm and the SiLUs as their own kernels (the matmul adds the residual).
    fuse_input overrides the size rule for the norm and the SiLUs of a single row (benchmarks).
    Under PDL the decode GEMV loads its residual (and bias) before the wait on the kernel launched just
    before it: that kernel must not write the residual (in the model an earlier one always does)."""
    return _linear(x, w, config, out_dtype, norm_weight, norm_eps, silu_mul, residual, silu_mul_out, fuse_input,
                   None)[0]


def linear_add_norm(x: torch.Tensor, w: LinearWeight, residual: torch.Tensor, norm_weight: torch.Tensor,
                    norm_eps: float, config: LinearConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h = linear(x, w, residual=residual), the residual stream, and rms_norm(h, norm_weight, norm_eps)'s
    output where one kernel makes both: the split-K sum (several rows with K split, as decode batches are, and
    a hidden size of at most SUM_FUSES_MAX_HIDDEN) or, after cuBLAS (dense weights, several rows), rms_norm's
    residual form; else None: the next linear norms h itself (the decode GEMV in its prologue)."""
    return _linear(x, w, config, None, None, 0.0, False, residual, False, None, (norm_weight, norm_eps))


def _split_count(cfg: LinearConfig, k: int, fmt: int) -> int:
    """The K splits a launch of several rows of x makes (its partials then go through _sum_splits)."""
    if cfg.kind == "gemv":
        return _k_split(*_x_rows_steps(k, fmt, cfg), cfg.split)[1]
    return _k_split(k, max(cfg.block_k, 32), max(1, cfg.split))[1]


def _linear(x: torch.Tensor, w: LinearWeight, config: LinearConfig | None, out_dtype: torch.dtype | None,
            norm_weight: torch.Tensor | None, norm_eps: float, silu_mul: bool, residual: torch.Tensor | None,
            silu_mul_out: bool, fuse_input: bool | None,
            norm_after: tuple[torch.Tensor, float] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """linear, and (norm_after: its weight and eps) the norm of the result where a split-K sum makes it."""
    out_dtype = out_dtype or x.dtype
    if silu_mul_out:
        check_silu_mul_out(w, residual)
    k = w.in_features
    n = w.out_features
    lead = x.shape[:-1]
    width = 2 * k if silu_mul else k
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n // 2 if silu_mul_out else n, dtype=out_dtype), None
    cfg = config or choose_config(m, n, k, w.format, x.device, mma_order=w.mma_order)
    # RMSNorm / SiLU in the GEMV's prologue only where the GEMV is small (launch-bound): each program
    # recomputes the row's inverse RMS or the SiLU of its columns, which on an H200 costs more than
    # the separate kernel from about 8M weights on (w8 28672x4096: +40 us against ~3 us). SiLU in the
    # epilogue too: a program then streams a gate and an up row block far apart, which measured 1-2 us
    # slower than the plain GEMV + silu_and_mul at 1B and 8B gate_up shapes (docs/BENCHMARKS.md)
    if fuse_input is None:
        fuse_input = n * k <= FUSED_INPUT_MAX_WEIGHTS
    fuse_input = fuse_input and cfg.kind == "gemv" and m == 1
    if not fuse_input and norm_weight is not None:
        x2, _ = rms_norm(x2, norm_weight, norm_eps)
        norm_weight = None
    if not fuse_input and silu_mul:
        x2 = silu_and_mul(x2)
        silu_mul = False
    res2 = None if residual is None else residual.reshape(m, n)
    fmt = _FORMATS[w.format]
    # several rows of x split over K in a model of short rows: the sum of the splits also makes silu(gate) * up
    # (gate_up's K is the hidden size), or the norm after (o's and down's N is)
    sums_splits = m > 1 and cfg.kind != "torch" and _split_count(cfg, k, fmt) > 1
    gate_in_sum = silu_mul_out and sums_splits and k <= SUM_FUSES_MAX_HIDDEN
    if silu_mul_out and not fuse_input and not gate_in_sum:
        y = linear(x2, w, cfg, out_dtype)
        return silu_and_mul(y).reshape(*lead, n // 2), None
    if cfg.kind == "torch":
        y = _torch_linear(x2, w, out_dtype)
        if res2 is not None and norm_after is not None:
            # the add and the norm after it in rms_norm's one kernel, not a torch add then the next linear's norm:
            # H100 decode step (session 43), 8B dense batch 64: 64 adds a step, 106-112 us of 7.99 ms
            normed, h = rms_norm(y, norm_after[0], norm_after[1], residual=res2)
            return h.reshape(*lead, n), normed.reshape(*lead, n)
        if res2 is not None:
            y = y + res2  # rounds once more, as the fused epilogue does
        return y.reshape(*lead, n), None
    if res2 is not None and (not res2.is_contiguous() or res2.dtype != out_dtype):
        res2 = res2.to(out_dtype).contiguous()
    if fmt and k % w.group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {w.group_size}")
    if fmt == 1 and w.group_size % 32 and w.group_size != k:
        raise ValueError(f"w8 group_size {w.group_size} is neither a multiple of 32 nor the whole row")
    data = w.data if w.data.stride(-1) == 1 else w.data.contiguous()
    scale = w.scale if w.scale is not None else data
    sym = fmt == 1 and w.minimum is None  # GGUF Q8_0's symmetric w8: w = (q - 128) * scale
    minimum = w.minimum if w.minimum is not None else scale
    bias = w.bias if w.bias is not None else data
    out = torch.empty(m, n // 2 if silu_mul_out else n, dtype=out_dtype, device=x.device)
    normed = torch.empty_like(out) if norm_after is not None and sums_splits and n <= SUM_FUSES_MAX_HIDDEN else None
    res = res2 if res2 is not None else out
    nw = norm_weight.to(x.dtype).contiguous() if norm_weight is not None else out
    fused = dict(NORM=norm_weight is not None, SILU=silu_mul, GATED=silu_mul_out)
    exact = exact_gemv(x.dtype, out_dtype)
    if cfg.kind == "gemv" and cfg.block_n not in (1, 2, 4):
        raise ValueError(f"a GEMV program takes 1, 2 or 4 weight rows, not {cfg.block_n}")
    if cfg.kind == "gemv" and m > 1:
        if cfg.block_n > 2:
            raise ValueError(f"a GEMV of {m} rows of x takes 1 or 2 weight rows a program, not {cfg.block_n}")
        per_launch = X_ROWS_PER_LAUNCH_W4 if fmt == 2 else X_ROWS_PER_LAUNCH
        for m0 in range(0, m, per_launch):
            rows = slice(m0, min(m0 + per_launch, m))
            norm = None if normed is None else NormAfter(norm_after[0], norm_after[1], normed[rows])
            _gemv_x_rows(x2[rows], data, scale, minimum, bias, out[rows], None if res2 is None else res2[rows], w,
                         fmt, sym, exact, cfg, silu_mul_out, norm)
        return out.reshape(*lead, out.shape[-1]), _rows_as(normed, lead)
    split = max(1, cfg.split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    rows_per_program = max(cfg.block_n, 2) if silu_mul_out else cfg.block_n  # a gate row and its up row
    # programs of the GEMV: each makes rows_per_program results, or half as many gated outputs
    programs = triton.cdiv(n // 2, rows_per_program // 2) if silu_mul_out else triton.cdiv(n, rows_per_program)
    cap = {"maxnreg": cfg.max_registers} if cfg.max_registers else {}
    if fmt == 2 and cfg.kind == "gemv":
        kb = k // 2  # bytes a row; a whole number of 16-byte chunks since groups are >= 32 weights
        block_kb = max(16, cfg.block_k // 2)
        per, split = _k_split(kb, block_kb, split)
        _gemv_w4_kernel[(programs, split)](
            _x_words(x2), data, scale, minimum, bias, out, part, _gemv_counters(x.device, programs, split, out),
            _x_words(nw) if norm_weight is not None else out, res, norm_eps, n, kb, per, split, data.stride(0),
            scale.stride(0), X_KIND=_X_KINDS[x.dtype], HAS_BIAS=w.bias is not None, SPLIT=split > 1,
            EVEN_K=kb % block_kb == 0, GROUP_SIZE=w.group_size, ROWS=rows_per_program, BLOCK_KB=block_kb,
            RESIDUAL=res2 is not None, **fused, ASM=asm_conversions(x.device), EXACT=exact, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **cap, **pdl_launch(x.device))
    else:
        block_k = max(cfg.block_k, 32)
        row_group = fmt == 1 and w.group_size == k
        per, split = _k_split(k, block_k, split)
        even_k = k % block_k == 0
        if cfg.kind == "gemv":
            _gemv_kernel[(programs, split)](
                x2, data, scale, minimum, bias, out, part, _gemv_counters(x.device, programs, split, out), nw, res,
                norm_eps, n, k, per, split, data.stride(0), scale.stride(0) if fmt else 0, FORMAT=fmt,
                HAS_BIAS=w.bias is not None, SPLIT=split > 1, EVEN_K=even_k, GROUP_SIZE=max(w.group_size, 1),
                ROWS=rows_per_program, BLOCK_K=block_k,
                VEC=16 // data.element_size(), RESIDUAL=res2 is not None, **fused, ASM=asm_conversions(x.device),
                EXACT=exact, SYM=sym, QUARTER_XSUM=quarter_xsum(k), MMA=w.mma_order, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, **cap, **pdl_launch(x.device))
        else:
            # one tile of rows (decode batches): the split partials are marked to stay in the L2 for the sum, which
            # marks them to leave it first, while weights stream past (H200 decode step, session 30: 1B w8 batch 64
            # 32,718 -> 33,107 tok/s, SmolLM2 42,517 -> 43,066, 1B w4 26,543 -> 26,875; 8B +0.2-0.8%)
            stream = m <= cfg.block_m
            tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
            swap = cfg.swap and fmt in (1, 2) and not row_group
            # the swap form converts bytes by one prmt each (magic_u8_f32_asm) where the MMA order has its 4 bytes in
            # one register; in column order they come two at a time and are repacked first (session 36)
            _matmul_kernel[(tiles, split)](
                x2, data, scale, minimum, bias, out, part, res, m, n, k, per,
                x2.stride(0), data.stride(0), scale.stride(0) if fmt else 0, out.stride(0), res.stride(0),
                FORMAT=fmt, HAS_BIAS=w.bias is not None, SPLIT=split > 1, EVEN_K=even_k,
                GROUP_SIZE=max(w.group_size, 1), ROW_GROUP=row_group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                BLOCK_K=block_k, GROUP_M=8, RESIDUAL=res2 is not None,
                SWAP=swap, PREFETCH=cfg.prefetch and fmt == 1 and not row_group,
                SYM=sym, ASM=fmt == 1 and (cfg.asm_dequant or (w.mma_order and swap)) and asm_conversions(x.device),
                PART_EVICT="evict_last" if stream else "", MMA=w.mma_order,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cap, **pdl_launch(x.device))
            if split > 1:
                norm = None if normed is None else NormAfter(norm_after[0], norm_after[1], normed)
                _sum_splits(part, bias, res, out, split, w.bias is not None, res2 is not None, stream,
                            silu_mul_out, norm)
    return out.reshape(*lead, out.shape[-1]), _rows_as(normed, lead)


def _rows_as(t: torch.Tensor | None, lead: torch.Size) -> torch.Tensor | None:
    return None if t is None else t.reshape(*lead, t.shape[-1])
