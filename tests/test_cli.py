"""Smoke runs of the `edged` commands not covered elsewhere: hash-key, models, bench decode/kernels.

`serve`, `chat` and `cache` run against the real daemon (test_daemon_e2e.py, test_caching_daemon.py),
`bench serve` in test_bench_serve.py, `topology` in test_topology.py, `check-config` in test_config.py.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import edged.models.loader as loader
from edged.cli import build_parser, main

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def edged(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edged.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def _commands(parser: argparse.ArgumentParser, name: str = "edged"):
    """(name, parser) of `edged` and each of its commands, sub-commands included."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _commands(sub, f"{name} {sub_name}")


def test_every_command_has_a_description_and_every_flag_and_argument_a_help_text() -> None:
    undescribed, unexplained = [], []
    for name, parser in _commands(build_parser()):
        if not parser.description:
            undescribed.append(name)
        unexplained += [f"{name} {a.option_strings or a.dest}" for a in parser._actions
                        if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert not undescribed and not unexplained, (undescribed, unexplained)


def test_serve_help_names_each_flags_default() -> None:
    r = edged("serve", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for default in ("0.0.0.0:4433", "~/.local/state/edged", "SmolLM2-135M-Instruct", "logging.level, info"):
        assert default in text, default


def test_hash_key_prints_the_sha256_of_the_argument_or_of_stdin() -> None:
    want = hashlib.sha256(b"s3cret key").hexdigest()
    r = edged("hash-key", "s3cret key")
    assert (r.returncode, r.stdout) == (0, want + "\n")
    r = edged("hash-key", stdin="s3cret key\n")  # one line, without its newline
    assert (r.returncode, r.stdout) == (0, want + "\n")
    r = edged("hash-key", stdin="\n")
    assert r.returncode == 2 and "empty key" in r.stderr and r.stdout == ""


def test_models_shows_a_model_directory_and_its_shape(tiny_hf_dir) -> None:
    path = tiny_hf_dir("llama")
    r = edged("models", "--model", str(path))
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first.endswith(f"({path})")
    assert second.strip() == "layers 2, hidden 64, heads 4/2 (q/kv), head_dim 16, vocab 49152, context 256"


def test_models_without_a_path_shows_the_embedded_default(monkeypatch, capsys, loaded_model) -> None:
    asked = []
    monkeypatch.setattr(loader, "load_model", lambda path: asked.append(path) or loaded_model)  # loaded once
    assert main(["models"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert asked == [None]
    assert out[0].startswith("SmolLM2-135M-Instruct  (") and out[0].endswith(".gguf)")
    assert out[1].strip() == "layers 30, hidden 576, heads 9/3 (q/kv), head_dim 64, vocab 49152, context 8192"


def test_models_reports_a_missing_file_and_exits_1(tmp_path: Path) -> None:
    r = edged("models", "--model", str(tmp_path / "missing.gguf"))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("edged: cannot load the model:") and "missing.gguf" in r.stderr


@pytest.mark.gpu
@needs_cuda
def test_bench_decode_at_a_tiny_size_prints_one_row_per_quant_and_batch() -> None:
    r = edged("bench", "decode", "--shapes", "smollm2-135m", "--quant", "none,w4", "--batch", "1,2", "--steps", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("smollm2-135m")]
    assert [(row[1], row[2]) for row in rows] == [("none", "1"), ("none", "2"), ("w4", "1"), ("w4", "2")]
    for row in rows:
        tok_s, step_ms = float(row[3].replace(",", "")), float(row[4])
        assert tok_s > 0 and step_ms > 0
        assert tok_s == pytest.approx(int(row[2]) / (step_ms / 1000), rel=0.02)  # tok/s = batch / step time


@pytest.mark.gpu
@needs_cuda
def test_bench_decode_kernel_times_list_the_steps_kernels() -> None:
    """--kernel-times: after the table, the step's kernels from the profiler; the decode GEMV launches at
    least four times a layer (qkv, o, gate_up, down) and the rows' launches cover the table's count."""
    r = edged("bench", "decode", "--shapes", "smollm2-135m", "--quant", "w8", "--batch", "1", "--steps", "4",
              "--kernel-times")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    table_row = next(line.split() for line in lines if line.startswith("smollm2-135m  w8"))
    start = lines.index(next(line for line in lines if line.startswith("smollm2-135m w8 batch 1:")))
    # a row: the name (torch's have spaces), then calls/step, us/step and the share of the step
    rows = [line.strip().rsplit(None, 3) for line in lines[start + 2:] if line.startswith("  ")]
    calls = {name: float(n) for name, n, _, _ in rows}
    assert calls["_gemv_kernel"] >= 4 * 30, r.stdout
    launches = sum(float(n) for name, n, _, _ in rows if not name.startswith(("Memcpy", "Memset")))
    assert launches >= int(table_row[8]), r.stdout  # the table's kernels a step


@pytest.mark.gpu
@needs_cuda
def test_bench_kernels_prints_every_kernel_without_a_failure() -> None:
    r = edged("bench", "kernels", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAILED" not in r.stdout, r.stdout
    lines = r.stdout.splitlines()
    assert any(line.startswith("copy ceiling") for line in lines), r.stdout
    assert sum(" GB/s " in line for line in lines) >= 10 and any("TFLOP/s" in line for line in lines), r.stdout
