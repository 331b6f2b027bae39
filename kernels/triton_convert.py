"""Exact integer -> float conversions for the Triton kernels, without the integer-to-float unit.

On Hopper that unit converts 16 values per clock per SM: at HBM speed an int8 GEMV needs more. These
set the integer as the mantissa of a power of two (one logic op) and subtract it (one float op).

The `*_asm` forms do the same with one PRMT a byte (which also ORs in the exponent) on sm_80 and later:
a decode GEMV issues about six instructions a weight in the portable form, two of them to isolate a
byte, and is bound by that issue rate rather than by HBM. Inline PTX does not run in the Triton
interpreter, so kernels take them only where `asm_conversions(device)` says so; both forms give the
same floats, bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_device import compiled_sm_major


def asm_conversions(device: torch.device) -> bool:
    """May this device's kernels use the inline-PTX conversions (a CUDA device of sm_80+, not the
    interpreter)?"""
    return compiled_sm_major(device) >= 8


@triton.jit
def i8_to_f32(q):
    """int8 -> float32: byte ^ 0x80 in the mantissa of 2**23, minus 2**23 + 128."""
    bits = (q.to(tl.int32) & 0xFF) ^ 0x4B000080
    return bits.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def small_uint_to_f32(q):
    """int32 in [0, 2**23) -> float32 (the w4 nibbles)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def u8_to_f32_asm(q):
    """uint8 -> float32, as small_uint_to_f32(q): byte i of each 4-byte register moved under the
    exponent of 2**23 by one prmt (selector 0x765i: the byte, two zero bytes, 0x4B), then 2**23
    subtracted."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 m;
        mov.b32 m, 0x4B000000;
        prmt.b32 $0, $4, m, 0x7650;
        prmt.b32 $1, $4, m, 0x7651;
        prmt.b32 $2, $4, m, 0x7652;
        prmt.b32 $3, $4, m, 0x7653;
        sub.f32 $0, $0, 0f4B000000;
        sub.f32 $1, $1, 0f4B000000;
        sub.f32 $2, $2, 0f4B000000;
        sub.f32 $3, $3, 0f4B000000;
        }""",
        constraints="=r,=r,=r,=r,r", args=[q], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def nibbles_to_f32_asm(b):
    """uint8 holding two nibbles -> (low nibble, 16 * high nibble) as float32, as small_uint_to_f32(b &
    0x0F) and small_uint_to_f32(b & 0xF0): one prmt a byte (as u8_to_f32_asm), two ands keeping
    the exponent and one nibble each, two subtractions."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 m, t0, t1, t2, t3;
        mov.b32 m, 0x4B000000;
        prmt.b32 t0, $8, m, 0x7650;
        prmt.b32 t1, $8, m, 0x7651;
        prmt.b32 t2, $8, m, 0x7652;
        prmt.b32 t3, $8, m, 0x7653;
        and.b32 $0, t0, 0x4B00000F;
        and.b32 $1, t1, 0x4B00000F;
        and.b32 $2, t2, 0x4B00000F;
        and.b32 $3, t3, 0x4B00000F;
        and.b32 $4, t0, 0x4B0000F0;
        and.b32 $5, t1, 0x4B0000F0;
        and.b32 $6, t2, 0x4B0000F0;
        and.b32 $7, t3, 0x4B0000F0;
        sub.f32 $0, $0, 0f4B000000;
        sub.f32 $1, $1, 0f4B000000;
        sub.f32 $2, $2, 0f4B000000;
        sub.f32 $3, $3, 0f4B000000;
        sub.f32 $4, $4, 0f4B000000;
        sub.f32 $5, $5, 0f4B000000;
        sub.f32 $6, $6, 0f4B000000;
        sub.f32 $7, $7, 0f4B000000;
        }""",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[b], dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
