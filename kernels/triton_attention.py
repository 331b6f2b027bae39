"""Attention over the paged KV cache on the GPU: flash-decoding for decode, causal flash attention for
prefill. Both read K/V token by token through the block table (any block size), optionally from an
int8 cache with one float32 scale per token, kv head and group of channels (kernels/reference.py: 32
channels for keys, the whole head for values): a tile is dequantized in float32 registers and rounded
to the activation dtype right before tl.dot, like a dequantized weight tile (a key scale varies along
head_dim, so it cannot be applied to the dot's result).

Softmax runs in base 2: scores are multiplied by scale * log2(e) once.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .triton_convert import i8_to_f32
from .triton_pdl import pdl_begin, pdl_launch

_LOG2E = 1.4426950408889634


@triton.jit
def _kv_offsets(bt_row_ptr, t, tmask, block_size, stride_n, stride_s):
    """Element offsets of cached tokens t (masked -> block 0) for a block-table row."""
    blk = tl.load(bt_row_ptr + t // block_size, mask=tmask, other=0).to(tl.int64)
    return blk * stride_n + (t % block_size).to(tl.int64) * stride_s


@triton.jit
def _scaled(q, s_ptr, s_off, tmask, d, dmask, head_dim, group, stride_g, CH: tl.constexpr, BLOCK_D: tl.constexpr):
    """An int8 tile q [T, BLOCK_D] in float32, channel d times scale d // group of its token (s_off: the
    tokens' scale offsets). CH: the same group as a power of two dividing BLOCK_D, so that a token's scales load
    once a group and broadcast over its channels; 0: a scale load a channel (any group)."""
    if CH > 0:
        g = tl.arange(0, BLOCK_D // CH)
        gs = tl.load(s_ptr + s_off[:, None] + g[None, :] * stride_g, mask=tmask[:, None] & (g * CH < head_dim)[None, :],
                     other=0.0)
        f = tl.reshape(i8_to_f32(q), (q.shape[0], BLOCK_D // CH, CH)) * gs[:, :, None]
        return tl.reshape(f, (q.shape[0], BLOCK_D))
    else:
        scale = tl.load(s_ptr + s_off[:, None] + (d // group)[None, :] * stride_g, mask=tmask[:, None] & dmask[None, :],
                        other=0.0)
        return i8_to_f32(q) * scale


@triton.jit
def _load_tile(k_ptr, v_ptr, bt_row, t, tmask, d, dmask, block_size, kvh, ks_ptr, vs_ptr, head_dim, k_group, v_group,
               stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
               stride_ksn, stride_kss, stride_ksh, stride_ksg, stride_vsn, stride_vss, stride_vsh, stride_vsg,
               dtype: tl.constexpr, INT8: tl.constexpr, K_CH: tl.constexpr, V_CH: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """The K/V tile of cached tokens t for one kv head, in dtype (masked tokens: 0).
    int8: channel d of a token's key takes scale d // k_group of its (token, kv head), of its value
    scale d // v_group (K_CH, V_CH: _scaled's CH)."""
    k_off = _kv_offsets(bt_row, t, tmask, block_size, stride_kn, stride_ks) + kvh * stride_kh
    v_off = _kv_offsets(bt_row, t, tmask, block_size, stride_vn, stride_vs) + kvh * stride_vh
    kv_mask = tmask[:, None] & dmask[None, :]
    k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0)
    v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0)
    if INT8:
        ks_off = _kv_offsets(bt_row, t, tmask, block_size, stride_ksn, stride_kss) + kvh * stride_ksh
        vs_off = _kv_offsets(bt_row, t, tmask, block_size, stride_vsn, stride_vss) + kvh * stride_vsh
        k = _scaled(k, ks_ptr, ks_off, tmask, d, dmask, head_dim, k_group, stride_ksg, K_CH, BLOCK_D)
        v = _scaled(v, vs_ptr, vs_off, tmask, d, dmask, head_dim, v_group, stride_vsg, V_CH, BLOCK_D)
    return k.to(dtype), v.to(dtype)


@triton.jit
def _tile_scores(q, k_ptr, v_ptr, bt_row, t, tmask, d, dmask, block_size, kvh, ks_ptr, vs_ptr, head_dim, k_group,
                 v_group, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
                 stride_ksn, stride_kss, stride_ksh, stride_ksg, stride_vsn, stride_vss, stride_vsh, stride_vsg,
                 INT8: tl.constexpr, K_CH: tl.constexpr, V_CH: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load the K/V tile of cached tokens t for one kv head; return (q.K^T, V as a dot operand)."""
    k, v = _load_tile(k_ptr, v_ptr, bt_row, t, tmask, d, dmask, block_size, kvh, ks_ptr, vs_ptr, head_dim, k_group,
                      v_group, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
                      stride_ksn, stride_kss, stride_ksh, stride_ksg, stride_vsn, stride_vss, stride_vsh, stride_vsg,
                      q.dtype, INT8, K_CH, V_CH, BLOCK_D)
    return tl.dot(q, tl.trans(k)), v


@triton.jit
def _softmax_step(q, s, v, m_i, l_i, acc):
    """One online-softmax update (base 2) of the running max, sum and output with a tile's scores."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc += tl.dot(p.to(q.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, po_ptr, plse_ptr,
                   qk_scale, block_size, num_splits, num_heads, group, head_dim, k_group, v_group,
                   stride_qb, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
                   stride_ksn, stride_kss, stride_ksh, stride_ksg, stride_vsn, stride_vss, stride_vsh, stride_vsg,
                   stride_bt, stride_ob, stride_oh,
                   INT8: tl.constexpr, SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_T: tl.constexpr, PDL: tl.constexpr, K_CH: tl.constexpr, V_CH: tl.constexpr):
    """Program (sequence, kv head, split): all q heads of the kv head over one slice of the context.
    The slice's first tile loads before the wait on the previous kernel (PDL), but for the newest token,
    which that kernel (rope_write_kv) writes: the program whose first tile holds it loads the tile again
    after the wait. The context lengths and block tables must not be written by the kernel before."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    per = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_T) * BLOCK_T
    lo = sp * per
    hi = tl.minimum(lo + per, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < group
    dmask = d < head_dim
    heads = kvh * group + g
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    dt = q_ptr.dtype.element_ty
    t = lo + tl.arange(0, BLOCK_T)
    tmask = t < hi
    k, v = _load_tile(k_ptr, v_ptr, bt_row, t, tmask & (t < ctx - 1), d, dmask, block_size, kvh, ks_ptr, vs_ptr,
                      head_dim, k_group, v_group, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
                      stride_ksn, stride_kss, stride_ksh, stride_ksg, stride_vsn, stride_vss, stride_vsh, stride_vsg,
                      dt, INT8, K_CH, V_CH, BLOCK_D)
    pdl_begin(PDL)
    if lo + BLOCK_T >= ctx:
        k, v = _load_tile(k_ptr, v_ptr, bt_row, t, tmask, d, dmask, block_size, kvh, ks_ptr, vs_ptr, head_dim,
                          k_group, v_group, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
                          stride_ksn, stride_kss, stride_ksh, stride_ksg, stride_vsn, stride_vss, stride_vsh,
                          stride_vsg, dt, INT8, K_CH, V_CH, BLOCK_D)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    if lo < hi:  # an empty split (short context) keeps lse = -inf
        s = tl.where(tmask[None, :], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_i, l_i, acc = _softmax_step(q, s, v, m_i, l_i, acc)
    for t0 in range(lo + BLOCK_T, hi, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tmask = t < hi
        s, v = _tile_scores(q, k_ptr, v_ptr, bt_row, t, tmask, d, dmask, block_size, kvh, ks_ptr, vs_ptr,
                            head_dim, k_group, v_group, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs,
                            stride_vh, stride_ksn, stride_kss, stride_ksh, stride_ksg, stride_vsn, stride_vss,
                            stride_vsh, stride_vsg, INT8, K_CH, V_CH, BLOCK_D)
        s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc = _softmax_step(q, s, v, m_i, l_i, acc)
    o_mask = gmask[:, None] & dmask[None, :]
    if SPLIT:
        # normalized partial output and its log2-sum-exp; an empty split leaves lse = -inf
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        base = (b.to(tl.int64) * num_heads + heads) * num_splits + sp
        tl.store(plse_ptr + base, tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf")), mask=gmask)
        tl.store(po_ptr + base[:, None] * BLOCK_D + d[None, :], acc / safe_l[:, None], mask=o_mask)
    else:
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _decode_reduce_kernel(po_ptr, plse_ptr, out_ptr, num_heads, num_splits, head_dim, stride_ob, stride_oh,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Program (sequence, q head): merge the splits' partial softmaxes."""
    pdl_begin(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    base = (b * num_heads + h) * num_splits
    lse = tl.load(plse_ptr + base + sp, mask=sp < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(po_ptr + (base + sp)[:, None] * BLOCK_D + d[None, :], mask=(sp < num_splits)[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d < head_dim)


# The batch's sequence count and block-table width change with every burst; Triton would compile a
# variant per value class (== 1, divisible by 16, other) on first use, mid-burst (seen on the H200).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_ptr, lens_ptr, out_ptr,
                    qk_scale, block_size, num_seqs, group, head_dim, k_group, v_group,
                    stride_qt, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
                    stride_ksn, stride_kss, stride_ksh, stride_ksg, stride_vsn, stride_vss, stride_vsh, stride_vsg,
                    stride_bt, stride_ot, stride_oh,
                    INT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    PDL: tl.constexpr, K_CH: tl.constexpr, V_CH: tl.constexpr):
    """Program (query tile, q head). Query tiles are numbered over all sequences in order; the grid
    has an upper bound of them (no host sync on cu_seqlens), surplus programs exit."""
    pdl_begin(PDL)
    tile = tl.program_id(0)
    h = tl.program_id(1)
    # find this tile's sequence: tiles of sequence b follow those of sequences < b
    seq = tl.zeros([], dtype=tl.int32) - 1
    local = tl.zeros([], dtype=tl.int32)
    seen = tl.zeros([], dtype=tl.int32)
    for b in range(num_seqs):
        n_tiles = tl.cdiv(tl.load(cu_ptr + b + 1) - tl.load(cu_ptr + b), BLOCK_M)
        hit = (tile >= seen) & (tile < seen + n_tiles)
        seq = tl.where(hit, b, seq)
        local = tl.where(hit, tile - seen, local)
        seen += n_tiles
    if seq >= 0:
        q_start = tl.load(cu_ptr + seq)
        q_len = tl.load(cu_ptr + seq + 1) - q_start
        ctx = tl.load(lens_ptr + seq)
        i = local * BLOCK_M + tl.arange(0, BLOCK_M)
        imask = i < q_len
        pos = ctx - q_len + i  # absolute position of each query
        d = tl.arange(0, BLOCK_D)
        dmask = d < head_dim
        rows = (q_start + i).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=imask[:, None] & dmask[None, :], other=0.0)
        kvh = h // group
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        end = tl.minimum(ctx, ctx - q_len + local * BLOCK_M + BLOCK_M)  # last key any row of the tile sees
        for t0 in range(0, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < end
            s, v = _tile_scores(q, k_ptr, v_ptr, bt_row, t, tmask, d, dmask, block_size, kvh, ks_ptr, vs_ptr,
                                head_dim, k_group, v_group, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs,
                                stride_vh, stride_ksn, stride_kss, stride_ksh, stride_ksg, stride_vsn, stride_vss,
                                stride_vsh, stride_vsg, INT8, K_CH, V_CH, BLOCK_D)
            # key 0 is visible to every row (padding rows included), so m_i is finite after step one
            visible = (t[None, :] <= pos[:, None]) & tmask[None, :]
            s = tl.where(visible, s * qk_scale, float("-inf"))
            m_i, l_i, acc = _softmax_step(q, s, v, m_i, l_i, acc)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=imask[:, None] & dmask[None, :])


def _scale_layout(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, head_dim: int) -> tuple[int, ...]:
    """(channels per key scale, per value scale, then each scale tensor's 4 strides) of an int8 cache's
    [N, S, Hkv, G] scales; (head_dim, head_dim, zeros) for a float cache."""
    if k_scale is None:
        return (head_dim, head_dim) + (0,) * 8
    return (head_dim // k_scale.shape[-1], head_dim // v_scale.shape[-1], *k_scale.stride(), *v_scale.stride())


def _scale_channels(group: int, block_d: int) -> int:
    """_scaled's CH for `group` channels a scale: the group where it is a power of two dividing block_d, else 0."""
    return group if group & (group - 1) == 0 and block_d % group == 0 else 0


@lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # interpreter: small grids that still split
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(batch_heads: int, max_context: int, block_t: int, device: torch.device) -> int:
    """Context splits per (sequence, kv head): about two programs per SM, >= block_t tokens each.
    Depends only on shapes (the block table's width bounds the context), so CUDA graphs can hold it."""
    want = -(-2 * _sm_count(device) // batch_heads)
    return max(1, min(want, max_context // block_t, 64))


def decode_tile(batch_heads: int, max_context: int, head_dim: int, int8: bool, device: torch.device) -> int:
    """Tokens a step (block_t) of attention_decode on a GPU: about 4096 K elements (64 tokens of a 64-wide head),
    no more than a split's slice of the context (decode_splits at 32 tokens); 32 tokens for int8 caches.
    H200, 512-token context, the decode step's CUDA graph against 32-token tiles, w8 tok/s: 1B batch 32
    18,674 -> 19,585, batch 64 28,776 -> 32,611; SmolLM2 batch 64 38,814 -> 42,500; the 8B (128-wide heads:
    32-token tiles) unchanged. 8 warps, single splits and 128-token tiles measured no faster, 64-token tiles
    of an int8 cache 1.26x slower (docs/BENCHMARKS.md, session 30)."""
    if int8:
        return 32
    slice_tokens = -(-max_context // decode_splits(batch_heads, max_context, 32, device))
    return max(16, min(128, 4096 // triton.next_power_of_2(head_dim), 1 << (slice_tokens.bit_length() - 1)))


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, num_splits: int | None = None,
                     block_t: int | None = None, num_warps: int = 4,
                     num_stages: int | None = None) -> torch.Tensor:
    """q [B,Hq,D] (the token at position context_len - 1) over its cached context; out [B,Hq,D].
    num_splits, block_t (tokens a step), num_warps and num_stages override the heuristics (tests, sweeps).
    Under PDL the cache, block tables and context lengths are read before the wait on the kernel launched
    just before, but for each sequence's newest token: that kernel may write the newest token's K/V
    (rope_write_kv does), nothing else of these."""
    batch, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    on_gpu = q.is_cuda
    max_context = block_tables.shape[1] * k_cache.shape[1]
    if block_t is None:
        block_t = decode_tile(batch * n_kv, max_context, head_dim, k_scale is not None, q.device) if on_gpu else 16
    block_d = triton.next_power_of_2(head_dim)
    if num_splits is None:
        num_splits = decode_splits(batch * n_kv, max_context, min(block_t, 32), q.device)
    split = num_splits > 1
    if split:
        po = torch.empty(batch, n_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        plse = torch.empty(batch, n_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        po = plse = out
    k_group, v_group, *ss = _scale_layout(k_scale, v_scale, head_dim)
    _decode_kernel[(batch, n_kv, num_splits)](
        q, k_cache, v_cache, k_scale if k_scale is not None else k_cache,
        v_scale if v_scale is not None else v_cache, block_tables, context_lens, out, po, plse,
        scale * _LOG2E, k_cache.shape[1], num_splits, n_heads, group, head_dim, k_group, v_group,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], *ss,
        block_tables.stride(0), out.stride(0), out.stride(1),
        INT8=k_scale is not None, SPLIT=split, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_T=block_t, K_CH=_scale_channels(k_group, block_d), V_CH=_scale_channels(v_group, block_d),
        num_warps=num_warps, num_stages=num_stages or (2 if on_gpu else 1), **pdl_launch(q.device))
    if split:
        _decode_reduce_kernel[(batch, n_heads)](
            po, plse, out, n_heads, num_splits, head_dim, out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4, **pdl_launch(q.device))
    return out


def attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      block_m: int | None = None) -> torch.Tensor:
    """Causal attention of the new tokens q [T,Hq,D] (packed by cu_seqlens_q) over the cached prefix
    and themselves (already written to the cache); out [T,Hq,D]."""
    tokens, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = context_lens.shape[0]
    if tokens == 0 or num_seqs == 0:
        return out
    on_gpu = q.is_cuda
    block_d = triton.next_power_of_2(head_dim)
    if block_m is None:
        block_m = (128 if head_dim <= 64 else 64) if on_gpu else 16
    block_n = (64 if head_dim <= 128 else 32) if on_gpu else 16
    k_group, v_group, *ss = _scale_layout(k_scale, v_scale, head_dim)
    tiles = math.ceil(tokens / block_m) + num_seqs
    _prefill_kernel[(tiles, n_heads)](
        q, k_cache, v_cache, k_scale if k_scale is not None else k_cache,
        v_scale if v_scale is not None else v_cache, block_tables, cu_seqlens_q, context_lens, out,
        scale * _LOG2E, k_cache.shape[1], num_seqs, n_heads // n_kv, head_dim, k_group, v_group,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], *ss,
        block_tables.stride(0), out.stride(0), out.stride(1),
        INT8=k_scale is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        K_CH=_scale_channels(k_group, block_d), V_CH=_scale_channels(v_group, block_d),
        num_warps=4 if block_m <= 64 else 8, num_stages=2 if on_gpu else 1, **pdl_launch(q.device))
    return out
