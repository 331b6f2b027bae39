"""`edged bench decode`'s table (formatting only: the timing needs CUDA)."""
from __future__ import annotations

from edged.bench.decode import SHORT_WINDOW_MS, DecodeResult, format_table


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
