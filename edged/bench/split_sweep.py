"""`edged bench kernels --split-sweep`: every K split (1-16) of the batched decode matmul's launch at M = 32 and 64,
w8 and w4, over the Llama-3.2-1B's and Llama-3-8B's linears, against choose_config's split; a line a linear and
the step sums (every layer and the lm_head). The data behind choose_config's split rules for decode batches."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from edged.kernels import triton_linear as tlin

from .kernel_inputs import model_linears

SWEPT_MODELS = ("llama-3.2-1b", "llama-3-8b")  # SmolLM2's short rows cap its splits at 2-6
SWEPT_ROWS = (32, 64)
SWEPT_FORMATS = ("w8", "w4")
MAX_SPLIT = 16


@dataclass(frozen=True)
class SweptLinear:
    """One linear's times (seconds a call, its split sum included) by split, and the launch rule's split."""
    model: str
    name: str
    n: int
    k: int
    calls_a_step: int  # the model's layers, or 1 for the lm_head
    rule: tlin.LinearConfig
    times: dict[int, float]

    @property
    def best_split(self) -> int:
        return min(self.times, key=self.times.get)

    @property
    def rule_time(self) -> float:
        return self.times[self.rule.split]


def sweep_splits(model: str, m: int, fmt: str, rule_of: Callable[[int, int, int, str], tlin.LinearConfig],
                 time_call: Callable[[int, int, tlin.LinearConfig], float]) -> list[SweptLinear]:
    """Each linear of `model` at M = m: the rule's launch (rule_of(m, n, k, fmt)) timed at every split that
    leaves a split >= 2 K steps (time_call(n, k, config): seconds a call), the rule's own split always."""
    swept = []
    for name, (n, k, calls) in model_linears(model).items():
        rule = rule_of(m, n, k, fmt)
        k_steps = -(-k // rule.block_k)
        splits = sorted({s for s in range(1, MAX_SPLIT + 1) if k_steps >= 2 * s} | {1, rule.split})
        times = {s: time_call(n, k, replace(rule, split=s)) for s in splits}
        swept.append(SweptLinear(model, name, n, k, calls, rule, times))
    return swept


def format_sweep(swept: list[SweptLinear], m: int, fmt: str) -> str:
    """A line a linear (tiles, the rule's split and time, the best split and time, every split's time) and the
    step sums with the rule's splits and with each linear's best."""
    lines = []
    for s in swept:
        tiles = -(-m // s.rule.block_m) * -(-s.n // s.rule.block_n)
        every = " ".join(f"{split}:{t * 1e6:.1f}" for split, t in s.times.items())
        lines.append(f"{s.model:<13} {fmt} M={m:<3} {s.name:<8} {s.n}x{s.k} {s.rule.block_m}x{s.rule.block_n}x"
                     f"{s.rule.block_k} tiles {tiles:<5} rule s{s.rule.split} {s.rule_time * 1e6:7.1f} us   best "
                     f"s{s.best_split} {s.times[s.best_split] * 1e6:7.1f} us | {every}")
    rule_sum = sum(s.calls_a_step * s.rule_time for s in swept)
    best_sum = sum(s.calls_a_step * s.times[s.best_split] for s in swept)
    lines.append(f"  step sum ({swept[0].model}, {fmt}, M = {m}): rule {rule_sum * 1e3:.3f} ms, each linear's best "
                 f"split {best_sum * 1e3:.3f} ms ({best_sum / rule_sum:.2f}x)")
    return "\n".join(lines)


def split_sweep_report() -> None:
    """The sweep on this machine's GPU: weights rotated past the L2, times from CUDA-graph replays."""
    from .kernels import gemv_time

    device = torch.device("cuda")
    print("batched decode matmul (bf16 x), us a call (the split-K sum included): choose_config's launch at every K "
          "split", flush=True)

    def rule_of(m: int, n: int, k: int, fmt: str) -> tlin.LinearConfig:
        return tlin.choose_config(m, n, k, fmt, device)

    for model in SWEPT_MODELS:
        for fmt in SWEPT_FORMATS:
            for m in SWEPT_ROWS:
                def time_call(n: int, k: int, config: tlin.LinearConfig, m: int = m, fmt: str = fmt) -> float:
                    return gemv_time(fmt, n, k, m=m, config=config, copies=2 if n * k > 2e8 else 4)[0]

                print(format_sweep(sweep_splits(model, m, fmt, rule_of, time_call), m, fmt), flush=True)
