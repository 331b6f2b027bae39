"""Logging for journald: one line per event, `key=value` fields, no timestamps under systemd."""
from __future__ import annotations

import logging
import os
import sys


def setup_logging(level: str = "info", process: str | None = None) -> None:
    """Configure the root `edged` logger once; safe to call again to change the level (live reload).
    `process` ("core", "w0", ...) names the daemon's child process in every line it writes."""
    logger = logging.getLogger("edged")
    logger.setLevel(level.upper())
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    fmt = "%(levelname)s %(name)s: %(message)s" if process is None else f"%(levelname)s %(name)s[{process}]: %(message)s"
    # journald stamps each line itself and reads its level from a "<N>" prefix; elsewhere a timestamp helps.
    handler.setFormatter(JournalFormatter(fmt) if stderr_is_journal() else logging.Formatter("%(asctime)s " + fmt))
    logger.addHandler(handler)
    logger.propagate = False


def stderr_is_journal() -> bool:
    """Whether stderr is systemd's journal stream: $JOURNAL_STREAM names its device:inode (systemd.exec(5)), which
    a redirection (`edged serve 2>file` inside a unit) no longer matches."""
    try:
        dev, ino = (int(n) for n in os.environ.get("JOURNAL_STREAM", "").split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


class JournalFormatter(logging.Formatter):
    """Each line starts with its record's syslog priority, `<3>` for an error: journald files the line at that level and
    strips the prefix (SyslogLevelPrefix=, on by default), so `journalctl -u edged -p warning` finds warnings."""

    def format(self, record: logging.LogRecord) -> str:
        n = record.levelno
        priority = 2 if n >= logging.CRITICAL else 3 if n >= logging.ERROR else 4 if n >= logging.WARNING \
            else 6 if n >= logging.INFO else 7
        # a traceback's lines too: journald makes each line an entry of its own
        return "\n".join(f"<{priority}>{line}" for line in super().format(record).splitlines())


def fields(**kw: object) -> str:
    """Render event fields as `k=v` pairs, quoting values with spaces."""
    parts = []
    for k, v in kw.items():
        s = str(v)
        parts.append(f"{k}={s!r}" if (" " in s or not s) else f"{k}={s}")
    return " ".join(parts)
