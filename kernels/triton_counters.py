"""Arrival counters for split kernels that reduce their own partials (no separate reduce kernel).

A kernel split into `arrivals` programs per output group writes float32 partials, then each program
`arrive`s at its group's counter; the one that arrives last (it sees every other partial: acq_rel at
GPU scope) sums them in a fixed split order, so the result is deterministic, and resets the counter
to zero for the next launch (CUDA graph replays included). Kernels on one stream never overlap, so
every split kernel shares one zeroed buffer per device.

Used by the decode GEMV, whose partials are a few floats per program. The batched matmul and the
split decode attention keep a separate reduce kernel: there the last program's serial read of a
whole tile's partials measured slower on an H200 than the extra launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# groups that one split launch may use: splits happen only while a launch has fewer groups than
# about two programs per SM, far below this
MAX_GROUPS = 8192

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed int32 counters (allocated on first use, before any graph capture: warm-up)."""
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one buffer
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _COUNTERS.get(device)
    if buf is None:
        buf = _COUNTERS[device] = torch.zeros(MAX_GROUPS, dtype=torch.int32, device=device)
    return buf


def check_groups(groups: int) -> None:
    if groups > MAX_GROUPS:
        raise ValueError(f"a split launch with {groups} output groups exceeds the {MAX_GROUPS} arrival counters")


@triton.jit
def arrive(counters_ptr, group, arrivals):
    """True in the last of `arrivals` programs to reach counter `group` (which then reads the others'
    partials with cache_modifier=".cg"); that program also resets the counter."""
    tl.debug_barrier()  # every thread of this program has issued its partial stores
    old = tl.atomic_add(counters_ptr + group, 1, sem="acq_rel", scope="gpu")
    last = old == arrivals - 1
    if last:
        tl.atomic_xchg(counters_ptr + group, 0, sem="relaxed", scope="gpu")
    return last
