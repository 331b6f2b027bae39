"""Load a Hugging Face model directory: config.json, *.safetensors, tokenizer.json, the chat template."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import safe_open

from .chat_template import ChatTemplate, pick_template
from .config import ModelConfig
from .loader import LoadedModel, SamplingDefaults, sampling_defaults_from
from .runtime_weights import Named
from .tokenizer import Tokenizer

log = logging.getLogger("edged.models")

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def load_hf(path: str | Path, model_id: str | None = None) -> LoadedModel:
    root = Path(path)
    model_id = model_id or root.name
    raw = _read_json(root / "config.json")
    tokenizer_config = _read_json(root / "tokenizer_config.json", missing_ok=True)
    tokenizer = _tokenizer(root, raw, tokenizer_config)
    config = config_from_hf(raw, tokenizer, model_id)
    named = load_safetensors(root)
    log.info("loaded %s: %s, %d tensors", root, raw.get("model_type"), len(named))
    template = ChatTemplate(_chat_template(root, tokenizer_config),
                            _token_text(tokenizer_config.get("bos_token")) or tokenizer.bos_token,
                            _token_text(tokenizer_config.get("eos_token")) or tokenizer.eos_token)
    generation_config = _read_json(root / "generation_config.json", missing_ok=True)
    defaults = sampling_defaults_from_generation_config(generation_config, str(root / "generation_config.json"))
    return LoadedModel(config, named, tokenizer, template, model_id, root, defaults)


def sampling_defaults_from_generation_config(gc: dict[str, Any], source: str) -> SamplingDefaults:
    """generation_config.json's temperature / top_p / top_k / max_new_tokens, as vLLM takes them
    (`do_sample` is not consulted, as in vLLM: a file that names a temperature means it)."""
    return sampling_defaults_from({"temperature": gc.get("temperature"), "top_p": gc.get("top_p"),
                                   "top_k": gc.get("top_k"), "max_tokens": gc.get("max_new_tokens")}, source)


def config_from_hf(raw: dict[str, Any], tokenizer: Tokenizer, name: str) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias is not supported")
    if raw.get("sliding_window") and raw.get("use_sliding_window", model_type == "mistral"):
        log.warning("%s: sliding window attention (%s) is not applied; attention is full", name, raw["sliding_window"])
    missing = [k for k in _REQUIRED_KEYS if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    rope = raw.get("rope_parameters") or {}  # transformers 5 nests rope_theta and the scaling here
    heads = raw["num_attention_heads"]
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or 0,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=raw.get("rope_theta", rope.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(raw.get("rope_scaling") or rope),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),  # Qwen2 always has q/k/v bias
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=list(tokenizer.eos_token_ids),
        name=name,
    )


def _rope_scaling(scaling: dict[str, Any]) -> dict[str, Any] | None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")
    return {k: v for k, v in scaling.items() if k != "rope_theta"}


def load_safetensors(root: Path) -> Named:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root} has no *.safetensors files")
    named: Named = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.endswith("rotary_emb.inv_freq"):  # recomputed from the config
                    continue
                named[key] = f.get_tensor(key).to(torch.float32)
    return named


def _read_json(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    if not path.is_file():
        if missing_ok:
            return {}
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _token_text(value: str | dict | None) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _tokenizer(root: Path, config: dict, tokenizer_config: dict) -> Tokenizer:
    path = root / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{root} has no tokenizer.json (only fast tokenizers are supported)")
    backend = tokenizers.Tokenizer.from_file(str(path))

    def token_id(value: str | dict | None) -> list[int]:
        text = _token_text(value)
        found = backend.token_to_id(text) if text else None
        return [] if found is None else [found]

    bos = (_ids(config.get("bos_token_id")) + token_id(tokenizer_config.get("bos_token")) + [None])[0]
    # generation_config.json first (what HF generate stops at), then config.json, then the tokenizer's
    generation_config = _read_json(root / "generation_config.json", missing_ok=True)
    eos = (_ids(generation_config.get("eos_token_id")) + _ids(config.get("eos_token_id"))
           + token_id(tokenizer_config.get("eos_token")))
    return Tokenizer(backend, bos, eos)


def _chat_template(root: Path, tokenizer_config: dict) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = root / "chat_template.json"
    if json_file.is_file():
        return pick_template(_read_json(json_file).get("chat_template"))
    return pick_template(tokenizer_config.get("chat_template"))
