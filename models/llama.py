"""The Llama-family decoder (Llama, SmolLM, Mistral, Qwen2) written only on `kernels` ops."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from edged import kernels
from edged.kernels import LinearWeight

from .batch import AttentionMetadata, KVCache
from .config import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: LinearWeight  # q, k, v stacked on the output dimension
    o: LinearWeight
    post_norm: torch.Tensor
    gate_up: LinearWeight  # gate, up stacked on the output dimension
    down: LinearWeight


@dataclass
class LlamaWeights:
    embed: torch.Tensor | LinearWeight  # [vocab, hidden]: dense, or a tied w8 lm_head whose rows it reads
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: LinearWeight

    @property
    def nbytes(self) -> int:
        """Bytes read per decoded token (embedding row excluded): the roofline's numerator."""
        total = self.lm_head.nbytes + self.final_norm.numel() * self.final_norm.element_size()
        for layer in self.layers:
            total += sum(w.nbytes for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
            total += 2 * layer.input_norm.numel() * layer.input_norm.element_size()
        return total


def _normed_input(residual: torch.Tensor, normed: torch.Tensor | None,
                  norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's input and the norm_weight kernels.linear is to norm it with: the rows the last output
    projection normed (kernels.linear_add_norm) as they are, else the residual stream and the layer's norm."""
    if normed is not None:
        return normed, None
    return residual, norm_weight


class LlamaModel:
    """Forward over a flat batch of new tokens from many sequences (prefill chunks and decodes)."""

    def __init__(self, config: ModelConfig, weights: LlamaWeights, max_positions: int | None = None) -> None:
        self.config = config
        self.weights = weights
        self.device = weights.final_norm.device
        self.dtype = weights.final_norm.dtype
        self.cos_sin = config.rope_cos_sin(max_positions).to(self.device)
        self.scale = config.head_dim ** -0.5

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm. between_layers, if given, is called before
        every layer after the first (the engine's CPU steps raise from it to give way to a more
        important request)."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        # the residual stream: each sublayer's output projection adds itself to it (the linear's
        # epilogue) and the next projection normalizes it on the way in (its prologue), or the output
        # projection's split-K sum makes that norm too (normed: then the next projection takes it as is)
        residual = self.embed(input_ids)
        normed = None
        layers = self.weights.layers
        for i, layer in enumerate(layers):
            if between_layers is not None and i:
                between_layers()
            x, norm_weight = _normed_input(residual, normed, layer.input_norm)
            qkv = kernels.linear(x, layer.qkv, norm_weight=norm_weight, norm_eps=eps)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.reshape(-1, cfg.num_heads, cfg.head_dim)
            k = k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            k_scale = kv.k_scale[i] if kv.k_scale is not None else None
            v_scale = kv.v_scale[i] if kv.v_scale is not None else None
            kernels.rope_write_kv(q, k, v, positions, self.cos_sin, kv.k[i], kv.v[i], meta.slot_mapping,
                                  k_scale, v_scale)
            if meta.is_decode:
                attn = kernels.attention_decode(q, kv.k[i], kv.v[i], meta.block_tables, meta.context_lens,
                                                self.scale, k_scale, v_scale)
            else:
                attn = kernels.attention_prefill(q, kv.k[i], kv.v[i], meta.block_tables, meta.cu_seqlens_q,
                                                 meta.context_lens, self.scale, k_scale, v_scale)
            residual, normed = kernels.linear_add_norm(attn.reshape(-1, cfg.q_size), layer.o, residual,
                                                       layer.post_norm, eps)
            x, norm_weight = _normed_input(residual, normed, layer.post_norm)
            act = kernels.linear(x, layer.gate_up, norm_weight=norm_weight, norm_eps=eps, silu_mul_out=True)
            next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else self.weights.final_norm
            residual, normed = kernels.linear_add_norm(act, layer.down, residual, next_norm, eps)
        if normed is not None:
            return normed
        out, _ = kernels.rms_norm(residual, self.weights.final_norm, eps)
        return out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden] in the activation dtype."""
        table = self.weights.embed
        if isinstance(table, LinearWeight):  # quantized rows (a tied lm_head): dequantize only these
            minimum = None if table.minimum is None else table.minimum[input_ids]
            rows = LinearWeight(table.format, table.data[input_ids], table.scale[input_ids], minimum, table.group_size)
            return kernels.dequantize(rows, self.dtype)  # each group in float32, rounded once
        return table[input_ids]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] float32 logits for the rows of hidden that need a next token."""
        return kernels.linear(hidden, self.weights.lm_head, out_dtype=torch.float32)
