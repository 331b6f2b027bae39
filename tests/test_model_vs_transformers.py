"""The loaded models compute what transformers computes from the same files.

Acceptance: greedy decoding of the embedded SmolLM2 GGUF with edged's LlamaModel (float32, CPU kernels,
paged KV cache) equals transformers' greedy `generate` token for token.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.gguf import llama_cpp_permute
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize as gguf_quantize

from edged.kernels import LinearWeight, dequantize
from edged.models.batch import AttentionMetadata, KVCache
from edged.models.config import ModelConfig
from edged.models.llama import LlamaModel
from edged.models.loader import LoadedModel, load_model
from edged.models.runtime_weights import build_weights, random_named_weights

transformers = pytest.importorskip("transformers")

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You are a helpful coding assistant."},
     {"role": "user", "content": "How do I reverse a list in Python?"}],
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path, hf_gguf_model):
    return hf_gguf_model(gguf_path, torch.float32)


@pytest.fixture(scope="module")
def edged_model(loaded_model: LoadedModel) -> LlamaModel:
    return edged_dense(loaded_model)


def greedy(model: LlamaModel, prompt: list[int], max_new: int, eos: set[int], block_size: int = 16) -> list[int]:
    """Prefill, then one token per step, through a paged cache whose block table is deliberately not 0..n."""
    cfg = model.config
    blocks = -(-(len(prompt) + max_new) // block_size)
    kv = KVCache.allocate(cfg.num_layers, blocks, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    table = torch.arange(blocks - 1, -1, -1, dtype=torch.int32)[None]
    tokens, positions, out = torch.tensor(prompt), torch.arange(len(prompt)), []
    while len(out) < max_new:
        context = int(positions[-1]) + 1
        slots = table[0, positions // block_size].long() * block_size + positions % block_size
        meta = AttentionMetadata(is_decode=bool(out), slot_mapping=slots, block_tables=table,
                                 context_lens=torch.tensor([context], dtype=torch.int32),
                                 cu_seqlens_q=torch.tensor([0, len(tokens)], dtype=torch.int32))
        hidden = model.forward(tokens, positions, meta, kv)
        token = int(model.logits(hidden[-1:]).argmax(dim=-1))
        out.append(token)
        if token in eos:
            break
        tokens, positions = torch.tensor([token]), torch.tensor([context])
    return out


def prefill_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    cfg, n = model.config, len(ids)
    kv = KVCache.allocate(cfg.num_layers, 1, n, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    meta = AttentionMetadata(False, torch.arange(n), torch.zeros(1, 1, dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32))
    return model.logits(model.forward(torch.tensor(ids), torch.arange(n), meta, kv))


def edged_dense(loaded: LoadedModel) -> LlamaModel:
    """float32, every weight dequantized: the CPU path, compared with transformers' float32 model."""
    return LlamaModel(loaded.config, build_weights(loaded.named_weights, loaded.config, quant="none"), 512)


# --- the embedded SmolLM2 GGUF ---------------------------------------------------------------------

def test_weights_equal_transformers(loaded_model: LoadedModel, hf_model) -> None:
    """transformers dequantizes the GGUF to float32 and un-permutes q/k: every tensor must agree exactly."""
    state = hf_model.state_dict()
    for name, w in loaded_model.named_weights.items():
        dense = dequantize(w) if isinstance(w, LinearWeight) else w
        assert torch.equal(dense, state[name]), name
    q = dequantize(loaded_model.named_weights["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(q, hf_model.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("messages", PROMPTS, ids=["france", "poem", "system"])
def test_greedy_decoding_matches_transformers(loaded_model: LoadedModel, edged_model: LlamaModel, hf_model,
                                              messages: list[dict]) -> None:
    prompt = loaded_model.tokenizer.encode(loaded_model.chat_template.render(messages))
    eos = set(np.atleast_1d(hf_model.generation_config.eos_token_id).tolist())
    with torch.inference_mode():
        want = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
    got = greedy(edged_model, prompt, NEW_TOKENS, eos)
    assert got == want
    if messages is PROMPTS[0]:
        assert "Paris" in loaded_model.tokenizer.decode(got)


# --- tiny Hugging Face directories (llama with llama3 rope scaling; qwen2 with q/k/v bias) ----------

@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_hf_directory_logits_match_transformers(tiny_hf_dir, model_type: str) -> None:
    root = tiny_hf_dir(model_type)
    loaded = load_model(root)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    ids = torch.randint(3, loaded.config.vocab_size, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(edged_dense(loaded), ids), want, atol=1e-4, rtol=1e-4)


# --- a tiny GGUF: SentencePiece vocabulary, Q4_0 matrices, permuted q/k ------------------------------

SP_PIECES = ["\u2581", *"etaohnsrldwicumfgypbvkxjqzTHWIA,.!?'123",
             "\u2581t", "he", "\u2581the", "in", "er", "\u2581a", "or", "on", "ll", "\u2581w", "\u2581h", "\u2581s",
             "an", "en", "ld", "\u2581wor", "\u2581world", "\u2581he", "llo", "\u2581hello", "ing", "\u2581T",
             "\u2581The", "\u2581is", "is", "re", "at", "it", "\u2581it"]
_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_GGUF_LAYER['.'.join(module)]}.{kind}"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What convert_hf_to_gguf + llama-quantize would write for a tiny Llama with a SentencePiece vocab."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SP_PIECES]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SP_PIECES)
    scores = [0.0] * 259 + [-float(i) for i in range(len(SP_PIECES))]
    Q4_0 = GGMLQuantizationType.Q4_0
    cfg = ModelConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, rms_norm_eps=1e-6)
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-sp.gguf"
    w = GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(256)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    for name, t in random_named_weights(cfg, seed=5, std=0.1).items():
        a = t.numpy()
        if ".q_proj." in name:
            a = llama_cpp_permute(a, cfg.num_heads, cfg.num_heads)
        elif ".k_proj." in name:
            a = llama_cpp_permute(a, cfg.num_heads, cfg.num_kv_heads)
        if a.ndim == 2 and "embed" not in name:
            w.add_tensor(_gguf_name(name), gguf_quantize(a, Q4_0), raw_dtype=Q4_0)
        else:
            w.add_tensor(_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_sentencepiece_gguf_tokenizer_matches_transformers(tiny_gguf: Path) -> None:
    tok = load_model(tiny_gguf).tokenizer
    hf = transformers.AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    for text in ["hello world", "The world is it", "Hello, World!\nxyz", "héllo 😀 zq", "hello\n\nthe  it"]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), repr(text)
        assert tok.encode(text, add_special_tokens=True) == hf.encode(text), repr(text)
        assert tok.decode(tok.encode(text)) == text
    # llama.cpp prefixes a space to every text fragment, also one that already starts with a space
    # (transformers' GGUF conversion does not); the round trip keeps the text.
    assert tok.encode(" hello") == [tok.token_to_id("\u2581"), tok.token_to_id("\u2581hello")]
    assert tok.decode(tok.encode(" hello")) == " hello"


def test_q4_0_gguf_logits_match_transformers(tiny_gguf: Path) -> None:
    loaded = load_model(tiny_gguf)
    assert loaded.named_weights["model.layers.0.self_attn.k_proj.weight"].format == "w4"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                                           dtype=torch.float32).eval()
    assert torch.equal(dequantize(loaded.named_weights["model.layers.1.self_attn.k_proj.weight"]),
                       hf.model.layers[1].self_attn.k_proj.weight)
    ids = loaded.tokenizer.encode("The world is hello, it is the world!", add_special_tokens=True)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(edged_dense(loaded), ids), want, atol=1e-4, rtol=1e-4)
