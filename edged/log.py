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
    # journald stamps each line itself; elsewhere a timestamp helps.
    fmt = "%(levelname)s %(name)s: %(message)s" if process is None else f"%(levelname)s %(name)s[{process}]: %(message)s"
    if not os.environ.get("JOURNAL_STREAM"):
        fmt = "%(asctime)s " + fmt
    handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(handler)
    logger.propagate = False


def fields(**kw: object) -> str:
    """Render event fields as `k=v` pairs, quoting values with spaces."""
    parts = []
    for k, v in kw.items():
        s = str(v)
        parts.append(f"{k}={s!r}" if (" " in s or not s) else f"{k}={s}")
    return " ".join(parts)
