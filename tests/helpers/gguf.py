"""llama.cpp's q/k row permutation, which GGUF files store and the loaders undo."""
from __future__ import annotations

import numpy as np


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute, verbatim: the q/k row order GGUF files store, which loaders undo."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
