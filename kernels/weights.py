"""Runtime weight formats read by `linear`: dense, w8 (uint8 groups), w4 (uint4 groups).

Both quantized formats are groups along the input dimension, w = q * scale + minimum, and w8 also comes
symmetric (GGUF Q8_0's form, no minimum stored): w = (q - 128) * scale.
Storage (the numerics policy is in kernels/__init__.py): dense data and bias in the activation dtype;
w8 and w4 scales and minimums in float16, GGUF's own storage, so Q8_0 and Q4_0/Q4_1 are held exactly
(bfloat16 would drop 3 bits of a Q4_1 minimum, an error shared by the whole group). Requantizing a
Q4_1 layer to w8 keeps it almost exactly: a group's (hi - lo) / 255 is its Q4_1 step / 17.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

W8_PARAM_DTYPE = torch.float16
W4_PARAM_DTYPE = torch.float16
W8_GROUP_SIZE = 32  # GGUF Q8_0's block


def w8_group_size(in_features: int) -> int:
    """W8_GROUP_SIZE, or one group per row where in_features is not a multiple of it (tiny test models):
    every kernel then finds a group in whole 16-column chunks, or the row is one group."""
    return W8_GROUP_SIZE if in_features % W8_GROUP_SIZE == 0 else in_features


@dataclass
class LinearWeight:
    """One linear layer's weight in a runtime format.

    - ``dense``: ``data`` is ``[out, in]`` in the compute dtype.
    - ``w8``: ``data`` is uint8 ``[out, in]``, q in 0..255; ``scale`` and ``minimum`` are
      ``[out, in // group_size]``; w = q * scale + minimum (a requantized Q4_0/Q4_1 group almost
      exactly), or symmetric with ``minimum`` None: w = (q - 128) * scale (GGUF Q8_0 exactly, q + 128
      and scale = d; float weights quantized as Q8_0 does: 2 bytes fewer a group of 32 to read).
      group_size is W8_GROUP_SIZE, or in_features (see `w8_group_size`). ``mma_order``: the bytes of every
      16 columns stored in the order Hopper's tensor-core register operand reads them (`to_mma_order`:
      MMA_COLUMNS); every kernel reads either order, `dequantize` gives the natural one.
    - ``w4``: ``data`` is uint8 ``[out, in // 2]``, column 2j in the low nibble and 2j+1 in the
      high nibble, q in 0..15; ``scale`` and ``minimum`` are ``[out, in // group_size]``;
      w = q * scale + minimum (GGUF Q4_1 exactly; Q4_0 is scale=d, minimum=-8d).
    ``bias`` is ``[out]`` or None.
    """

    format: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    minimum: torch.Tensor | None = None
    group_size: int = 0
    bias: torch.Tensor | None = None
    mma_order: bool = False

    def __post_init__(self) -> None:
        if self.format == "w4" and self.minimum is None:  # only w8 has a symmetric form
            raise ValueError("a w4 weight needs its minimums")
        if self.mma_order and not mma_order_fits(self):
            raise ValueError("only w8 in groups of 16-column blocks, several a row, is stored in the MMA order")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        return self.data.shape[1] * (2 if self.format == "w4" else 1)

    @property
    def nbytes(self) -> int:
        parts = (self.data, self.scale, self.minimum, self.bias)
        return sum(p.numel() * p.element_size() for p in parts if p is not None)

    def to(self, device: torch.device | str) -> "LinearWeight":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return LinearWeight(self.format, move(self.data), move(self.scale), move(self.minimum),
                            self.group_size, move(self.bias), self.mma_order)

    def astype(self, dtype: torch.dtype) -> "LinearWeight":
        """The same weight with dense data and bias in the activation dtype; packed integers, scales and
        minimums keep their storage dtype (never the activation dtype: see the module docstring)."""
        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or not t.is_floating_point() else t.to(dtype)

        return LinearWeight(self.format, cast(self.data), self.scale, self.minimum, self.group_size, cast(self.bias),
                            self.mma_order)


# Hopper's wgmma takes its first operand from registers, a thread holding columns 2c, 2c + 1, 2c + 8 and 2c + 9 of
# each 16 (c < 4). Stored position 4c + 2b + d holds column 8b + 2c + d, so those 4 bytes lie together and the
# batched w8 matmul reads them from shared memory by ldmatrix instead of two bytes at a time (docs/BENCHMARKS.md,
# session 38). A 16-column block lies inside one group, so each block keeps its scale.
MMA_COLUMNS = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)
_NATURAL_COLUMNS = tuple(sorted(range(16), key=MMA_COLUMNS.__getitem__))


def mma_order_fits(w: LinearWeight) -> bool:
    """Whether w can be stored in the MMA order: w8 in groups of whole 16-column blocks, more than one a row (rows
    of one group take another kernel path; w4 packs two columns a byte)."""
    return w.format == "w8" and w.group_size % 16 == 0 and w.group_size < w.in_features


def _reorder_columns(data: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    out, k = data.shape
    index = torch.tensor(order, device=data.device)
    return data.view(out, k // 16, 16).index_select(2, index).reshape(out, k).contiguous()


def to_mma_order(w: LinearWeight) -> LinearWeight:
    """w with its bytes in the MMA order (MMA_COLUMNS), where it fits (mma_order_fits); else w."""
    if w.mma_order or not mma_order_fits(w):
        return w
    return LinearWeight(w.format, _reorder_columns(w.data, MMA_COLUMNS), w.scale, w.minimum, w.group_size, w.bias,
                        True)


def natural_order(w: LinearWeight) -> LinearWeight:
    """w with its bytes in column order."""
    if not w.mma_order:
        return w
    return LinearWeight(w.format, _reorder_columns(w.data, _NATURAL_COLUMNS), w.scale, w.minimum, w.group_size,
                        w.bias)


def group_minimums(w: LinearWeight) -> torch.Tensor:
    """A quantized weight's minimums [out, in // group_size]: stored, or for symmetric w8 the -128 * scale it
    implies (exact in float16: a power-of-two multiple)."""
    if w.minimum is not None:
        return w.minimum
    return w.scale * -128  # symmetric w8: every w4 holds its minimums (LinearWeight checks)


def dequantize(w: LinearWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as a dense ``[out, in]`` tensor (the oracle for every linear kernel)."""
    if w.format == "dense":
        return w.data.to(dtype)
    if w.format in ("w8", "w4"):
        w = natural_order(w)
        if w.format == "w8":
            q = w.data.to(torch.float32)
        else:
            low = (w.data & 0x0F).to(torch.float32)
            high = (w.data >> 4).to(torch.float32)
            q = torch.stack((low, high), dim=-1).reshape(w.data.shape[0], -1)
        out, k = q.shape
        g = q.view(out, k // w.group_size, w.group_size)
        # symmetric w8 too: q * scale - 128 * scale is (q - 128) * scale exactly (8-bit q, 11-bit scale)
        deq = g * w.scale.to(torch.float32)[..., None] + group_minimums(w).to(torch.float32)[..., None]
        return deq.reshape(out, k).to(dtype)
    raise ValueError(f"unknown weight format {w.format!r}")


def quantize_w8(weight: torch.Tensor, bias: torch.Tensor | None = None, symmetric: bool = False) -> LinearWeight:
    """uint8 groups of `w8_group_size(in)` columns, parameters in float16: asymmetric (scale + minimum
    per group: holds a requantized Q4_0/Q4_1 group almost exactly), or symmetric, GGUF Q8_0's rounding
    (scale = max |w| / 127, no minimum: 1/17 fewer bytes to read).

    q is computed against the float16 scale and minimum, the values the kernels will use."""
    out, k = weight.shape
    gs = w8_group_size(k)
    g = weight.to(torch.float32).view(out, k // gs, gs)
    if symmetric:
        scale = (g.abs().amax(dim=-1) / 127.0).to(W8_PARAM_DTYPE).to(torch.float32)
        safe = torch.where(scale > 0, scale, 1.0)
        q = (torch.round(g / safe[..., None]).clamp(-127, 127) + 128).to(torch.uint8).view(out, k)
        return LinearWeight("w8", q, scale.to(W8_PARAM_DTYPE), None, gs, bias)
    lo = _float16_at_most(g.amin(dim=-1))
    scale = ((g.amax(dim=-1) - lo) / 255.0).clamp(min=1e-7).to(W8_PARAM_DTYPE).to(torch.float32)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 255).to(torch.uint8).view(out, k)
    return LinearWeight("w8", q, scale.to(W8_PARAM_DTYPE), lo.to(W8_PARAM_DTYPE), gs, bias)


def _float16_at_most(x: torch.Tensor) -> torch.Tensor:
    """x rounded to a float16 value <= x (a minimum rounded up would clip its group's lowest weights)."""
    h = x.to(torch.float16)
    h = torch.where(h.to(torch.float32) > x, torch.nextafter(h, torch.full_like(h, -float("inf"))), h)
    return h.to(torch.float32)


def quantize_w4(weight: torch.Tensor, group_size: int = 32, bias: torch.Tensor | None = None) -> LinearWeight:
    """Asymmetric int4 (scale + min per group), the layout GGUF Q4_1 uses."""
    if group_size not in (32, 64, 128):
        raise ValueError(f"w4 group_size must be 32, 64 or 128, got {group_size}")
    out, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    g = weight.to(torch.float32).view(out, k // group_size, group_size)
    lo = g.amin(dim=-1)
    hi = g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(out, k)
    return pack_w4(q, scale, lo, group_size, bias)


def pack_w4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int,
            bias: torch.Tensor | None = None) -> LinearWeight:
    """Pack unsigned 4-bit values ``q [out, in]`` two to a byte; scale and minimum stored in float16."""
    q = q.to(torch.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return LinearWeight("w4", packed, scale.to(W4_PARAM_DTYPE), minimum.to(W4_PARAM_DTYPE), group_size, bias)


def concat_out(weights: list[LinearWeight]) -> LinearWeight:
    """Stack weights of one format along the output dimension (fused qkv, fused gate_up)."""
    first = weights[0]
    if any(w.format != first.format or w.group_size != first.group_size for w in weights):
        raise ValueError("cannot fuse weights of different formats")
    if any(w.mma_order != first.mma_order for w in weights):
        weights = [natural_order(w) for w in weights]
        first = weights[0]

    def cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if parts[0] is None else torch.cat(parts, dim=0)

    minimums = [w.minimum for w in weights]
    if any(m is None for m in minimums) and any(m is not None for m in minimums):
        # symmetric w8 beside asymmetric parts (a Q8_0 q_proj, a requantized Q4_1 v_proj): the minimum it implies
        minimums = [group_minimums(w) for w in weights]
    biases = [w.bias for w in weights]
    if any(b is not None for b in biases):
        biases = [b if b is not None else torch.zeros(w.out_features, dtype=first.data.dtype)
                  for b, w in zip(biases, weights)]
    return LinearWeight(first.format, cat([w.data for w in weights]), cat([w.scale for w in weights]),
                        cat(minimums), first.group_size, cat(biases), first.mma_order)
