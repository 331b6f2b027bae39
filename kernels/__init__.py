"""Kernel ops: one contract, three implementations.

Each op dispatches by device: Triton kernels for CUDA tensors (when Triton imports), the fast CPU
implementation in `cpu.py` for CPU tensors, and the plain-torch reference in `reference.py`
otherwise. `EDGED_KERNELS=reference` forces the reference everywhere (debugging, and the oracle
run in tests).

Numerics policy, followed by every implementation whatever the activation dtype (bf16, fp16, fp32):
- computed in float32: weight dequantization, every matmul's accumulation (`linear`, attention's
  QK^T and PV), rms_norm (sum of squares, scaling and the weight product), softmax, rope, SiLU and
  its product, int8 KV dequantization, and the logits (`linear(..., out_dtype=torch.float32)`);
- stored in the activation dtype: activations between ops (the output of each op, rounded once),
  the residual stream, dense weights, norm weights and the KV cache (or int8 KV, symmetric, with float32
  scales: keys one per token, kv head and 32 channels of head_dim, values one per token and kv head;
  layout in reference.py);
- stored in their own dtype: w8 and w4 group scales and minimums in float16, GGUF's own (w = q * scale
  + minimum per group of 32; kernels/weights.py);
- tensor-core operands (Triton tl.dot) are the activation dtype: a dequantized weight tile, a dequantized
  int8 K or V tile and the softmax probabilities are rounded to it right before the dot, which
  accumulates in float32.
"""
from __future__ import annotations

import os
from types import ModuleType

import torch

from . import cpu, reference
from .weights import (LinearWeight, concat_out, dequantize, natural_order, pack_w4, quantize_w4, quantize_w8,
                      to_mma_order)

__all__ = [
    "LinearWeight", "concat_out", "dequantize", "natural_order", "pack_w4", "quantize_w4", "quantize_w8",
    "to_mma_order",
    "linear", "linear_add_norm", "rms_norm", "rope", "silu_and_mul", "write_kv", "rope_write_kv", "attention_decode",
    "attention_prefill", "argmax", "sample", "backend_for",
]

_triton_ops: ModuleType | None = None
_triton_checked = False


def _load_triton() -> ModuleType | None:
    global _triton_ops, _triton_checked
    if not _triton_checked:
        _triton_checked = True
        try:
            from . import triton_ops
            _triton_ops = triton_ops
        except ImportError:
            _triton_ops = None
    return _triton_ops


# EDGED_KERNELS is read at every op (tests and `bench accuracy` set it at run time). os.environ.get costs
# more than a small CPU op's dispatch; CPython keeps the raw values in os.environ._data, a plain dict.
_RAW_ENV: dict | None = getattr(os.environ, "_data", None)
_RAW_KEY = os.environ.encodekey("EDGED_KERNELS") if hasattr(os.environ, "encodekey") else None
_RAW_REFERENCE = os.environ.encodevalue("reference") if hasattr(os.environ, "encodevalue") else None


def _reference_forced() -> bool:
    if _RAW_ENV is not None and _RAW_KEY is not None:
        return _RAW_ENV.get(_RAW_KEY) == _RAW_REFERENCE
    return os.environ.get("EDGED_KERNELS", "auto") == "reference"


def backend_for(t: torch.Tensor) -> ModuleType:
    """The implementation module for tensors on t's device."""
    if _reference_forced():
        return reference
    if t.is_cpu:
        return cpu
    if t.is_cuda:
        ops = _load_triton()
        if ops is not None:
            return ops
    return reference


def linear(x: torch.Tensor, w: LinearWeight, out_dtype: torch.dtype | None = None, *,
           norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0, silu_mul: bool = False,
           residual: torch.Tensor | None = None, silu_mul_out: bool = False) -> torch.Tensor:
    """x @ W^T (+ b); optionally RMSNorm(x) or silu(gate) * up as its input, and a residual add or
    silu(gate) * up on its output (reference.linear defines each; the GPU fuses them into the decode
    GEMV)."""
    return backend_for(x).linear(x, w, out_dtype=out_dtype, norm_weight=norm_weight, norm_eps=norm_eps,
                                 silu_mul=silu_mul, residual=residual, silu_mul_out=silu_mul_out)


def linear_add_norm(x: torch.Tensor, w: LinearWeight, residual: torch.Tensor, norm_weight: torch.Tensor,
                    norm_eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An output projection and the norm after it: h = linear(x, w, residual=residual), the residual stream,
    and rms_norm(h, norm_weight, norm_eps)'s output, or None where the implementation leaves that norm to
    the next linear's norm_weight (the same numbers; the GPU makes it in the split-K sum of several rows, in
    models of short rows)."""
    return backend_for(x).linear_add_norm(x, w, residual, norm_weight, norm_eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return backend_for(x).rms_norm(x, weight, eps, residual)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    backend_for(q).rope(q, k, positions, cos_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return backend_for(x).silu_and_mul(x)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    backend_for(k).write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """rope(q, k, positions, cos_sin) then write_kv(k, v, ...): one launch on the GPU."""
    backend_for(q).rope_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    return backend_for(q).attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                                           k_scale, v_scale)


def attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                      scale: float, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    return backend_for(q).attention_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                            context_lens, scale, k_scale, v_scale)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens: the first index of each row's maximum, [B, V] -> [B] int64."""
    return backend_for(logits).argmax(logits)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return backend_for(logits).sample(logits, temperature, top_k, top_p, seeds, offsets)
