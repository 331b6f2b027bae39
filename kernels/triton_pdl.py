"""Programmatic dependent launch (PDL, sm_90 and later) for the kernels of a step.

A small model's decode step is launch-bound: a few microseconds a kernel, most of it not the kernel's
own work (docs/BENCHMARKS.md, issue 16). Launched with PDL, a kernel may be scheduled while the one
before it on the stream is still finishing, so its launch overlaps that kernel's tail, in CUDA
graphs too. Every kernel launched so calls `pdl_begin`: griddepcontrol.wait (the previous kernel has
completed and its memory is visible), then griddepcontrol.launch_dependents (the next kernel may be
scheduled). Before it a kernel may only load what the previous kernel cannot write: the GEMVs load
their first step of weights, their bias, residual and first step of norm weight there, rms_norm its
weight, rope_write_kv its position, angles and slot, decode attention its first K/V tile but for the
newest token. That takes those loads off the chain of dependent loads a step is (SmolLM2 w8 batch 1:
1,817 -> 2,226 tok/s on an H200; the residual and norm loads 2,220 -> 2,260, docs/BENCHMARKS.md).
Every store comes after it. Kernels launched without the flag, torch's among them, wait for their
predecessor as always.

Off where the instructions do not exist (before sm_90, the Triton interpreter) and with EDGED_PDL=0
(read once per process, e.g. for `edged bench decode` with and without it).
"""
from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl

from .triton_device import compiled_sm_major


@cache
def pdl_enabled(device: torch.device) -> bool:
    """Launch this device's step kernels with PDL?"""
    return os.environ.get("EDGED_PDL") != "0" and compiled_sm_major(device) >= 9


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The launch arguments of a step kernel: its PDL constexpr and Triton's launch flag."""
    on = pdl_enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """A PDL-launched kernel's first statement: wait for the previous kernel, then release the next."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
