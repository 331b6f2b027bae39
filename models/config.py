"""Llama-family model shapes, and the shapes of the models we benchmark."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has a bias on q, k and v
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "llama"

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def rope_cos_sin(self, max_positions: int | None = None) -> torch.Tensor:
        """[max_pos, head_dim] float32: cos in the first half, sin in the second (kernels.rope)."""
        n = max_positions or self.max_position_embeddings
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        inv_freq = scaled_inv_freq(inv_freq, self.rope_scaling)
        freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.float32)

    def with_changes(self, **kw) -> "ModelConfig":
        return replace(self, **kw)


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """Llama 3 frequency-dependent rope scaling (and linear scaling); unknown kinds are rejected."""
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


# Shapes for random-weight benchmarks and GPU tests (the real models' config.json values).
MODEL_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True, name="smollm2-135m"),
    "llama-3.2-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                                num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                max_position_embeddings=131072, tie_word_embeddings=True, name="llama-3.2-1b"),
    "llama-3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                              max_position_embeddings=8192, name="llama-3-8b"),
}
