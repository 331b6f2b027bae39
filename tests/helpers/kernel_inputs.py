"""Random kernel inputs for the kernel tests: quantized weights and a paged KV cache, on any device.

Built here from the kernels' own quantizers and the reference `write_kv`, so that the tests do not
depend on the benchmark code (edged.bench) they are meant to check.
"""
from __future__ import annotations

import torch

from edged.kernels import reference
from edged.kernels.weights import LinearWeight, quantize_w4, quantize_w8, to_mma_order


def make_weight(fmt: str, n: int, k: int, dtype: torch.dtype, bias: bool = False, group: int = 32,
                seed: int = 0, device: torch.device | str = "cpu", std: float = 0.02,
                bias_std: float = 0.1) -> LinearWeight:
    """A random [n, k] weight in `fmt` ("dense", "w8", "w8sym": symmetric w8 as GGUF Q8_0 holds it, "w4";
    quantized from float32; a w8 format + "+mma": stored in the MMA order, as on a GPU), its float parts in dtype."""
    if fmt.endswith("+mma"):
        w = to_mma_order(make_weight(fmt.removesuffix("+mma"), n, k, dtype, bias, group, seed, device, std, bias_std))
        if not w.mma_order:
            raise ValueError(f"a [{n}, {k}] {fmt} weight in groups of {group} does not fit the MMA order")
        return w
    g = torch.Generator(device=device).manual_seed(seed)
    dense = torch.randn(n, k, generator=g, device=device) * std
    b = torch.randn(n, generator=g, device=device) * bias_std if bias else None
    if fmt == "dense":
        w = LinearWeight("dense", dense, bias=b)
    else:
        w = quantize_w8(dense, b, symmetric=fmt == "w8sym") if fmt.startswith("w8") else quantize_w4(dense, group, b)
    return w.astype(dtype)


def paged_cache(ctx_lens: list[int], hkv: int, d: int, block: int, dtype: torch.dtype, int8: bool, seed: int = 0,
                device: torch.device | str = "cpu"):
    """(k_cache, v_cache, k_scale, v_scale, block_tables): random keys and values for sequences of
    `ctx_lens` tokens, in blocks scattered through the pool in a random order (int8: the scale layout of
    kernels/reference.py, keys one scale per 32 channels, values one per head)."""
    g = torch.Generator(device=device).manual_seed(seed)
    width = max(-(-c // block) for c in ctx_lens) + 2
    n_blocks = sum(-(-c // block) for c in ctx_lens) + 5
    perm = torch.randperm(n_blocks, device=device, generator=g)
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.int32, device=device)
    store = torch.int8 if int8 else dtype
    kc = torch.zeros(n_blocks, block, hkv, d, dtype=store, device=device)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(n_blocks, block, hkv, reference.k_scale_groups(d), device=device) if int8 else None
    vs = torch.zeros(n_blocks, block, hkv, reference.v_scale_groups(d), device=device) if int8 else None
    used = 0
    for b, c in enumerate(ctx_lens):
        nb = -(-c // block)
        tables[b, :nb] = perm[used:used + nb].int()
        used += nb
        p = torch.arange(c, device=device)
        slots = tables[b, p // block].long() * block + p % block
        k = torch.randn(c, hkv, d, generator=g, device=device).to(dtype)
        v = torch.randn(c, hkv, d, generator=g, device=device).to(dtype)
        reference.write_kv(k, v, kc, vc, slots, ks, vs)
    return kc, vc, ks, vs, tables
