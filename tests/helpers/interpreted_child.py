"""One child pytest of a test file under Triton's interpreter, started early and read when needed.

The interpreter must be on before `import triton` and off for the GPU tests of the same process, so
tests/test_kernels_triton.py runs itself in a child with TRITON_INTERPRET=1 (~110 s on a 2-core box).
conftest starts that child as soon as collection ends, niced and on one thread, so it runs in the time
the daemon-level tests before it spend waiting; the file's tests then wait for it and replay its results.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

# results[name] = (outcome, detail); "" holds the child's output tail, for tests the report lacks
Results = dict[str, tuple[str, str]]


def _lower_priority() -> None:
    os.nice(19)  # the suite's own tests come first: the child takes what CPU they leave


@dataclass
class InterpretedChild:
    """A child `pytest FILE` with TRITON_INTERPRET=1, its JUnit report parsed into Results."""

    test_file: Path
    _tmp: tempfile.TemporaryDirectory | None = None
    _proc: subprocess.Popen | None = None
    _results: Results | None = field(default=None, repr=False)

    def start(self) -> None:
        if self._proc is not None or self._results is not None:
            return
        self._tmp = tempfile.TemporaryDirectory()
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        with open(self._path("output.txt"), "w") as out:  # a file, not a pipe: a long output cannot stall it
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", str(self.test_file), "-q", "-p", "no:cacheprovider",
                 f"--junitxml={self._path('report.xml')}", "-o", "addopts="],
                env=env, cwd=self.test_file.parents[1], stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=_lower_priority)

    def _path(self, name: str) -> Path:
        assert self._tmp is not None
        return Path(self._tmp.name) / name

    def results(self) -> Results:
        """Waits for the child (starting it if nobody has) and returns its outcome per test name."""
        if self._results is None:
            self.start()
            assert self._proc is not None
            self._proc.wait()
            output = self._path("output.txt").read_text(errors="replace")
            self._results = _parse(self._path("report.xml"), output[-6000:])
            self._tmp.cleanup()
        return self._results

    def stop(self) -> None:
        """Ends a child nobody read (a run that deselected the file's tests after all)."""
        if self._proc is not None and self._results is None:
            self._proc.kill()
            self._proc.wait()
            self._tmp.cleanup()


def _parse(report: Path, tail: str) -> Results:
    results: Results = {"": ("missing", tail)}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome, detail = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = "skipped" if tag == "skipped" else "failed"
                    detail = (el.get("message") or "") + "\n" + (el.text or "")
                    break
            results[case.get("name", "")] = (outcome, detail)
    return results


_CHILDREN: dict[Path, InterpretedChild] = {}


def interpreted_child(test_file: str | Path) -> InterpretedChild:
    """The session's one child run of test_file."""
    path = Path(test_file).resolve()
    if path not in _CHILDREN:
        _CHILDREN[path] = InterpretedChild(path)
    return _CHILDREN[path]


def stop_all() -> None:
    for child in _CHILDREN.values():
        child.stop()
