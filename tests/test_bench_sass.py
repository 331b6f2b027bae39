"""`edged bench sass`: the decode GEMV's K loop compiled for sm_90 on this (GPU-less) machine and counted.

It guards what the H200 measurements rest on (docs/BENCHMARKS.md, issue 16): the loop streams weights
without moving data through shared memory or between threads, and it takes the weights as "magic + q"
floats (one prmt a byte for w8, 1.5 instructions a weight for w4) instead of converting and subtracting
each one (4.8 instructions a weight at both formats before).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for a GPU: not under the Triton interpreter", allow_module_level=True)

from edged.bench.kernel_inputs import model_linears  # noqa: E402
from edged.bench.sass import (Residency, _read_cubin, compile_gemv, compile_matmul, gemv_loop,  # noqa: E402
                              gemv_x_rows_loop, longest_loop, ptxas_info, residency)
from edged.kernels import triton_linear as tlin  # noqa: E402


@pytest.mark.parametrize("fmt,shape", [("w8", (28672, 4096)), ("w4", (4096, 14336))])
def test_decode_gemv_loop_streams_weights_without_shuffles_under_4_5_instructions_a_weight(fmt, shape) -> None:
    stats, cfg = gemv_loop(fmt, *shape)
    # the launch rule's: w8 gate_up 4096 columns a step over 4 warps, w4 down 2048 over 2 (LONG_ROW_GEMV_WARPS)
    assert (cfg.kind, cfg.block_n, cfg.block_k, cfg.num_warps) == (("gemv", 4, 4096, 4) if fmt == "w8" else
                                                                   ("gemv", 4, 2048, tlin.LONG_ROW_GEMV_WARPS))
    assert stats.weights_per_iteration == 4 * cfg.block_k / (32 * cfg.num_warps)
    assert stats.shared_or_shuffle == 0, stats.opcodes
    # one FMA a weight; w8 one prmt a byte, w4 one prmt per two bytes and one and a nibble
    assert stats.opcodes["FFMA"] >= 0.9 * stats.weights_per_iteration
    prmt_per_weight = stats.opcodes["PRMT"] / stats.weights_per_iteration
    assert prmt_per_weight >= (1.0 if fmt == "w8" else 0.5)
    assert stats.per_weight < 4.5, (stats.per_weight, stats.opcodes.most_common(8))


@pytest.mark.parametrize("fmt", ["w8", "w4"])
@pytest.mark.parametrize("forms", [dict(NORM=True), dict(SILU=True), dict(RESIDUAL=True), dict(HAS_BIAS=True),
                                   dict(GATED=True), dict(NORM=True, RESIDUAL=True, HAS_BIAS=True)],
                         ids=lambda f: "+".join(f))
def test_every_fused_form_of_the_decode_gemv_compiles_for_hopper(fmt, forms) -> None:
    """The interpreter runs these forms but does not type-check them as the compiler does (a jit helper
    returning a tensor or a float compiled nowhere but ran interpreted): compile each for sm_90 here."""
    compiled, _ = compile_gemv(fmt, 3072, 2048, **forms)
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("fmt,xrows", [("w8", 2), ("w8", 4), ("w8", 8), ("w4", 2), ("w4", 4)])
def test_gemv_of_several_x_rows_converts_each_weight_once_without_shuffles(fmt: str, xrows: int) -> None:
    """The GEMV of a few sequences (grouped w8 or w4, the 8B's qkv shape): no shared memory or shuffles in
    its loop, each weight converted once whatever the rows of x (w8: a prmt a weight; w4: its nibbles'
    LOP3s no more than for one row of x, plus the x words' unpacking), one FMA a weight and row of x, and
    under 4 instructions a weight and row of x (the x rows' conversions and sums shared by the program's 2
    weight rows)."""
    stats, cfg = gemv_x_rows_loop(6144, 4096, xrows, fmt=fmt)
    assert cfg.kind == "gemv" and cfg.block_n == 2
    assert stats.shared_or_shuffle == 0, stats.opcodes
    weights = stats.weights_per_iteration
    if fmt == "w8":
        assert stats.opcodes["PRMT"] >= weights
    else:
        one_row, _ = gemv_x_rows_loop(6144, 4096, 1, fmt=fmt)
        assert stats.opcodes["LOP3"] <= one_row.opcodes["LOP3"] + 32 * (xrows - 1), stats.opcodes
    assert stats.opcodes["FFMA"] >= 0.9 * weights * xrows
    assert stats.per_weight / xrows < 4.0, (stats.per_weight, stats.opcodes.most_common(8))


@pytest.mark.parametrize("model,rows", [("smollm2-135m", 17), ("smollm2-135m", 32), ("smollm2-135m", 64),
                                        ("llama-3.2-1b", 32), ("llama-3.2-1b", 64), ("llama-3-8b", 32),
                                        ("llama-3-8b", 64)])
def test_the_batched_w8_matmuls_swap_form_keeps_its_wgmmas_in_flight(model: str, rows: int) -> None:
    """The swap form's dot takes the dequantized weights from registers; ptxas serialized its wgmmas (C7515: each
    one waited for before the next issues) while the K loop had a skip path that zeroes the accumulator. Every
    swap launch of SmolLM2's, the 1B's and the 8B's decode batches compiles without that note (the H200's Triton 3.6
    serialized them all; this machine's 3.9 the 64-column tiles and the lm_heads)."""
    swap = 0
    for linear, (n, k, _) in model_linears(model).items():
        compiled, cfg = compile_matmul("w8", rows, n, k)
        if cfg.swap:
            swap += 1
            assert "C7515" not in ptxas_info(compiled), (linear, cfg)
    assert swap


@pytest.mark.parametrize("rows,n,k", [(64, 4096, 14336), (32, 4096, 14336), (48, 960, 576)])
def test_the_swap_form_reads_weights_in_the_mma_order_by_ldmatrix_and_converts_a_byte_in_one_prmt(rows: int, n: int,
                                                                                                  k: int) -> None:
    """The w8 swap form at the 8B's down (64 x 128 tiles) and SmolLM2's short rows (64 x 64): in column order a K
    step reads each thread's weights from shared memory two bytes at a time (LDS.U16); stored in the MMA order
    (kernels/weights.py) four bytes of each 16 columns lie together, so ldmatrix reads them, and the one-prmt
    conversion takes them as they are: about a third fewer instructions a step (docs/BENCHMARKS.md, session 38)."""
    loops = {}
    for mma in (False, True):
        compiled, cfg = compile_matmul("w8", rows, n, k, mma_order=mma)
        assert cfg.swap
        loops[mma] = longest_loop(_read_cubin(compiled, "nvdisasm", "-c"))
    count = {mma: {op: sum(i.split()[0].startswith(op) for i in loop) for op in ("LDS.U16", "LDSM")}
             for mma, loop in loops.items()}
    assert count[False]["LDS.U16"] >= 16 and count[False]["LDSM"] == 0, count
    assert count[True]["LDS.U16"] <= count[False]["LDS.U16"] // 4 and count[True]["LDSM"] >= 2, count
    assert len(loops[True]) < 0.8 * len(loops[False]), (len(loops[True]), len(loops[False]))


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (3072, 2048)])
def test_w4_gemv_of_several_x_rows_sums_whole_chunks_in_a_thread_at_shorter_rows(n: int, k: int) -> None:
    """SmolLM2's and the 1B's rows: the launch rule gives the w4 GEMV of x rows as many warps as keep a
    whole 16-byte chunk in each thread, so its loop still has no shuffles or shared memory."""
    stats, cfg = gemv_x_rows_loop(n, k, 2, fmt="w4")
    assert cfg.block_k // 2 >= 16 * 32 * cfg.num_warps, cfg
    assert stats.shared_or_shuffle == 0, stats.opcodes


@pytest.mark.parametrize("registers,shared,warps,programs", [
    (124, 1024, 4, 4), (40, 1024, 4, 12), (48, 1024, 4, 10),  # registers bind
    (42, 1024, 4, 10),  # 42 a thread is 1,344 a warp, given as 1,536: 10 programs, not 12
    (32, 0, 8, 8),  # 64 warps an SM bind as well
    (16, 0, 1, 32),  # 32 programs an SM bind
    (32, 100000, 4, 2),  # shared memory binds
])
def test_programs_an_sm_keeps_follow_the_sm_90_occupancy_limits(registers, shared, warps, programs) -> None:
    held = Residency(registers, shared, warps)
    assert held.programs_per_sm == programs
    assert held.waves(132 * programs * 3 // 2) == pytest.approx(1.5)


def test_residency_reads_each_compiled_gemvs_own_register_count() -> None:
    """The 8B's gate_up GEMV (4 rows of 4096 bytes a step) holds more registers a thread than its qkv one (2
    rows of 2048), so an SM keeps fewer of its programs."""
    small, small_cfg = compile_gemv("w8", 6144, 4096)
    large, large_cfg = compile_gemv("w8", 28672, 4096)
    assert (small_cfg.block_n, small_cfg.block_k, large_cfg.block_n, large_cfg.block_k) == (2, 2048, 4, 4096)
    held_small, held_large = residency(small, small_cfg.num_warps), residency(large, large_cfg.num_warps)
    assert 16 <= held_small.registers < held_large.registers <= 255
    assert held_small.programs_per_sm > held_large.programs_per_sm >= 1


def test_a_register_cap_lets_an_sm_keep_more_of_the_large_gemvs_programs(monkeypatch) -> None:
    """The 8B's gate_up GEMV (w8 in the MMA order) holds over 100 registers uncapped, 4 programs an SM. The launch
    rule caps it at LARGE_GEMV_W8_MAX_REGISTERS (ptxas' maxnreg) and a cap of 88 is tighter still: each holds at
    most its cap, keeps more programs an SM than the uncapped build, and spills nothing."""
    ruled, cfg = compile_gemv("w8", 28672, 4096)
    capped, capped_cfg = compile_gemv("w8", 28672, 4096, max_registers=88)
    monkeypatch.setattr(tlin, "LARGE_GEMV_W8_MAX_REGISTERS", None)
    free, free_cfg = compile_gemv("w8", 28672, 4096)
    assert (free_cfg.max_registers, cfg.max_registers, capped_cfg.max_registers) == (None, 96, 88)
    held_free = residency(free, cfg.num_warps)
    for build, cap in ((ruled, 96), (capped, 88)):
        held = residency(build, cfg.num_warps)
        assert held.registers <= cap < held_free.registers, cap
        assert held.programs_per_sm > held_free.programs_per_sm, cap
        assert held.stack == 0, cap


def test_the_w4_register_cap_fits_12_programs_of_the_large_gemvs_an_sm_without_spills(monkeypatch) -> None:
    """The 8B's w4 gate_up GEMV over 2 warps holds over 100 registers uncapped, 8 programs an SM; capped at
    LARGE_GEMV_W4_MAX_REGISTERS as the launch rule launches it, at least 12 (Triton 3.9: 12, the H200's 3.6: 14),
    and nothing spills."""
    ruled, cfg = compile_gemv("w4", 28672, 4096)
    monkeypatch.setattr(tlin, "LARGE_GEMV_W4_MAX_REGISTERS", None)
    free, free_cfg = compile_gemv("w4", 28672, 4096)
    assert (cfg.num_warps, cfg.max_registers, free_cfg.max_registers) == (2, 80, None)
    held, held_free = residency(ruled, cfg.num_warps), residency(free, cfg.num_warps)
    assert held.registers <= 80 < 100 < held_free.registers
    assert held.programs_per_sm >= 12 and held_free.programs_per_sm <= 8 and held.stack == 0


def test_bench_sass_prints_a_row_per_shape_and_format() -> None:
    r = subprocess.run([sys.executable, "-m", "edged.cli", "bench", "sass", "--shapes", "smollm2-135m qkv",
                        "--quant", "w8,w4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("smollm2-135m qkv")]
    assert [row.split()[3] for row in rows] == ["w8", "w4"], r.stdout
    for row in rows:  # registers, programs an SM keeps, programs, waves: whole numbers and a fraction
        cells = dict(zip(("regs", "stack", "prog/SM", "programs", "waves"), row.split()[9:14]))
        assert 16 <= int(cells["regs"]) <= 255 and int(cells["prog/SM"]) >= 1, row
        assert float(cells["waves"]) == pytest.approx(int(cells["programs"]) / (132 * int(cells["prog/SM"])),
                                                      abs=0.01), row
    bad = subprocess.run([sys.executable, "-m", "edged.cli", "bench", "sass", "--shapes", "no such shape"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown shapes" in bad.stderr
