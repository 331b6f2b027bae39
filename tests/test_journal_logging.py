"""Log lines for journald: under systemd's journal stream each line starts with its syslog priority and
carries no timestamp; written anywhere else (a terminal, a file, a redirection inside a unit) it is stamped."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

LOG_EACH_LEVEL_AND_A_TRACEBACK = ("from edged.log import setup_logging; import logging; setup_logging('debug', 'core'); "
                   "log = logging.getLogger('edged.test'); log.debug('d'); log.info('i rid=1'); log.warning('w'); "
                   "log.error('e')\ntry:\n    1 / 0\nexcept ZeroDivisionError:\n    log.exception('step failed')")


def run_logging(stderr_path: Path, journal_stream: str) -> list[str]:
    with open(stderr_path, "wb") as f:
        subprocess.run([sys.executable, "-c", LOG_EACH_LEVEL_AND_A_TRACEBACK], stderr=f, check=True, timeout=60,
                       env={**os.environ, "JOURNAL_STREAM": journal_stream})
    return stderr_path.read_text().splitlines()


def test_on_the_journal_stream_each_line_carries_its_syslog_priority_and_no_timestamp(tmp_path: Path) -> None:
    stream = tmp_path / "journal"
    stream.touch()
    st = os.stat(stream)
    lines = run_logging(stream, f"{st.st_dev}:{st.st_ino}")
    assert lines[:6] == [
        "<7>DEBUG edged.test[core]: d", "<6>INFO edged.test[core]: i rid=1", "<4>WARNING edged.test[core]: w",
        "<3>ERROR edged.test[core]: e", "<3>ERROR edged.test[core]: step failed", "<3>Traceback (most recent call last):"]
    assert all(line.startswith("<3>") for line in lines[6:])  # a traceback's lines at the error's level too
    assert lines[-1] == "<3>ZeroDivisionError: division by zero"


def test_stderr_redirected_away_from_the_journal_stream_gets_timestamps_and_no_priorities(tmp_path: Path) -> None:
    stream = tmp_path / "journal"
    stream.touch()
    st = os.stat(stream)
    lines = run_logging(tmp_path / "elsewhere", f"{st.st_dev}:{st.st_ino}")  # the unit's stream, not this file
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "
    assert all(re.match(stamp, line) for line in lines[:5])
    assert [re.sub(stamp, "", line, count=1) for line in lines[:6]] == [
        "DEBUG edged.test[core]: d", "INFO edged.test[core]: i rid=1", "WARNING edged.test[core]: w",
        "ERROR edged.test[core]: e", "ERROR edged.test[core]: step failed", "Traceback (most recent call last):"]
    assert not any(line.startswith("<") for line in lines)
