"""`edged bench decode --peer gpt-fast` (edged/bench/gpt_fast_peer.py), what can be checked without a GPU:
the mapping of edged's shapes onto gpt-fast's ModelArgs (against gpt-fast's own files, from .peer/gpt-fast or
$EDGED_GPT_FAST_DIR, skipped without them: gpt-fast is not shipped with edged), the failure paths, the table."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from edged.bench.decode import CONTEXT, DecodeResult, format_peers
from edged.bench.gpt_fast_peer import gpt_fast_tok_s, load_gpt_fast, model_args_kwargs
from edged.cli import build_parser
from edged.models.config import MODEL_SHAPES

GPT_FAST_DIR = Path(os.environ.get("EDGED_GPT_FAST_DIR") or Path(__file__).resolve().parents[1] / ".peer" / "gpt-fast")
needs_gpt_fast = pytest.mark.skipif(
    not (GPT_FAST_DIR / "model.py").is_file() or not (GPT_FAST_DIR / "quantize.py").is_file(),
    reason=f"no gpt-fast model.py + quantize.py in {GPT_FAST_DIR} (copy them from github.com/pytorch-labs/gpt-fast "
           "or set EDGED_GPT_FAST_DIR)")


@needs_gpt_fast
@pytest.mark.parametrize("name", list(MODEL_SHAPES))
def test_gpt_fast_model_args_match_edged_shape(name: str) -> None:
    gf_model, _ = load_gpt_fast(GPT_FAST_DIR)
    cfg = MODEL_SHAPES[name]
    max_seq = CONTEXT + 64 + 16
    args = gf_model.ModelArgs(**model_args_kwargs(cfg, max_seq))
    assert (args.dim, args.n_layer, args.n_head, args.n_local_heads) == \
        (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
    assert (args.intermediate_size, args.vocab_size) == (cfg.intermediate_size, cfg.vocab_size)
    assert args.head_dim == cfg.head_dim  # gpt-fast's __post_init__ recomputes it as dim // n_head
    assert (args.rope_base, args.norm_eps) == (cfg.rope_theta, cfg.rms_norm_eps)
    assert args.block_size >= max_seq
    if cfg.rope_scaling:
        assert args.rope_scaling == {k: v for k, v in cfg.rope_scaling.items() if k != "rope_type"}
    else:
        assert args.rope_scaling is None

    # gpt-fast's Transformer at that shape (on the meta device: no memory) has edged's weight shapes
    with torch.device("meta"):
        model = gf_model.Transformer(args)
    attn, ffn = model.layers[0].attention, model.layers[0].feed_forward
    assert tuple(attn.wqkv.weight.shape) == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
    assert tuple(attn.wo.weight.shape) == (cfg.hidden_size, cfg.q_size)
    assert tuple(ffn.w1.weight.shape) == tuple(ffn.w3.weight.shape) == (cfg.intermediate_size, cfg.hidden_size)
    assert tuple(ffn.w2.weight.shape) == (cfg.hidden_size, cfg.intermediate_size)
    assert tuple(model.output.weight.shape) == (cfg.vocab_size, cfg.hidden_size)
    assert len(model.layers) == cfg.num_layers


def test_model_args_refuse_what_gpt_fast_cannot_express() -> None:
    cfg = MODEL_SHAPES["smollm2-135m"]
    with pytest.raises(ValueError, match="head_dim"):
        model_args_kwargs(cfg.with_changes(head_dim=128), 600)
    with pytest.raises(ValueError, match="bias"):
        model_args_kwargs(cfg.with_changes(attention_bias=True), 600)
    with pytest.raises(ValueError, match="rope scaling"):
        model_args_kwargs(cfg.with_changes(rope_scaling={"rope_type": "yarn", "factor": 4.0}), 600)


def test_gpt_fast_peer_returns_none_with_a_missing_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert gpt_fast_tok_s("smollm2-135m", 4, str(tmp_path / "missing")) is None
    out = capsys.readouterr().out
    assert "--peer gpt-fast" in out and "model.py" in out and len(out.strip().splitlines()) == 1
    assert gpt_fast_tok_s("smollm2-135m", 4, None) is None
    assert "EDGED_GPT_FAST_DIR" in capsys.readouterr().out


def test_bench_decode_takes_the_gpt_fast_peer_and_its_dir() -> None:
    args = build_parser().parse_args(["bench", "decode", "--peer", "gpt-fast", "--gpt-fast-dir", "/x/gpt-fast"])
    assert (args.peer, args.gpt_fast_dir) == ("gpt-fast", "/x/gpt-fast")
    args = build_parser().parse_args(["bench", "decode", "--peer"])
    assert (args.peer, args.gpt_fast_dir) == ("transformers", None)


def test_gpt_fast_peer_table_puts_edged_batch_1_beside_it() -> None:
    results = [DecodeResult("smollm2-135m", q, 1, tok_s, 1.0, 0.1, 1e4) for q, tok_s in
               [("none", 900.0), ("w8", 1200.0)]]
    text = format_peers({("smollm2-135m", 1): 1000.0, ("llama-3-8b", 1): None}, "gpt-fast", results)
    lines = text.splitlines()
    assert lines[0].startswith("peer: gpt-fast int8 weight-only, torch.compile reduce-overhead")
    assert lines[1].split() == ["shape", "batch", "peer", "tok/s", "edged", "none", "edged", "w8", "edged", "w8/peer"]
    assert lines[2].split() == ["smollm2-135m", "1", "1,000", "900", "1,200", "1.20x"]
    assert lines[3].split() == ["llama-3-8b", "1", "failed", "-", "-", "-"]
