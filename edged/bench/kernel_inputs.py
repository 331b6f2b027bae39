"""Kernel inputs at real shapes: the decode linears of the benchmark models, and random quantized weights and a
paged KV cache on the GPU."""
from __future__ import annotations

import torch

from edged.kernels import reference
from edged.kernels.weights import LinearWeight, quantize_w4, quantize_w8
from edged.models.config import MODEL_SHAPES

DEV = torch.device("cuda")


def model_linears(model: str) -> dict[str, tuple[int, int, int]]:
    """(N, K, calls a decode step) of a MODEL_SHAPES model's linears: fused qkv, o, fused gate_up, down (a call a
    layer each) and the lm_head (one)."""
    c = MODEL_SHAPES[model]
    h, layers = c.hidden_size, c.num_layers
    return {"qkv": (c.q_size + 2 * c.kv_size, h, layers), "o": (h, c.q_size, layers),
            "gate_up": (2 * c.intermediate_size, h, layers), "down": (h, c.intermediate_size, layers),
            "head": (c.vocab_size, h, 1)}


def make_weight(fmt: str, n: int, k: int, dtype: torch.dtype, bias: bool = False, group: int = 32,
                seed: int = 0, device: torch.device | str = DEV, std: float = 0.02,
                bias_std: float = 0.1) -> LinearWeight:
    """A random [n, k] weight in `fmt` (quantized from float32; w8 symmetric, as GGUF Q8_0 and float
    weights load), its float parts in dtype."""
    g = torch.Generator(device=device).manual_seed(seed)
    dense = torch.randn(n, k, generator=g, device=device) * std
    b = torch.randn(n, generator=g, device=device) * bias_std if bias else None
    if fmt == "dense":
        w = LinearWeight("dense", dense, bias=b)
    else:
        w = quantize_w8(dense, b, symmetric=True) if fmt == "w8" else quantize_w4(dense, group, b)
    return w.astype(dtype)


def paged_cache(ctx_lens: list[int], hkv: int, d: int, block: int, dtype: torch.dtype, int8: bool, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    width = max(-(-c // block) for c in ctx_lens) + 2
    n_blocks = sum(-(-c // block) for c in ctx_lens) + 5
    perm = torch.randperm(n_blocks, device=DEV, generator=g)
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.int32, device=DEV)
    store = torch.int8 if int8 else dtype
    kc = torch.zeros(n_blocks, block, hkv, d, dtype=store, device=DEV)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(n_blocks, block, hkv, reference.k_scale_groups(d), device=DEV) if int8 else None
    vs = torch.zeros(n_blocks, block, hkv, reference.v_scale_groups(d), device=DEV) if int8 else None
    used = 0
    for b, c in enumerate(ctx_lens):
        nb = -(-c // block)
        tables[b, :nb] = perm[used:used + nb].int()
        used += nb
        p = torch.arange(c, device=DEV)
        slots = tables[b, p // block].long() * block + p % block
        k = torch.randn(c, hkv, d, generator=g, device=DEV).to(dtype)
        v = torch.randn(c, hkv, d, generator=g, device=DEV).to(dtype)
        reference.write_kv(k, v, kc, vc, slots, ks, vs)
    return kc, vc, ks, vs, tables
