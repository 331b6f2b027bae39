"""`edged bench decode --peer gpt-fast`: gpt-fast's int8 weight-only decode at edged's random-weight shapes.

gpt-fast (github.com/pytorch-labs/gpt-fast, BSD-3-Clause) is not part of this repository. Its `model.py`
and `quantize.py` are loaded from the directory given with `--gpt-fast-dir` (default: $EDGED_GPT_FAST_DIR),
under private module names, so that nothing is added to sys.path for good and no top-level `model` module
is left behind. quantize.py imports gpt-fast's tokenizer (sentencepiece, tiktoken) for GPTQ only: a stub
stands in for it while the file loads, so the two files are all that is needed.

What is timed is generate.py's decode path, built the way generate.py builds it: the Transformer in
bfloat16, its nn.Linear layers swapped for WeightOnlyInt8Linear by WeightOnlyInt8QuantHandler
(create_quantized_state_dict + convert_for_runtime, per-channel symmetric int8, the LM head included),
a static KV cache from setup_caches(batch, CONTEXT + steps + 16), and decode_one_token under
torch.compile(mode="reduce-overhead", fullgraph=True) (inductor, CUDA graphs) with generate.py's inductor
settings and its math-only SDPA (inductor generates the attention). Weights are random (normal, std 0.02).
Decoding starts at input_pos = CONTEXT: the cache's contents do not change the step's cost, and gpt-fast's
attention reads the whole static cache under a mask whatever the position. The next token is the argmax,
as in edged's timed step (generate.py samples top-k; that is left out on both sides).
"""
from __future__ import annotations

import gc
import importlib.util
import sys
import time
import types
from pathlib import Path

import torch

from edged.bench.decode import CONTEXT
from edged.models.config import MODEL_SHAPES, ModelConfig

TITLE = "gpt-fast int8 weight-only, torch.compile reduce-overhead"
# generate.py's module-level settings, applied here only around the peer's compile and timing.
INDUCTOR_CONFIG = {"coordinate_descent_tuning": True, "triton.unique_kernel_names": True, "fx_graph_cache": True}
FUNCTORCH_CONFIG = {"enable_autograd_cache": True}
WARMUP = 5  # calls before timing: dynamo + inductor compile, CUDA-graph warm-up run, then recording
_LOADED: dict[str, tuple[types.ModuleType, types.ModuleType]] = {}


def model_args_kwargs(cfg: ModelConfig, max_seq_length: int) -> dict:
    """gpt-fast ModelArgs(**this) for an edged shape. ValueError for what gpt-fast's model cannot express."""
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        raise ValueError(f"head_dim {cfg.head_dim} x {cfg.num_heads} heads != hidden size {cfg.hidden_size}: "
                         "gpt-fast derives head_dim = dim // n_head")
    if cfg.attention_bias:
        raise ValueError("gpt-fast's attention has no q/k/v bias")
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in (None, "default", "llama3"):
        raise ValueError(f"gpt-fast supports llama3 rope scaling only, not {kind!r}")
    rope_scaling = None
    if kind == "llama3":
        rope_scaling = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings")}
    return {"block_size": max_seq_length, "vocab_size": cfg.vocab_size, "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads, "n_local_heads": cfg.num_kv_heads, "dim": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "head_dim": cfg.head_dim, "rope_base": cfg.rope_theta,
            "norm_eps": cfg.rms_norm_eps, "rope_scaling": rope_scaling}


def load_gpt_fast(gpt_fast_dir: str | Path) -> tuple[types.ModuleType, types.ModuleType]:
    """(model, quantize): gpt-fast's two files from gpt_fast_dir, loaded once per directory.
    FileNotFoundError when either is missing."""
    root = Path(gpt_fast_dir).expanduser().resolve()
    key = str(root)
    if key in _LOADED:
        return _LOADED[key]
    missing = [f for f in ("model.py", "quantize.py") if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{root} has no {' or '.join(missing)} (a gpt-fast checkout: "
                                "github.com/pytorch-labs/gpt-fast)")
    tag = f"_edged_gpt_fast_{len(_LOADED)}"

    def load(name: str) -> types.ModuleType:
        spec = importlib.util.spec_from_file_location(f"{tag}.{name}", root / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and pickling look a class's module up here
        spec.loader.exec_module(module)
        return module

    tokenizer = types.ModuleType("tokenizer")

    def get_tokenizer(*_args, **_kwargs):
        raise RuntimeError("gpt-fast's tokenizer is not loaded by edged's bench peer")

    tokenizer.get_tokenizer = get_tokenizer
    # quantize.py says `from tokenizer import get_tokenizer` and `from model import Transformer`: those
    # two names point at the stub and at the model just loaded while it runs, and at what they were after.
    saved = {name: sys.modules.get(name) for name in ("model", "tokenizer")}
    try:
        model = load("model")
        sys.modules["model"], sys.modules["tokenizer"] = model, tokenizer
        quantize = load("quantize")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    _LOADED[key] = (model, quantize)
    return model, quantize


def build_int8_model(gf_model: types.ModuleType, gf_quantize: types.ModuleType, args, device: str,
                     dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    """gpt-fast's Transformer with random weights (norms 1, the rest normal(0, 0.02)), quantized by its
    WeightOnlyInt8QuantHandler as quantize.py + generate.py's _load_model do, in eval mode."""
    with torch.device("meta"):
        model = gf_model.Transformer(args).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    handler = gf_quantize.WeightOnlyInt8QuantHandler(model)
    state = handler.create_quantized_state_dict()
    with torch.device("meta"):  # the int8 modules' placeholder buffers: replaced by the state dict's
        model = handler.convert_for_runtime()
    model.load_state_dict(state, assign=True)
    del state
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def decode_one_token(model: torch.nn.Module, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """generate.py's decode_one_token with greedy selection instead of top-k sampling."""
    logits = model(x, input_pos)
    return logits[:, -1].argmax(dim=-1, keepdim=True).to(torch.int)


def _patched(module, changes: dict):
    """module.config.patch(changes), leaving out settings this torch no longer has."""
    known = {}
    for name, value in changes.items():
        obj, *path = module, *name.split(".")
        try:
            for part in path:
                obj = getattr(obj, part)
        except AttributeError:
            continue
        known[name] = value
    return module.patch(known)


def gpt_fast_tok_s(shape_name: str, steps: int, gpt_fast_dir: str | None, batch: int = 1, *,
                   compile: bool = True, device: str = "cuda", cfg: ModelConfig | None = None,
                   warmup: int = WARMUP) -> float | None:
    """gpt-fast's int8 weight-only decode tokens/s at an edged shape (MODEL_SHAPES[shape_name], or cfg),
    `batch` sequences at CONTEXT tokens, `steps` steps timed. None, with one line printed saying why, when
    gpt-fast cannot be loaded or the model cannot be built, compiled or run. compile=False runs it eagerly
    (what a CPU check can do)."""
    label = f"edged bench decode --peer gpt-fast ({shape_name})"
    if not gpt_fast_dir:
        print(f"{label}: no gpt-fast directory (--gpt-fast-dir DIR or EDGED_GPT_FAST_DIR)", flush=True)
        return None
    model = step = None
    try:
        gf_model, gf_quantize = load_gpt_fast(gpt_fast_dir)
        cfg = cfg or MODEL_SHAPES[shape_name]
        max_seq = CONTEXT + steps + 16
        args = gf_model.ModelArgs(**model_args_kwargs(cfg, max_seq))
        cuda = torch.device(device).type == "cuda"

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        from torch.nn.attention import SDPBackend, sdpa_kernel

        with (_patched(torch._inductor.config, INDUCTOR_CONFIG),
              _patched(torch._functorch.config, FUNCTORCH_CONFIG),
              torch.no_grad(),
              sdpa_kernel(SDPBackend.MATH)):  # generate.py: "better for Inductor to codegen attention here"
            model = build_int8_model(gf_model, gf_quantize, args, device)
            with torch.device(device):
                model.setup_caches(max_batch_size=batch, max_seq_length=max_seq)
            step = (torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True) if compile
                    else decode_one_token)
            tokens = torch.randint(0, cfg.vocab_size, (batch, 1), dtype=torch.int, device=device)
            input_pos = torch.tensor([CONTEXT], dtype=torch.int, device=device)  # as generate.py's decode
            for _ in range(warmup):
                tokens = step(model, tokens, input_pos).clone()  # a CUDA-graph output is overwritten by the next replay
                input_pos += 1
            sync()
            input_pos.fill_(CONTEXT)
            t0 = time.perf_counter()
            for _ in range(steps):
                tokens = step(model, tokens, input_pos).clone()
                input_pos += 1
            sync()
            seconds = time.perf_counter() - t0
        return batch * steps / seconds
    except Exception as e:  # noqa: BLE001 -- a peer must not take the bench down with it
        print(f"{label}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
              flush=True)
        return None
    finally:
        del model, step
        if compile:
            torch._dynamo.reset()  # the compiled step holds the model and its CUDA-graph pool
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
