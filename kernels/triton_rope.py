"""`rope` on the GPU: rotate-half rotary embedding, in place on q and k (strided views allowed)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import pdl_begin, pdl_launch


@triton.jit
def _rotate(ptr, stride_t, stride_h, t, n_heads, cos, sin, j, jm, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h[:, None] < n_heads) & jm[None, :]
        p1 = ptr + t * stride_t + h[:, None] * stride_h + j[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        tl.store(p1, (a * cos - b * sin).to(x1.dtype), mask=mask)
        tl.store(p1 + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rope_angles(pos_ptr, cs_ptr, t, stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token t's cos and sin rows [1, BLOCK_HALF], the channel indices j and their mask."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + j, mask=jm, other=0.0)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + j, mask=jm, other=0.0)[None, :]
    return cos, sin, j, jm


@triton.jit
def _rope_token(q_ptr, k_ptr, cos, sin, j, jm, t, n_q, n_k, stride_qt, stride_qh, stride_kt, stride_kh,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Token t's q and k heads, rotated in place (each thread loads and stores the same elements)."""
    _rotate(q_ptr, stride_qt, stride_qh, t, n_q, cos, sin, j, jm, HALF, BLOCK_H)
    _rotate(k_ptr, stride_kt, stride_kh, t, n_k, cos, sin, j, jm, HALF, BLOCK_H)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, n_q, n_k, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    cos, sin, j, jm = _rope_angles(pos_ptr, cs_ptr, t, stride_cs, HALF, BLOCK_HALF)
    _rope_token(q_ptr, k_ptr, cos, sin, j, jm, t, n_q, n_k, stride_qt, stride_qh, stride_kt, stride_kh, HALF, BLOCK_H)


def rope_launch_args(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[tuple, dict]:
    """The arguments of _rope_kernel after (q, k, positions), and its block sizes; q and k are rotated in
    place, so the head dimension of each must be contiguous."""
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope needs the head dimension of q and k to be contiguous")
    n_q, d = q.shape[1], q.shape[2]
    half = d // 2
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(n_q, k.shape[1])), 4096 // block_half))
    cs = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    args = (cs, n_q, k.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), cs.stride(0))
    return args, dict(HALF=half, BLOCK_HALF=block_half, BLOCK_H=block_h)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """In place on q [T,Hq,D] and k [T,Hk,D]; cos_sin [max_pos, D] float32 (cos | sin halves)."""
    if q.shape[0] == 0:
        return
    args, blocks = rope_launch_args(q, k, cos_sin)
    _rope_kernel[(q.shape[0],)](q, k, positions, *args, **blocks, num_warps=4, **pdl_launch(q.device))
