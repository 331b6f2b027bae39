"""A tiny random-weight Hugging Face model directory that carries the default model's tokenizer and
chat template: the daemon serves it exactly like a real model (same tokens, same template, same
wire format) while a step costs next to nothing, so whatever is measured or tested around it is
the daemon's own work, not the model's. Used by `edged bench transport` and the tests' fixtures."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edged.models.loader import LoadedModel

TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
MODEL_TYPES = ("llama", "qwen2")


def write_tiny_hf_dir(root: Path, model_type: str = "llama", source: LoadedModel | None = None,
                      max_position_embeddings: int = TINY_SHAPE["max_position_embeddings"],
                      seed: int = 3) -> Path:
    """Write config.json, model.safetensors, generation_config.json, tokenizer.json and
    tokenizer_config.json into `root` (which must exist) and return it. `source` gives the tokenizer,
    chat template and vocabulary (default: the embedded model, `load_model(None)`)."""
    # torch and the loaders are imported here: `edged bench` imports its modules only when run.
    from safetensors.torch import save_file

    from edged.models.config import ModelConfig
    from edged.models.runtime_weights import random_named_weights

    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {', '.join(MODEL_TYPES)}; got {model_type!r}")
    if source is None:
        from edged.models.loader import load_model

        source = load_model(None)
    qwen = model_type == "qwen2"
    raw = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"], "model_type": model_type,
        "vocab_size": source.config.vocab_size, **TINY_SHAPE, "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0 if qwen else 50000.0, "tie_word_embeddings": qwen,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    if not qwen:  # llama3 scaling with a short original context, so that it matters at short positions
        raw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}
    shape = ModelConfig(vocab_size=raw["vocab_size"], hidden_size=TINY_SHAPE["hidden_size"],
                        intermediate_size=TINY_SHAPE["intermediate_size"], num_layers=TINY_SHAPE["num_hidden_layers"],
                        num_heads=TINY_SHAPE["num_attention_heads"], num_kv_heads=TINY_SHAPE["num_key_value_heads"],
                        tie_word_embeddings=qwen, attention_bias=qwen)
    named = random_named_weights(shape, seed=seed, std=0.08)
    save_file({k: v.contiguous() for k, v in named.items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(raw))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    source.tokenizer.save(root / "tokenizer.json")
    (root / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": source.chat_template.source, "bos_token": source.tokenizer.bos_token,
        "eos_token": source.tokenizer.eos_token}))
    return root
