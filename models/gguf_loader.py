"""Load a llama-family GGUF file: ModelConfig from metadata, HF-named tensors, tokenizer, chat template.

Q4_0/Q4_1 tensors stay packed as `w4` and Q8_0 as `w8` LinearWeights (group 32, the same values, no
requantization); every other type is dequantized to float32. llama.cpp's row permutation of
attn_q/attn_k is undone, so every tensor here means exactly what the Hugging Face tensor of the same
name means.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize as gguf_dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from edged.kernels import LinearWeight, pack_w4
from edged.kernels.weights import W8_PARAM_DTYPE

from .chat_template import ChatTemplate, pick_template
from .config import ModelConfig, scaled_inv_freq
from .loader import LoadedModel, SamplingDefaults, sampling_defaults_from
from .runtime_weights import Named
from .tokenizer import Tokenizer

log = logging.getLogger("edged.models")

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# convert_hf_to_gguf permutes q/k rows for llama.cpp's interleaved rope on llama only; qwen2 is stored as is.
_PERMUTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_Q4_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}
_Q4_GROUP = 32
_Q8_0_GROUP, _Q8_0_BLOCK_BYTES = 32, 34  # float16 d, then 32 int8 q: w = q * d

_REQUIRED = object()


class PlainViewGGUFReader(GGUFReader):
    """GGUFReader slicing a plain ndarray view of its memory map: numpy.memmap's per-slice Python hooks
    made parsing the header (a 49k-token vocabulary and its merges, ~250k slices) take 2.4 s; 0.7 s so."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def load_gguf(path: str | Path, model_id: str | None = None) -> LoadedModel:
    path = Path(path)
    model_id = model_id or path.stem
    try:
        reader = PlainViewGGUFReader(path)
    except ValueError as e:  # bad magic, truncated header
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    meta = {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    tokenizer = tokenizer_from_gguf(meta)
    config = config_from_gguf(meta, tensors, tokenizer, model_id)
    named = load_tensors(tensors.values(), config, permute_qk=meta["general.architecture"] in _PERMUTED_ARCHITECTURES)
    log.info("loaded %s: %s, %d tensors", path, meta.get("general.name", path.stem), len(named))
    source = pick_template(meta.get("tokenizer.chat_template"))
    template = ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token)
    return LoadedModel(config, named, tokenizer, template, model_id, path,
                       sampling_defaults_from_gguf(meta, str(path)))


def sampling_defaults_from_gguf(meta: dict[str, Any], source: str) -> SamplingDefaults:
    """The `general.sampling.*` metadata that recent converters write (llama.cpp takes them as the
    model's defaults); most files have none."""
    return sampling_defaults_from({"temperature": meta.get("general.sampling.temp"),
                                   "top_p": meta.get("general.sampling.top_p"),
                                   "top_k": meta.get("general.sampling.top_k")}, source)


# --- config -----------------------------------------------------------------------------------------

def config_from_gguf(meta: dict[str, Any], tensors: dict[str, ReaderTensor], tokenizer: Tokenizer,
                     name: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {supported})")

    def get(key: str, default: Any = _REQUIRED) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is _REQUIRED:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("partial rotary embeddings (rope.dimension_count < head_dim) are not supported")
    return ModelConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF dims are reversed: [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(get, tensors.get("rope_freqs.weight"), head_dim),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=list(tokenizer.eos_token_ids),
        name=name,
    )


def _rope_scaling(get: Callable[..., Any], freq_factors: ReaderTensor | None, head_dim: int) -> dict | None:
    kind = get("rope.scaling.type", None)
    if freq_factors is not None:  # llama 3.x stores its rope scaling as per-frequency factors
        return _llama3_scaling(np.asarray(freq_factors.data, dtype=np.float64), float(get("rope.freq_base", 1e4)),
                               head_dim, int(get("rope.scaling.original_context_length", 8192)))
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported (supported: linear, llama3)")


def _llama3_scaling(factors: np.ndarray, theta: float, head_dim: int, original_len: int) -> dict:
    """The llama3 rope_scaling dict whose factors (inv_freq / scaled inv_freq) are the ones in the file.

    convert_hf_to_gguf only writes the factors; Meta's low/high frequency factors are always 1 and 4,
    and the result is checked against the file so that another scheme is rejected, not misread.
    """
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": original_len}
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    expected = (inv_freq / scaled_inv_freq(inv_freq, scaling)).numpy()
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-3):
        raise ValueError("rope_freqs.weight does not match llama3 rope scaling; this rope scheme is not supported")
    return scaling


# --- tensors ----------------------------------------------------------------------------------------

def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def load_tensors(tensors: Iterable[ReaderTensor], config: ModelConfig, permute_qk: bool) -> Named:
    named: Named = {}
    for t in tensors:
        hf_name = hf_tensor_name(t.name)
        if hf_name is None:
            log.debug("GGUF tensor %s is not used", t.name)
            continue
        value = read_tensor(t)
        if permute_qk and ".attn_q." in t.name:
            value = unpermute_rows(value, config.num_heads)
        elif permute_qk and ".attn_k." in t.name:
            value = unpermute_rows(value, config.num_kv_heads)
        named[hf_name] = value
    return named


def read_tensor(t: ReaderTensor) -> torch.Tensor | LinearWeight:
    """One tensor in HF orientation ([out, in] for matrices): w4 for Q4_0/Q4_1, w8 for Q8_0, float32 otherwise."""
    shape = [int(n) for n in reversed(t.shape)]  # GGUF lists ne0 (the contiguous dim) first
    if t.tensor_type in _Q4_BLOCK_BYTES and len(shape) == 2:
        return q4_to_w4(np.asarray(t.data), t.tensor_type, *shape)
    if t.tensor_type == GGMLQuantizationType.Q8_0 and len(shape) == 2:
        return q8_0_to_w8(np.asarray(t.data), *shape)
    try:
        values = gguf_dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {t.name} has unsupported type {t.tensor_type.name}") from e
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a copy, off the memory map


def q4_to_w4(raw: np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int) -> LinearWeight:
    """GGUF Q4_0/Q4_1 blocks as a w4 LinearWeight holding the same values (w = q * d + m).

    In a GGUF block of 32, byte j holds element j in its low nibble and element j + 16 in its high
    nibble; pack_w4 wants element 2j low and 2j + 1 high, so the nibbles are unpacked and repacked.
    """
    blocks = raw.reshape(rows, cols // _Q4_GROUP, _Q4_BLOCK_BYTES[qtype])

    def half(lo: int) -> np.ndarray:
        return np.ascontiguousarray(blocks[..., lo:lo + 2]).view(np.float16)[..., 0].astype(np.float32)

    scale = half(0)
    if qtype == GGMLQuantizationType.Q4_1:
        minimum, qs = half(2), blocks[..., 4:]
    else:
        minimum, qs = -8.0 * scale, blocks[..., 2:]  # Q4_0: w = (q - 8) * d
    q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(rows, cols)
    return pack_w4(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(minimum), _Q4_GROUP)


def q8_0_to_w8(raw: np.ndarray, rows: int, cols: int) -> LinearWeight:
    """GGUF Q8_0 blocks as a symmetric w8 LinearWeight holding the same values: q + 128 in uint8,
    scale = d and no minimum, so (q - 128) * scale = q_gguf * d."""
    blocks = raw.reshape(rows, cols // _Q8_0_GROUP, _Q8_0_BLOCK_BYTES)
    d = torch.from_numpy(np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].copy())
    q = torch.from_numpy((np.ascontiguousarray(blocks[..., 2:]) ^ 0x80).reshape(rows, cols))  # int8 + 128
    return LinearWeight("w8", q, d.to(W8_PARAM_DTYPE), None, _Q8_0_GROUP)


def unpermute_rows(value: torch.Tensor | LinearWeight, n_head: int) -> torch.Tensor | LinearWeight:
    """Inverse of convert_hf_to_gguf's `permute` (rows of each head: halves interleaved -> halves)."""
    if isinstance(value, LinearWeight):
        data, scale, minimum, bias = (None if p is None else _unpermute(p, n_head)
                                      for p in (value.data, value.scale, value.minimum, value.bias))
        return LinearWeight(value.format, data, scale, minimum, value.group_size, bias)
    return _unpermute(value, n_head)


def _unpermute(t: torch.Tensor, n_head: int) -> torch.Tensor:
    rows = t.shape[0]
    return t.reshape(n_head, rows // n_head // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


# --- tokenizer --------------------------------------------------------------------------------------

# Pre-tokenizer split regexes by tokenizer.ggml.pre, as llama.cpp's llama-vocab.cpp applies them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
_SPLIT_REGEX = {
    **dict.fromkeys((*_LLAMA3_NAMES, "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
_IGNORE_MERGES = (*_LLAMA3_NAMES, "tekken")  # a word that is in the vocabulary is one token, whatever the merges say
# Digits one by one, then the GPT-2 split (llama.cpp's STARCODER/SMOLLM group).
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2 = ("gpt-2", "gpt2", "phi-2", "roberta-bpe", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "jina-v2-code")
# Token texts that end generation whatever the file's eos id says (llama.cpp's end-of-generation list).
_EOG_TEXTS = frozenset(("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                        "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>"))
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        backend = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores"),
                                     meta.get("tokenizer.ggml.unknown_token_id"),
                                     bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(tokens, types, strict=False) if ty == _CONTROL])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types, strict=False) if ty == _USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None and meta.get("tokenizer.ggml.add_bos_token", kind == "llama"):
        backend.post_processor = processors.TemplateProcessing(
            single=[tokens[bos], "$A"], pair=[tokens[bos], "$A", "$B"], special_tokens=[(tokens[bos], bos)])
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos += [i for i, t in enumerate(tokens) if t in _EOG_TEXTS]
    return Tokenizer(backend, bos, [i for i in eos if i is not None])


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> Backend:
    if not merges:
        raise ValueError("GGUF byte-level BPE tokenizer has no merges (tokenizer.ggml.merges)")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(models.BPE(vocab, pairs, ignore_merges=pre in _IGNORE_MERGES))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # its regex is GPT-2's
    if pre in _SPLIT_REGEX:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        if pre not in _GPT2:
            log.warning("GGUF pre-tokenizer %r is not known; splitting text the GPT-2 way", pre)
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], scores: list[float] | None, unk_id: int | None,
                       add_space_prefix: bool) -> Backend:
    """SentencePiece BPE with byte fallback; merges recovered from the vocabulary, best score first.

    A space is prefixed to every text fragment (also after special tokens), as llama.cpp does."""
    vocab = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, scores, strict=True)) if scores else {t: -float(i) for t, i in vocab.items()}
    merges = [(piece[:k], piece[k:], score[piece]) for piece in vocab for k in range(1, len(piece))
              if piece[:k] in vocab and piece[k:] in vocab]
    merges.sort(key=lambda m: (-m[2], vocab[m[0]], vocab[m[1]]))
    unk = tokens[unk_id] if unk_id is not None else None
    pairs = [(a, b) for a, b, _ in merges]
    backend = Backend(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])
    return backend
