"""`edged bench kernels --split-sweep`: every K split of the batched decode matmul's launch at each 1B and 8B
linear, against the launch rule's split, and the step sums. The GPU timing is replaced here by a model of it;
the sweep's choices and arithmetic are what these tests hold."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from edged.bench.kernel_inputs import model_linears  # noqa: E402
from edged.bench.split_sweep import MAX_SPLIT, format_sweep, sweep_splits  # noqa: E402
from edged.kernels import triton_linear as tlin  # noqa: E402
from edged.models.config import MODEL_SHAPES  # noqa: E402


def _h200_rule(m: int, n: int, k: int, fmt: str) -> tlin.LinearConfig:
    return tlin.choose_config(m, n, k, fmt, torch.device("cuda"), sm_count=132)


def _fake_time(n: int, k: int, config: tlin.LinearConfig) -> float:
    """Fastest at split 5 where K allows it, slower by 1 us a split away; larger linears take longer."""
    return (n * k / 1e9 + abs(config.split - 5)) * 1e-6


def test_a_model_s_decode_linears_are_its_fused_projections_a_layer_each_and_one_lm_head() -> None:
    c = MODEL_SHAPES["llama-3-8b"]
    assert model_linears("llama-3-8b") == {"qkv": (6144, 4096, 32), "o": (4096, 4096, 32),
                                           "gate_up": (28672, 4096, 32), "down": (4096, 14336, 32),
                                           "head": (c.vocab_size, 4096, 1)}


def test_every_split_that_leaves_two_k_steps_is_timed_and_the_fastest_is_reported_beside_the_rule_s() -> None:
    swept = sweep_splits("llama-3-8b", 64, "w8", _h200_rule, _fake_time)
    assert [s.name for s in swept] == ["qkv", "o", "gate_up", "down", "head"]
    for s in swept:
        assert s.rule == _h200_rule(64, s.n, s.k, "w8")
        k_steps = -(-s.k // s.rule.block_k)
        assert sorted(s.times) == [split for split in range(1, MAX_SPLIT + 1) if k_steps >= 2 * split]
        assert s.best_split == 5
        assert s.rule_time == s.times[s.rule.split]
    assert {s.name: s.rule.split for s in swept} == {"qkv": 8, "o": 8, "gate_up": 4, "down": 12, "head": 1}

    def long_steps(m: int, n: int, k: int, fmt: str) -> tlin.LinearConfig:  # 512 columns a step: 8 at K = 4096
        return tlin.LinearConfig("matmul", 64, 128, 512, 1)

    o = next(s for s in sweep_splits("llama-3-8b", 64, "w8", long_steps, _fake_time) if s.name == "o")
    assert sorted(o.times) == [1, 2, 3, 4] and o.best_split == 4


def test_the_step_sums_weigh_each_layer_s_linears_by_the_layers_and_the_lm_head_once() -> None:
    swept = sweep_splits("llama-3.2-1b", 32, "w4", _h200_rule, _fake_time)
    text = format_sweep(swept, 32, "w4")
    rule_sum = sum((16 if s.name != "head" else 1) * s.times[s.rule.split] for s in swept)
    best_sum = sum((16 if s.name != "head" else 1) * s.times[5] for s in swept)
    assert text.splitlines()[-1] == (f"  step sum (llama-3.2-1b, w4, M = 32): rule {rule_sum * 1e3:.3f} ms, each "
                                     f"linear's best split {best_sum * 1e3:.3f} ms ({best_sum / rule_sum:.2f}x)")
    gate_up = next(line for line in text.splitlines() if " gate_up " in line)
    assert "32x128x64 tiles 128" in gate_up and " best s5 " in gate_up, gate_up


def test_split_sweep_is_a_documented_kernels_bench_flag_that_needs_a_gpu() -> None:
    help_text = subprocess.run([sys.executable, "-m", "edged.cli", "bench", "kernels", "--help"],
                               capture_output=True, text=True, check=True).stdout
    assert "--split-sweep" in help_text
    if not torch.cuda.is_available():
        run = subprocess.run([sys.executable, "-m", "edged.cli", "bench", "kernels", "--split-sweep"],
                             capture_output=True, text=True)
        assert run.returncode == 1 and "needs a CUDA GPU" in run.stderr
