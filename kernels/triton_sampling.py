"""`sample` and `argmax` on the GPU. Greedy rows are logits.argmax, as in the reference. Sampled rows use the
reference's counter-based uniforms, computed here by a Triton kernel in uint32 arithmetic (bit-exact
with reference.sampling_uniform), then the same top-k/top-p filter and Gumbel-max argmax in torch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .triton_counters import arrive, check_groups, split_counters
from .triton_pdl import pdl_begin, pdl_launch


@triton.jit
def _mix32(x):
    # lowbias32, as reference._mix32; uint32 products wrap mod 2**32
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _uniform_kernel(seed_ptr, offset_ptr, out_ptr, vocab, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # int64 -> uint32 keeps the low 32 bits, as the reference's & 0xFFFFFFFF
    seed = tl.load(seed_ptr + row).to(tl.uint32)
    off = tl.load(offset_ptr + row).to(tl.uint32)
    key = _mix32(off ^ _mix32(tl.full([BLOCK], 0, tl.uint32) + seed))
    h = _mix32(idx.to(tl.uint32) ^ key)
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    tl.store(out_ptr + row * stride_o + idx, u, mask=idx < vocab)


def sampling_uniform(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 uniforms in (0, 1), equal bit for bit to reference.sampling_uniform."""
    rows = seeds.shape[0]
    out = torch.empty(rows, vocab, dtype=torch.float32, device=seeds.device)
    if rows == 0 or vocab == 0:
        return out
    block = min(4096, triton.next_power_of_2(vocab))
    _uniform_kernel[(rows, triton.cdiv(vocab, block))](seeds.to(torch.int64), offsets.to(torch.int64), out,
                                                        vocab, out.stride(0), BLOCK=block, num_warps=4,
                                                        **pdl_launch(out.device))
    return out


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Next token per row of logits [B,V]: the reference's sampling with the uniforms made on the GPU."""
    return reference.sample(logits, temperature, top_k, top_p, seeds, offsets, uniform=sampling_uniform)


@triton.jit
def _argmax_kernel(x_ptr, part_v_ptr, part_i_ptr, counters_ptr, out_ptr, vocab, stride_x, pieces,
                   BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """Program (row, piece): the max and its first index over one piece of the row; the row's last piece
    to arrive takes the first of the pieces' maxima (ties: the lowest index, as torch.argmax)."""
    pdl_begin(PDL)
    row = tl.program_id(0)
    piece = tl.program_id(1)
    idx = piece * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # a NaN counts as +inf (torch.argmax also picks a NaN)
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    slot = row * pieces + piece
    tl.store(part_v_ptr + slot, best)
    tl.store(part_i_ptr + slot, piece * BLOCK + at)
    if arrive(counters_ptr, row, pieces):
        p = tl.arange(0, BLOCK_P)
        vals = tl.load(part_v_ptr + row * pieces + p, mask=p < pieces, other=float("-inf"), cache_modifier=".cg")
        _, which = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out_ptr + row, tl.load(part_i_ptr + row * pieces + which, cache_modifier=".cg").to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> [B] int64, the first index of each row's maximum: one kernel of many programs a
    row (torch's one-block-a-row reduction takes ~30 us for a 128K vocabulary on an H200)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block = min(4096, triton.next_power_of_2(vocab))
    pieces = triton.cdiv(vocab, block)
    check_groups(rows)
    part_v = torch.empty(rows * pieces, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(rows * pieces, dtype=torch.int32, device=logits.device)
    _argmax_kernel[(rows, pieces)](logits, part_v, part_i, split_counters(logits.device), out, vocab,
                                   logits.stride(0), pieces, BLOCK=block,
                                   BLOCK_P=triton.next_power_of_2(pieces), num_warps=4,
                                   **pdl_launch(logits.device))
    return out
