"""Plain-torch reference of every kernel op: the oracle for the Triton kernels and the CPU path.

Shapes (T new tokens in a step, B sequences, H heads, D head_dim, N cache blocks of S slots):
  k_cache/v_cache: [N, S, Hkv, D]; optional int8 caches carry float32 k_scale [N, S, Hkv, Gk] and
  v_scale [N, S, Hkv, Gv]: symmetric int8 with one scale per token, kv head and group of D / G
  consecutive channels of head_dim. Keys: Gk = k_scale_groups(D), groups of K_SCALE_GROUP = 32 channels
  (one group per head when D is not a multiple of 32), so that their outlier channels do not flatten
  the rest; values: Gv = v_scale_groups(D) = 1, one scale per token and head (on SmolLM2, per-32 value
  scales lowered teacher-forced top-1 agreement from 98.4% to 97.8%: docs/BENCHMARKS.md). Every
  implementation reads G from each scale tensor's last dimension (any G that divides D).
  block_tables: [B, max_blocks] int32; context_lens: [B] int32 (tokens in cache after the step);
  slot_mapping: [T] int64, slot = block * S + offset, -1 = padding (not written).

Numerics (the policy of kernels/__init__.py): every op computes in float32 and rounds its result once
to the activation dtype (or to float32 for `linear(..., out_dtype=torch.float32)`, the logits).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .weights import LinearWeight, dequantize


def linear(x: torch.Tensor, w: LinearWeight, out_dtype: torch.dtype | None = None, *,
           norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0, silu_mul: bool = False,
           residual: torch.Tensor | None = None, silu_mul_out: bool = False) -> torch.Tensor:
    """y = x @ W^T + b for any weight format: dequantized and accumulated in float32, returned in
    out_dtype (default: x's dtype).

    The fused forms are these compositions, each op rounding as it does alone: norm_weight, the input
    is rms_norm(x, norm_weight, norm_eps); silu_mul, it is silu_and_mul(x) (x holds 2 * in_features);
    residual, the result is y + residual (the residual stream's add, rounded once more);
    silu_mul_out, the result is silu_and_mul(y) (W's rows are [gate | up]; no residual with it)."""
    if silu_mul_out:
        check_silu_mul_out(w, residual)
    if norm_weight is not None:
        x, _ = rms_norm(x, norm_weight, norm_eps)
    if silu_mul:
        x = silu_and_mul(x)
    bias = None if w.bias is None else w.bias.to(torch.float32)
    y = F.linear(x.to(torch.float32), dequantize(w, torch.float32), bias).to(out_dtype or x.dtype)
    if silu_mul_out:
        return silu_and_mul(y)
    return y if residual is None else y + residual


def linear_add_norm(x: torch.Tensor, w: LinearWeight, residual: torch.Tensor, norm_weight: torch.Tensor,
                    norm_eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h = linear(x, w, residual=residual) and rms_norm(h, norm_weight, norm_eps)'s output."""
    h = linear(x, w, residual=residual)
    return h, rms_norm(h, norm_weight, norm_eps)[0]


def check_silu_mul_out(w: LinearWeight, residual: torch.Tensor | None) -> None:
    """linear's silu_mul_out needs [gate | up] rows (an even count) and no residual add."""
    if residual is not None or w.out_features % 2:
        raise ValueError("silu_mul_out needs an even out_features and no residual")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: h = x + residual; returns (norm(h) * weight, h)."""
    h = x if residual is None else x + residual  # the residual stream is stored in the activation dtype
    hf = h.to(torch.float32)
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(torch.float32) * normed).to(x.dtype), h


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotary embedding (rotate-half / NeoX layout) in place on q [T,Hq,D] and k [T,Hk,D].

    cos_sin: [max_pos, D] float32, cos in the first D/2 columns and sin in the last D/2.
    """
    half = q.shape[-1] // 2
    cs = cos_sin[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for t in (q, k):
        tf = t.to(torch.float32)
        x1, x2 = tf[..., :half], tf[..., half:]
        t.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(x[..., :I]) * x[..., I:]."""
    gate, up = x.to(torch.float32).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


K_SCALE_GROUP = 32  # channels of head_dim per int8 key scale


def k_scale_groups(head_dim: int) -> int:
    """Int8 key scales per token and kv head: one per K_SCALE_GROUP channels, or a single one for the
    whole head when head_dim is not a multiple of it (tiny test models)."""
    return head_dim // K_SCALE_GROUP if head_dim % K_SCALE_GROUP == 0 else 1


def v_scale_groups(head_dim: int) -> int:
    """Int8 value scales per token and kv head: one."""
    return 1


def quantize_kv_int8(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per token, head and group of D / groups channels:
    x [T,H,D] -> (int8 [T,H,D], scale [T,H,groups])."""
    xf = x.to(torch.float32).unflatten(-1, (groups, -1))
    scale = xf.abs().amax(dim=-1).clamp(min=1e-6) / 127.0
    return torch.round(xf / scale[..., None]).clamp(-127, 127).to(torch.int8).flatten(-2), scale


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter this step's k, v [T,Hkv,D] into the paged cache at slot_mapping (skipping -1)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    n, s = k_cache.shape[:2]
    kc, vc = k_cache.view(n * s, *k_cache.shape[2:]), v_cache.view(n * s, *v_cache.shape[2:])
    if k_scale is None:
        kc[slots] = k[keep].to(kc.dtype)
        vc[slots] = v[keep].to(vc.dtype)
        return
    kq, ks = quantize_kv_int8(k[keep], k_scale.shape[-1])
    vq, vs = quantize_kv_int8(v[keep], v_scale.shape[-1])
    kc[slots], vc[slots] = kq, vq
    k_scale.view(n * s, *k_scale.shape[2:])[slots] = ks.to(k_scale.dtype)
    v_scale.view(n * s, *v_scale.shape[2:])[slots] = vs.to(v_scale.dtype)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """`rope` in place on q and k, then `write_kv` of the rotated k (rounded to its dtype) and v."""
    rope(q, k, positions, cos_sin)
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _gather_kv(cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor,
               length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence as float32 [length, Hkv, D]."""
    s = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table[pos // s].long()
    out = cache[blocks, pos % s].to(torch.float32)
    if scale is not None:
        sc = scale[blocks, pos % s].to(torch.float32)  # [length, Hkv, G]
        out = (out.unflatten(-1, (sc.shape[-1], -1)) * sc[..., None]).flatten(-2)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int) -> torch.Tensor:
    """Causal attention of q [Tq,Hq,D] at positions q_start.. over k, v [L,Hkv,D], GQA by repeat."""
    group = q.shape[1] // k.shape[1]
    kf = k.to(torch.float32).repeat_interleave(group, dim=1)
    vf = v.to(torch.float32).repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.to(torch.float32), kf) * scale
    q_pos = torch.arange(q.shape[0], device=q.device)[:, None] + q_start
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    scores = scores.masked_fill((k_pos > q_pos)[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(dim=-1), vf).to(q.dtype)


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One new query per sequence, q [B,Hq,D], over its whole cached context."""
    out = torch.empty_like(q)
    for b, length in enumerate(context_lens.tolist()):
        k = _gather_kv(k_cache, k_scale, block_tables[b], length)
        v = _gather_kv(v_cache, v_scale, block_tables[b], length)
        out[b] = _attend(q[b:b + 1], k, v, scale, length - 1)[0]
    return out


def attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                      scale: float, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens (q [T,Hq,D], packed by cu_seqlens_q) over a
    cached prefix plus themselves; their K/V are already in the cache (write_kv ran first)."""
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for b, length in enumerate(context_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        k = _gather_kv(k_cache, k_scale, block_tables[b], length)
        v = _gather_kv(v_cache, v_scale, block_tables[b], length)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale, length - (hi - lo))
    return out


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on uint32 values held in int64 (the Triton kernel does the same)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def sampling_uniform(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Counter-based uniforms in (0,1), [B, vocab]: a function of (seed, offset, token id) only,
    so a seeded request samples the same tokens on every device and in every batch."""
    seed = seeds.long()[:, None] & _M32
    off = offsets.long()[:, None] & _M32
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    h = _mix32(idx ^ _mix32(off ^ _mix32(seed)))
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf everything outside each row's top_k (0 = off) and then its top_p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
    sorted_logits = sorted_logits.masked_fill((before >= top_p[:, None]) & (rank > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens: logits [B, V] -> [B] int64, the first index of each row's maximum."""
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, offsets: torch.Tensor,
           uniform: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None) -> torch.Tensor:
    """Next token per row of logits [B,V]: argmax where temperature == 0, else a Gumbel-max draw
    from softmax(logits / temperature) restricted to top_k / top_p, with counter-based noise
    (`uniform`: sampling_uniform, or a device kernel bit-exact with it)."""
    logits = logits.to(torch.float32)
    greedy = logits.argmax(dim=-1)
    if bool((temperature <= 0).all()):
        return greedy
    temp = torch.where(temperature > 0, temperature, 1.0).to(torch.float32)[:, None]
    filtered = apply_top_k_top_p(logits / temp, top_k, top_p.to(torch.float32))
    u = (uniform or sampling_uniform)(seeds, offsets, logits.shape[-1])
    drawn = (filtered - torch.log(-torch.log(u))).argmax(dim=-1)
    return torch.where(temperature > 0, drawn, greedy)
