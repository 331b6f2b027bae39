"""`write_kv` on the GPU: scatter this step's K/V into the paged cache, optionally quantized to int8 with
one scale per token, kv head and group of channels (keys: 32 channels, values: the whole head; the
layout in kernels/reference.py). `rope_write_kv`: `rope` and `write_kv` in one launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_rope import _rope_angles, _rope_token, rope_launch_args
from .triton_pdl import pdl_begin, pdl_launch


@triton.jit
def _store_token(src_ptr, cache_ptr, scale_ptr, t, block, off, n_heads, stride_st, stride_sh,
                 stride_cn, stride_cs, stride_ch, stride_qn, stride_qs, stride_qh, stride_qg, head_dim, n_groups,
                 INT8: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One token's [n_heads, head_dim] as rows of (head, scale group), each of head_dim / n_groups channels."""
    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    group_size = head_dim // n_groups
    h = r // n_groups
    g = r % n_groups
    rmask = r < n_heads * n_groups
    mask = rmask[:, None] & (c[None, :] < group_size)
    chan = g[:, None] * group_size + c[None, :]
    x = tl.load(src_ptr + t * stride_st + h[:, None] * stride_sh + chan, mask=mask, other=0.0)
    dst = cache_ptr + block * stride_cn + off * stride_cs + h[:, None] * stride_ch + chan
    if INT8:
        # exactly reference.quantize_kv_int8: IEEE divisions and round-half-to-even
        xf = x.to(tl.float32)
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-6), 127.0)
        q = tl.div_rn(xf, scale[:, None])
        q = (q + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds half to even for |q| < 2**22
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(dst, q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + block * stride_qn + off * stride_qs + h * stride_qh + g * stride_qg,
                 scale.to(scale_ptr.dtype.element_ty), mask=rmask)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_token(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot, t, n_heads, head_dim, k_groups, v_groups,
                 block_size, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_cn, stride_cs, stride_ch, stride_vn, stride_vs, stride_vch,
                 stride_kqn, stride_kqs, stride_kqh, stride_kqg, stride_vqn, stride_vqs, stride_vqh, stride_vqg,
                 INT8: tl.constexpr, K_ROWS: tl.constexpr, K_COLS: tl.constexpr, V_ROWS: tl.constexpr,
                 V_COLS: tl.constexpr):
    """Token t's k and v into the cache at slot (its slot_mapping entry; nothing when it is -1)."""
    if slot >= 0:
        block = slot // block_size
        off = slot % block_size
        _store_token(k_ptr, kc_ptr, ks_ptr, t, block, off, n_heads, stride_kt, stride_kh,
                     stride_cn, stride_cs, stride_ch, stride_kqn, stride_kqs, stride_kqh, stride_kqg, head_dim,
                     k_groups, INT8, K_ROWS, K_COLS)
        _store_token(v_ptr, vc_ptr, vs_ptr, t, block, off, n_heads, stride_vt, stride_vh,
                     stride_vn, stride_vs, stride_vch, stride_vqn, stride_vqs, stride_vqh, stride_vqg, head_dim,
                     v_groups, INT8, V_ROWS, V_COLS)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, n_heads, head_dim, k_groups, v_groups,
                     block_size, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cn, stride_cs, stride_ch, stride_vn, stride_vs, stride_vch,
                     stride_kqn, stride_kqs, stride_kqh, stride_kqg, stride_vqn, stride_vqs, stride_vqh, stride_vqg,
                     INT8: tl.constexpr, K_ROWS: tl.constexpr, K_COLS: tl.constexpr, V_ROWS: tl.constexpr,
                     V_COLS: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    _write_token(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot, t, n_heads, head_dim, k_groups, v_groups,
                 block_size, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_cn, stride_cs, stride_ch, stride_vn, stride_vs, stride_vch,
                 stride_kqn, stride_kqs, stride_kqh, stride_kqg, stride_vqn, stride_vqs, stride_vqh, stride_vqg,
                 INT8, K_ROWS, K_COLS, V_ROWS, V_COLS)


@triton.jit
def _rope_write_kv_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, n_q, n_k, stride_qt, stride_qh, stride_kt, stride_kh,
                          stride_cos_sin, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, head_dim, k_groups,
                          v_groups, block_size, stride_vt, stride_vh,
                          stride_cn, stride_cs, stride_ch, stride_vn, stride_vs, stride_vch,
                          stride_kqn, stride_kqs, stride_kqh, stride_kqg, stride_vqn, stride_vqs, stride_vqh,
                          stride_vqg, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                          INT8: tl.constexpr, K_ROWS: tl.constexpr, K_COLS: tl.constexpr, V_ROWS: tl.constexpr,
                          V_COLS: tl.constexpr, PDL: tl.constexpr):
    """rope then write_kv for one token: q and k rotated in place, then the rotated k (read back from k, so
    rounded to its dtype, as the reference writes it) and v into the cache. The position, its cos and sin
    and the slot load before the wait on the previous kernel (PDL), off the chain of loads that follow
    it: rope_write_kv's contract is that the kernel launched just before does not write them."""
    t = tl.program_id(0).to(tl.int64)
    cos, sin, j, jm = _rope_angles(pos_ptr, cs_ptr, t, stride_cos_sin, HALF, BLOCK_HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pdl_begin(PDL)
    _rope_token(q_ptr, k_ptr, cos, sin, j, jm, t, n_q, n_k, stride_qt, stride_qh, stride_kt, stride_kh, HALF, BLOCK_H)
    # _store_token reads k back in another layout than _rotate stored it (other threads' elements): the
    # barrier (bar.sync) makes this program's stores visible to all its threads first
    tl.debug_barrier()
    _write_token(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot, t, n_k, head_dim, k_groups, v_groups,
                 block_size, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_cn, stride_cs, stride_ch, stride_vn, stride_vs, stride_vch,
                 stride_kqn, stride_kqs, stride_kqh, stride_kqg, stride_vqn, stride_vqs, stride_vqh, stride_vqg,
                 INT8, K_ROWS, K_COLS, V_ROWS, V_COLS)


def _cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None, n_heads: int, head_dim: int) -> tuple[tuple, tuple, tuple, dict]:
    """_write_token's (cache and scale pointers, (k_groups, v_groups), cache and scale strides, block sizes)."""
    int8 = k_scale is not None
    kg, vg = (k_scale.shape[-1], v_scale.shape[-1]) if int8 else (1, 1)
    ptrs = (k_cache, v_cache, k_scale if int8 else k_cache, v_scale if int8 else v_cache)
    kqs = k_scale.stride() if int8 else (0, 0, 0, 0)
    vqs = v_scale.stride() if int8 else (0, 0, 0, 0)
    strides = (*k_cache.stride()[:3], *v_cache.stride()[:3], *kqs, *vqs)
    blocks = dict(INT8=int8, K_ROWS=triton.next_power_of_2(n_heads * kg), K_COLS=triton.next_power_of_2(head_dim // kg),
                  V_ROWS=triton.next_power_of_2(n_heads * vg), V_COLS=triton.next_power_of_2(head_dim // vg))
    return ptrs, (kg, vg), strides, blocks


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v [T,Hkv,D] -> caches [N,S,Hkv,D] at slot_mapping [T] (-1 = skip); int8 when scales
    [N,S,Hkv,G] are given (one per group of D / G channels, G of each tensor its own)."""
    tokens, n_heads, head_dim = k.shape
    if tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    ptrs, groups, strides, blocks = _cache_args(k_cache, v_cache, k_scale, v_scale, n_heads, head_dim)
    _write_kv_kernel[(tokens,)](k, v, *ptrs, slot_mapping, n_heads, head_dim, *groups, k_cache.shape[1],
                                k.stride(0), k.stride(1), v.stride(0), v.stride(1), *strides, **blocks, num_warps=4,
                                **pdl_launch(k.device))


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """`rope(q, k, positions, cos_sin)` then `write_kv(k, v, ...)` in one launch: q [T,Hq,D] and k [T,Hkv,D]
    rotated in place (strided views allowed, head dimension contiguous), the rotated k and v [T,Hkv,D]
    scattered into the cache as write_kv does. positions, slot_mapping and cos_sin are read before the
    wait on the kernel launched just before (PDL): that kernel must not write them (in the model it is
    the qkv projection; they are a step's inputs)."""
    tokens, n_heads, head_dim = k.shape
    if tokens == 0:
        return
    rope_args, rope_blocks = rope_launch_args(q, k, cos_sin)
    if v.stride(-1) != 1:
        v = v.contiguous()
    ptrs, groups, strides, blocks = _cache_args(k_cache, v_cache, k_scale, v_scale, n_heads, head_dim)
    _rope_write_kv_kernel[(tokens,)](q, k, positions, *rope_args, v, *ptrs, slot_mapping, head_dim, *groups,
                                     k_cache.shape[1], v.stride(0), v.stride(1), *strides, **rope_blocks, **blocks,
                                     num_warps=4, **pdl_launch(k.device))
