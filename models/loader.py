"""One entry point for every model source: the embedded default, a GGUF file, or an HF directory."""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .chat_template import ChatTemplate
from .config import ModelConfig
from .default_model import DEFAULT_MODEL_ID, DEFAULT_MODEL_SAMPLING, default_model_path
from .runtime_weights import Named
from .tokenizer import Tokenizer

log = logging.getLogger("edged.models")

# What a request that omits a field gets, as the model's authors recommend (vLLM's generation_config
# defaults, Ollama's model parameters): a plain mapping, so that it travels to the workers pickled
# without pulling in anything.
SamplingDefaults = dict[str, float | int]
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "max_tokens")


@dataclass
class LoadedModel:
    """Everything a model source provides; `named_weights` go to runtime_weights.build_weights."""

    config: ModelConfig
    named_weights: Named
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    model_id: str
    source_path: Path
    # A subset of SAMPLING_DEFAULT_KEYS; a key absent: the server's own default (temperature 1,
    # top_p 1, top_k off, limits.max_tokens_default).
    sampling_defaults: SamplingDefaults = field(default_factory=dict)


def sampling_defaults_from(values: Mapping[str, Any], source: str) -> SamplingDefaults:
    """The valid sampling defaults among `values` (keys of SAMPLING_DEFAULT_KEYS). A value that a
    request could not carry either (temperature outside [0, 2], top_p outside (0, 1], top_k < 0,
    max_tokens < 1, or not a number) is logged and dropped: a model file's odd value should cost
    its default, not the daemon's start."""
    out: SamplingDefaults = {}
    for key in SAMPLING_DEFAULT_KEYS:
        v = values.get(key)
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if ok and key == "temperature":
            ok = 0.0 <= v <= 2.0
        elif ok and key == "top_p":
            ok = 0.0 < v <= 1.0
        elif ok and key in ("top_k", "max_tokens"):
            ok = float(v).is_integer() and v >= (0 if key == "top_k" else 1)
        if not ok:
            log.warning("%s: ignoring sampling default %s=%r (out of range or not a number)", source, key, v)
            continue
        out[key] = float(v) if key in ("temperature", "top_p") else int(v)
    return out


def load_model(path: str | Path | None = None) -> LoadedModel:
    """None: the embedded SmolLM2-135M-Instruct; a .gguf file; or a directory with config.json."""
    # The format modules import this one for LoadedModel, so they are imported here, when used.
    from .gguf_loader import load_gguf
    from .hf_loader import load_hf

    if path is None:
        loaded = load_gguf(default_model_path(), DEFAULT_MODEL_ID)
        # The GGUF carries no sampling metadata: edged's choice for it (default_model.py) stands in.
        loaded.sampling_defaults = {**loaded.sampling_defaults, **DEFAULT_MODEL_SAMPLING}
        return loaded
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file() and path.suffix.lower() == ".gguf":
        return load_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf(path)
    if path.is_dir():
        raise ValueError(f"model directory {path} has no config.json (expected a Hugging Face model directory)")
    raise ValueError(f"model path {path} is neither a .gguf file nor a Hugging Face model directory")


def with_overrides(loaded: LoadedModel, served_name: str | None = None, tokenizer_path: str | Path | None = None,
                   chat_template_path: str | Path | None = None,
                   sampling_defaults: Mapping[str, float | int] | None = None) -> LoadedModel:
    """Apply the config's model.served_name / model.tokenizer / model.chat_template /
    model.sampling_defaults (key by key: a key the config leaves unset keeps the model's) to a loaded model."""
    if sampling_defaults:
        loaded.sampling_defaults = {**loaded.sampling_defaults,
                                    **sampling_defaults_from(sampling_defaults, "model.sampling_defaults")}
    if tokenizer_path is not None:
        old = loaded.tokenizer
        loaded.tokenizer = Tokenizer.from_file(tokenizer_path, old.bos_token_id, old.eos_token_ids)
    if chat_template_path is not None:
        tok = loaded.tokenizer
        loaded.chat_template = ChatTemplate(Path(chat_template_path).read_text(encoding="utf-8"), tok.bos_token,
                                            tok.eos_token)
    if served_name:
        loaded.model_id = served_name
    return loaded
