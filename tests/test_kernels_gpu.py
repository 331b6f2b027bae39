"""The Triton kernels against the torch reference on the GPU, at real model shapes, fp16 and bf16.

Errors are relative, ||out - ref|| / ||ref||, against the reference run in float32 on the same inputs.
`python tests/test_kernels_gpu.py` prints bandwidth figures (GEMV, attention decode, copy).
"""
from __future__ import annotations

import math
import sys

import pytest
import torch

from edged.kernels import reference
from edged.kernels.weights import LinearWeight, quantize_w4, quantize_w8

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from edged.kernels import triton_attention as tattn  # noqa: E402
from edged.kernels import triton_linear as tlin  # noqa: E402
from edged.kernels import triton_ops as ops  # noqa: E402
from edged.kernels import triton_sampling as tsamp  # noqa: E402

DEV = torch.device("cuda")
DTYPES = [torch.float16, torch.bfloat16]
# relative-error bounds: bf16 keeps 8 mantissa bits, fp16 11
REL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape
    assert torch.isfinite(got).all()
    g, w = got.double(), want.double()
    return ((g - w).norm() / w.norm().clamp(min=1e-12)).item()


def make_weight(fmt: str, n: int, k: int, dtype: torch.dtype, bias: bool = False, group: int = 32,
                seed: int = 0) -> LinearWeight:
    g = torch.Generator(device=DEV).manual_seed(seed)
    dense = torch.randn(n, k, generator=g, device=DEV) * 0.02
    b = (torch.randn(n, generator=g, device=DEV) * 0.1).to(dtype) if bias else None
    if fmt == "dense":
        return LinearWeight("dense", dense.to(dtype), bias=b)
    w = quantize_w8(dense, b) if fmt == "w8" else quantize_w4(dense, group, b)
    w.scale = w.scale.to(dtype)
    if w.minimum is not None:
        w.minimum = w.minimum.to(dtype)
    return w


def ref_linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    """The reference in float32 on the weight's exact values (the oracle, without its rounding)."""
    from edged.kernels.weights import dequantize

    out = x.float() @ dequantize(w, torch.float32).T
    return out if w.bias is None else out + w.bias.float()


# ---------------------------------------------------------------------------------------------- linear

SHAPES = [(4096, 14336), (14336, 4096), (2048, 8192)]  # (out, in): Llama-3-8B down / gate, Llama-3.2-1B


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["dense", "w8", "w4"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_real_shapes(n: int, k: int, fmt: str, dtype: torch.dtype) -> None:
    w = make_weight(fmt, n, k, dtype, bias=(n == 2048), group=32 if k != 8192 else 128, seed=n + k)
    for m in (1, 5, 16, 48, 200):
        x = torch.randn(m, k, device=DEV).to(dtype)
        got = ops.linear(x, w)
        assert got.dtype == dtype
        err = rel_err(got, ref_linear(x, w))
        assert err < REL[dtype], (m, err)


@pytest.mark.parametrize("fmt", ["w4"])
@pytest.mark.parametrize("group", [64, 128])
def test_linear_w4_groups(fmt: str, group: int) -> None:
    w = make_weight(fmt, 3072, 3072, torch.bfloat16, bias=True, group=group, seed=group)
    for m in (1, 9, 130):
        x = torch.randn(m, 3072, device=DEV).to(torch.bfloat16)
        assert rel_err(ops.linear(x, w), ref_linear(x, w)) < REL[torch.bfloat16]


@pytest.mark.parametrize("fmt", ["dense", "w8", "w4"])
def test_linear_gemv_variants(fmt: str) -> None:
    """Every GEMV shape of program the sweeps consider, on a ragged N, with K splits."""
    w = make_weight(fmt, 4099, 14336, torch.bfloat16, bias=True, seed=7)
    x = torch.randn(1, 14336, device=DEV).bfloat16()
    want = ref_linear(x, w)
    for rows in (1, 2, 4):
        for block_k, split in ((1024, 1), (2048, 3), (4096, 2)):
            cfg = tlin.LinearConfig("gemv", 1, rows, block_k, split, num_warps=4 if block_k < 4096 else 8)
            assert rel_err(tlin.linear(x, w, cfg), want) < REL[torch.bfloat16], (rows, block_k, split)


def test_linear_odd_shapes() -> None:
    # N not a multiple of any block, K not a multiple of the K step (SmolLM2's 576 / 1536)
    for fmt in ("dense", "w8", "w4"):
        w = make_weight(fmt, 1536 + 7 * (fmt != "w4"), 576, torch.float16, bias=True, group=32, seed=3)
        for m in (1, 3, 70):
            x = torch.randn(m, 576, device=DEV).half()
            assert rel_err(ops.linear(x, w), ref_linear(x, w)) < REL[torch.float16], (fmt, m)


def test_linear_is_deterministic() -> None:
    w = make_weight("w8", 4096, 14336, torch.bfloat16)
    x = torch.randn(1, 14336, device=DEV).bfloat16()
    first = ops.linear(x, w)
    for _ in range(3):
        assert torch.equal(ops.linear(x, w), first)


# ------------------------------------------------------------------------------------- norm and friends

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [2048, 4096, 8192])
def test_rms_norm(hidden: int, dtype: torch.dtype) -> None:
    x = torch.randn(37, hidden, device=DEV).to(dtype)
    r = torch.randn(37, hidden, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    out, h = ops.rms_norm(x, w, 1e-5, r)
    ref_out, ref_h = reference.rms_norm(x, w, 1e-5, r)
    assert torch.equal(h, ref_h)
    assert rel_err(out, ref_out) < REL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = (2 * torch.randn(33, 2 * 14336, device=DEV)).to(dtype)
    assert rel_err(ops.silu_and_mul(x), reference.silu_and_mul(x)) < REL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,hq,hk", [(128, 32, 8), (64, 32, 8), (64, 9, 3)])
def test_rope(dtype: torch.dtype, head_dim: int, hq: int, hk: int) -> None:
    t = 300
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, device=DEV).to(dtype)
    pos = torch.randint(0, 8192, (t,), device=DEV)
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    f = torch.outer(torch.arange(8192, dtype=torch.float64), inv)
    cs = torch.cat((f.cos(), f.sin()), -1).float().to(DEV)
    ref = qkv.clone()
    for buf, fn in ((qkv, ops.rope), (ref, reference.rope)):
        q = buf[:, :hq * head_dim].view(t, hq, head_dim)
        k = buf[:, hq * head_dim:(hq + hk) * head_dim].view(t, hk, head_dim)
        fn(q, k, pos, cs)
    assert rel_err(qkv, ref) < REL[dtype] / 4


# -------------------------------------------------------------------------------------------- KV cache

def paged_cache(ctx_lens: list[int], hkv: int, d: int, block: int, dtype: torch.dtype, int8: bool, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    width = max(-(-c // block) for c in ctx_lens) + 2
    n_blocks = sum(-(-c // block) for c in ctx_lens) + 5
    perm = torch.randperm(n_blocks, device=DEV, generator=g)
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.int32, device=DEV)
    store = torch.int8 if int8 else dtype
    kc = torch.zeros(n_blocks, block, hkv, d, dtype=store, device=DEV)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(n_blocks, block, hkv, device=DEV) if int8 else None
    vs = torch.zeros_like(ks) if int8 else None
    used = 0
    for b, c in enumerate(ctx_lens):
        nb = -(-c // block)
        tables[b, :nb] = perm[used:used + nb].int()
        used += nb
        p = torch.arange(c, device=DEV)
        slots = tables[b, p // block].long() * block + p % block
        k = torch.randn(c, hkv, d, generator=g, device=DEV).to(dtype)
        v = torch.randn(c, hkv, d, generator=g, device=DEV).to(dtype)
        reference.write_kv(k, v, kc, vc, slots, ks, vs)
    return kc, vc, ks, vs, tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("int8", [False, True])
def test_write_kv_exact(dtype: torch.dtype, int8: bool) -> None:
    """Bit-exact with the reference run on the CPU. (The reference run on the GPU is not: PyTorch's
    CUDA division by the scalar 127.0 multiplies by its reciprocal, so its scales can differ by an ulp.)"""
    n, s, h, d, t = 64, 16, 8, 128, 333
    k = (3 * torch.randn(t, h, d, device=DEV)).to(dtype)
    v = torch.randn(t, h, d, device=DEV).to(dtype)
    slots = torch.randperm(n * s, device=DEV)[:t]
    slots[::7] = -1
    store = torch.int8 if int8 else dtype
    caches = [torch.full((n, s, h, d), 3, dtype=store) for _ in range(4)]
    scales = [torch.full((n, s, h), -1.0) if int8 else None for _ in range(4)]
    got = [c.to(DEV) for c in caches[:2]]
    got_s = [None if x is None else x.to(DEV) for x in scales[:2]]
    ops.write_kv(k, v, got[0], got[1], slots, got_s[0], got_s[1])
    reference.write_kv(k.cpu(), v.cpu(), caches[2], caches[3], slots.cpu(), scales[2], scales[3])
    assert torch.equal(got[0].cpu(), caches[2]) and torch.equal(got[1].cpu(), caches[3])
    if int8:
        assert torch.equal(got_s[0].cpu(), scales[2]) and torch.equal(got_s[1].cpu(), scales[3])


# ------------------------------------------------------------------------------------------- attention

def _attn_rel(dtype: torch.dtype, int8: bool) -> float:
    return REL[dtype] * (3 if int8 else 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("head_dim,hq,hkv", [(128, 32, 8), (64, 32, 8), (64, 9, 3)])
def test_attention_decode(dtype: torch.dtype, int8: bool, head_dim: int, hq: int, hkv: int) -> None:
    ctx = [1, 17, 500, 1024, 4096, 2049, 33, 3000]
    kc, vc, ks, vs, tables = paged_cache(ctx, hkv, head_dim, 16, dtype, int8)
    q = torch.randn(len(ctx), hq, head_dim, device=DEV).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    scale = head_dim ** -0.5
    want = reference.attention_decode(q.float(), kc, vc, tables, lens, scale, ks, vs) if int8 else \
        reference.attention_decode(q.float(), kc.float(), vc.float(), tables, lens, scale)
    for splits, block_t in ((None, None), (1, 64), (7, 128)):
        got = tattn.attention_decode(q, kc, vc, tables, lens, scale, ks, vs, num_splits=splits, block_t=block_t)
        assert rel_err(got, want) < _attn_rel(dtype, int8), splits


def test_attention_decode_batch32_ctx1024() -> None:
    ctx = [1024] * 32
    kc, vc, _, _, tables = paged_cache(ctx, 8, 128, 16, torch.bfloat16, False, seed=1)
    q = torch.randn(32, 32, 128, device=DEV).bfloat16()
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    want = reference.attention_decode(q.float(), kc.float(), vc.float(), tables, lens, 128 ** -0.5)
    assert rel_err(ops.attention_decode(q, kc, vc, tables, lens, 128 ** -0.5), want) < REL[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_prefill(dtype: torch.dtype, int8: bool, head_dim: int) -> None:
    hq, hkv = 32, 8
    ctx = [700, 1500, 64, 2048, 300]
    new = [700, 200, 1, 2048, 0]  # full prompt, a chunk after a prefix, one token, long prompt, none
    kc, vc, ks, vs, tables = paged_cache(ctx, hkv, head_dim, 16, dtype, int8, seed=2)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = torch.randn(sum(new), hq, head_dim, device=DEV).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    scale = head_dim ** -0.5
    want = reference.attention_prefill(q.float(), kc, vc, tables, cu, lens, scale, ks, vs) if int8 else \
        reference.attention_prefill(q.float(), kc.float(), vc.float(), tables, cu, lens, scale)
    got = ops.attention_prefill(q, kc, vc, tables, cu, lens, scale, ks, vs)
    assert rel_err(got, want) < _attn_rel(dtype, int8)


# -------------------------------------------------------------------------------------------- sampling

def test_sampling_uniform_bit_exact() -> None:
    seeds = torch.tensor([0, 1, 2**31 + 5, -7, 2**40 + 3, 12345], dtype=torch.int64)
    offsets = torch.tensor([0, 9, 2**32 - 1, 3, 123456, 77], dtype=torch.int64)
    got = tsamp.sampling_uniform(seeds.to(DEV), offsets.to(DEV), 128256).cpu()
    assert torch.equal(got, reference.sampling_uniform(seeds, offsets, 128256))


def test_sample_same_tokens_as_cpu() -> None:
    b, v = 8, 128256
    logits = torch.randn(b, v, generator=torch.Generator().manual_seed(0)) * 4
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0, 0.9, 0.6, 1.0])
    top_k = torch.tensor([0, 0, 50, 5, 3, 0, 0, 1000])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 0.95, 1.0, 0.8])
    seeds = torch.arange(b) * 7919
    for step in range(4):
        offsets = torch.full((b,), step)
        args = [t.to(DEV) for t in (logits, temperature, top_k, top_p, seeds, offsets)]
        got = ops.sample(*args)
        assert torch.equal(got, reference.sample(*args))  # same torch ops on the GPU: exact
        cpu = reference.sample(logits, temperature, top_k, top_p, seeds, offsets)
        assert torch.equal(got.cpu(), cpu)


# ---------------------------------------------------------------------------------------- whole model

def test_llama_forward_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small random Llama through the dispatcher: Triton vs EDGED_KERNELS=reference, prefill then decode."""
    from edged.models.batch import AttentionMetadata, KVCache
    from edged.models.config import ModelConfig
    from edged.models.llama import LayerWeights, LlamaModel, LlamaWeights

    cfg = ModelConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                      num_kv_heads=2, head_dim=64)
    g = torch.Generator(device=DEV).manual_seed(0)
    dt = torch.bfloat16

    def lin(n: int, k: int) -> LinearWeight:
        return make_weight("w4", n, k, dt, group=64, seed=n * 3 + k)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(cfg.hidden_size, generator=g, device=DEV)).to(dt)

    layers = [LayerWeights(norm(), lin(cfg.q_size + 2 * cfg.kv_size, 512), lin(512, cfg.q_size), norm(),
                           lin(2 * 1024, 512), lin(512, 1024)) for _ in range(cfg.num_layers)]
    weights = LlamaWeights((torch.randn(1000, 512, generator=g, device=DEV) * 0.5).to(dt), layers, norm(),
                           lin(1000, 512))
    model = LlamaModel(cfg, weights, max_positions=256)
    prompt = [37, 21]
    ids = torch.randint(0, 1000, (sum(prompt),), generator=g, device=DEV)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32, device=DEV)
    pos = torch.cat([torch.arange(n) for n in prompt]).to(DEV)
    slots = torch.cat([tables[b, torch.arange(n) // 16].long().cpu() * 16 + torch.arange(n) % 16
                       for b, n in enumerate(prompt)]).to(DEV)
    prefill = AttentionMetadata(False, slots, tables, torch.tensor(prompt, dtype=torch.int32, device=DEV),
                                torch.tensor([0, 37, 58], dtype=torch.int32, device=DEV))
    decode = AttentionMetadata(True, torch.tensor([2 * 16 + 5, 5 * 16 + 5], device=DEV), tables,
                               torch.tensor([38, 22], dtype=torch.int32, device=DEV),
                               torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV))
    outs = {}
    for backend in ("reference", "auto"):
        monkeypatch.setenv("EDGED_KERNELS", backend)
        for int8 in (False, True):
            kv = KVCache.allocate(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, dt, DEV, int8=int8)
            h1 = model.forward(ids, pos, prefill, kv)
            h2 = model.forward(ids[[36, 57]], torch.tensor([37, 21], device=DEV), decode, kv)
            outs[backend, int8] = (model.logits(h1), model.logits(h2))
    for int8 in (False, True):
        for got, want in zip(outs["auto", int8], outs["reference", int8]):
            assert rel_err(got, want) < 3e-2, int8


# ---------------------------------------------------------------------------------------------- timing

def _graph_time(fn, calls: int = 8, replays: int = 20) -> float:
    """Seconds per call, from CUDA-graph replays of `calls` calls (launch gaps out of the numbers)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / (replays * calls))
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> tuple[float, float]:
    """(copy, read) bytes per second: a 2 GiB device-to-device copy counting bytes read + written,
    and a sum over the same 2 GiB (bytes read)."""
    src = torch.randn(2**29, device=DEV)  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(50):  # let the clocks come up
        dst.copy_(src)
    torch.cuda.synchronize()
    copy = 2 * src.numel() * 4 / _graph_time(lambda i=0: dst.copy_(src), calls=4, replays=10)
    kernel_copy = 2 * src.numel() * 4 / _graph_time(lambda i=0: torch.add(src, 1.0, out=dst), calls=4, replays=10)
    read = src.numel() * 4 / _graph_time(lambda i=0: src.sum(), calls=4, replays=10)
    print(f"elementwise kernel copy (dst = src + 1, read+write): {kernel_copy / 1e9:8.0f} GB/s", flush=True)
    return copy, read


_WEIGHTS: dict[tuple, list[LinearWeight]] = {}


def _weights(fmt: str, n: int, k: int, dtype: torch.dtype, group: int, copies: int) -> list[LinearWeight]:
    key = (fmt, n, k, dtype, group, copies)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        _WEIGHTS[key] = [make_weight(fmt, n, k, dtype, group=group, seed=i) for i in range(copies)]
    return _WEIGHTS[key]


def gemv_time(fmt: str, n: int, k: int, m: int = 1, dtype=torch.bfloat16, config=None, copies: int = 4,
              group: int = 32, use_torch: bool = False) -> tuple[float, int]:
    """(seconds per linear call at M rows, weight bytes), rotating over copies that overflow the L2."""
    ws = _weights(fmt, n, k, dtype, group, copies)
    x = torch.randn(m, k, device=DEV).to(dtype)
    if use_torch:
        t = _graph_time(lambda i=0: torch.nn.functional.linear(x, ws[i % copies].data))
    else:
        t = _graph_time(lambda i=0: tlin.linear(x, ws[i % copies], config))
    return t, ws[0].nbytes


def decode_time(batch: int, ctx: int, dtype=torch.bfloat16, int8: bool = False, hq: int = 32, hkv: int = 8,
                d: int = 128) -> tuple[float, int]:
    """(seconds per attention_decode call, K/V bytes read), rotating caches so they overflow the L2."""
    nbytes = 2 * batch * ctx * hkv * d * (1 if int8 else 2) + (2 * batch * ctx * hkv * 4 if int8 else 0)
    copies = max(1, min(64, -(-256 * 2**20 // nbytes)))
    caches = [paged_cache([ctx] * batch, hkv, d, 16, dtype, int8, seed=i) for i in range(copies)]
    q = torch.randn(batch, hq, d, device=DEV).to(dtype)
    lens = torch.tensor([ctx] * batch, dtype=torch.int32, device=DEV)

    def call(i: int = 0) -> torch.Tensor:
        kc, vc, ks, vs, tables = caches[i % copies]
        return tattn.attention_decode(q, kc, vc, tables, lens, d ** -0.5, ks, vs)

    return _graph_time(call, calls=max(8, min(copies, 32))), nbytes


def prefill_time(tokens: int, dtype=torch.bfloat16, hq: int = 32, hkv: int = 8, d: int = 128) -> tuple[float, float]:
    """(seconds, causal attention FLOPs) of one prompt of `tokens` tokens."""
    kc, vc, _, _, tables = paged_cache([tokens], hkv, d, 16, dtype, False, seed=5)
    q = torch.randn(tokens, hq, d, device=DEV).to(dtype)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=DEV)
    lens = torch.tensor([tokens], dtype=torch.int32, device=DEV)
    t = _graph_time(lambda i=0: ops.attention_prefill(q, kc, vc, tables, cu, lens, d ** -0.5), calls=2, replays=5)
    return t, 2.0 * tokens * tokens * hq * d  # 4 T^2 H D / 2 (causal)


def report(sweep: bool = False) -> None:
    copy, read = copy_bandwidth()
    print(f"copy bandwidth (2 GiB fp32, read+write): {copy / 1e9:8.0f} GB/s   read (sum): {read / 1e9:8.0f} GB/s",
          flush=True)

    def row(name: str, fn) -> None:
        try:
            t, nbytes = fn()
            print(f"{name:46s} {t * 1e6:9.1f} us {nbytes / t / 1e9:8.0f} GB/s {100 * nbytes / t / copy:6.1f}% of copy",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - keep measuring the rest
            print(f"{name:46s} FAILED {type(e).__name__}: {e}", flush=True)

    for fmt in ("w8", "w4", "dense"):
        for n, k in ((4096, 14336), (14336, 4096)):
            for m in (1, 16, 64):
                row(f"linear {fmt} {n}x{k} M={m} bf16", lambda: gemv_time(fmt, n, k, m))
    row("linear w8 4096x14336 M=1 fp16", lambda: gemv_time("w8", 4096, 14336, 1, torch.float16))
    row("linear w4 4096x14336 M=1 fp16", lambda: gemv_time("w4", 4096, 14336, 1, torch.float16))
    row("linear w4 g128 4096x14336 M=1 bf16", lambda: gemv_time("w4", 4096, 14336, 1, group=128))
    row("linear w8 128256x4096 M=1 bf16 (lm_head)", lambda: gemv_time("w8", 128256, 4096, 1, copies=1))
    for n, k in ((4096, 14336), (14336, 4096)):
        row(f"cuBLAS F.linear dense {n}x{k} M=1 bf16", lambda: gemv_time("dense", n, k, 1, use_torch=True))
    for batch in (1, 32):
        for ctx in (1024, 4096):
            row(f"attention_decode B={batch} ctx={ctx} bf16", lambda: decode_time(batch, ctx))
    row("attention_decode B=32 ctx=1024 int8 KV", lambda: decode_time(32, 1024, int8=True))
    row("attention_decode B=1 ctx=1024 hd64", lambda: decode_time(1, 1024, d=64))
    for fmt in ("w8", "w4", "dense"):
        try:
            t, _ = gemv_time(fmt, 14336, 4096, 2048, copies=1, use_torch=fmt == "dense")
            print(f"linear {fmt} 14336x4096 M=2048 bf16: {t * 1e6:8.1f} us {2 * 2048 * 14336 * 4096 / t / 1e12:6.0f} TFLOP/s",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"linear {fmt} M=2048 FAILED {type(e).__name__}: {e}", flush=True)
    for tokens in (2048, 8192):
        try:
            t, flops = prefill_time(tokens)
            print(f"attention_prefill T={tokens} hd128 bf16: {t * 1e6:8.1f} us {flops / t / 1e12:6.0f} TFLOP/s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"attention_prefill T={tokens} FAILED {type(e).__name__}: {e}", flush=True)
    if sweep:
        sweep_configs(copy)


def sweep_configs(copy: float) -> None:
    """Launch configurations (for the heuristics in triton_linear.choose_config and attention_decode)."""
    def measure(label: str, fn) -> float:
        try:
            t, nbytes = fn()
        except Exception as e:  # noqa: BLE001 - a config that fails is reported and skipped
            print(f"  {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return 0.0
        print(f"  {label}: {t * 1e6:7.1f} us {nbytes / t / 1e9:6.0f} GB/s {100 * nbytes / t / copy:5.1f}%", flush=True)
        return nbytes / t

    gemv = {"w8": [(4, 1024, 4), (4, 2048, 4), (4, 2048, 8), (4, 4096, 8), (2, 2048, 4)],
            "w4": [(4, 2048, 4), (4, 4096, 4), (4, 4096, 8), (2, 4096, 4), (4, 8192, 8)],
            "dense": [(4, 1024, 4), (4, 2048, 4), (4, 2048, 8), (2, 2048, 4)]}
    for fmt, cands in gemv.items():
        for n, k in ((4096, 14336), (14336, 4096)):
            best = (0.0, "")
            for rows, bk, warps in cands:
                if bk > k:
                    continue
                for split in sorted({1, 2}):
                    cfg = tlin.LinearConfig("gemv", 1, rows, bk, split, num_warps=warps, num_stages=1)
                    label = f"{fmt} {n}x{k} M=1 rows={rows} bk={bk} warps={warps} split={split}"
                    best = max(best, (measure(label, lambda: gemv_time(fmt, n, k, config=cfg)), label))
            print(f"BEST {best[1]}: {best[0] / 1e9:.0f} GB/s {100 * best[0] / copy:.1f}%", flush=True)


def _decode_time_cfg(batch: int, ctx: int, int8: bool, block_t: int, warps: int) -> tuple[float, int]:
    kc, vc, ks, vs, tables = paged_cache([ctx] * batch, 8, 128, 16, torch.bfloat16, int8, seed=7)
    q = torch.randn(batch, 32, 128, device=DEV).bfloat16()
    lens = torch.tensor([ctx] * batch, dtype=torch.int32, device=DEV)
    t = _graph_time(lambda i=0: tattn.attention_decode(q, kc, vc, tables, lens, 128 ** -0.5, ks, vs,
                                                       block_t=block_t, num_warps=warps))
    return t, 2 * batch * ctx * 8 * 128 * (1 if int8 else 2) + (2 * batch * ctx * 8 * 4 if int8 else 0)


if __name__ == "__main__":
    report(sweep="--sweep" in sys.argv)
