"""`rms_norm` on the GPU: residual add + RMSNorm in one pass over each row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import pdl_begin, pdl_launch


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, n_cols, stride_x, stride_r, stride_o, stride_h,
                     eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # the norm weight is never written during a step: under PDL its load overlaps the previous kernel
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_begin(PDL)
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        # the add rounds to the activation dtype, as the reference's x + residual does
        h = h + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    # float32 to the end, rounded once (kernels/__init__.py's numerics policy)
    tl.store(out_ptr + row * stride_o + cols, rms_row(h.to(tl.float32), w, n_cols, eps).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def rms_row(hf, w, n_cols, eps):
    """RMSNorm(hf) * w of one row in float32 (hf: 0 past its n_cols columns)."""
    inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)
    return w * (hf * inv)


def norm_warps(block: int) -> int:
    """Warps of a program that norms one row of `block` (a power of two) columns."""
    # 8 at 513-1024 columns (SmolLM2's 576), not 4: H200 decode step, session 31, SmolLM2 w8 batch 64 with its
    # split-K sums making the norms, 45,236-46,037 -> 47,238-47,411 tok/s
    return 4 if block <= 512 else 8 if block <= 1024 else 4 if block <= 2048 else 8 if block <= 8192 else 16


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; returns (rmsnorm(h) * weight, h)."""
    n_cols = x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        h, r2, h2 = x, x2, x2
    else:
        r2 = _rows(residual.to(x.dtype))
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        h2 = h.view(-1, n_cols)
    if rows == 0:
        return out, h
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(rows,)](x2, r2, weight, out.view(-1, n_cols), h2, n_cols, x2.stride(0), r2.stride(0),
                              n_cols, h2.stride(0), eps, HAS_RES=residual is not None, BLOCK=block,
                              num_warps=norm_warps(block), **pdl_launch(x2.device))
    return out, h
