"""`edged bench kernels`: each Triton kernel's GB/s (or TFLOP/s) against the measured ceilings.

Times come from CUDA-graph replays (launch gaps out of the numbers) with weights and caches rotated
over copies larger than the L2, so every call reads from HBM.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

from edged.kernels import reference
from edged.kernels import triton_attention as tattn
from edged.kernels import triton_linear as tlin
from edged.kernels import triton_ops as ops
from edged.kernels.weights import LinearWeight
from edged.models.config import MODEL_SHAPES

from .kernel_inputs import DEV, make_weight, model_linears, paged_cache


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
    print(f"torch copy_ (read+write): {copy / 1e9:8.0f} GB/s (a slower memcpy path; not the ceiling)", flush=True)
    return kernel_copy, read


def decode_shapes() -> dict[str, tuple[int, int]]:
    """(N, K) of each decode linear of the MODEL_SHAPES models: fused qkv, o, fused gate_up, down, head."""
    return {f"{name} {linear}": (n, k) for name in MODEL_SHAPES for linear, (n, k, _) in model_linears(name).items()}


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


def fused_times(fmt: str, n: int, k: int, dtype=torch.bfloat16, copies: int = 4) -> dict[str, float]:
    """Seconds per decode (M = 1) linear call in each fused form and as the separate kernels it
    replaces: plain; RMSNorm in (fused / rms_norm kernel + linear); silu(gate) * up in (fused /
    silu_and_mul + linear); residual add out (fused / linear + add); silu(gate) * up out, W's rows
    being [gate | up] (fused / linear + silu_and_mul)."""
    ws = _weights(fmt, n, k, dtype, 32, copies)
    x = torch.randn(1, k, device=DEV).to(dtype)
    gu = torch.randn(1, 2 * k, device=DEV).to(dtype)
    nw = torch.ones(k, device=DEV).to(dtype)
    res = torch.randn(1, n, device=DEV).to(dtype)
    w = lambda i: ws[i % copies]  # noqa: E731
    forms = {
        "plain": lambda i=0: tlin.linear(x, w(i)),
        "norm fused": lambda i=0: tlin.linear(x, w(i), norm_weight=nw, norm_eps=1e-5, fuse_input=True),
        "norm apart": lambda i=0: tlin.linear(ops.rms_norm(x, nw, 1e-5)[0], w(i)),
        "silu fused": lambda i=0: tlin.linear(gu, w(i), silu_mul=True, fuse_input=True),
        "silu apart": lambda i=0: tlin.linear(ops.silu_and_mul(gu), w(i)),
        "residual fused": lambda i=0: tlin.linear(x, w(i), residual=res),
        "residual apart": lambda i=0: tlin.linear(x, w(i)) + res,
        "silu out fused": lambda i=0: tlin.linear(x, w(i), silu_mul_out=True, fuse_input=True),
        "silu out apart": lambda i=0: ops.silu_and_mul(tlin.linear(x, w(i))),
    }
    return {name: _graph_time(fn) for name, fn in forms.items()}


def fused_report() -> None:
    """The fused decode GEMV forms against the separate kernels, at SmolLM2, Llama-3.2-1B and 8B shapes."""
    names = ["plain", "norm fused", "norm apart", "silu fused", "silu apart", "residual fused", "residual apart",
             "silu out fused", "silu out apart"]
    print("decode linear (M = 1, bf16), us per call, fused forms against the separate kernels "
          f"(linear fuses its input below {tlin.FUSED_INPUT_MAX_WEIGHTS:,} weights)", flush=True)
    print(f"{'fmt':6}{'N x K':>13}" + "".join(f"{n:>16}" for n in names), flush=True)
    for n, k in ((960, 576), (576, 1536), (3072, 576), (3072, 2048), (2048, 8192), (16384, 2048), (6144, 4096),
                 (4096, 14336), (28672, 4096)):
        for fmt in ("w8", "w4", "dense"):
            try:
                t = fused_times(fmt, n, k)
                print(f"{fmt:6}{f'{n}x{k}':>13}" + "".join(f"{t[name] * 1e6:>16.1f}" for name in names), flush=True)
            except Exception as e:  # noqa: BLE001 - keep measuring the rest
                print(f"{fmt:6}{f'{n}x{k}':>13} FAILED {type(e).__name__}: {e}", flush=True)


def kv_bytes(batch: int, ctx: int, hkv: int, d: int, int8: bool) -> int:
    """K and V bytes a decode call reads: bf16 values, or int8 values and their float32 scales (per token and
    kv head: keys one per 32 channels, values one)."""
    if not int8:
        return 2 * batch * ctx * hkv * d * 2
    return batch * ctx * hkv * (2 * d + 4 * (reference.k_scale_groups(d) + reference.v_scale_groups(d)))


def decode_time(batch: int, ctx: int, dtype=torch.bfloat16, int8: bool = False, hq: int = 32, hkv: int = 8,
                d: int = 128) -> tuple[float, int]:
    """(seconds per attention_decode call, K/V bytes read), rotating caches so they overflow the L2."""
    nbytes = kv_bytes(batch, ctx, hkv, d, int8)
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
    print(f"copy ceiling (elementwise kernel dst = src + 1 over 2 GiB, read+write): {copy / 1e9:8.0f} GB/s   "
          f"read (sum): {read / 1e9:8.0f} GB/s",
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
    fused_report()
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

    # M = 1: every decode GEMV shape of SmolLM2, Llama-3.2-1B and Llama-3-8B, each launch against
    # choose_config's; one line per shape (the best, and the heuristic's time) after its candidates
    for fmt in ("w8", "w4", "dense"):
        for name, (n, k) in decode_shapes().items():
            copies = 1 if n * k > 2e8 else 4
            heuristic = tlin.choose_config(1, n, k, fmt, torch.device(DEV))
            base = measure(f"{fmt} {name} {n}x{k} heuristic {heuristic}",
                           lambda: gemv_time(fmt, n, k, copies=copies))
            best = (base, "heuristic")
            for rows, bk, warps in itertools.product((2, 4), (512, 1024, 2048, 4096), (4, 8)):
                for split in sorted({1, 2, 4, heuristic.split}):
                    if bk > 2 * k or -(-k // bk) < split:
                        continue
                    cfg = tlin.LinearConfig("gemv", 1, rows, bk, split, num_warps=warps, num_stages=1)
                    label = f"rows={rows} bk={bk} warps={warps} split={split}"
                    best = max(best, (measure(f"{fmt} {name} {label}",
                                              lambda: gemv_time(fmt, n, k, config=cfg, copies=copies)), label))
            print(f"BEST {fmt} {name} {n}x{k}: {best[1]} {100 * best[0] / copy:.1f}% of copy "
                  f"(heuristic {100 * base / copy:.1f}%)", flush=True)


def _decode_time_cfg(batch: int, ctx: int, int8: bool, block_t: int, warps: int) -> tuple[float, int]:
    kc, vc, ks, vs, tables = paged_cache([ctx] * batch, 8, 128, 16, torch.bfloat16, int8, seed=7)
    q = torch.randn(batch, 32, 128, device=DEV).bfloat16()
    lens = torch.tensor([ctx] * batch, dtype=torch.int32, device=DEV)
    t = _graph_time(lambda i=0: tattn.attention_decode(q, kc, vc, tables, lens, 128 ** -0.5, ks, vs,
                                                       block_t=block_t, num_warps=warps))
    return t, kv_bytes(batch, ctx, 8, 128, int8)


def w4_tensor_core_report(copies: int = 8) -> None:
    """The tensor-core w4 decode GEMV (kernels/triton_w4_dot.py, not launched by linear) against linear's w4 and
    w8 GEMVs at the 1B and 8B decode shapes and two of SmolLM2's: us a call, its best K split, and its speed
    against each GEMV."""
    from edged.kernels.triton_w4_dot import shuffle_w4_tiles, w4_dot_linear

    print("decode linear (M = 1, bf16), us per call: linear's w8 and w4 GEMVs against the tensor-core w4 GEMV at "
          "K splits 1 / 2 / 4 / 8 (best kept)", flush=True)
    print(f"{'N x K':>12} {'w8 GEMV':>8} {'w4 GEMV':>8} {'w4 dot':>8} {'split':>5} {'dot/w4':>7} {'dot/w8':>7}",
          flush=True)
    for n, k in ((3072, 576), (576, 1536), (3072, 2048), (16384, 2048), (2048, 8192), (6144, 4096), (4096, 4096),
                 (28672, 4096), (4096, 14336)):
        x = torch.randn(1, k, device=DEV).bfloat16()
        w8 = _weights("w8", n, k, torch.bfloat16, 32, copies)
        t8 = _graph_time(lambda i=0: tlin.linear(x, w8[i % copies]))
        w4 = _weights("w4", n, k, torch.bfloat16, 32, copies)
        t4 = _graph_time(lambda i=0: tlin.linear(x, w4[i % copies]))
        words = [shuffle_w4_tiles(w.data) for w in w4]
        dot = {split: _graph_time(lambda i=0: w4_dot_linear(x, words[i % copies], w4[i % copies].scale,
                                                            w4[i % copies].minimum, n, 32, split=split))
               for split in (1, 2, 4, 8)}
        split, td = min(dot.items(), key=lambda kv: kv[1])
        print(f"{f'{n}x{k}':>12} {t8 * 1e6:8.1f} {t4 * 1e6:8.1f} {td * 1e6:8.1f} {split:>5} {t4 / td:6.2f}x "
              f"{t8 / td:6.2f}x", flush=True)
        del words


def run_kernels_bench(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("edged bench kernels: needs a CUDA GPU", file=sys.stderr)
        return 1
    if getattr(args, "w4_tensor_cores", False):
        w4_tensor_core_report()
        return 0
    if getattr(args, "split_sweep", False):
        from .split_sweep import split_sweep_report
        split_sweep_report()
        return 0
    report(sweep=getattr(args, "sweep", False))
    return 0
