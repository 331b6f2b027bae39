"""`edged bench accuracy`: teacher-forced top-1 agreement of edged's logits with a float32 reference.

A fixed English text (well over 500 tokens) is fed through the model with the true tokens as input
(teacher forcing): most positions in prefill chunks over a growing cached prefix, the last ones as
single-token decode steps, so both attention paths and both linear paths (GEMM and GEMV) are measured.
At every position the argmax of the logits is compared with the argmax of the float32 reference (the
same weights dequantized, reference kernels, float32 throughout). One row per dtype and weight format.
"""
from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from edged.kernels import LinearWeight, dequantize
from edged.models.batch import AttentionMetadata, KVCache
from edged.models.llama import LlamaModel
from edged.models.loader import LoadedModel, load_model
from edged.models.runtime_weights import build_weights

TEXT = (
    "The history of the lighthouse is a history of fire, glass and patience. Long before electric lamps, "
    "keepers climbed narrow stairs every evening to trim wicks, polish brass and wind the clockwork that "
    "turned the lens. A good keeper knew the weather by the colour of the sky at dusk and by the sound of the "
    "sea against the rocks below. When fog rolled in, the light alone was not enough, so bells were rung and "
    "later horns were sounded at fixed intervals, each station with its own pattern so that a captain could "
    "tell where he was without seeing the shore. The lenses themselves were marvels of engineering. Augustin "
    "Fresnel, a French physicist, showed in the eighteen twenties that a lens could be built from rings of "
    "prisms instead of one thick piece of glass. His design bent the light of a small flame into a narrow beam "
    "that could be seen more than twenty miles away, and it used far less glass than a solid lens would have "
    "needed. Within a few decades nearly every major coast in Europe and North America was lit by Fresnel "
    "lenses, and shipwrecks along dangerous shores became much less common. Life at a remote station was "
    "lonely and hard. Supplies arrived by boat once a month if the weather allowed, and storms could cut a "
    "family off for weeks. Children learned their lessons from books sent by mail, and keepers kept careful "
    "logs of every ship that passed, every change in the wind and every hour the lamp was burning. Many of "
    "those logs survive today and give historians a detailed record of weather and shipping over more than a "
    "century. Today most lighthouses are automatic. Solar panels charge batteries during the day, sensors "
    "switch the lamps on at night, and satellite navigation has made the old beams less important than they "
    "once were. Yet many towns have restored their towers as museums, and visitors still climb the winding "
    "stairs to look out over the water. Standing at the top, with the wind pulling at your coat and the waves "
    "breaking far below, it is easy to imagine the keeper on a winter night, watching the beam sweep across "
    "the dark sea and hoping that every ship out there would find its way safely home. In the kitchen below, "
    "a kettle would be singing on the stove, and the keeper's notebook would lie open on the table, waiting "
    "for the next entry: the time, the wind, the state of the sea, and a few words about the night. Some "
    "keepers wrote poems in the margins, others drew the birds that rested on the gallery rail during "
    "migration, and a few recorded the names of every vessel they had ever seen, thousands of them, in neat "
    "columns that filled book after book. Those pages remind us that safety at sea was once the work of "
    "ordinary people who chose to stay awake so that others could sleep."
)


@dataclass(frozen=True)
class Variant:
    """One row of the table: activation dtype, weight format (`model.quant`) and KV cache dtype."""

    dtype: torch.dtype
    quant: str  # auto (the daemon's default: GGUF Q4 kept as stored) | none | w8 (Q8_0 kept, the rest
    # requantized) | w4 (all requantized)
    kv_cache: str = "auto"  # auto | int8

    @property
    def label(self) -> str:
        kv = " int8-kv" if self.kv_cache == "int8" else ""
        return f"{str(self.dtype).removeprefix('torch.')} {self.quant}{kv}"


@dataclass
class Agreement:
    label: str
    positions: int
    top1: float  # fraction of positions whose argmax equals the float32 reference's


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """Force the plain-torch oracle for the ops run inside (kernels.backend_for reads it per call)."""
    old = os.environ.get("EDGED_KERNELS")
    os.environ["EDGED_KERNELS"] = "reference"
    try:
        yield
    finally:
        if old is None:
            del os.environ["EDGED_KERNELS"]
        else:
            os.environ["EDGED_KERNELS"] = old


def text_ids(loaded: LoadedModel, min_tokens: int = 520) -> list[int]:
    ids = loaded.tokenizer.encode(TEXT)
    if len(ids) < min_tokens:
        raise ValueError(f"the accuracy text is {len(ids)} tokens with this tokenizer, fewer than {min_tokens}")
    return ids


def build_variant(loaded: LoadedModel, variant: Variant, device: torch.device | str) -> LlamaModel:
    named = loaded.named_weights
    if variant.quant == "w4":  # requantize GGUF Q4 tensors too (group 64, the config's default)
        named = {k: dequantize(v) if isinstance(v, LinearWeight) else v for k, v in named.items()}
    weights = build_weights(named, loaded.config, variant.quant, variant.dtype, device, 64)
    return LlamaModel(loaded.config, weights, len(text_ids(loaded)) + 16)


@torch.inference_mode()
def teacher_forced_logits(model: LlamaModel, ids: list[int], int8_kv: bool = False, chunk: int = 128,
                          decode_tail: int = 48) -> torch.Tensor:
    """float32 logits [len(ids), vocab] at every position: prefill chunks, then one token a step."""
    cfg, n, block = model.config, len(ids), 16
    blocks = -(-n // block)
    kv = KVCache.allocate(cfg.num_layers, blocks, block, cfg.num_kv_heads, cfg.head_dim, model.dtype,
                          model.device, int8_kv)
    # a block table that is not 0..n, as a paged cache hands them out
    table = torch.arange(blocks - 1, -1, -1, dtype=torch.int32, device=model.device)[None]
    tokens = torch.tensor(ids, device=model.device)
    bounds = list(range(0, n - decode_tail, chunk)) + list(range(n - decode_tail, n + 1))
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        pos = torch.arange(lo, hi, device=model.device)
        slots = table[0, pos // block].long() * block + pos % block
        meta = AttentionMetadata(is_decode=hi - lo == 1 and lo >= n - decode_tail, slot_mapping=slots,
                                 block_tables=table,
                                 context_lens=torch.tensor([hi], dtype=torch.int32, device=model.device),
                                 cu_seqlens_q=torch.tensor([0, hi - lo], dtype=torch.int32, device=model.device))
        out.append(model.logits(model.forward(tokens[lo:hi], pos, meta, kv)))
    return torch.cat(out)


def reference_top1(loaded: LoadedModel, ids: list[int], device: torch.device | str) -> torch.Tensor:
    """The float32 oracle's argmax at every position."""
    with reference_kernels():
        model = build_variant(loaded, Variant(torch.float32, "none"), device)
        return teacher_forced_logits(model, ids).argmax(dim=-1).cpu()


def agreement(loaded: LoadedModel, variant: Variant, ids: list[int], ref_top1: torch.Tensor,
              device: torch.device | str) -> Agreement:
    model = build_variant(loaded, variant, device)
    top1 = teacher_forced_logits(model, ids, variant.kv_cache == "int8").argmax(dim=-1).cpu()
    return Agreement(variant.label, len(ids), float((top1 == ref_top1).float().mean()))


def transformers_agreement(loaded: LoadedModel, ids: list[int], ref_top1: torch.Tensor, dtype: torch.dtype,
                           device: torch.device | str, hf: object | None = None) -> Agreement:
    """Hugging Face transformers on the same GGUF (needs `transformers`): the yardstick for a dtype.
    `hf`: that model already loaded in `dtype` on `device` (a GGUF load takes seconds)."""
    if hf is None:
        import transformers

        path = loaded.source_path
        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        hf = hf.to(device).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([ids], device=device)).logits[0]
    top1 = logits.float().argmax(dim=-1).cpu()
    label = f"transformers {str(dtype).removeprefix('torch.')}"
    return Agreement(label, len(ids), float((top1 == ref_top1).float().mean()))


DEFAULT_VARIANTS = {
    "cpu": [Variant(torch.float32, q) for q in ("auto", "none", "w8", "w4")]
    + [Variant(torch.bfloat16, q) for q in ("auto", "none")] + [Variant(torch.float32, "auto", "int8")],
    "cuda": [Variant(dt, q) for dt in (torch.bfloat16, torch.float16) for q in ("auto", "none", "w8", "w4")]
    + [Variant(torch.float32, "auto"), Variant(torch.bfloat16, "auto", "int8"), Variant(torch.bfloat16, "w8", "int8")],
}


def run_accuracy_bench(args: argparse.Namespace) -> int:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    loaded = load_model(args.model)
    ids = text_ids(loaded)
    ref = reference_top1(loaded, ids, device)
    rows = [agreement(loaded, v, ids, ref, device) for v in DEFAULT_VARIANTS[device.type]]
    if args.peer:
        rows += [transformers_agreement(loaded, ids, ref, dt, device) for dt in (torch.bfloat16, torch.float32)]
    print(f"teacher-forced top-1 agreement with float32 (reference kernels), {loaded.model_id}, "
          f"{len(ids)} positions, {device.type}")
    print(f"{'variant':<28}{'top-1':>8}")
    for r in rows:
        print(f"{r.label:<28}{100 * r.top1:>7.1f}%")
    return 0
