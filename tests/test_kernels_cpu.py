"""The fast CPU kernels (kernels/cpu.py) against the plain-torch oracle (kernels/reference.py).

Each op on small shapes in float32 (tight tolerances: both compute in fp32, in a different order)
and in bfloat16, both with the C kernels of kernels/cpu_native.py and with the torch calls that
replace them where no C compiler is; then the embedded model end to end: the engine's greedy text on
the fast path equals the oracle's for 32 tokens on 3 chat prompts run together.
"""
from __future__ import annotations

import os

import pytest
import torch

from edged.kernels import (LinearWeight, concat_out, cpu, cpu_native, dequantize, natural_order, pack_w4, quantize_w4,
                           quantize_w8, reference, to_mma_order)
from edged.models.batch import KVCache
from edged.models.loader import LoadedModel
from edged.models.runtime_weights import build_weights
from edged.models.llama import LlamaModel, LlamaWeights, LayerWeights

from helpers.tiny_engine import request, run_to_completion

F32, BF16 = torch.float32, torch.bfloat16


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """Max error within rel of the largest magnitude of the oracle's result."""
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * want.float().abs().max().item(), (err, want.abs().max().item())


# --- linear ------------------------------------------------------------------------------------------

def q4_1_with_large_offsets(n: int, k: int, seed: int = 0) -> LinearWeight:
    """Q4_1-shaped groups whose minimums are ~100x their step: bf16 would lose the offset."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=g) * 0.002 + 0.001
    m = torch.randn(n, k // 32, generator=g).sign() * (0.15 + 0.05 * torch.rand(n, k // 32, generator=g))
    return pack_w4(q, d, m, 32)


# float32 against float32 in another summation order (groups, SIMD lanes): ~1e-6 of the largest output
# (2.3e-6 seen on an unseeded input); a wrong scale, group or nibble is off by 1e-2 or more.
FP32_ORDER = 1e-5


def weights(kind: str, n: int, k: int) -> LinearWeight:
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    if kind == "dense":
        return LinearWeight("dense", dense)
    if kind == "w8":  # symmetric, as float weights and GGUF Q8_0 load
        return quantize_w8(dense, symmetric=True)
    if kind == "w8-q4_1":  # Q4_1's large offsets requantized to w8 groups
        return quantize_w8(dequantize(q4_1_with_large_offsets(n, k)))
    if kind == "w4-q4_1":
        return q4_1_with_large_offsets(n, k)
    return quantize_w4(dense, int(kind.removeprefix("w4-g")))


KINDS = ["dense", "w8", "w8-q4_1", "w4-g32", "w4-g64", "w4-g128", "w4-q4_1"]


@pytest.fixture(params=["native", "torch"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The C kernels of cpu_native.py, and the torch calls that stand in where no C compiler is
    (for linear: torch's bfloat16 int4 kernel, w8 dequantized to float32 at prepack)."""
    if request.param == "native" and not cpu_native.available():
        pytest.skip("no C compiler for the CPU kernels")
    if request.param == "torch":
        monkeypatch.setattr(cpu_native, "available", lambda: False)
        monkeypatch.setattr(cpu, "_NATIVE", False)
    return request.param


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 5, cpu.DEQUANT_ROWS + 3])
def test_linear_matches_the_oracle(kind: str, rows: int, impl: str) -> None:
    n, k = 72, 256  # 72 rows: not a whole number of the kernels' 64-row tasks
    w = weights(kind, n, k)
    w.bias = torch.randn(n) * 0.1
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = reference.linear(x, w)
    got = cpu.linear(x, w)
    assert got.shape == want.shape and got.dtype == F32
    # fp32 end to end: summation order only. torch's bf16 int4 kernel rounds x, the scales and the result.
    close(got, want, FP32_ORDER if impl == "native" or not kind.startswith("w4") else 2e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_linear_takes_any_leading_dimensions(kind: str, impl: str) -> None:
    w = weights(kind, 72, 128)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(23))
    got = cpu.linear(x, w)
    assert got.shape == (2, 3, 72)
    close(got, reference.linear(x, w), FP32_ORDER if impl == "native" or not kind.startswith("w4") else 2e-2)


@pytest.mark.parametrize("kind", ["dense", "w8", "w4-g32"])
def test_linear_with_silu_mul_out_is_linear_then_silu_and_mul_and_refuses_what_it_cannot_be(kind: str) -> None:
    """A [gate | up] projection's silu(gate) * up; an odd number of rows or a residual add is a clear
    ValueError in every implementation, not a wrong shape."""
    w = weights(kind, 72, 128)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(29))
    got = cpu.linear(x, w, silu_mul_out=True)
    assert got.shape == (3, 36) and torch.equal(got, cpu.silu_and_mul(cpu.linear(x, w)))
    assert torch.equal(reference.linear(x, w, silu_mul_out=True), reference.silu_and_mul(reference.linear(x, w)))
    odd = weights(kind, 71, 128)
    for impl in (cpu.linear, reference.linear):
        with pytest.raises(ValueError, match="silu_mul_out"):
            impl(x, odd, silu_mul_out=True)
        with pytest.raises(ValueError, match="silu_mul_out"):
            impl(x, w, silu_mul_out=True, residual=torch.zeros(3, 72))


@pytest.mark.parametrize("kind", ["dense", "w8", "w8-q4_1", "w4-g32", "w4-q4_1"])
def test_linear_in_bfloat16_rounds_once_and_logits_come_out_in_float32(kind: str) -> None:
    w = weights(kind, 64, 128)
    if kind == "dense":
        w = w.astype(BF16)
    x = torch.randn(3, 128).to(BF16)
    want = reference.linear(x, w, out_dtype=F32)
    got = cpu.linear(x, w, out_dtype=F32)
    assert got.dtype == F32
    close(got, want, 1e-2 if kind == "dense" else 2e-6)
    assert cpu.linear(x, w).dtype == BF16
    close(cpu.linear(x, w), want, 1e-2)


@pytest.mark.parametrize("cols", [75, 50])
def test_w8_rows_that_are_one_group(cols: int, impl: str) -> None:
    """in_features not a multiple of 32: one group per row; an odd width has no native kernel (column pairs)."""
    w = quantize_w8(torch.randn(40, cols, generator=torch.Generator().manual_seed(cols)))
    assert w.group_size == cols and w.scale.shape == (40, 1)
    for rows in (3, cpu.DEQUANT_ROWS):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        close(cpu.linear(x, w), reference.linear(x, w), FP32_ORDER)
    want = "native-w8" if impl == "native" and cols % 2 == 0 else "torch-w8"
    assert w.cpu_packed.format == want


def test_prepack_keeps_the_weight_readable_by_the_oracle() -> None:
    w = quantize_w4(torch.randn(64, 64), 32)
    before = dequantize(w)
    assert cpu.prepack(w) is w and hasattr(w, "cpu_packed")
    assert torch.equal(dequantize(w), before)


# --- norms, rope, activation -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, with_residual: bool, impl: str) -> None:
    x, r = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    wt = (1 + torch.randn(64) * 0.1).to(dtype)
    res = r if with_residual else None
    got, got_h = cpu.rms_norm(x, wt, 1e-5, res)
    want, want_h = reference.rms_norm(x, wt, 1e-5, res)
    assert got.dtype == dtype and torch.equal(got_h, want_h)
    close(got, want, 1e-6 if dtype == F32 else 8e-3)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("fused", [False, True])
def test_rope_on_separate_and_fused_qkv(dtype: torch.dtype, fused: bool, impl: str) -> None:
    t, hq, hk, d = 6, 4, 2, 16
    cos_sin = torch.cat((torch.randn(64, d // 2).cos(), torch.randn(64, d // 2).sin()), -1)
    positions = torch.tensor([0, 5, 9, 10, 33, 63])
    qkv = torch.randn(t, (hq + 2 * hk) * d).to(dtype)
    if fused:  # views into one buffer, as the model's split of the qkv projection gives
        q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k = q.reshape(t, hq, d), k.reshape(t, hk, d)
        assert cpu._joined(q, k) is not None
    else:
        q, k = torch.randn(t, hq, d).to(dtype), torch.randn(t, hk, d).to(dtype)
    q2, k2 = q.clone(), k.clone()
    cpu.rope(q, k, positions, cos_sin)
    reference.rope(q2, k2, positions, cos_sin)
    close(q, q2, 1e-6 if dtype == F32 else 8e-3)
    close(k, k2, 1e-6 if dtype == F32 else 8e-3)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_silu_and_mul(dtype: torch.dtype, impl: str) -> None:
    x = torch.randn(4, 64).to(dtype)
    close(cpu.silu_and_mul(x), reference.silu_and_mul(x), 1e-6 if dtype == F32 else 8e-3)


# --- paged KV cache and attention ----------------------------------------------------------------------

N_BLOCKS, BLOCK, HKV, D = 24, 4, 2, 16
# (int8 KV, head_dim): the float cache, int8 with one key scale per head (16 channels, not a multiple of
# 32) and int8 with two key scales per head (groups of 32 channels); one value scale per head always
KV_CASES = [(False, D), (True, D), (True, 64)]


def caches(int8: bool, dtype: torch.dtype = F32, d: int = D) -> list[torch.Tensor | None]:
    shape = (N_BLOCKS, BLOCK, HKV, d)
    if not int8:
        return [torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), None, None]
    return [torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8),
            torch.zeros(*shape[:3], reference.k_scale_groups(d)),
            torch.zeros(*shape[:3], reference.v_scale_groups(d))]


def filled(lens: list[int], int8: bool, dtype: torch.dtype = F32, seed: int = 0, d: int = D
           ) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Caches holding `lens[b]` random tokens of sequence b, in shuffled blocks; the block table."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(N_BLOCKS, generator=g)
    width = max(-(-n // BLOCK) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    c = caches(int8, dtype, d)
    used = 0
    for b, n in enumerate(lens):
        nb = -(-n // BLOCK)
        table[b, :nb] = order[used:used + nb].to(torch.int32)
        used += nb
        pos = torch.arange(n)
        slots = table[b, pos // BLOCK].long() * BLOCK + pos % BLOCK
        k, v = torch.randn(n, HKV, d, generator=g).to(dtype), torch.randn(n, HKV, d, generator=g).to(dtype)
        reference.write_kv(k, v, *c[:2], slots, *c[2:])
    return c, table


@pytest.mark.parametrize("int8,d", KV_CASES)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_write_kv_skips_padding_and_matches_the_oracle(int8: bool, d: int, dtype: torch.dtype, impl: str) -> None:
    k, v = torch.randn(5, HKV, d).to(dtype), torch.randn(5, HKV, d).to(dtype)
    slots = torch.tensor([7, -1, 0, 30, -1])
    got, want = caches(int8, dtype, d), caches(int8, dtype, d)
    cpu.write_kv(k, v, *got[:2], slots, *got[2:])
    reference.write_kv(k, v, *want[:2], slots, *want[2:])
    for a, b in zip(got, want):
        if a is not None:
            assert torch.equal(a, b)


@pytest.mark.parametrize("int8,d", KV_CASES)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_rope_write_kv_is_rope_then_write_kv(int8: bool, d: int, dtype: torch.dtype, impl: str) -> None:
    """On q, k, v views of one qkv buffer (the model's split): q and k end rotated as the oracle's rope
    leaves them (within rope's bound), v untouched, and the caches hold exactly what the oracle's write_kv
    writes of the rotated k and v, padding skipped."""
    t, hq = 5, 4
    g = torch.Generator().manual_seed(1)
    cos_sin = torch.cat((torch.randn(64, d // 2, generator=g).cos(), torch.randn(64, d // 2, generator=g).sin()), -1)
    positions = torch.tensor([3, 0, 17, 63, 8])
    slots = torch.tensor([7, -1, 0, 30, -1])
    qkv = torch.randn(t, (hq + 2 * HKV) * d, generator=g).to(dtype)
    ref = qkv.clone()
    q, k, v = (x.reshape(t, -1, d) for x in qkv.split([hq * d, HKV * d, HKV * d], dim=-1))
    q2, k2, v2 = (x.reshape(t, -1, d) for x in ref.split([hq * d, HKV * d, HKV * d], dim=-1))
    got, want = caches(int8, dtype, d), caches(int8, dtype, d)
    cpu.rope_write_kv(q, k, v, positions, cos_sin, *got[:2], slots, *got[2:])
    reference.rope(q2, k2, positions, cos_sin)
    close(q, q2, 1e-6 if dtype == F32 else 8e-3)
    close(k, k2, 1e-6 if dtype == F32 else 8e-3)
    assert torch.equal(v, v2)
    reference.write_kv(k, v, *want[:2], slots, *want[2:])  # the oracle's write of these rotated keys
    for a, b in zip(got, want):
        if a is not None:
            assert torch.equal(a, b)


def test_int8_keys_have_one_scale_per_32_channels() -> None:
    """The int8 layout (kernels/reference.py): an outlier channel of a key sets the scale of its own group
    of 32 channels only, and the other group keeps its resolution; the cache allocates one key scale per
    group and one value scale per head."""
    k = torch.randn(3, HKV, 64, generator=torch.Generator().manual_seed(0)) * 0.1
    k[:, :, 5] = 40.0
    q, scale = reference.quantize_kv_int8(k, reference.k_scale_groups(64))
    assert q.shape == k.shape and scale.shape == (3, HKV, 2)
    assert torch.equal(scale[..., 0], torch.full((3, HKV), 40.0 / 127))
    assert torch.equal(scale[..., 1], k[..., 32:].abs().amax(-1) / 127)
    back = (q.float().unflatten(-1, (2, 32)) * scale[..., None]).flatten(-2)
    assert ((back - k)[..., 32:].abs() <= scale[..., 1:] / 2 * (1 + 1e-6)).all()
    kv = KVCache.allocate(1, 2, 4, 3, 64, F32, "cpu", int8=True)
    assert kv.k_scale[0].shape == (2, 4, 3, 2) and kv.v_scale[0].shape == (2, 4, 3, 1)
    assert kv.k_scale[0].dtype == kv.v_scale[0].dtype == F32
    assert kv.bytes_per_block() == 2 * 4 * 3 * 64 + 4 * 4 * 3 * (2 + 1)
    assert KVCache.allocate(1, 2, 4, 3, 48, F32, "cpu", int8=True).k_scale[0].shape == (2, 4, 3, 1)


@pytest.mark.parametrize("int8,d", KV_CASES)
@pytest.mark.parametrize("hq", [2, 6])  # MHA and GQA (3 query heads per KV head)
@pytest.mark.parametrize("lens", [[9], [1, 17, 6, 12], [16, 16]])
def test_attention_decode_over_ragged_paged_contexts(int8: bool, d: int, hq: int, lens: list[int], impl: str) -> None:
    c, table = filled(lens, int8, d=d)
    q = torch.randn(len(lens), hq, d)
    ctx = torch.tensor(lens, dtype=torch.int32)
    got = cpu.attention_decode(q, c[0], c[1], table, ctx, d ** -0.5, c[2], c[3])
    want = reference.attention_decode(q, c[0], c[1], table, ctx, d ** -0.5, c[2], c[3])
    close(got, want, 1e-5)


def test_attention_decode_in_bfloat16() -> None:
    c, table = filled([5, 13], False, BF16)
    q = torch.randn(2, 6, D).to(BF16)
    ctx = torch.tensor([5, 13], dtype=torch.int32)
    got = cpu.attention_decode(q, c[0], c[1], table, ctx, D ** -0.5)
    assert got.dtype == BF16
    close(got, reference.attention_decode(q, c[0], c[1], table, ctx, D ** -0.5), 1e-2)


@pytest.mark.parametrize("int8,d", KV_CASES)
@pytest.mark.parametrize("hq", [2, 6])
@pytest.mark.parametrize("case", ["one prompt", "cached prefix", "mixed with decodes"])
def test_attention_prefill_with_cached_prefixes(int8: bool, d: int, hq: int, case: str, impl: str) -> None:
    lens, new = {"one prompt": ([11], [11]), "cached prefix": ([14], [5]),
                 "mixed with decodes": ([7, 20, 9, 3], [1, 6, 1, 3])}[case]
    c, table = filled(lens, int8, d=d)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d)
    ctx = torch.tensor(lens, dtype=torch.int32)
    got = cpu.attention_prefill(q, c[0], c[1], table, cu, ctx, d ** -0.5, c[2], c[3])
    want = reference.attention_prefill(q, c[0], c[1], table, cu, ctx, d ** -0.5, c[2], c[3])
    close(got, want, 1e-5)


def test_per_step_values_are_not_reused_after_the_metadata_changes_in_place(impl: str) -> None:
    c, table = filled([6, 10], False)
    q = torch.randn(2, 2, D)
    ctx = torch.tensor([6, 10], dtype=torch.int32)
    cpu.attention_decode(q, c[0], c[1], table, ctx, D ** -0.5)
    ctx[0] = 3  # same tensor object, new content
    got = cpu.attention_decode(q, c[0], c[1], table, ctx, D ** -0.5)
    close(got, reference.attention_decode(q, c[0], c[1], table, ctx, D ** -0.5), 1e-5)
    positions = torch.tensor([1, 2])
    cos_sin = torch.randn(8, D)
    a, b = torch.randn(2, 2, D), torch.randn(2, 1, D)
    cpu.rope(a.clone(), b.clone(), positions, cos_sin)
    positions[0] = 5
    a2, b2 = a.clone(), b.clone()
    cpu.rope(a, b, positions, cos_sin)
    reference.rope(a2, b2, positions, cos_sin)
    close(a, a2, 1e-6)


# --- the embedded model, end to end ------------------------------------------------------------------

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You are a helpful coding assistant."},
     {"role": "user", "content": "How do I reverse a list in Python?"}],
]


def densified(w: LlamaWeights) -> LlamaWeights:
    """The same weights with every linear dequantized: what the oracle computes per call, done once."""
    def dense(lw: LinearWeight) -> LinearWeight:
        return LinearWeight("dense", dequantize(lw), bias=lw.bias)

    layers = [LayerWeights(lay.input_norm, dense(lay.qkv), dense(lay.o), lay.post_norm, dense(lay.gate_up),
                           dense(lay.down)) for lay in w.layers]
    return LlamaWeights(w.embed, layers, w.final_norm, dense(w.lm_head))


def engine_greedy(model: LlamaModel, prompts: list[list[int]], kernels: str,
                  monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    from edged.engine.block_manager import BlockManager
    from edged.engine.llm_engine import LLMEngine
    from edged.engine.model_runner import ModelRunner
    from edged.models.batch import KVCache
    from edged.scheduler.batcher import Batcher, BatchLimits

    monkeypatch.setenv("EDGED_KERNELS", kernels)
    c = model.config
    kv = KVCache.allocate(c.num_layers, 32, 16, c.num_kv_heads, c.head_dim, F32, "cpu")
    blocks = BlockManager(32, 16, True)
    engine = LLMEngine(ModelRunner(model, kv), blocks, Batcher(blocks, BatchLimits(8, 256)), 512, [],
                       lambda _: None)
    reqs = [request(f"p{i}", p, max_tokens=32, ignore_eos=True) for i, p in enumerate(prompts)]
    return run_to_completion(engine, reqs)


def test_engine_greedy_text_on_the_fast_path_equals_the_oracle(loaded_model: LoadedModel,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The default CPU build of the embedded model (w4 GGUF layers, a w8 lm_head whose int8 rows are
    also the embedding), 3 prompts decoded
    together (a ragged batch), 32 greedy tokens each: the same text with kernels/cpu.py as with the
    oracle, which runs on the same weights dequantized once (what it computes at every call)."""
    if not cpu_native.available():
        pytest.skip("no C compiler: torch's bf16 kernels are not expected to match float32 greedy text")
    cfg, tok = loaded_model.config, loaded_model.tokenizer
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # OpenMP threads wait for each other while tests share the cores
    try:
        w = build_weights(loaded_model.named_weights, cfg, "auto", F32)
        fast, oracle, prompts = _fast_and_oracle(loaded_model, w, monkeypatch)
    finally:
        torch.set_num_threads(threads)
    for rid in fast:
        assert len(fast[rid]) == 32
        assert tok.decode(fast[rid]) == tok.decode(oracle[rid])
    assert "Paris" in tok.decode(fast["p0"])


def _fast_and_oracle(loaded_model: LoadedModel, w: LlamaWeights, monkeypatch: pytest.MonkeyPatch):
    cfg, tok = loaded_model.config, loaded_model.tokenizer
    assert [w.layers[0].qkv.format, w.lm_head.format] == ["w4", "w8"] and w.embed is w.lm_head
    prompts = [tok.encode(loaded_model.chat_template.render(m)) for m in PROMPTS]
    fast = engine_greedy(LlamaModel(cfg, w, 512), prompts, "auto", monkeypatch)
    oracle = engine_greedy(LlamaModel(cfg, densified(w), 512), prompts, "reference", monkeypatch)
    assert os.environ.get("EDGED_KERNELS") == "reference"
    return fast, oracle, prompts


def test_bench_decode_cpu_table_reports_the_ratios_the_issue_asks_for() -> None:
    from edged.bench.decode_cpu import format_table, median_result

    def run(system: str, scale: float) -> dict:
        return {"system": system, "weights": "w4", "threads": 2, "prefill_tok_s": 300 * scale, "rss_mb": 500,
                "peak_rss_mb": 700, "decode": {"1": {"tok_s": 60 * scale, "step_ms": 16.7 / scale},
                                               "8": {"tok_s": 180 * scale, "step_ms": 44.4 / scale}}}

    edged = median_result([run("edged", 1.0), run("edged", 0.5), run("edged", 2.0)])
    assert edged["decode"]["1"]["tok_s"] == 60 and edged["runs"] == 3
    text = format_table([edged, median_result([run("llama.cpp", 2.0)])],
                        {"model": None, "threads": 2, "prompt_tokens": 128, "context": 32, "steps": 64, "repeat": 3})
    assert "edged batch 8 / batch 1 aggregate tok/s: 3.00x" in text
    assert "edged / llama.cpp: batch-1 decode 0.50x, prefill 0.50x" in text


def test_w8_in_the_mma_order_holds_the_same_weights_and_every_reader_gets_them_back() -> None:
    """to_mma_order stores each 16 columns' bytes as Hopper's register operand reads them (position 4c + 2b + d holds
    column 8b + 2c + d): the bytes move, the weights do not. dequantize, the CPU kernels and concat_out give what
    column order gives; rows of one group (another kernel path) and w4 stay as they are, and a weight marked so
    that cannot be is refused."""
    torch.manual_seed(11)
    for symmetric in (True, False):
        w = quantize_w8(torch.randn(40, 96), torch.randn(40), symmetric=symmetric)
        mma = to_mma_order(w)
        assert mma.mma_order and not torch.equal(mma.data, w.data)
        blocks, stored = w.data.view(40, 6, 16), mma.data.view(40, 6, 16)
        for c in range(4):
            for b in range(2):
                for d in range(2):
                    assert torch.equal(stored[:, :, 4 * c + 2 * b + d], blocks[:, :, 8 * b + 2 * c + d])
        assert torch.equal(dequantize(mma), dequantize(w))
        assert torch.equal(natural_order(mma).data, w.data) and not natural_order(mma).mma_order
        x = torch.randn(3, 96)
        assert torch.equal(cpu.linear(x, mma), cpu.linear(x, w))
        fused = concat_out([mma, to_mma_order(quantize_w8(torch.randn(8, 96), symmetric=symmetric))])
        assert fused.mma_order and torch.equal(dequantize(fused)[:40], dequantize(w))
        mixed = concat_out([mma, w])
        assert not mixed.mma_order and torch.equal(dequantize(mixed)[40:], dequantize(w))
    one_group = quantize_w8(torch.randn(4, 48))  # 48 columns: one group a row
    assert one_group.group_size == 48 and to_mma_order(one_group) is one_group
    w4 = quantize_w4(torch.randn(4, 64))
    assert to_mma_order(w4) is w4
    with pytest.raises(ValueError, match="MMA order"):
        LinearWeight("w8", one_group.data, one_group.scale, None, 48, mma_order=True)
