"""One entry point for every model source: the embedded default, a GGUF file, or an HF directory."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .chat_template import ChatTemplate
from .config import ModelConfig
from .default_model import DEFAULT_MODEL_ID, default_model_path
from .runtime_weights import Named
from .tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """Everything a model source provides; `named_weights` go to runtime_weights.build_weights."""

    config: ModelConfig
    named_weights: Named
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    model_id: str
    source_path: Path


def load_model(path: str | Path | None = None) -> LoadedModel:
    """None: the embedded SmolLM2-135M-Instruct; a .gguf file; or a directory with config.json."""
    # The format modules import this one for LoadedModel, so they are imported here, when used.
    from .gguf_loader import load_gguf
    from .hf_loader import load_hf

    if path is None:
        return load_gguf(default_model_path(), DEFAULT_MODEL_ID)
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
                   chat_template_path: str | Path | None = None) -> LoadedModel:
    """Apply the config's model.served_name / model.tokenizer / model.chat_template to a loaded model."""
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
