"""The decode GEMV of w4 weights on tensor cores (one row of x): measured, and not what `linear` launches.

Issue 16 asks for a w4 decode GEMV that is memory-bound; triton_linear._gemv_w4_kernel issues about 3.7
instructions a weight on sm_90 (an FMA and a nibble's conversion each). Here a tensor core does the multiply-adds:

- Groups as columns. x enters the dot as a block-diagonal [BLOCK_K, 16] matrix whose column j holds x only on the
  columns of group j of a cycle of 16 groups, so one dot of a weight tile makes each row's 16 group sums
  sum(q * x) at once, and scales and minimums apply to that [rows, 16] result once a cycle.
- Nibbles as "128 + q" bfloat16 pairs: (word >> 4t) & 0x000F000F | 0x43004300 is two of them in one LOP3 (inline
  PTX), and the dot's 128 * sum(x) comes off with the minimum: scale * sum((128 + q) x) + (min - 128 scale) sum(x).
- No shared-memory round trip for the weights: the weights are stored tile-major (shuffle_w4_tiles) and _tile
  relabels the index bits of a tile's column pairs (RELABEL_ORDER) so that each thread already holds what the
  wgmma register operand wants of it (Triton 3.6, sm_90: no local_alloc for the tile).
`edged bench kernels --w4-tensor-cores` times it against the GEMVs.

On the H200 (docs/BENCHMARKS.md, session 29) it is correct (the GEMV's error against the float32 reference) but
0.51-0.65x the GEMV's speed at the 1B and 8B shapes: 255 registers a thread (2 programs an SM) and a block-diagonal
x built and stored to shared memory every 128 columns keep it latency-bound at 1.2-1.8 TB/s, where the GEMV reads
2.1-3.1 TB/s. So `linear` keeps the GEMV; this stays, tested, as the measured base for a version with the x operand
built once (Gluon or TMA).

The portable form (the interpreter, float16 / float32 x) makes the same tile from the same words with integer ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_convert import asm_conversions
from .triton_linear import _gemv_counters, _gemv_epilogue_inputs, _gemv_store, _k_split
from .triton_pdl import pdl_begin, pdl_launch

GROUPS_PER_CYCLE = 16  # the block-diagonal x's columns: tl.dot's smallest N
BLOCK_N = 128  # weight rows a program
BLOCK_K = 128  # columns a step; a tile of BLOCK_N x BLOCK_K weights is BLOCK_N * BLOCK_K / 8 consecutive words
NUM_WARPS = 4  # the relabelling in _tile is this layout's (128 x 128 tile, 4 warps)
# _tile's permutation of the 13 index bits of a tile's [128, 64] column pairs (7 row bits, 6 pair bits, high first)
RELABEL_ORDER = (0, 2, 3, 1, 4, 5, 6, 9, 10, 11, 12, 7, 8)


def shuffle_w4_tiles(data: torch.Tensor) -> torch.Tensor:
    """A w4 weight's bytes [N, K / 2] (column 2j in byte j's low nibble, 2j + 1 in its high one) as the int32 words
    _w4_dot_kernel reads: [row tiles, K steps, BLOCK_N * BLOCK_K / 8], rows and columns padded with zeros to whole
    tiles; in a tile, word j's nibbles t and t + 4 hold column pair 4j + t of the [BLOCK_N, BLOCK_K / 2] pair tensor
    that _tile relabels (RELABEL_ORDER) into the natural [rows, columns] tile."""
    n, kb = data.shape
    k = 2 * kb
    tiles_n, steps = -(-n // BLOCK_N), -(-k // BLOCK_K)
    q = torch.zeros(tiles_n * BLOCK_N, steps * BLOCK_K, dtype=torch.int32, device=data.device)
    q[:n, :k] = torch.stack((data & 0x0F, data >> 4), dim=-1).reshape(n, k).to(torch.int32)
    # natural tiles [tiles_n, steps, BLOCK_N, BLOCK_K / 2 pairs, 2]
    natural = q.reshape(tiles_n, BLOCK_N, steps, BLOCK_K // 2, 2).permute(0, 2, 1, 3, 4)
    # where _tile's relabelled pair (r, c) comes from in the stored pair tensor
    source = torch.arange(BLOCK_N * BLOCK_K // 2, device=data.device).reshape((2,) * 13).permute(RELABEL_ORDER)
    stored = torch.empty_like(natural).reshape(tiles_n, steps, -1, 2)
    stored[:, :, source.reshape(-1)] = natural.reshape(tiles_n, steps, -1, 2)
    # stored pair 4j + t: word j, nibbles t (low column) and t + 4 (high)
    pairs = stored.reshape(tiles_n, steps, BLOCK_N * BLOCK_K // 8, 4, 2).to(torch.int64)
    shifts = 4 * torch.arange(4, device=data.device)
    words = ((pairs[..., 0] << shifts) | (pairs[..., 1] << (shifts + 16))).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


@triton.jit
def _pairs_asm(w):
    """Shuffled words -> four int32 tensors, each two bfloat16 128 + q of adjacent columns: t holds word columns
    2t (its nibble t) and 2t + 1 (nibble t + 4): (word >> 4t) & 0x000F000F | 0x43004300."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a1, a2, a3;
        shr.b32 a1, $4, 4;
        shr.b32 a2, $4, 8;
        shr.b32 a3, $4, 12;
        lop3.b32 $0, $4, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $1, a1, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $2, a2, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $3, a3, 0x000F000F, 0x43004300, 0xEA;
        }""",
        constraints="=r,=r,=r,=r,r", args=[w], dtype=(tl.int32,) * 4, is_pure=True, pack=1)


@triton.jit
def _halves_asm(pair):
    """An int32 holding two bfloat16 -> the two (low half first); free where the pair feeds the dot as is."""
    return tl.inline_asm_elementwise(asm="mov.b32 {$0, $1}, $2;", constraints="=h,=h,r", args=[pair],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def _join4(t0, t1, t2, t3):
    """Four [R, C] tensors as one [R, C, 4], tensor t at index t (each join adds the innermost dimension)."""
    return tl.join(tl.join(t0, t2), tl.join(t1, t3))


@triton.jit
def _tile(w, dt: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """A step's tile-major words [BLOCK_N * BLOCK_K / 8] -> the weights' 128 + q [BLOCK_N, BLOCK_K] in dt. Word j of
    the step makes the pairs 4j..4j+3 of a [BLOCK_N, BLOCK_K / 2] tensor of column pairs; RELABEL_ORDER permutes
    its 13 index bits so that each thread holds the pairs the dot's operand layout has it hold (no shared-memory
    round trip under Triton 3.6, sm_90); each pair is then two columns. shuffle_w4_tiles stores the weights so that
    the result is the [rows, columns] tile in natural order."""
    w = w.reshape(BLOCK_N, BLOCK_K // 8)
    if ASM:
        p0, p1, p2, p3 = _pairs_asm(w)
    else:
        p0 = _pair_ints(w, 0)
        p1 = _pair_ints(w, 1)
        p2 = _pair_ints(w, 2)
        p3 = _pair_ints(w, 3)
    # RELABEL_ORDER, written out: tl.permute takes no module-level tuple
    pairs = tl.permute(_join4(p0, p1, p2, p3).reshape(2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2),
                       (0, 2, 3, 1, 4, 5, 6, 9, 10, 11, 12, 7, 8)).reshape(BLOCK_N, BLOCK_K // 2)
    if ASM:
        lo, hi = _halves_asm(pairs)
    else:
        lo = ((pairs & 0xFFFF) + 128).to(dt)
        hi = ((pairs >> 16) + 128).to(dt)
    return tl.join(lo, hi).reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _pair_ints(w, t: tl.constexpr):
    """_pairs_asm's pair t without PTX: nibbles t and t + 4 as the int32 low and high halves (no magic)."""
    return ((w >> (4 * t)) & 0xF) | (((w >> (4 * t + 16)) & 0xF) << 16)


@triton.jit
def _w4_dot_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr, res_ptr, N, K,
                   k_per_split, num_splits, stride_sn, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                   RESIDUAL: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   ASM: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """out[n] = sum_k W[n, k] x[k] (+ bias, + residual) for BLOCK_N rows of shuffled w4 words a program, over one
    K split of k_per_split columns (a whole number of cycles of GROUPS_PER_CYCLE groups)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    G: tl.constexpr = 16  # GROUPS_PER_CYCLE (a jit function reads no plain module global)
    CYCLE: tl.constexpr = G * GROUP_SIZE
    STEPS: tl.constexpr = CYCLE // BLOCK_K
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(n, N - 1).to(tl.int64)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    cols = tl.arange(0, BLOCK_K)
    TILE_WORDS: tl.constexpr = BLOCK_N * BLOCK_K // 8
    tile_words = tl.arange(0, TILE_WORDS)
    last_step = tl.cdiv(K, BLOCK_K) - 1
    w_tile = w_ptr + pid_n.to(tl.int64) * (last_step + 1) * TILE_WORDS
    g = tl.arange(0, G)
    dt = x_ptr.dtype.element_ty
    GPS: tl.constexpr = BLOCK_K // GROUP_SIZE  # groups a step
    pdl_begin(PDL)
    acc = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, CYCLE):
        p = tl.zeros([BLOCK_N, G], dtype=tl.float32)
        kx = k0 + g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
        xs = tl.sum(tl.load(x_ptr + kx, mask=kx < k_hi, other=0.0).to(tl.float32), axis=1)
        for s in tl.range(0, STEPS, num_stages=STAGES):
            # steps past K (a cycle's tail) read the last step again against zeros of x
            step = tl.minimum((k0 + s * BLOCK_K) // BLOCK_K, last_step)
            wv = tl.load(w_tile + step * TILE_WORDS + tile_words)
            kk = k0 + s * BLOCK_K + cols
            xk = tl.load(x_ptr + kk, mask=kk < k_hi, other=0.0).to(dt)
            xb = tl.where(g[None, :] == (s * GPS + cols // GROUP_SIZE)[:, None], xk[:, None], 0.0)
            p = tl.dot(_tile(wv, dt, BLOCK_N, BLOCK_K, ASM), xb, p)
        grp = k0 // GROUP_SIZE + g
        gm = grp < k_hi // GROUP_SIZE
        sc = tl.load(scale_ptr + rows[:, None] * stride_sn + grp[None, :], mask=gm[None, :], other=0.0).to(tl.float32)
        mn = tl.load(min_ptr + rows[:, None] * stride_sn + grp[None, :], mask=gm[None, :], other=0.0).to(tl.float32)
        acc += p * sc + (mn - 128.0 * sc) * xs[None, :]
    y = tl.sum(acc, axis=1)
    bias, res = _gemv_epilogue_inputs(n, N, bias_ptr, res_ptr, HAS_BIAS, RESIDUAL, False)
    _gemv_store(y, n, N, pid_n, pid_k, num_splits, bias_ptr, out_ptr, part_ptr, counters_ptr, bias, res,
                HAS_BIAS, SPLIT, RESIDUAL, False, 4)


def w4_dot_linear(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, n: int,
                  group_size: int, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, split: int = 1, asm: bool | None = None,
                  stages: int = 3) -> torch.Tensor:
    """y [1, n] = x [1, K] @ W^T (+ bias, + residual) for W's tile-major words (shuffle_w4_tiles), K split in up to
    `split` pieces of whole cycles of GROUPS_PER_CYCLE groups; `stages` software-pipelines the K steps (3 measured
    best). The PTX pairs (asm, by default where the device takes inline PTX) make bfloat16 and need bfloat16 x."""
    k = x.shape[-1]
    asm = asm_conversions(x.device) if asm is None else asm
    if asm and x.dtype != torch.bfloat16:
        raise ValueError(f"the PTX nibble pairs are bfloat16; x is {x.dtype}")
    if x.device.type == "cuda" and x.dtype == torch.float32:
        raise ValueError("float32 x would make the dot TF32; the tensor-core GEMV takes bfloat16 or float16")
    out_dtype = out_dtype or x.dtype
    cycle = GROUPS_PER_CYCLE * group_size
    tiles_n = -(-n // BLOCK_N)
    if words.shape != (tiles_n, -(-k // BLOCK_K), BLOCK_N * BLOCK_K // 8):
        raise ValueError(f"words {tuple(words.shape)} are not the tiles of a {n} x {k} weight")
    per, split = _k_split(k, cycle, split)
    x = x.reshape(1, k).contiguous()
    out = torch.empty(1, n, dtype=out_dtype, device=x.device)
    part = torch.empty(split, n, dtype=torch.float32, device=x.device) if split > 1 else out
    counters = _gemv_counters(x.device, tiles_n, split, out)
    res = residual.reshape(1, n).to(out_dtype).contiguous() if residual is not None else out
    _w4_dot_kernel[(tiles_n, split)](
        x, words, scale, minimum, bias if bias is not None else out, out, part, counters, res, n, k, per, split,
        scale.stride(0), HAS_BIAS=bias is not None, SPLIT=split > 1, RESIDUAL=residual is not None,
        GROUP_SIZE=group_size, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        ASM=asm, STAGES=stages, num_warps=NUM_WARPS, num_stages=1,
        **pdl_launch(x.device))
    return out
