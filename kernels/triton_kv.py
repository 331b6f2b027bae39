"""`write_kv` on the GPU: scatter this step's K/V into the paged cache, optionally quantized to int8."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_token(src_ptr, cache_ptr, scale_ptr, t, block, off, n_heads, stride_st, stride_sh,
                 stride_cn, stride_cs, stride_ch, stride_qn, stride_qs, stride_qh, head_dim,
                 INT8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < n_heads) & (d[None, :] < head_dim)
    x = tl.load(src_ptr + t * stride_st + h[:, None] * stride_sh + d[None, :], mask=mask, other=0.0)
    dst = cache_ptr + block * stride_cn + off * stride_cs + h[:, None] * stride_ch + d[None, :]
    if INT8:
        # exactly reference.quantize_kv_int8: IEEE divisions and round-half-to-even
        xf = x.to(tl.float32)
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-6), 127.0)
        r = tl.div_rn(xf, scale[:, None])
        r = (r + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds half to even for |r| < 2**22
        q = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(dst, q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + block * stride_qn + off * stride_qs + h * stride_qh,
                 scale.to(scale_ptr.dtype.element_ty), mask=h < n_heads)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, n_heads, head_dim, block_size,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cn, stride_cs, stride_ch, stride_vn, stride_vs, stride_vch,
                     stride_qn, stride_qs, stride_qh,
                     INT8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        off = slot % block_size
        _store_token(k_ptr, kc_ptr, ks_ptr, t, block, off, n_heads, stride_kt, stride_kh,
                     stride_cn, stride_cs, stride_ch, stride_qn, stride_qs, stride_qh, head_dim,
                     INT8, BLOCK_H, BLOCK_D)
        _store_token(v_ptr, vc_ptr, vs_ptr, t, block, off, n_heads, stride_vt, stride_vh,
                     stride_vn, stride_vs, stride_vch, stride_qn, stride_qs, stride_qh, head_dim,
                     INT8, BLOCK_H, BLOCK_D)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v [T,Hkv,D] -> caches [N,S,Hkv,D] at slot_mapping [T] (-1 = skip); int8 when scales are given."""
    tokens, n_heads, head_dim = k.shape
    if tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    int8 = k_scale is not None
    if int8 and k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale must share a layout")
    ks = k_scale if int8 else k_cache
    vs = v_scale if int8 else v_cache
    qstr = k_scale.stride() if int8 else (0, 0, 0)
    _write_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping, n_heads, head_dim, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        qstr[0], qstr[1], qstr[2],
        INT8=int8, BLOCK_H=triton.next_power_of_2(n_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4)
