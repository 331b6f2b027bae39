"""What the Triton kernels are compiled for on a device: features that exist only as GPU instructions
(PDL's griddepcontrol, inline PTX) are chosen from this, and are off where kernels are interpreted."""
from __future__ import annotations

import os
from functools import cache

import torch


@cache
def compiled_sm_major(device: torch.device) -> int:
    """The major compute capability the kernels compile for on `device`; 0 for a CPU device or under
    the Triton interpreter (TRITON_INTERPRET=1)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    return torch.cuda.get_device_capability(device)[0]
