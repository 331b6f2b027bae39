"""`edged bench decode`'s tables (formatting and summing only: the timing needs CUDA)."""
from __future__ import annotations

from edged.bench.decode import SHORT_WINDOW_MS, DecodeResult, KernelTime, format_kernel_times, format_table, summarize_kernels


def test_decode_table_marks_the_rows_timed_over_a_short_window() -> None:
    # 32 steps: 0.45 ms a step is a 14 ms window (marked), 2.9 ms a step a 93 ms one (not)
    results = [DecodeResult("smollm2-135m", "w8", 1, 2222.0, 0.45, 0.15, 28294.0),
               DecodeResult("llama-3-8b", "w8", 1, 345.0, 2.9, 8.44, 507.0)]
    lines = format_table(4.28e12, results, {}, steps=32).splitlines()
    assert lines[2].startswith("smollm2-135m") and lines[2].endswith(" *")
    assert lines[3].startswith("llama-3-8b") and not lines[3].endswith("*")
    assert lines[4].startswith(f"* timed over less than {SHORT_WINDOW_MS:.0f} ms (32 steps)")
    # enough steps: no row is marked and there is no note
    long_enough = format_table(4.28e12, results, {}, steps=256).splitlines()
    assert len(long_enough) == 4 and not any(line.endswith("*") for line in long_enough)
    assert format_table(4.28e12, results, {}).splitlines() == long_enough  # steps unknown: nothing said


def test_kernel_times_are_launches_and_microseconds_a_step_the_most_time_first() -> None:
    """Three profiled steps of two GEMVs and a norm each, plus one fill: per name, launches and time a
    step; a name longer than the column is cut with an ellipsis; a result without times prints nothing."""
    events = [("_gemv_kernel", 3.0), ("_gemv_kernel", 5.0), ("_rms_norm_kernel", 1.5)] * 3 + [("Memset (Device)", 1.5)]
    rows = summarize_kernels(events, steps=3)
    assert rows == [KernelTime("_gemv_kernel", 2.0, 8.0), KernelTime("_rms_norm_kernel", 1.0, 1.5),
                    KernelTime("Memset (Device)", 1 / 3, 0.5)]
    long = KernelTime("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>",
                      1.0, 2.0)
    timed = DecodeResult("smollm2-135m", "w8", 1, 2000.0, 0.5, 0.15, 28000.0, kernel_times=rows + [long])
    lines = format_kernel_times([timed, DecodeResult("llama-3-8b", "w8", 1, 345.0, 2.9, 8.44, 507.0)]).splitlines()
    assert lines[0] == "smollm2-135m w8 batch 1: 500.0 us a step"
    assert lines[2].split() == ["_gemv_kernel", "2.0", "8.0", "2%"]
    assert lines[3].split() == ["_rms_norm_kernel", "1.0", "1.5", "0%"]
    assert lines[5][2:50].rstrip() == long.name[:44] + "..." and lines[5].split()[-3:] == ["1.0", "2.0", "0%"]
    assert len(lines) == 6  # the 8B row had no kernel times
