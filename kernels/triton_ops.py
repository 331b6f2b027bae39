"""The Triton implementation of the kernel contract (the CUDA path the dispatcher in __init__ picks).

Same functions and signatures as reference.py; each op lives in its own triton_*.py file.
"""
from __future__ import annotations

from .triton_activation import silu_and_mul
from .triton_attention import attention_decode, attention_prefill
from .triton_kv import rope_write_kv, write_kv
from .triton_linear import linear, linear_add_norm
from .triton_norm import rms_norm
from .triton_rope import rope
from .triton_sampling import argmax, sample

__all__ = ["linear", "linear_add_norm", "rms_norm", "rope", "silu_and_mul", "write_kv", "rope_write_kv",
           "attention_decode", "attention_prefill", "argmax", "sample"]
