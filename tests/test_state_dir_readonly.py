"""A state directory the daemon cannot write gives a result cache that is unavailable, said as
such: no warning that a file was "moved aside" when there was none."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from edged.cache.result_cache import ResultCache, db_path


def read_only_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create files in (root writes anywhere but /proc)."""
    if os.geteuid() == 0:
        return Path("/proc")
    tmp_path.chmod(0o555)
    return tmp_path


def test_a_read_only_state_dir_logs_unavailable_and_nothing_moved(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    state = read_only_dir(tmp_path)
    with caplog.at_level(logging.INFO, logger="edged.cache"):
        cache = ResultCache.open(db_path(str(state)), 1 << 20, 60.0)
    try:
        assert not cache.available
        assert cache.get("any") is None  # serving goes on without the cache
    finally:
        cache.close()
        tmp_path.chmod(0o755)
    assert "moved aside" not in caplog.text
    assert "result cache unavailable, serving without it" in caplog.text
    assert not list(state.glob("*.corrupt-*"))
