"""What one forward pass reads besides the tokens: attention metadata and the paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from edged.kernels.reference import k_scale_groups, v_scale_groups


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
    # int8 cache: float32 [num_blocks, block_size, num_kv_heads, groups]: keys one scale per 32 channels of a
    # head (k_scale_groups), values one per head (v_scale_groups); the layout in kernels/reference.py
    k_scale: list[torch.Tensor] | None = None
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

        def scales(groups: int) -> list[torch.Tensor] | None:
            if not int8:
                return None
            return [torch.zeros((*shape[:3], groups), dtype=torch.float32, device=device) for _ in range(num_layers)]

        return KVCache(pool(), pool(), scales(k_scale_groups(head_dim)), scales(v_scale_groups(head_dim)))

    def bytes_per_block(self) -> int:
        per = sum(t[0].numel() * t.element_size() for t in (self.k[0], self.v[0]))
        if self.k_scale is not None:
            per += sum(t[0][0].numel() * t[0].element_size() for t in (self.k_scale, self.v_scale))
        return per * len(self.k)
