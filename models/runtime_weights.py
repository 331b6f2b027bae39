"""Turn loaded, Hugging Face-named tensors into the model's runtime weights in one format.

A loader yields ``{name: Tensor | LinearWeight}`` with HF names (``model.layers.0.self_attn.q_proj.weight``)
where a GGUF Q4_0/Q4_1 tensor already is a ``w4`` LinearWeight and a Q8_0 tensor a ``w8`` one; everything
else is a float tensor.
"""
from __future__ import annotations

import os

import torch

from edged.kernels import LinearWeight, concat_out, dequantize, quantize_w4, quantize_w8, to_mma_order
from edged.kernels import cpu as cpu_kernels

from .config import ModelConfig
from .llama import LayerWeights, LlamaWeights

QUANT_MODES = ("auto", "none", "w8", "w4")
Named = dict[str, "torch.Tensor | LinearWeight"]


def to_runtime_linear(src: torch.Tensor | LinearWeight, bias: torch.Tensor | None, quant: str,
                      dtype: torch.dtype, device: torch.device, group_size: int = 32) -> LinearWeight:
    """One linear weight in the runtime format that `quant` asks for.

    auto keeps w4 sources as they are (GGUF Q4 is not requantized). Other sources stay dense on CUDA
    and become w8 on the CPU, where the weight-only int8 kernel reads about a quarter of float32's bytes;
    a w8 source (GGUF Q8_0) is kept as it is wherever the result is w8. Float weights become symmetric w8
    (Q8_0's rounding), requantized GGUF Q4 asymmetric w8 (which holds a Q4_1 group almost exactly).
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    is_packed = isinstance(src, LinearWeight)
    if quant == "auto":
        if is_packed and src.format == "w4":
            quant = "w4"
        else:
            quant = "w8" if device.type == "cpu" else "none"
    if is_packed and src.format == quant:
        w = LinearWeight(quant, src.data, src.scale, src.minimum, src.group_size, bias)
    else:
        dense = dequantize(src, torch.float32) if is_packed else src.to(torch.float32)
        if quant == "none":
            w = LinearWeight("dense", dense, bias=bias)
        elif quant == "w8":  # float weights as GGUF Q8_0 would hold them; a Q4 source asymmetric (near exact)
            w = quantize_w8(dense, bias, symmetric=not is_packed)
        else:
            w = quantize_w4(dense, group_size, bias)
    return w.astype(dtype).to(device)


def prepacked(w: LinearWeight) -> LinearWeight:
    """w in its device kernels' layout, made once here: the CPU kernels' attached (unless the reference kernels
    are forced), on CUDA grouped w8 in the MMA order (to_mma_order)."""
    if w.data.device.type == "cpu" and os.environ.get("EDGED_KERNELS", "auto") != "reference":
        return cpu_kernels.prepack(w)
    if w.data.device.type == "cuda":
        return to_mma_order(w)
    return w


def _dense(t: torch.Tensor | LinearWeight) -> torch.Tensor:
    return dequantize(t, torch.float32) if isinstance(t, LinearWeight) else t.to(torch.float32)


def build_weights(named: Named, config: ModelConfig, quant: str = "auto", dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", group_size: int = 32) -> LlamaWeights:
    """Fuse q/k/v and gate/up, convert to `quant`, and move to `device`."""
    device = torch.device(device)
    missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in named]
    if missing:
        raise ValueError(f"model weights lack {', '.join(missing)}")

    def get(name: str) -> torch.Tensor | LinearWeight:
        if name not in named:
            raise ValueError(f"model weights lack {name}")
        return named[name]

    def norm(name: str) -> torch.Tensor:
        return _dense(get(name)).to(dtype).to(device)

    def fused(names: list[str]) -> LinearWeight:
        parts = [to_runtime_linear(get(f"{n}.weight"), named.get(f"{n}.bias"), quant, dtype, device, group_size)
                 for n in names]
        return prepacked(concat_out(parts))

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        layers.append(LayerWeights(
            input_norm=norm(f"{p}.input_layernorm.weight"),
            qkv=fused([f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"]),
            o=fused([f"{attn}.o_proj"]),
            post_norm=norm(f"{p}.post_attention_layernorm.weight"),
            gate_up=fused([f"{mlp}.gate_proj", f"{mlp}.up_proj"]),
            down=fused([f"{mlp}.down_proj"]),
        ))
    embed_src = named["model.embed_tokens.weight"]
    head_src = named.get("lm_head.weight")
    tied = head_src is None or config.tie_word_embeddings
    lm_head = prepacked(to_runtime_linear(embed_src if tied else head_src, None, quant, dtype, device, group_size))
    table: torch.Tensor | LinearWeight
    if tied and lm_head.format == "w8" and device.type == "cpu":
        table = lm_head  # the embedding reads the head's uint8 rows instead of a float copy of them
    else:
        table = _dense(embed_src).to(dtype).to(device)
    return LlamaWeights(table, layers, norm("model.norm.weight"), lm_head)


def random_named_weights(config: ModelConfig, seed: int = 0, std: float = 0.02,
                         device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Named:
    """Random weights at a model's real shapes, for benchmarks and GPU tests (no files).
    Made on `device` so that an 8B shape does not pass through host memory."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype) * std

    c = config
    named: Named = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size),
                    "model.norm.weight": 1.0 + rand(c.hidden_size)}
    if not c.tie_word_embeddings:
        named["lm_head.weight"] = rand(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        named[f"{p}.input_layernorm.weight"] = 1.0 + rand(c.hidden_size)
        named[f"{p}.post_attention_layernorm.weight"] = 1.0 + rand(c.hidden_size)
        named[f"{p}.self_attn.q_proj.weight"] = rand(c.q_size, c.hidden_size)
        named[f"{p}.self_attn.k_proj.weight"] = rand(c.kv_size, c.hidden_size)
        named[f"{p}.self_attn.v_proj.weight"] = rand(c.kv_size, c.hidden_size)
        named[f"{p}.self_attn.o_proj.weight"] = rand(c.hidden_size, c.q_size)
        named[f"{p}.mlp.gate_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        named[f"{p}.mlp.up_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        named[f"{p}.mlp.down_proj.weight"] = rand(c.hidden_size, c.intermediate_size)
        if c.attention_bias:
            for n, size in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
                named[f"{p}.self_attn.{n}_proj.bias"] = rand(size)
    return named
