"""Integer -> float conversions for the Triton kernels, without the integer-to-float unit.

On Hopper that unit converts 16 values per clock per SM: at HBM speed a quantized GEMV needs more.
These set the integer as the mantissa of a power of two (one logic op) and subtract it (one float op).

The decode GEMV goes further and skips the subtraction: its weights become floats "magic + q" whose
integer sits as high under the exponent as a byte or nibble can (32768 + q for a byte on bits 8-15,
128 + q / 2048 + q for a nibble on bits 16-19 / 12-15), the kernel taking magic * sum(x) off once a
chunk. The `*_asm` forms build them with one PRMT for every four bytes' placement on sm_80 and later,
about 1 (w8) or 1.5 (w4) instructions a weight before its FMA where the conversion and subtraction
took 2 to 2.5, and the GEMV was bound by that issue rate rather than by HBM. Inline PTX does not run
in the Triton interpreter, so kernels take them only where `asm_conversions(device)` says so; the
portable forms (`magic_u8_f32`, `magic_nibbles_f32`) give the same floats, bit for bit.
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
def magic_u8_f32(q):
    """uint8 -> the float32 32768 + q: the byte on bits 8-15 under the exponent of 2**15."""
    return (((q.to(tl.int32) & 0xFF) << 8) | 0x47000000).to(tl.float32, bitcast=True)


@triton.jit
def magic_nibbles_f32(b):
    """uint8 holding two nibbles -> (128 + low nibble, 2048 + high nibble) as float32: each nibble on
    bits 16-19 (low) or 12-15 (high) under an exponent that makes that field the float's units."""
    bi = b.to(tl.int32)
    lo = (((bi & 0x0F) << 16) | 0x43000000).to(tl.float32, bitcast=True)
    hi = (((bi & 0xF0) << 8) | 0x45000000).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def magic_nibbles_f32_asm(b):
    """magic_nibbles_f32, bit for bit: four bytes come as one word, placed four ways by one prmt each
    (in place, 8 bits left and right, rotated 16; the byte 0x47 on top holds both exponents), which
    puts every nibble on bits 12-15 (high nibbles) or 16-19 (low); one and then keeps a nibble's
    field and its exponent, 0x45 (2048) or 0x43 (128). No subtraction: the kernel takes the constants
    off once a chunk."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 k, t0, tl, tr, tq;
        mov.b32 k, 0x47;
        prmt.b32 t0, $8, k, 0x4210;
        prmt.b32 tl, $8, k, 0x4100;
        prmt.b32 tr, $8, k, 0x4321;
        prmt.b32 tq, $8, k, 0x4032;
        and.b32 $0, tq, 0x430F0000;
        and.b32 $1, tl, 0x430F0000;
        and.b32 $2, t0, 0x430F0000;
        and.b32 $3, tr, 0x430F0000;
        and.b32 $4, tl, 0x4500F000;
        and.b32 $5, t0, 0x4500F000;
        and.b32 $6, tr, 0x4500F000;
        and.b32 $7, tq, 0x4500F000;
        }""",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[b], dtype=(tl.float32, tl.float32), is_pure=True, pack=4)


@triton.jit
def magic_u8_f32_asm(q):
    """magic_u8_f32, bit for bit: one prmt a byte puts it on bits 8-15 under the byte 0x47 (the
    exponent of 2**15) and zeros elsewhere."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 k;
        mov.b32 k, 0x47;
        prmt.b32 $0, $4, k, 0x4505;
        prmt.b32 $1, $4, k, 0x4515;
        prmt.b32 $2, $4, k, 0x4525;
        prmt.b32 $3, $4, k, 0x4535;
        }""",
        constraints="=r,=r,=r,=r,r", args=[q], dtype=tl.float32, is_pure=True, pack=4)
