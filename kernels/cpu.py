"""Fast CPU implementation of the kernels contract (same signatures as `reference.py`).

- `linear`: weights stay quantized in memory. w4 and w8 run the float32 weight-only GEMV/GEMM of
  `cpu_native.py` (activations, scales, accumulation and result in fp32, as the numerics policy
  asks); from `DEQUANT_ROWS` rows on (prefill) a packed weight is dequantized into a scratch buffer
  and multiplied by MKL's float32 GEMM, which is faster once the product is compute-bound. Where no
  C compiler is available, torch's own weight-only kernel `_weight_int4pack_mm_for_cpu` runs w4
  instead: vectorized on x86 only for bfloat16, so activations, scales and results pass through
  bfloat16 there (greedy text may then differ from the oracle's); w8 (groups, which torch's int8
  kernel does not take) is dequantized once at prepack to float32 and multiplied densely.
- attention: decode runs one C kernel over every sequence's blocks in place (no per-sequence loop,
  no gather copy; float32 or int8 caches); otherwise (bf16) one `index_select` gathers the blocks
  into a padded [B, L] layout for one masked `scaled_dot_product_attention`. Prefill runs SDPA per
  sequence with a prompt chunk and batches its single-token rows as decodes. Scores, softmax and the
  value sum are computed in fp32 whatever the activation dtype.
- rope, rms_norm (+ residual), silu_and_mul, write_kv: one C call each in float32, a few torch calls
  otherwise, with the per-step values that every layer shares (rope's cos/sin rows, the KV slots, the
  attention gather index and mask) computed once per step.

`prepack(w)` builds the kernel layout of a weight once (at load); `linear` packs on first use
otherwise. The packed form hangs off the LinearWeight (`w.cpu_packed`); the LinearWeight itself is
untouched, so `dequantize` and the reference path keep working on the same object.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_native
from .reference import check_silu_mul_out, quantize_kv_int8
from .reference import argmax as argmax  # noqa: PLC0414 - per-step ops: the reference is the implementation
from .reference import sample as sample  # noqa: PLC0414
from .weights import LinearWeight, dequantize, group_minimums, natural_order

DEQUANT_ROWS = 32  # rows from which a quantized linear dequantizes into scratch and runs a dense GEMM
DEQUANT_MAX_ELEMENTS = 1 << 23  # ... unless the weight is larger than this (a vocabulary-sized lm_head)
_BF16 = torch.bfloat16
_F32 = torch.float32
_NATIVE: bool | None = None  # whether the C kernels of cpu_native.py run here: decided at the first op


def _native() -> bool:
    global _NATIVE
    if _NATIVE is None:
        _NATIVE = cpu_native.available()
    return _NATIVE


# --- linear ------------------------------------------------------------------------------------------

@dataclass
class CpuPacked:
    """A LinearWeight in the layout of a CPU kernel.

    native-w4 / native-w8: cpu_native's layout (weight, scale: float16 scales+minimums per group);
    torch-w4: torch's bfloat16 kernel (weight: int4pack, scale: bf16 scale-and-zero, offset_rest: the
    part of the Q4 offsets that bf16 could not hold, fp32); torch-w8: the weight dequantized to float32
    (torch has no grouped int8 kernel); dense: the weight itself."""

    format: str
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    out_features: int = 0
    group_size: int = 0
    bias: torch.Tensor | None = None  # fp32
    offset_rest: torch.Tensor | None = None


def prepack(w: LinearWeight) -> LinearWeight:
    """Attach the CPU kernel layout to w (a CPU LinearWeight) and return w."""
    w.cpu_packed = _pack(w)  # type: ignore[attr-defined]
    return w


def _pack(w: LinearWeight) -> CpuPacked:
    w = natural_order(w)  # a GPU weight's MMA order: these kernels read columns in order
    bias = None if w.bias is None else w.bias.to(_F32)
    n = w.out_features
    if w.format == "dense":
        return CpuPacked("dense", w.data, None, n, 0, bias)
    if w.format not in ("w4", "w8"):
        raise ValueError(f"unknown weight format {w.format!r}")
    if _native():
        if w.format == "w8" and w.group_size % 2 == 0:  # the kernel takes columns in pairs
            return CpuPacked("native-w8", *cpu_native.pack_w8(w.data, w.scale, group_minimums(w)), n, w.group_size,
                             bias)
        if w.format == "w4":
            return CpuPacked("native-w4", *cpu_native.pack_w4(w.data, w.scale, w.minimum, w.group_size), n,
                             w.group_size, bias)
    if w.format == "w8":  # torch's int8 kernel (_weight_int8pack_mm) takes one scale per row, no groups
        return CpuPacked("torch-w8", dequantize(w, _F32), None, n, 0, bias)
    padded = -(-n // 64) * 64  # the int4 kernel works on blocks of 64 output rows
    q = torch.zeros(padded, w.in_features, dtype=torch.int32)
    q[:n] = torch.stack(((w.data & 0x0F), (w.data >> 4)), dim=-1).view(n, -1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # torch's kernel computes (q - 8) * scale + zero in bf16; w = q * scale + minimum. zero comes from
    # the exact scale, so that the scale's rounding errs by (q - 8) * (bf16(s) - s), centred on the
    # group, not by q * (bf16(s) - s), a bias shared by the whole group; the offset's own rounding is
    # added back in fp32 from the group sums of x.
    scale, want_zero = torch.zeros(padded, w.scale.shape[1]), torch.zeros(padded, w.scale.shape[1])
    scale[:n] = w.scale.to(_F32)
    want_zero[:n] = w.minimum.to(_F32) + 8.0 * w.scale.to(_F32)
    zero = want_zero.to(_BF16)
    rest = (want_zero - zero.to(_F32)).t().contiguous()
    scale_zero = torch.stack((scale.to(_BF16).t(), zero.t()), dim=-1).contiguous()
    return CpuPacked("torch-w4", packed, scale_zero, n, w.group_size, bias, rest)


def _packed(w: LinearWeight) -> CpuPacked:
    p = getattr(w, "cpu_packed", None)
    if p is None:
        p = _pack(w)
        w.cpu_packed = p  # type: ignore[attr-defined]
    return p


def linear(x: torch.Tensor, w: LinearWeight, out_dtype: torch.dtype | None = None, *,
           norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0, silu_mul: bool = False,
           residual: torch.Tensor | None = None, silu_mul_out: bool = False) -> torch.Tensor:
    """y = x @ W^T + b, accumulated in fp32, returned in out_dtype (default: x's dtype); the fused
    forms of reference.linear run as this module's own ops in turn."""
    if silu_mul_out:
        check_silu_mul_out(w, residual)
    if norm_weight is not None:
        x, _ = rms_norm(x, norm_weight, norm_eps)
    if silu_mul:
        x = silu_and_mul(x)
    y = _linear(x, w, out_dtype)
    if silu_mul_out:
        return silu_and_mul(y)
    if residual is None:
        return y
    if y.dtype == residual.dtype and y.shape == residual.shape:
        return y.add_(residual)  # in place: y is this call's own tensor
    return y + residual


def linear_add_norm(x: torch.Tensor, w: LinearWeight, residual: torch.Tensor, norm_weight: torch.Tensor,
                    norm_eps: float) -> tuple[torch.Tensor, None]:
    """The projection with its residual add; the norm after it is left to the next linear's norm_weight."""
    return linear(x, w, residual=residual), None


def _linear(x: torch.Tensor, w: LinearWeight, out_dtype: torch.dtype | None) -> torch.Tensor:
    out_dtype = out_dtype or x.dtype
    p = _packed(w)
    if p.format == "dense" and out_dtype == _F32 and x.dtype != _F32:
        y = F.linear(x.to(_F32), p.weight.to(_F32))  # float32 logits: no half-precision rounding before argmax
    elif p.format == "dense":
        y = F.linear(x, p.weight if p.weight.dtype == x.dtype else p.weight.to(x.dtype))
    elif p.format.startswith("native"):
        xf = (x if x.dtype == _F32 else x.to(_F32)).reshape(-1, x.shape[-1])
        y = _native_linear(xf, p).reshape(*x.shape[:-1], p.out_features)
    elif p.format == "torch-w4":
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(_BF16).contiguous(), p.weight, p.group_size, p.scale)
        sums = x2.to(_F32).view(x2.shape[0], -1, p.group_size).sum(-1)
        y = torch.addmm(y.to(_F32), sums, p.offset_rest)[:, :p.out_features].reshape(*x.shape[:-1], -1)
    else:  # torch-w8: the weight dequantized once at prepack, float32 throughout
        y = F.linear(x if x.dtype == _F32 else x.to(_F32), p.weight)
    if p.bias is not None:
        y = y.to(_F32).add_(p.bias)
    return y if y.dtype == out_dtype else y.to(out_dtype)


_scratch = threading.local()


def _native_linear(x: torch.Tensor, p: CpuPacked) -> torch.Tensor:
    x = x.contiguous()
    w4 = p.format == "native-w4"
    if x.shape[0] >= DEQUANT_ROWS and p.weight.numel() <= DEQUANT_MAX_ELEMENTS:
        k = x.shape[1]
        size = p.weight.shape[0] * cpu_native.ROWS * k
        buf = getattr(_scratch, "buf", None)
        if buf is None or buf.numel() < size:
            buf = _scratch.buf = torch.empty(size, dtype=_F32)
        wt = buf[:size].view(k, -1)  # [K, padded N], reused: the weight lives only inside this call
        if w4:
            cpu_native.w4_dequant_t(p.weight, p.scale, p.group_size, out=wt)
        else:
            cpu_native.w8_dequant_t(p.weight, p.scale, p.group_size, out=wt)
        y = torch.mm(x, wt)
        return y if y.shape[1] == p.out_features else y[:, :p.out_features]
    if w4:
        return cpu_native.w4_gemm(x, p.weight, p.scale, p.out_features, p.group_size)
    return cpu_native.w8_gemm(x, p.weight, p.scale, p.out_features, p.group_size)


# --- norms, rope, activation -------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: h = x + residual; returns (norm(h) * weight, h); norm in fp32."""
    if (_native() and x.dtype == _F32 and weight.dtype == _F32 and x.shape[-1] % 16 == 0 and x.is_contiguous()
            and (residual is None or (residual.dtype == _F32 and residual.is_contiguous()))):
        return cpu_native.rms_norm(x, weight, eps, residual)
    h = x if residual is None else x + residual
    if h.dtype == _F32:
        return F.rms_norm(h, weight.shape, weight if weight.dtype == _F32 else weight.to(_F32), eps), h
    return F.rms_norm(h.to(_F32), weight.shape, weight.to(_F32), eps).to(h.dtype), h


class _StepMemo:
    """A value derived from one step's metadata, reused by every layer of that step.

    A hit needs metadata equal in content to the cached copy (and the very same objects passed as
    `same`), so a tensor changed in place, or a new step, never sees a stale value."""

    def __init__(self) -> None:
        self._entry: tuple[tuple[torch.Tensor, ...], tuple[object, ...], object] | None = None

    def get(self, tensors: tuple[torch.Tensor, ...], same: tuple[object, ...] = ()) -> object | None:
        entry = self._entry  # one read: another thread's put replaces the whole entry
        if entry is None:
            return None
        keys, objs, value = entry
        if any(a is not b for a, b in zip(objs, same)):
            return None
        for key, t in zip(keys, tensors):
            if key.shape != t.shape or key.dtype != t.dtype or not torch.equal(key, t):
                return None
        return value

    def put(self, value: object, tensors: tuple[torch.Tensor, ...], same: tuple[object, ...] = ()) -> object:
        self._entry = (tuple(t.clone() for t in tensors), same, value)
        return value


_rope_memo = _StepMemo()


def _rope_tables(positions: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 1, D] cos and signed sin rows, so that rope(x) = x * cos + roll(x, D/2) * sin."""
    hit = _rope_memo.get((positions,), (cos_sin,))
    if hit is not None:
        return hit  # type: ignore[return-value]
    half = cos_sin.shape[-1] // 2
    cs = cos_sin.index_select(0, positions.view(-1).long()).to(_F32)
    cos, sin = cs[:, :half], cs[:, half:]
    tables = (torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :])
    return _rope_memo.put(tables, (positions,), (cos_sin,))  # type: ignore[return-value]


def _joined(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [T, Hq + Hk, D] view when k's heads follow q's in each row (a fused qkv)."""
    if q.dim() != 3 or q.stride()[1:] != (q.shape[2], 1) or k.stride() != q.stride() or k.dtype != q.dtype:
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * q.shape[2] * q.element_size():
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotary embedding (rotate-half layout) in place on q [T,Hq,D] and k [T,Hk,D], in fp32."""
    qk = _joined(q, k)
    parts = (q, k) if qk is None else (qk,)
    if (_native() and q.dtype == _F32 and cos_sin.dtype == _F32 and cos_sin.is_contiguous()
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and all(t.stride()[1:] == (t.shape[2], 1) for t in parts)):
        for t in parts:
            cpu_native.rope(t, t.shape[1], positions, cos_sin)
        return
    cos, sin = _rope_tables(positions, cos_sin)
    half = q.shape[-1] // 2
    for t in parts:
        if t.dtype == _F32:
            rolled = t.roll(half, -1)
            t.mul_(cos).addcmul_(rolled, sin)
        else:
            tf = t.to(_F32)
            t.copy_(tf.roll(half, -1).mul_(sin).addcmul_(tf, cos))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(x[..., :I]) * x[..., I:], in fp32."""
    if _native() and x.dtype == _F32 and x.shape[-1] % 32 == 0 and x.is_contiguous():
        return cpu_native.silu_mul(x)
    if x.dtype == _F32:
        gate, up = x.chunk(2, dim=-1)
        return torch.mul(F.silu(gate), up)
    gate, up = x.to(_F32).chunk(2, dim=-1)
    return torch.mul(F.silu(gate), up).to(x.dtype)


# --- KV cache ----------------------------------------------------------------------------------------

_slot_memo = _StepMemo()


def _slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(slots to write, the rows of k/v they take or None for all), -1 padding dropped."""
    hit = _slot_memo.get((slot_mapping,))
    if hit is not None:
        return hit  # type: ignore[return-value]
    slots = slot_mapping.view(-1).long()
    keep = None
    if slots.numel() and int(slots.min()) < 0:
        keep = (slots >= 0).nonzero().view(-1)
        slots = slots.index_select(0, keep)
    return _slot_memo.put((slots, keep), (slot_mapping,))  # type: ignore[return-value]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter this step's k, v [T,Hkv,D] into the paged cache at slot_mapping (skipping -1)."""
    if (_native() and k_scale is None and k_cache.dtype == _F32 and k.dtype == _F32 and v.dtype == _F32
            and k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64
            and slot_mapping.is_contiguous() and k.stride()[1:] == (k.shape[2], 1)
            and v.stride()[1:] == (v.shape[2], 1)):
        cpu_native.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    slots, keep = _slots(slot_mapping)
    if keep is not None:
        k, v = k.index_select(0, keep), v.index_select(0, keep)
    n, s = k_cache.shape[:2]
    kc, vc = k_cache.view(n * s, *k_cache.shape[2:]), v_cache.view(n * s, *v_cache.shape[2:])
    if k_scale is None:
        kc.index_copy_(0, slots, k if k.dtype == kc.dtype else k.to(kc.dtype))
        vc.index_copy_(0, slots, v if v.dtype == vc.dtype else v.to(vc.dtype))
        return
    kq, ks = quantize_kv_int8(k, k_scale.shape[-1])
    vq, vs = quantize_kv_int8(v, v_scale.shape[-1])
    kc.index_copy_(0, slots, kq)
    vc.index_copy_(0, slots, vq)
    k_scale.view(n * s, *k_scale.shape[2:]).index_copy_(0, slots, ks.to(k_scale.dtype))
    v_scale.view(n * s, *v_scale.shape[2:]).index_copy_(0, slots, vs.to(v_scale.dtype))


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """`rope` in place on q and k, then `write_kv` of the rotated k and v (two calls: nothing to fuse here)."""
    rope(q, k, positions, cos_sin)
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


# --- attention ---------------------------------------------------------------------------------------

@dataclass
class _DecodeLayout:
    index: torch.Tensor  # [B * nb] int64 block ids
    length: int  # padded context length L = nb * S (or the exact length when B == 1)
    mask: torch.Tensor | None  # [B, 1, 1, L] additive fp32 mask, None when nothing is padded
    block_size: int


_decode_memo = _StepMemo()


def _decode_layout(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> _DecodeLayout:
    hit = _decode_memo.get((block_tables, context_lens))
    if hit is not None and hit.block_size == block_size:  # type: ignore[attr-defined]
        return hit  # type: ignore[return-value]
    lens = context_lens.tolist()
    top = max(lens)
    nb = -(-top // block_size)
    index = block_tables[:, :nb].reshape(-1).long()
    mask = None
    if min(lens) != nb * block_size and len(lens) > 1:
        pos = torch.arange(nb * block_size)
        mask = torch.zeros(len(lens), 1, 1, nb * block_size, dtype=_F32)
        mask.masked_fill_((pos[None, :] >= context_lens.long()[:, None])[:, None, None, :], float("-inf"))
    length = top if len(lens) == 1 else nb * block_size
    layout = _DecodeLayout(index, length, mask, block_size)
    return _decode_memo.put(layout, (block_tables, context_lens))  # type: ignore[return-value]


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, index: torch.Tensor, batch: int,
            length: int) -> torch.Tensor:
    """The blocks at index as fp32 [batch, Hkv, length, D] (a transposed view of the copy)."""
    n_blocks = index.numel() // batch
    s, h, d = cache.shape[1:]
    out = cache.index_select(0, index).view(batch, n_blocks * s, h, d)
    if scale is not None:  # one scale per group of d / G channels
        groups = scale.shape[-1]
        sc = scale.index_select(0, index).view(batch, n_blocks * s, h, groups, 1)
        out = out.to(_F32).view(batch, n_blocks * s, h, groups, d // groups).mul_(sc).flatten(-2)
    elif out.dtype != _F32:
        out = out.to(_F32)
    return out[:, :length].transpose(1, 2)


def _native_kv_scales(k_scale: torch.Tensor, v_scale: torch.Tensor, head_dim: int) -> bool:
    """Whether the C decode kernel reads these int8 scales: float32, contiguous, groups of whole 16-lane vectors."""
    return all(t.dtype == _F32 and t.is_contiguous() and (head_dim // t.shape[-1]) % 16 == 0
               for t in (k_scale, v_scale))


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One new query per sequence, q [B,Hq,D], over its whole cached context: the native kernel reads the
    blocks in place (float32 or int8 caches, float32 q); otherwise one gather and one batched SDPA."""
    b, hq, d = q.shape
    if (_native() and q.dtype == _F32 and d % 16 == 0 and d <= 256
            and k_cache.dtype in (_F32, torch.int8) and k_cache.is_contiguous() and v_cache.is_contiguous()
            and block_tables.dtype == torch.int32 and block_tables.is_contiguous()
            and context_lens.dtype == torch.int32 and context_lens.is_contiguous()
            and (k_scale is None) == (k_cache.dtype == _F32)
            and (k_scale is None or _native_kv_scales(k_scale, v_scale, d))):
        return cpu_native.attention_decode(q.contiguous(), k_cache, v_cache, block_tables, context_lens, scale,
                                           k_scale, v_scale)
    lay = _decode_layout(block_tables, context_lens, k_cache.shape[1])
    k = _gather(k_cache, k_scale, lay.index, b, lay.length)
    v = _gather(v_cache, v_scale, lay.index, b, lay.length)
    qf = q if q.dtype == _F32 else q.to(_F32)
    out = F.scaled_dot_product_attention(qf[:, :, None, :], k, v, attn_mask=lay.mask, scale=scale,
                                         enable_gqa=k.shape[1] != hq)
    out = out.view(b, hq, d)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                      scale: float, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens (q [T,Hq,D], packed by cu_seqlens_q) over a
    cached prefix plus themselves; their K/V are already in the cache (write_kv ran first).

    Sequences with one new token go through the batched decode path together; each sequence with
    several runs one SDPA over its gathered context (causal, offset by its cached prefix)."""
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    counts = [hi - lo for lo, hi in zip(starts, starts[1:])]
    singles = [i for i, c in enumerate(counts) if c == 1]
    chunks = [i for i, c in enumerate(counts) if c > 1]
    if len(singles) == len(counts):
        return attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    if len(chunks) == 1 and not singles and counts[chunks[0]] == q.shape[0]:
        return _prefill_one(q, k_cache, v_cache, block_tables[chunks[0]], lens[chunks[0]], scale, k_scale,
                            v_scale)
    out = torch.empty_like(q)
    for i in chunks:
        lo, hi = starts[i], starts[i + 1]
        out[lo:hi] = _prefill_one(q[lo:hi], k_cache, v_cache, block_tables[i], lens[i], scale, k_scale, v_scale)
    if singles:
        rows = torch.tensor([starts[i] for i in singles])
        picked = torch.tensor(singles)
        out[rows] = attention_decode(q.index_select(0, rows), k_cache, v_cache, block_tables.index_select(0, picked),
                                     context_lens.index_select(0, picked), scale, k_scale, v_scale)
    return out


def _prefill_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, length: int,
                 scale: float, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> torch.Tensor:
    """q [Tq,Hq,D], the last Tq of `length` cached tokens, causally over all of them."""
    tq, hq, d = q.shape
    index = table[:math.ceil(length / k_cache.shape[1])].long()
    k = _gather(k_cache, k_scale, index, 1, length)
    v = _gather(v_cache, v_scale, index, 1, length)
    qf = (q if q.dtype == _F32 else q.to(_F32)).transpose(0, 1)[None]
    gqa = k.shape[1] != hq
    if tq == length:
        out = F.scaled_dot_product_attention(qf, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        allowed = torch.arange(length)[None, :] <= torch.arange(length - tq, length)[:, None]
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    out = out[0].transpose(0, 1)
    return out if out.dtype == q.dtype else out.to(q.dtype)
