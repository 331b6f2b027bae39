"""`linear` on the GPU: y = x @ W^T + b for dense, w8 and w4 weights, dequantizing inside the loop.

Paths, by the number of rows M of x:
- M == 1 (decode of one sequence): a GEMV that streams BLOCK_N weight rows per program, optionally
  split over K (partials in float32, summed by a small reduce kernel; deterministic, no atomics).
  This is the memory-bound path that must run at DRAM bandwidth.
- M > 1: a tiled tl.dot kernel with dequantization in the loop, split over K while the output tiles
  alone cannot fill the GPU (decode batches). Dense weights at large M go to cuBLAS (torch).

w4 columns are never interleaved in registers: byte j of a row holds columns 2j (low nibble) and
2j+1 (high nibble), so the kernels multiply the low nibbles with x[0::2] and the high ones with
x[1::2]; the group of both is (2j) // group_size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .triton_convert import i8_to, i8_to_f32, small_uint_to_f32
from .weights import LinearWeight

_FORMATS = {"dense": 0, "w8": 1, "w4": 2}


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, N, K, k_per_split, stride_wn,
                 FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row of x against dense or w8 weights; program (n tile, k split)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ld = tl.minimum(n, N - 1)  # clamp instead of masking: the loop's loads stay unpredicated
    rows = w_ptr + n_ld.to(tl.int64)[:, None] * stride_wn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    zero = 0 * n[:, None]  # x is loaded as a broadcast [BLOCK_N, BLOCK_K] tile: the weights' layout, no shuffle
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            xv = tl.load(x_ptr + k[None, :] + zero).to(tl.float32)
            wv = tl.load(rows + k[None, :])
        else:
            km = k < k_hi
            xv = tl.load(x_ptr + k[None, :] + zero, mask=km[None, :], other=0.0).to(tl.float32)
            wv = tl.load(rows + k[None, :], mask=km[None, :], other=0)
        if FORMAT == 1:
            wf = i8_to_f32(wv)
        else:
            wf = wv.to(tl.float32)
        acc += wf * xv
    y = tl.sum(acc, axis=1)
    if FORMAT == 1:
        y = y * tl.load(scale_ptr + n_ld).to(tl.float32)
    if SPLIT:
        tl.store(part_ptr + pid_k * N + n, y, mask=n < N)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + n_ld).to(tl.float32)
        tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < N)


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
def _gemv_w4_kernel(xw_ptr, w_ptr, scale_ptr, min_ptr, bias_ptr, out_ptr, part_ptr, N, num_groups,
                    g_per_split, stride_wn, stride_sn,
                    X_KIND: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_G: tl.constexpr,
                    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, HALF_GROUP: tl.constexpr):
    """One row of x against w4 weights. Tiles are [BLOCK_N, GROUPS, HALF_GROUP] bytes so that the
    scale and minimum of a group broadcast over its bytes without a gather. x comes as words that
    each hold the pair (x[2j], x[2j+1]) of byte j, loaded in the bytes' layout (no shuffles)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ld = tl.minimum(n, N - 1)
    n64 = n_ld.to(tl.int64)
    j = tl.arange(0, HALF_GROUP)
    zero = 0 * n[:, None, None]
    g_lo = pid_k * g_per_split
    g_hi = tl.minimum(g_lo + g_per_split, num_groups)
    acc = tl.zeros([BLOCK_N, GROUPS, HALF_GROUP], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, GROUPS):
        g = g0 + tl.arange(0, GROUPS)
        byte = g[:, None] * HALF_GROUP + j[None, :]  # [GROUPS, HALF_GROUP]
        w_ptrs = w_ptr + n64[:, None, None] * stride_wn + byte[None, :, :]
        x_ptrs = xw_ptr + byte[None, :, :] + zero
        s_ptrs = scale_ptr + n64[:, None] * stride_sn + g[None, :]
        m_ptrs = min_ptr + n64[:, None] * stride_sn + g[None, :]
        if EVEN_G:
            b = tl.load(w_ptrs)
            xv = tl.load(x_ptrs)
            s = tl.load(s_ptrs).to(tl.float32)
            mn = tl.load(m_ptrs).to(tl.float32)
        else:
            gm = g < g_hi
            b = tl.load(w_ptrs, mask=gm[None, :, None], other=0)
            xv = tl.load(x_ptrs, mask=gm[None, :, None], other=0)
            s = tl.load(s_ptrs, mask=gm[None, :], other=0.0).to(tl.float32)
            mn = tl.load(m_ptrs, mask=gm[None, :], other=0.0).to(tl.float32)
        xe, xo = _x_pairs(xv, X_KIND)
        bi = b.to(tl.int32)
        lo = small_uint_to_f32(bi & 0x0F)
        hi16 = small_uint_to_f32(bi & 0xF0)  # 16 * high nibble: saves the shift, undone by s / 16
        s3 = s[:, :, None]
        m3 = mn[:, :, None]
        acc += (lo * s3 + m3) * xe + (hi16 * (s3 * 0.0625) + m3) * xo
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if SPLIT:
        tl.store(part_ptr + pid_k * N + n, y, mask=n < N)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + n_ld).to(tl.float32)
        tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, k_per_split,
                   stride_xm, stride_wn, stride_sn, stride_om,
                   FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                   GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """x [M, K] @ W^T with W dequantized per tile to x's dtype; program (output tile, k split).
    For w4 each group is two dots: its low nibbles with x's even columns, high nibbles with odd."""
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
    x_rows = x_ptr + rm_ld.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn64[None, :] * stride_wn
    dt = x_ptr.dtype.element_ty
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FORMAT == 2:
        # one group at a time (BLOCK_K is a multiple of the group): its scale and minimum are
        # vectors over N, and x's even / odd columns meet the low / high nibbles
        jb = tl.arange(0, GROUP_SIZE // 2)
        jx = tl.arange(0, GROUP_SIZE)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            for gi in tl.static_range(BLOCK_K // GROUP_SIZE):
                kg = k0 + gi * GROUP_SIZE
                s_ptrs = scale_ptr + rn64 * stride_sn + kg // GROUP_SIZE
                m_ptrs = min_ptr + rn64 * stride_sn + kg // GROUP_SIZE
                if EVEN_K:
                    xt = tl.load(x_rows + kg + jx[None, :])
                    b = tl.load(w_cols + kg // 2 + jb[:, None])
                    s = tl.load(s_ptrs).to(tl.float32)
                    mn = tl.load(m_ptrs).to(tl.float32)
                else:
                    # groups never straddle k_hi: K and the splits are whole groups
                    xt = tl.load(x_rows + kg + jx[None, :], mask=(kg + jx[None, :]) < k_hi, other=0.0)
                    b = tl.load(w_cols + kg // 2 + jb[:, None], mask=(kg + 2 * jb[:, None]) < k_hi, other=0)
                    valid = (kg + 0 * rn) < k_hi
                    s = tl.load(s_ptrs, mask=valid, other=0.0).to(tl.float32)
                    mn = tl.load(m_ptrs, mask=valid, other=0.0).to(tl.float32)
                xe, xo = tl.split(tl.reshape(xt, (BLOCK_M, GROUP_SIZE // 2, 2)))
                bi = b.to(tl.int32)
                lo = (small_uint_to_f32(bi & 0x0F) * s[None, :] + mn[None, :]).to(dt)
                hi = (small_uint_to_f32(bi >> 4) * s[None, :] + mn[None, :]).to(dt)
                acc += tl.dot(xe, lo)
                acc += tl.dot(xo, hi)
    else:
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
                wt = i8_to(wv, dt)
            else:
                wt = wv.to(dt)
            acc += tl.dot(xv, wt)
    if FORMAT == 1:
        acc = acc * tl.load(scale_ptr + rn64).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:
        tl.store(part_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn64).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, num_splits,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum over splits of part[s, m, n] (+ bias[n]), in a fixed order (deterministic)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
    """Launch parameters. GEMV: block_n rows per program, block_k weights per step (w4: groups per
    step = block_k // group_size). Matmul: block_m x block_n tiles over block_k. split: K splits."""

    kind: str  # "gemv" | "matmul" | "torch"
    block_m: int = 16
    block_n: int = 16
    block_k: int = 256
    split: int = 1
    num_warps: int = 4
    num_stages: int = 2


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: small grids, but still exercise the split path
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _pick_split(tiles: int, k_steps: int, sms: int, min_steps: int) -> int:
    """Split K until there are about two programs per SM, keeping >= min_steps steps per split."""
    want = max(1, -(-2 * sms // tiles))
    return max(1, min(want, k_steps // min_steps, 16))


def choose_config(m: int, n: int, k: int, fmt: str, device: torch.device) -> LinearConfig:
    """Shape heuristics (no autotuning: it must also run under the CPU interpreter)."""
    sms = _sm_count(device)
    on_gpu = device.type == "cuda"
    if m == 1:
        block_n = 8 if on_gpu else 16
        block_k = (512 if fmt == "w4" else 512 if fmt == "w8" else 256) if on_gpu else 64
        tiles = -(-n // block_n)
        split = _pick_split(tiles, -(-k // block_k), sms, 4 if on_gpu else 1)
        return LinearConfig("gemv", 1, block_n, block_k, split, num_warps=4, num_stages=3 if on_gpu else 1)
    if on_gpu and fmt == "dense" and m > 64:
        return LinearConfig("torch")
    if not on_gpu:
        block_m = 16 if m <= 16 else 32
        tiles = -(-m // block_m) * -(-n // 32)
        split = _pick_split(tiles, -(-k // 64), sms, 2)
        return LinearConfig("matmul", block_m, 32, 64, split, num_warps=4, num_stages=1)
    if m <= 64:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n = 64
        block_k = 128
        tiles = -(-m // block_m) * -(-n // block_n)
        split = _pick_split(tiles, -(-k // block_k), sms, 4)
        return LinearConfig("matmul", block_m, block_n, block_k, split, num_warps=4, num_stages=3)
    block_m = 64 if m <= 128 else 128
    return LinearConfig("matmul", block_m, 128, 64, 1, num_warps=8 if block_m == 128 else 4, num_stages=3)


def linear(x: torch.Tensor, w: LinearWeight, config: LinearConfig | None = None) -> torch.Tensor:
    """y = x @ W^T + b in x's dtype, for x [..., K]."""
    k = w.in_features
    n = w.out_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    cfg = config or choose_config(m, n, k, w.format, x.device)
    if cfg.kind == "torch":
        bias = None if w.bias is None else w.bias.to(x.dtype)
        return F.linear(x, w.data.to(x.dtype), bias)
    fmt = _FORMATS[w.format]
    if fmt == 2 and k % w.group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {w.group_size}")
    data = w.data if w.data.stride(-1) == 1 else w.data.contiguous()
    scale = w.scale if w.scale is not None else data
    minimum = w.minimum if w.minimum is not None else scale
    bias = w.bias if w.bias is not None else data
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = max(1, cfg.split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    if fmt == 2 and cfg.kind == "gemv":
        half = w.group_size // 2
        groups = max(1, cfg.block_k // w.group_size)
        num_groups = k // w.group_size
        per = -(-num_groups // split)
        per = -(-per // groups) * groups
        split = -(-num_groups // per)
        part = part[:split]
        _gemv_w4_kernel[(triton.cdiv(n, cfg.block_n), split)](
            _x_words(x2), data, scale, minimum, bias, out, part, n, num_groups, per, data.stride(0), scale.stride(0),
            X_KIND=_X_KINDS[x.dtype], HAS_BIAS=w.bias is not None, SPLIT=split > 1,
            EVEN_G=num_groups % groups == 0 and per % groups == 0,
            BLOCK_N=cfg.block_n, GROUPS=groups, HALF_GROUP=half, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        block_k = cfg.block_k
        if fmt == 2:
            block_k = -(-block_k // w.group_size) * w.group_size  # whole groups per step
        per = -(-k // split)
        per = -(-per // block_k) * block_k
        split = -(-k // per)
        part = part[:split]
        even_k = k % block_k == 0
        if cfg.kind == "gemv":
            _gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
                x2, data, scale, bias, out, part, n, k, per, data.stride(0),
                FORMAT=fmt, HAS_BIAS=w.bias is not None, SPLIT=split > 1, EVEN_K=even_k,
                BLOCK_N=cfg.block_n, BLOCK_K=block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        else:
            tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
            _matmul_kernel[(tiles, split)](
                x2, data, scale, minimum, bias, out, part, m, n, k, per,
                x2.stride(0), data.stride(0), scale.stride(0) if fmt == 2 else 0, out.stride(0),
                FORMAT=fmt, HAS_BIAS=w.bias is not None, SPLIT=split > 1, EVEN_K=even_k,
                GROUP_SIZE=max(w.group_size, 1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                GROUP_M=8, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, bias, out, m * n, n, split, HAS_BIAS=w.bias is not None, BLOCK=block)
    return out.reshape(*lead, n)
