"""transformers' GGUF loading, the reference of the correctness tests, without its two slow spots."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import gguf

from edged.models.gguf_loader import PlainViewGGUFReader


@contextlib.contextmanager
def fast_gguf_parsing() -> Iterator[None]:
    """While transformers loads a GGUF: the header parsed by edged's PlainViewGGUFReader (the same
    values; gguf's own reader took ~2.4 s per parse for SmolLM2 and transformers parses twice), and
    gguf's tensor-name map built once per (arch, layers), not once per tensor (~3 s). transformers
    imports both from `gguf` at call time, so patching the module's attributes reaches it."""
    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = PlainViewGGUFReader
    gguf.get_tensor_name_map = functools.cache(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved
