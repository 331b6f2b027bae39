"""Exact integer -> float conversions for the Triton kernels, without the integer-to-float unit.

On Hopper that unit converts 16 values per clock per SM: at HBM speed an int8 GEMV needs more. These
set the integer as the mantissa of a power of two (one logic op) and subtract it (one float op).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def i8_to_f32(q):
    """int8 -> float32: byte ^ 0x80 in the mantissa of 2**23, minus 2**23 + 128."""
    bits = (q.to(tl.int32) & 0xFF) ^ 0x4B000080
    return bits.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def small_uint_to_f32(q):
    """int32 in [0, 2**23) -> float32 (the w4 nibbles)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

