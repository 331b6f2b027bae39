"""CPU kernels in C, compiled on first use: float32 weight-only int4/int8 GEMM, the element-wise ops of
a decoder layer (rms_norm + residual, rope, SiLU-and-mul, the KV write) and decode attention straight
from the paged cache, each one call from Python (no per-op torch dispatch in the hot loop).

torch's CPU weight-only kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) are
vectorized on x86 only for bfloat16: float32 takes a scalar loop 30-100x slower, and the bf16 path
rounds the activations, the group scales and the output to bfloat16, which moves SmolLM2's logits
by ~0.3 where greedy decoding has margins of 0.03. These kernels keep everything the numerics
policy asks for in fp32 (activations in, scales applied, accumulation, result) and read the packed
weights once per call.

Layout (`pack_w4`, `pack_w8`): output rows in blocks of 16, one SIMD vector per column;
- w4: for each pair of columns (k, k+1), 16 bytes: byte i = q[row i][k] | q[row i][k+1] << 4;
- w8: for each column k, the 16 rows' uint8 values;
- both: per group, the 16 rows' scales then their minimums in float16 (GGUF's own precision);
  y = sum over groups of scale * sum_k q x_k + minimum * sum_k x_k.
Both are copies made at load (`cpu.prepack`); the LinearWeight keeps its own layout for the oracle.
Threads: OpenMP, `torch.get_num_threads()` for GEMMs of at least PARALLEL_MACS multiply-adds, one
below. The C source is compiled with the system C compiler (-O3 -march=native -fopenmp, about a second)
into a per-user cache; without a compiler `available()` is False and kernels/cpu.py falls back to
torch's bfloat16 int4 kernel and a float32 copy of w8 weights.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("edged.kernels")

ROWS = 16  # output rows per block: one float32 vector of 512 bits
TASK_ROWS = 64  # rows per parallel task (4 blocks); N is padded to a multiple of this

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* vf: 16 float32 lanes (one zmm, or two ymm on AVX2). */
#if defined(__AVX512F__)
typedef __m512 vf;
#define MB_WIDE 1 /* 32 vector registers: tiles of up to 8 rows of x */
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vloadf(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vloadh(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline void vstore(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
static inline vf vfloor(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vf vpow2i(vf n) { /* 2^n for integral n in float range */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline void u4x16(const uint8_t *p, vf *lo, vf *hi) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
static inline vf s8x16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf u8x16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
typedef struct { __m256 a, b; } vf;
#define MB_WIDE 0 /* 16 vector registers: tiles of 1 or 2 rows of x */
#define V2(e) vf r = {e(x.a, y.a), e(x.b, y.b)}; return r;
static inline vf vzero(void) { vf r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
static inline vf vset1(float v) { vf r = {_mm256_set1_ps(v), _mm256_set1_ps(v)}; return r; }
static inline vf vadd(vf x, vf y) { V2(_mm256_add_ps) }
static inline vf vsub(vf x, vf y) { V2(_mm256_sub_ps) }
static inline vf vmul(vf x, vf y) { V2(_mm256_mul_ps) }
static inline vf vdiv(vf x, vf y) { V2(_mm256_div_ps) }
static inline vf vmax(vf x, vf y) { V2(_mm256_max_ps) }
static inline vf vfma(vf x, vf y, vf z) { vf r = {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; return r; }
static inline vf vloadf(const float *p) { vf r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
static inline vf vloadh(const uint16_t *p) {
    vf r = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
    return r;
}
static inline void vstore(float *p, vf x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
static inline float vsum(vf x) {
    __m256 s = _mm256_add_ps(x.a, x.b);
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
}
static inline float vhmax(vf x) {
    __m256 s = _mm256_max_ps(x.a, x.b);
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    t = _mm_max_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
}
static inline vf vfloor(vf x) { vf r = {_mm256_floor_ps(x.a), _mm256_floor_ps(x.b)}; return r; }
static inline __m256 pow2i8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf vpow2i(vf x) { vf r = {pow2i8(x.a), pow2i8(x.b)}; return r; }
static inline void u4x16(const uint8_t *p, vf *lo, vf *hi) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i v0 = _mm256_cvtepu8_epi32(b), v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    __m256i m = _mm256_set1_epi32(15);
    lo->a = _mm256_cvtepi32_ps(_mm256_and_si256(v0, m)); lo->b = _mm256_cvtepi32_ps(_mm256_and_si256(v1, m));
    hi->a = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)); hi->b = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
}
static inline vf s8x16(const int8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    vf r = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
    return r;
}
static inline vf u8x16(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    vf r = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
    return r;
}
#else
#error "the CPU kernels need AVX512F, or AVX2 with FMA and F16C"
#endif

/* exp(x) for x <= 88 (Cephes' expf: range reduction by ln 2 and a degree-6 polynomial, ~1 ulp). */
static inline vf vexp(vf x) {
    x = vmax(x, vset1(-87.0f));
    vf n = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
    x = vsub(vsub(x, vmul(n, vset1(0.693359375f))), vmul(n, vset1(-2.12194440e-4f)));
    vf y = vset1(1.9875691500e-4f);
    y = vfma(y, x, vset1(1.3981999507e-3f));
    y = vfma(y, x, vset1(8.3334519073e-3f));
    y = vfma(y, x, vset1(4.1665795894e-2f));
    y = vfma(y, x, vset1(1.6666665459e-1f));
    y = vfma(y, x, vset1(5.0000001201e-1f));
    y = vadd(vfma(y, vmul(x, x), x), vset1(1.0f));
    return vmul(y, vpow2i(n));
}

/* ---- weight-only GEMM: blocks of 16 output rows, TASK = 4 blocks (64 rows) per parallel task ---- */

/* RBT blocks of 16 rows (at w, sm) against MB rows of x, one function per shape so that the
   accumulators are arrays of exactly that size, kept in registers. SPLIT: separate chains for the
   even and odd columns when MB * RBT alone gives too few independent chains. */
#define DEFINE_W4_TILE(MB, RBT)                                                                          \
static void w4_tile_##MB##_##RBT(const float *x, const float *xs, int64_t K, int64_t G, int64_t gs,      \
                                 const uint8_t *w, const uint16_t *sm, float *y, int64_t ldy)           \
{                                                                                                        \
    enum { SPLIT = MB * RBT < 8 };                                                                       \
    vf acc[MB][RBT], ga[MB][RBT], gb[MB][RBT];                                                           \
    for (int m = 0; m < MB; m++) for (int r = 0; r < RBT; r++) acc[m][r] = vzero();                      \
    const int64_t half = K / 2;                                                                          \
    for (int64_t g = 0; g < G; g++) {                                                                    \
        for (int m = 0; m < MB; m++) for (int r = 0; r < RBT; r++) { ga[m][r] = vzero(); gb[m][r] = vzero(); } \
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {                                             \
            for (int r = 0; r < RBT; r++) {                                                              \
                vf lo, hi;                                                                               \
                u4x16(w + (r * half + k / 2) * 16, &lo, &hi);                                            \
                for (int m = 0; m < MB; m++) {                                                           \
                    ga[m][r] = vfma(lo, vset1(x[m * K + k]), ga[m][r]);                                  \
                    if (SPLIT) gb[m][r] = vfma(hi, vset1(x[m * K + k + 1]), gb[m][r]);                   \
                    else ga[m][r] = vfma(hi, vset1(x[m * K + k + 1]), ga[m][r]);                         \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < RBT; r++) {                                                                  \
            const uint16_t *p = sm + ((int64_t)r * G + g) * 32;                                          \
            vf s = vloadh(p), mn = vloadh(p + 16);                                                       \
            for (int m = 0; m < MB; m++) {                                                               \
                vf dot = SPLIT ? vadd(ga[m][r], gb[m][r]) : ga[m][r];                                    \
                acc[m][r] = vfma(mn, vset1(xs[m * G + g]), vfma(dot, s, acc[m][r]));                     \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    for (int m = 0; m < MB; m++) for (int r = 0; r < RBT; r++) vstore(y + m * ldy + r * 16, acc[m][r]); \
}
#if MB_WIDE
DEFINE_W4_TILE(8, 1)
DEFINE_W4_TILE(4, 2)
DEFINE_W4_TILE(2, 4)
DEFINE_W4_TILE(1, 4)
#else
DEFINE_W4_TILE(2, 1)
DEFINE_W4_TILE(1, 2)
#endif

/* Each row's sum of x over every group of gs columns: the factor of a group's minimum (w4 and w8). */
static float *group_sums(const float *x, int64_t M, int64_t K, int64_t gs)
{
    const int64_t G = K / gs;
    float *xs = malloc(sizeof(float) * (M * G + 1));
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0;
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) s += x[m * K + k];
            xs[m * G + g] = s;
        }
    return xs;
}

#define W4_TILE(MB, RBT) for (int r = 0; r < 4; r += RBT) \
    w4_tile_##MB##_##RBT(x + m * K, xs + m * G, K, G, gs, wt + r * 16 * (K / 2), st + r * G * 32, \
                         y + m * N + t * 64 + r * 16, N)

void edged_w4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *sm,
                   int64_t N, int64_t gs, float *y, int nthreads)
{
    const int64_t G = K / gs, tasks = N / 64;
    float *xs = group_sums(x, M, K, gs);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const uint8_t *wt = w + t * 64 * (K / 2);
        const uint16_t *st = sm + t * 4 * G * 32;
        int64_t m = 0;
#if MB_WIDE
        for (; m + 8 <= M; m += 8) W4_TILE(8, 1);
        for (; m + 4 <= M; m += 4) W4_TILE(4, 2);
        for (; m + 2 <= M; m += 2) W4_TILE(2, 4);
        for (; m < M; m++) W4_TILE(1, 4);
#else
        for (; m + 2 <= M; m += 2) W4_TILE(2, 1);
        for (; m < M; m++) W4_TILE(1, 2);
#endif
    }
    free(xs);
}

/* w8: as w4 with one byte per weight (q in 0..255): per group, scale * sum q x + minimum * sum x. */
static inline __attribute__((always_inline)) void w8_tile(
    const float *x, const float *xs, int64_t K, int64_t G, int64_t gs, const uint8_t *w, const uint16_t *sm,
    float *y, int64_t ldy, const int MB, const int RBT)
{
    const int SPLIT = MB * RBT < 8;
    vf acc[8][4], ga[8][4], gb[8][4];
    for (int m = 0; m < MB; m++) for (int r = 0; r < RBT; r++) acc[m][r] = vzero();
    for (int64_t g = 0; g < G; g++) {
        for (int m = 0; m < MB; m++) for (int r = 0; r < RBT; r++) { ga[m][r] = vzero(); gb[m][r] = vzero(); }
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
            for (int r = 0; r < RBT; r++) {
                vf f0 = u8x16(w + (r * K + k) * 16), f1 = u8x16(w + (r * K + k + 1) * 16);
                for (int m = 0; m < MB; m++) {
                    ga[m][r] = vfma(f0, vset1(x[m * K + k]), ga[m][r]);
                    if (SPLIT) gb[m][r] = vfma(f1, vset1(x[m * K + k + 1]), gb[m][r]);
                    else ga[m][r] = vfma(f1, vset1(x[m * K + k + 1]), ga[m][r]);
                }
            }
        }
        for (int r = 0; r < RBT; r++) {
            const uint16_t *p = sm + ((int64_t)r * G + g) * 32;
            vf s = vloadh(p), mn = vloadh(p + 16);
            for (int m = 0; m < MB; m++) {
                vf dot = SPLIT ? vadd(ga[m][r], gb[m][r]) : ga[m][r];
                acc[m][r] = vfma(mn, vset1(xs[m * G + g]), vfma(dot, s, acc[m][r]));
            }
        }
    }
    for (int m = 0; m < MB; m++) for (int r = 0; r < RBT; r++) vstore(y + m * ldy + r * 16, acc[m][r]);
}

#define W8_TILE(MB, RBT) for (int r = 0; r < 4; r += RBT) \
    w8_tile(x + m * K, xs + m * G, K, G, gs, wt + r * 16 * K, st + r * G * 32, y + m * N + t * 64 + r * 16, N, \
            MB, RBT)

void edged_w8_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *sm,
                   int64_t N, int64_t gs, float *y, int nthreads)
{
    const int64_t G = K / gs, tasks = N / 64;
    float *xs = group_sums(x, M, K, gs);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const uint8_t *wt = w + t * 64 * K;
        const uint16_t *st = sm + t * 4 * G * 32;
        int64_t m = 0;
#if MB_WIDE
        for (; m + 8 <= M; m += 8) W8_TILE(8, 1);
        for (; m + 4 <= M; m += 4) W8_TILE(4, 2);
        for (; m + 2 <= M; m += 2) W8_TILE(2, 4);
        for (; m < M; m++) W8_TILE(1, 4);
#else
        for (; m + 2 <= M; m += 2) W8_TILE(2, 1);
        for (; m < M; m++) W8_TILE(1, 2);
#endif
    }
    free(xs);
}

/* The weight as float32 [K][N] (transposed: one vector store per 16 rows), for compute-bound calls. */
void edged_w4_dequant_t(const uint8_t *w, const uint16_t *sm, int64_t N, int64_t K, int64_t gs, float *out,
                        int nthreads)
{
    const int64_t G = K / gs, blocks = N / 16, half = K / 2;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t g = 0; g < G; g++) {
            const uint16_t *p = sm + (b * G + g) * 32;
            vf s = vloadh(p), mn = vloadh(p + 16);
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
                vf lo, hi;
                u4x16(w + (b * half + k / 2) * 16, &lo, &hi);
                vstore(out + k * N + b * 16, vfma(lo, s, mn));
                vstore(out + (k + 1) * N + b * 16, vfma(hi, s, mn));
            }
        }
}

void edged_w8_dequant_t(const uint8_t *w, const uint16_t *sm, int64_t N, int64_t K, int64_t gs, float *out,
                        int nthreads)
{
    const int64_t G = K / gs, blocks = N / 16;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t g = 0; g < G; g++) {
            const uint16_t *p = sm + (b * G + g) * 32;
            vf s = vloadh(p), mn = vloadh(p + 16);
            for (int64_t k = g * gs; k < (g + 1) * gs; k++)
                vstore(out + k * N + b * 16, vfma(u8x16(w + (b * K + k) * 16), s, mn));
        }
}

/* ---- element-wise ops of one decoder layer (float32, H a multiple of 16) ---- */

/* h = x + res (res may be NULL: h = x, not stored); out = h / sqrt(mean(h^2) + eps) * w. */
void edged_rms_norm(const float *x, const float *res, const float *w, float eps, float *out, float *h,
                    int64_t T, int64_t H)
{
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * H;
        vf ss = vzero();
        if (res) {
            for (int64_t i = 0; i < H; i += 16) {
                vf v = vadd(vloadf(xt + i), vloadf(res + t * H + i));
                vstore(h + t * H + i, v);
                ss = vfma(v, v, ss);
            }
            xt = h + t * H;
        } else {
            for (int64_t i = 0; i < H; i += 16) { vf v = vloadf(xt + i); ss = vfma(v, v, ss); }
        }
        vf inv = vset1(1.0f / sqrtf(vsum(ss) / (float)H + eps));
        for (int64_t i = 0; i < H; i += 16) vstore(out + t * H + i, vmul(vmul(vloadf(xt + i), inv), vloadf(w + i)));
    }
}

/* Rotate-half rope in place on nh heads of D floats at p + t * stride (heads contiguous). */
void edged_rope(float *p, int64_t stride, int64_t nh, int64_t D, const int64_t *pos, const float *cos_sin,
                int64_t T)
{
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_sin + pos[t] * D, *s = c + half;
        for (int64_t h = 0; h < nh; h++) {
            float *x = p + t * stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* out[t] = silu(x[t, :I]) * x[t, I:] */
void edged_silu_mul(const float *x, float *out, int64_t T, int64_t I)
{
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < I; i += 16) {
            vf g = vloadf(x + t * 2 * I + i), u = vloadf(x + t * 2 * I + I + i);
            vf sig = vdiv(vset1(1.0f), vadd(vset1(1.0f), vexp(vsub(vzero(), g))));
            vstore(out + t * I + i, vmul(vmul(g, sig), u));
        }
}

/* k, v rows of `row` floats (stride k_stride / v_stride) to slot rows of the caches; slot < 0: skipped. */
void edged_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *kc, float *vc,
                    const int64_t *slots, int64_t T, int64_t row)
{
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        memcpy(kc + slots[t] * row, k + t * k_stride, sizeof(float) * row);
        memcpy(vc + slots[t] * row, v + t * v_stride, sizeof(float) * row);
    }
}

/* Decode attention: one query per sequence over its paged context, straight from the cache blocks.
   q [B, Hq, D]; caches [blocks, S, Hkv, D] float32, or int8 (int8 != 0) with float32 scales
   [blocks, S, Hkv, NK] (keys) and [blocks, S, Hkv, NV] (values): one per group of D / N channels, a
   multiple of 16 (NK = NV = 1 for float32). Scores, softmax and the weighted sum in float32; one task
   per (sequence, KV head). */
void edged_attn_decode(const float *q, const void *kc, const void *vc, const float *ks, const float *vs,
                       int int8, int64_t NK, int64_t NV, const int32_t *tables, int64_t width, const int32_t *lens,
                       int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t S, float scale, float *out,
                       int nthreads)
{
    const int64_t G = Hq / Hkv, GK = D / NK, GV = D / NV;
    #pragma omp parallel for collapse(2) num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t L = lens[b];
            float *sc = malloc(sizeof(float) * (G * L + 16));
            const float *qb = q + (b * Hq + h * G) * D;
            for (int64_t t = 0; t < L; t++) {
                const int64_t row = ((int64_t)tables[b * width + t / S] * S + t % S) * Hkv + h;
                for (int64_t g = 0; g < G; g++) {
                    vf acc = vzero();
                    if (int8)
                        for (int64_t c = 0; c < NK; c++) { /* each group's dot product times its scale */
                            vf part = vzero();
                            for (int64_t d = c * GK; d < (c + 1) * GK; d += 16)
                                part = vfma(vloadf(qb + g * D + d), s8x16((const int8_t *)kc + row * D + d), part);
                            acc = vfma(part, vset1(ks[row * NK + c]), acc);
                        }
                    else
                        for (int64_t d = 0; d < D; d += 16)
                            acc = vfma(vloadf(qb + g * D + d), vloadf((const float *)kc + row * D + d), acc);
                    sc[g * L + t] = vsum(acc) * scale;
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *s = sc + g * L, mx = -INFINITY, sum = 0;
                for (int64_t t = 0; t < L; t++) mx = s[t] > mx ? s[t] : mx;
                int64_t t = 0;
                vf vsm = vzero();
                for (; t + 16 <= L; t += 16) {
                    vf e = vexp(vsub(vloadf(s + t), vset1(mx)));
                    vstore(s + t, e);
                    vsm = vadd(vsm, e);
                }
                sum = vsum(vsm);
                for (; t < L; t++) { s[t] = expf(s[t] - mx); sum += s[t]; }
                const float inv = 1.0f / sum;
                float *o = out + (b * Hq + h * G + g) * D;
                vf acc[16]; /* D <= 256 */
                for (int64_t d = 0; d < D / 16; d++) acc[d] = vzero();
                for (int64_t t2 = 0; t2 < L; t2++) {
                    const int64_t row = ((int64_t)tables[b * width + t2 / S] * S + t2 % S) * Hkv + h;
                    if (int8) {
                        for (int64_t c = 0; c < NV; c++) {
                            vf p = vset1(s[t2] * vs[row * NV + c]);
                            for (int64_t d = c * GV / 16; d < (c + 1) * GV / 16; d++)
                                acc[d] = vfma(p, s8x16((const int8_t *)vc + row * D + d * 16), acc[d]);
                        }
                    } else {
                        vf p = vset1(s[t2]);
                        for (int64_t d = 0; d < D / 16; d++) acc[d] = vfma(p, vloadf((const float *)vc + row * D + d * 16), acc[d]);
                    }
                }
                for (int64_t d = 0; d < D / 16; d++) vstore(o + d * 16, vmul(acc[d], vset1(inv)));
            }
            free(sc);
        }
}
"""
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=fast"]

_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for d in (Path(base) / "edged", Path(tempfile.gettempdir()) / f"edged-{os.getuid()}"):
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise OSError("no writable cache directory for the CPU kernels")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _compile() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    # -march=native: a library built for another CPU (a home directory shared between machines) must not load
    key = hashlib.sha256("\0".join([_SOURCE, *_FLAGS, version, sys.platform, _cpu_flags()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_kernels-{key}.so"
    if not out.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "cpu_kernels.c"
            src.write_text(_SOURCE)
            built = Path(tmp) / "cpu_kernels.so"
            subprocess.run([cc, *_FLAGS, str(src), "-o", str(built)], capture_output=True, text=True, check=True)
            partial = out.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(built, partial)
            os.replace(partial, out)  # atomic: a concurrent process sees the whole file or none
    lib = ctypes.CDLL(str(out))
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.edged_w4_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, cint]
    lib.edged_w4_gemm.restype = None
    lib.edged_w8_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, cint]
    lib.edged_w8_gemm.restype = None
    lib.edged_w4_dequant_t.argtypes = [ptr, ptr, i64, i64, i64, ptr, cint]
    lib.edged_w4_dequant_t.restype = None
    lib.edged_w8_dequant_t.argtypes = [ptr, ptr, i64, i64, i64, ptr, cint]
    lib.edged_w8_dequant_t.restype = None
    lib.edged_rms_norm.argtypes = [ptr, ptr, ptr, ctypes.c_float, ptr, ptr, i64, i64]
    lib.edged_rope.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64]
    lib.edged_silu_mul.argtypes = [ptr, ptr, i64, i64]
    lib.edged_write_kv.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64]
    lib.edged_attn_decode.argtypes = [ptr, ptr, ptr, ptr, ptr, cint, i64, i64, ptr, i64, ptr, i64, i64, i64, i64,
                                      i64, ctypes.c_float, ptr, cint]
    for f in (lib.edged_rms_norm, lib.edged_rope, lib.edged_silu_mul, lib.edged_write_kv, lib.edged_attn_decode):
        f.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built (logged once)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib = _compile()
            except (OSError, subprocess.CalledProcessError) as e:
                detail = getattr(e, "stderr", "") or str(e)
                log.warning("CPU float32 int4/int8 kernels unavailable, using torch fallbacks: %s",
                            detail.strip()[:500])
                _lib = None
            _tried = True
    return _lib


def available() -> bool:
    return os.environ.get("EDGED_CPU_NATIVE", "1") != "0" and library() is not None


PARALLEL_MACS = 1 << 19  # a GEMM smaller than this runs on one thread: waking a second costs about what it saves


def _threads(macs: int) -> int:
    return torch.get_num_threads() if macs >= PARALLEL_MACS else 1


def _padded_rows(n: int) -> int:
    return -(-n // TASK_ROWS) * TASK_ROWS


def pack_w4(data: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A w4 LinearWeight's (data, scale, minimum) in the kernel layout: (uint8 [Np/16, K/2, 16],
    float16 [Np/16, G, 2, 16]), Np = out_features padded to TASK_ROWS with zero rows."""
    n, half = data.shape
    np_ = _padded_rows(n)
    q = torch.zeros(np_, half, dtype=torch.uint8)
    q[:n] = data  # byte j holds columns 2j (low nibble) and 2j+1 (high nibble): the pair layout already
    packed = q.view(np_ // ROWS, ROWS, half).transpose(1, 2).contiguous()
    return packed, _pack_group_params(scale, minimum, np_)


def _pack_group_params(scale: torch.Tensor, minimum: torch.Tensor, np_: int) -> torch.Tensor:
    """Per-group scales and minimums [n, G] as float16 [Np/16, G, 2, 16]: per block of 16 rows and group,
    the rows' scales then their minimums (zero for the padding rows)."""
    n, groups = scale.shape
    sm = torch.zeros(np_, groups, 2, dtype=torch.float16)
    sm[:n, :, 0] = scale.to(torch.float16)
    sm[:n, :, 1] = minimum.to(torch.float16)
    return sm.view(np_ // ROWS, ROWS, groups, 2).permute(0, 2, 3, 1).contiguous()


def pack_w8(data: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A w8 LinearWeight's (data, scale, minimum) in the kernel layout: (uint8 [Np/16, K, 16],
    float16 [Np/16, G, 2, 16]), Np = out_features padded to TASK_ROWS with zero rows."""
    n, k = data.shape
    np_ = _padded_rows(n)
    q = torch.zeros(np_, k, dtype=torch.uint8)
    q[:n] = data
    return q.view(np_ // ROWS, ROWS, k).transpose(1, 2).contiguous(), _pack_group_params(scale, minimum, np_)


def w4_gemm(x: torch.Tensor, packed: torch.Tensor, sm: torch.Tensor, n: int, group_size: int) -> torch.Tensor:
    """x [M, K] float32 contiguous -> [M, n] float32."""
    m, k = x.shape
    np_ = packed.shape[0] * ROWS
    y = torch.empty(m, np_, dtype=torch.float32)
    _lib.edged_w4_gemm(x.data_ptr(), m, k, packed.data_ptr(), sm.data_ptr(), np_, group_size, y.data_ptr(),
                       _threads(m * k * np_))
    return y if np_ == n else y[:, :n]


def w8_gemm(x: torch.Tensor, packed: torch.Tensor, sm: torch.Tensor, n: int, group_size: int) -> torch.Tensor:
    """x [M, K] float32 contiguous -> [M, n] float32."""
    m, k = x.shape
    np_ = packed.shape[0] * ROWS
    y = torch.empty(m, np_, dtype=torch.float32)
    _lib.edged_w8_gemm(x.data_ptr(), m, k, packed.data_ptr(), sm.data_ptr(), np_, group_size, y.data_ptr(),
                       _threads(m * k * np_))
    return y if np_ == n else y[:, :n]


def w4_dequant_t(packed: torch.Tensor, sm: torch.Tensor, group_size: int, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """The packed w4 weight as float32 [K, Np] (transposed, padded rows included), into out if given."""
    blocks, half, _ = packed.shape
    np_, k = blocks * ROWS, half * 2
    out = torch.empty(k, np_, dtype=torch.float32) if out is None else out
    _lib.edged_w4_dequant_t(packed.data_ptr(), sm.data_ptr(), np_, k, group_size, out.data_ptr(),
                            torch.get_num_threads())
    return out


def w8_dequant_t(packed: torch.Tensor, sm: torch.Tensor, group_size: int, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """The packed w8 weight as float32 [K, Np] (transposed, padded rows included), into out if given."""
    blocks, k, _ = packed.shape
    np_ = blocks * ROWS
    out = torch.empty(k, np_, dtype=torch.float32) if out is None else out
    _lib.edged_w8_dequant_t(packed.data_ptr(), sm.data_ptr(), np_, k, group_size, out.data_ptr(),
                            torch.get_num_threads())
    return out


# --- element-wise ops and decode attention (float32; cpu.py checks layouts before calling) ---

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(h) * weight, h) with h = x + residual; x, residual [T, H] contiguous."""
    h_size = x.shape[-1]
    out = torch.empty_like(x)
    h = x if residual is None else torch.empty_like(x)
    _lib.edged_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), eps,
                        out.data_ptr(), None if residual is None else h.data_ptr(), x.numel() // h_size, h_size)
    return out, h


def rope(t: torch.Tensor, heads: int, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """In place on `heads` heads of [T, ., D] t whose heads are contiguous (stride D)."""
    _lib.edged_rope(t.data_ptr(), t.stride(0), heads, t.shape[-1], positions.data_ptr(), cos_sin.data_ptr(),
                    t.shape[0])


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
    _lib.edged_silu_mul(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], inter)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    row = k.shape[1] * k.shape[2]
    _lib.edged_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                        slots.data_ptr(), k.shape[0], row)


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None,
                     v_scale: torch.Tensor | None) -> torch.Tensor:
    b, hq, d = q.shape
    _, s, hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    int8 = k_scale is not None
    k_groups, v_groups = (k_scale.shape[-1], v_scale.shape[-1]) if int8 else (1, 1)  # [blocks, S, Hkv, groups]
    _lib.edged_attn_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                           k_scale.data_ptr() if int8 else None, v_scale.data_ptr() if int8 else None, int(int8),
                           k_groups, v_groups, block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(),
                           b, hq, hkv, d, s, scale, out.data_ptr(), _threads(b * hkv * d * block_tables.shape[1] * s // 8))
    return out
