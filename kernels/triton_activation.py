"""`silu_and_mul` on the GPU: the SwiGLU gate, silu(x[..., :I]) * x[..., I:]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import pdl_begin, pdl_launch


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # float32 to the end, rounded once (kernels/__init__.py's numerics policy)
    act = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](x2, out.view(-1, inter), inter, x2.stride(0), inter,
                                                            BLOCK=block, num_warps=4, **pdl_launch(x2.device))
    return out
