"""choose_config's decode launches for an H200 (132 SMs) where the session 25-34 sweeps changed them: the
register cap of the large one-row w8 GEMVs, 2 warps a program for the one-row GEMVs of long rows in 2049-8192 rows,
2 warps and a register cap for the large one-row w4 GEMVs, and the swap matmul's 64-wide tiles for SmolLM2's short
rows at 33-64 sequences; and attention_decode's tile (session 30). The kernels each launch runs are tested on the
GPU (test_kernels_gpu.py) and compiled in test_bench_sass.py."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from edged.kernels import triton_attention as tattn  # noqa: E402
from edged.kernels import triton_linear as tlin  # noqa: E402

CUDA = torch.device("cuda")  # choose_config only reads the device's kind; sm_count stands for the H200's SMs


def _config(m: int, n: int, k: int, fmt: str) -> tlin.LinearConfig:
    return tlin.choose_config(m, n, k, fmt, CUDA, sm_count=132)


def test_only_the_large_gemvs_cap_their_registers() -> None:
    """The caps measured faster only there: w8's 4096-column steps (8B gate_up and lm_head) and w4's large GEMVs
    of 1025-4096 columns (8B and 1B gate_up and lm_head, over 2 warps); the 1B's w8 2048-column steps, SmolLM2's
    short rows and the smaller GEMVs measured slower with one (or have no registers to spare), so they stay
    uncapped."""
    caps = {(fmt, n, k): _config(1, n, k, fmt).max_registers
            for fmt in ("w8", "w4")
            for n, k in ((28672, 4096), (128256, 4096), (6144, 4096), (4096, 14336), (16384, 2048), (128256, 2048),
                         (49152, 576), (2048, 8192))}
    capped = {key for key, cap in caps.items() if cap is not None}
    large_w4 = {("w4", 28672, 4096), ("w4", 128256, 4096), ("w4", 16384, 2048), ("w4", 128256, 2048)}
    assert capped == {("w8", 28672, 4096), ("w8", 128256, 4096)} | large_w4, caps
    assert {caps[key] for key in capped - large_w4} == {tlin.LARGE_GEMV_W8_MAX_REGISTERS}
    assert {caps[key] for key in large_w4} == {tlin.LARGE_GEMV_W4_MAX_REGISTERS}
    assert _config(2, 28672, 4096, "w8").max_registers is None  # batches take other kernels
    assert _config(1, 28672, 4096, "dense").max_registers is None


def test_one_row_gemvs_of_long_rows_in_2049_to_8192_rows_take_2_warps_and_2048_column_steps() -> None:
    """The 8B's qkv, o and down (K >= 4096), w8 and w4: 2 warps a program, 2048 columns a step, so their programs
    run in one wave; the 1B's down (2048 rows, measured slower so), the large w8 GEMVs, shorter rows and batches
    keep 4 warps."""
    long_rows = [(6144, 4096), (4096, 4096), (4096, 14336)]
    others = [(2048, 8192), (3072, 2048), (2048, 2048), (960, 576), (576, 1536)]
    large = [(28672, 4096), (128256, 4096), (16384, 2048)]
    for fmt in ("w8", "w4"):
        for n, k in long_rows:
            cfg = _config(1, n, k, fmt)
            assert (cfg.kind, cfg.num_warps, cfg.block_k) == ("gemv", tlin.LONG_ROW_GEMV_WARPS, 2048), (fmt, n, k, cfg)
        for n, k in others + (large if fmt == "w8" else []):
            short_w8 = fmt == "w8" and k <= 1024  # SmolLM2's 576-column rows: below
            assert _config(1, n, k, fmt).num_warps == (2 if short_w8 else 4), (fmt, n, k)
        assert _config(2, 4096, 14336, fmt).num_warps == 4, fmt
    assert tlin.LONG_ROW_GEMV_WARPS == 2
    # the 1B's down keeps session 25's launch: w8 2 rows of 2048-column steps, w4 4 rows of 4096
    assert (_config(1, 2048, 8192, "w8").block_n, _config(1, 2048, 8192, "w8").block_k) == (2, 2048)
    assert (_config(1, 2048, 8192, "w4").block_n, _config(1, 2048, 8192, "w4").block_k) == (4, 4096)
    assert _config(1, 4096, 14336, "dense").num_warps == 4  # bf16 rows: the sweep did not cover them


def test_large_one_row_w4_gemvs_of_1025_to_4096_columns_take_2_warps_capped_registers_and_2048_column_steps() -> None:
    """The 8B's and 1B's w4 gate_up and lm_head: 2 warps a program, 2048 columns a step, registers capped so that
    at least 12 programs fit an SM (8 uncapped); SmolLM2's 576-column lm_head (no gain measured), w8's and batches
    keep theirs."""
    for n, k in ((28672, 4096), (128256, 4096), (16384, 2048), (128256, 2048)):
        cfg = _config(1, n, k, "w4")
        assert (cfg.kind, cfg.block_n, cfg.block_k, cfg.split, cfg.num_warps, cfg.max_registers) == (
            "gemv", 4, 2048, 1, 2, tlin.LARGE_GEMV_W4_MAX_REGISTERS), (n, k, cfg)
    assert tlin.LARGE_GEMV_W4_MAX_REGISTERS == 80
    smollm_head = _config(1, 49152, 576, "w4")
    assert (smollm_head.num_warps, smollm_head.max_registers) == (4, None)
    assert (_config(1, 28672, 4096, "w8").num_warps, _config(2, 28672, 4096, "w4").max_registers) == (4, None)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_w8_gemvs_of_rows_of_at_most_1024_columns_take_2_warps_so_each_thread_holds_16_columns_whole(m: int) -> None:
    """SmolLM2's qkv, o, gate_up and lm_head (576 columns, 1024 a step: 64 chunks of 16) over 2 warps (64 threads)
    for one row of x and for the GEMV of several; its down (1536 columns, 2048 a step) and the longer rows keep 4
    (or the long rows' 2); w4's GEMVs keep their own warps."""
    for n, k in ((960, 576), (576, 576), (3072, 576), (49152, 576)):
        cfg = _config(m, n, k, "w8")
        assert (cfg.kind, cfg.block_k, cfg.num_warps) == ("gemv", 1024, 2), (n, k, cfg)
        assert _config(m, n, k, "w4").num_warps == (1 if m > 1 else 4), (n, k)
    for n, k in ((576, 1536), (3072, 2048), (2048, 8192)):
        assert _config(m, n, k, "w8").num_warps == 4, (n, k)


@pytest.mark.parametrize("m", [9, 16])
def test_16_row_w8_tiles_of_longer_rows_take_the_swap_form_in_the_mma_order_and_the_plain_one_in_column_order(
        m: int) -> None:
    """At 9-16 rows the swap form reads weights stored in the MMA order by ldmatrix and one prmt a 4 bytes, and
    measured faster than the plain form there; in column order the plain form (bytes made floats by PTX) stays."""
    for n, k in ((6144, 4096), (4096, 14336), (3072, 2048), (16384, 2048)):
        mma = tlin.choose_config(m, n, k, "w8", CUDA, sm_count=132, mma_order=True)
        natural = _config(m, n, k, "w8")
        assert (mma.kind, mma.block_m, mma.swap, mma.asm_dequant) == ("matmul", 16, True, False), (n, k, mma)
        assert (natural.block_m, natural.swap, natural.asm_dequant) == (16, False, True), (n, k, natural)
    assert _config(m, 960, 576, "w8").swap  # short rows take the swap form in either order


@pytest.mark.parametrize("m", [33, 48, 64])
def test_short_w8_rows_at_33_to_64_sequences_take_the_swap_matmul_over_64_wide_tiles(m: int) -> None:
    """SmolLM2's layers (K <= SHORT_K) at 33-64 rows: the swap form over 64 x 64 tiles; the 1B's and 8B's longer
    rows keep the swap form's 128-wide tiles."""
    for n, k in ((960, 576), (576, 1536), (3072, 576)):
        cfg = _config(m, n, k, "w8")
        assert (cfg.kind, cfg.block_m, cfg.block_n, cfg.block_k) == ("matmul", 64, 64, 64), (n, k, cfg)
        assert (cfg.swap, cfg.asm_dequant) == (True, False), (n, k, cfg)
    for n, k in ((6144, 4096), (4096, 14336), (3072, 2048)):
        cfg = _config(m, n, k, "w8")
        assert (cfg.block_n, cfg.swap, cfg.asm_dequant) == (128, True, False), (n, k, cfg)
    assert not _config(m, 960, 576, "w4").asm_dequant  # w4's tiles are its own


def test_decode_attention_tiles_hold_about_4096_elements_within_a_split_and_32_tokens_of_int8_caches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """64-wide heads (SmolLM2, 1B) read 64 tokens a step, 128-wide (8B) 32, at the decode bench's 512-token context
    (a 37-block table) where a split holds 64 or more tokens; batch 1's splits are 32-35 tokens, so its tile stays
    32; int8 caches keep 32 (64 measured 1.26x slower)."""
    monkeypatch.setattr(tattn, "_sm_count", lambda device: 132)

    def tile(batch: int, kv_heads: int, head_dim: int, int8: bool = False, blocks: int = 37) -> int:
        return tattn.decode_tile(batch * kv_heads, blocks * 16, head_dim, int8, CUDA)

    assert {tile(b, 8, 64) for b in (8, 16, 32, 64)} | {tile(b, 3, 64) for b in (16, 32, 64)} == {64}
    assert tile(8, 3, 64) == 32  # SmolLM2's batch 8: 11 splits of 54 tokens
    assert {tile(b, 8, 128) for b in (8, 16, 32, 64)} == {32}
    assert tile(8, 4, 96) == 32  # a power of two (tl.arange's rule), as for a 128-wide head
    assert {tile(b, 8, d, int8=True) for b in (1, 64) for d in (64, 128)} == {32}
    assert tile(1, 8, 64) == 32 and tile(1, 8, 64, blocks=512) == 64  # a split of 34 tokens, then of 248
    for batch, kv, d, blocks in ((1, 8, 64, 37), (2, 3, 64, 5), (1, 8, 32, 512), (64, 8, 256, 37)):
        context = blocks * 16
        splits = tattn.decode_splits(batch * kv, context, 32, CUDA)
        assert 16 <= tile(batch, kv, d, blocks=blocks) <= max(16, -(-context // splits)), (batch, kv, d, blocks)


@pytest.mark.parametrize("fmt", ["w8", "w4"])
def test_decode_batches_over_rows_of_4096_or_more_columns_split_k_into_one_wave_of_3_programs_an_sm(
        fmt: str) -> None:
    """The 8B's linears at 33-64 rows (128-row tiles): K splits that fill one wave of 3 programs an SM (396),
    >= 8 K steps each, about two waves where the tiles alone fill more than half of one (gate_up), and one split
    where they fill more than a wave (lm_head); the session 32 sweep's best split for each but o (s8 against s9,
    equal times). Shorter rows (the 1B's, SmolLM2's) keep splits for 2 programs an SM. w4 at 17-32 rows too."""
    for m in (33, 64):
        splits = {name: _config(m, n, k, fmt).split for name, (n, k) in
                  {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                   "head": (128256, 4096)}.items()}
        assert splits == {"qkv": 8, "o": 8, "gate_up": 4, "down": 12, "head": 1}, (m, splits)
        shorter = {name: _config(m, n, k, fmt).split for name, (n, k) in
                   {"1b qkv": (3072, 2048), "1b gate_up": (16384, 2048), "1b head": (128256, 2048),
                    "smollm2 head": (49152, 576)}.items()}
        assert shorter == {"1b qkv": 8, "1b gate_up": 3, "1b head": 1, "smollm2 head": 1}, (m, shorter)
    # 17-32 rows: w4 splits so too (its tiles are 32 x 128 x 64); w8's swap tiles keep 4 programs an SM
    thirty_two = {name: _config(32, n, k, fmt).split for name, (n, k) in
                  {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}.items()}
    want = {"qkv": 8, "o": 8, "gate_up": 4, "down": 12} if fmt == "w4" else {"qkv": 11, "o": 16, "gate_up": 3,
                                                                             "down": 16}
    assert thirty_two == want, thirty_two
