"""What one forward pass reads besides the tokens: attention metadata and the paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of the new tokens (see kernels/reference.py for the shapes)."""

    is_decode: bool  # every sequence adds exactly one token: the decode kernel (and CUDA graphs) apply
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32, cached tokens after this step
    cu_seqlens_q: torch.Tensor  # [B+1] int32, new tokens of sequence b are rows cu[b]:cu[b+1]


@dataclass
class KVCache:
    """One preallocated pool of blocks per layer: [num_blocks, block_size, num_kv_heads, head_dim]."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_scale: list[torch.Tensor] | None = None  # int8 cache: [num_blocks, block_size, num_kv_heads]
    v_scale: list[torch.Tensor] | None = None

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    @staticmethod
    def allocate(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, int8: bool = False) -> "KVCache":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        store = torch.int8 if int8 else dtype

        def pool() -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]

        def scales() -> list[torch.Tensor] | None:
            if not int8:
                return None
            return [torch.zeros(shape[:3], dtype=torch.float32, device=device) for _ in range(num_layers)]

        return KVCache(pool(), pool(), scales(), scales())

    def bytes_per_block(self) -> int:
        per = sum(t[0].numel() * t.element_size() for t in (self.k[0], self.v[0]))
        if self.k_scale is not None:
            per += 2 * self.k_scale[0][0].numel() * 4
        return per * len(self.k)
