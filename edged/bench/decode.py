"""`edged bench decode`: decode tokens/s of random-weight models at real shapes, against the HBM roofline.

(On the CPU, `--device cpu`, the real model beside llama.cpp: edged/bench/decode_cpu.py.)

For each shape, weight format and batch size it times the decode step as the engine runs it on
CUDA (captured graph replay + sampling, tokens fed back on the device) and reports tokens/s and
the fraction of the roofline: weight bytes read per step over the copy bandwidth measured first.
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch

from edged.kernels import argmax
from edged.engine.cuda_graphs import DecodeGraphs
from edged.models.batch import KVCache
from edged.models.config import MODEL_SHAPES, ModelConfig
from edged.models.llama import LlamaModel
from edged.models.runtime_weights import build_weights, random_named_weights

CONTEXT = 512  # tokens already in each sequence's cache when timing starts
BLOCK = 16
SHORT_WINDOW_MS = 50.0  # a row timed over less swings with GPU clocks and host hiccups (SmolLM2, 32 steps)


@dataclass(frozen=True)
class KernelTime:
    """One kernel name's share of a decode step: launches and device microseconds a step."""

    name: str
    calls: float
    us: float


@dataclass
class DecodeResult:
    shape: str
    quant: str
    batch: int
    tok_s: float
    step_ms: float
    weight_gb: float
    roofline_tok_s: float
    kernels: int | None = None  # GPU kernels a decode step launches (the captured graph's kernels)
    kernels_per_layer: float | None = None
    kernel_times: list[KernelTime] | None = None  # --kernel-times: where the step's device time goes

    @property
    def fraction(self) -> float:
        return self.tok_s / self.roofline_tok_s if self.roofline_tok_s else 0.0


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1e3)


def build_model(cfg: ModelConfig, quant: str, dtype: torch.dtype) -> LlamaModel:
    named = random_named_weights(cfg, seed=0, device="cuda", dtype=dtype)
    weights = build_weights(named, cfg, quant, dtype, "cuda", group_size=32)
    del named
    gc.collect()
    torch.cuda.empty_cache()
    return LlamaModel(cfg, weights, CONTEXT + 4096)


def summarize_kernels(events: Iterable[tuple[str, float]], steps: int) -> list[KernelTime]:
    """Device events (name, microseconds) recorded over `steps` steps, as one row per name with its
    launches and microseconds a step, the most time first."""
    calls: dict[str, int] = {}
    us: dict[str, float] = {}
    for name, elapsed in events:
        calls[name] = calls.get(name, 0) + 1
        us[name] = us.get(name, 0.0) + elapsed
    rows = [KernelTime(name, calls[name] / steps, us[name] / steps) for name in calls]
    return sorted(rows, key=lambda r: (-r.us, r.name))


def profile_kernels(run: Callable[[], object], steps: int = 5) -> list[KernelTime]:
    """summarize_kernels of `steps` calls of run() (each one decode step), from torch.profiler's device
    events."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    return summarize_kernels(((e.name, e.time_range.elapsed_us()) for e in prof.events()
                              if e.device_type == DeviceType.CUDA), steps)


def count_kernels(run: Callable[[], object]) -> int | None:
    """GPU kernels that one eager call of run() launches (torch.profiler's device events, copies and fills
    left out; None where the profiler records no device activity). What a CUDA graph captures from the
    same call."""
    rows = profile_kernels(run, steps=1)
    return int(sum(k.calls for k in rows if not k.name.startswith(("Memcpy", "Memset", "[memory]")))) or None


def format_kernel_times(results: list[DecodeResult], name_width: int = 48) -> str:
    """Per result with kernel_times, its kernels: launches and device microseconds a step, and the share
    of the step's wall time. Under PDL a kernel starts before the one ahead of it ends and its wait counts
    as its own time, so the column adds up to more than the step (EDGED_PDL=0 for times that add up)."""
    lines = []
    for r in results:
        if not r.kernel_times:
            continue
        lines.append(f"{r.shape} {r.quant} batch {r.batch}: {r.step_ms * 1e3:,.1f} us a step")
        lines.append(f"  {'kernel':<{name_width}}{'calls/step':>11}{'us/step':>10}{'of step':>9}")
        for k in r.kernel_times:
            name = k.name if len(k.name) <= name_width - 1 else k.name[:name_width - 4] + "..."
            lines.append(f"  {name:<{name_width}}{k.calls:>11.1f}{k.us:>10.1f}{k.us / (r.step_ms * 1e3):>9.0%}")
    return "\n".join(lines)


def step_kernels(graphs: DecodeGraphs, batch: int) -> tuple[int | None, float | None]:
    """(kernels per decode step, per decoder layer): the step as captured (forward, logits, argmax),
    and the same step of a one-layer copy of the model, whose difference is N - 1 layers."""
    model = graphs.model
    layers = len(model.weights.layers)

    def step(m: LlamaModel) -> None:
        hidden = m.forward(graphs.input_ids[:batch], graphs.positions[:batch], graphs._meta(batch), graphs.kv)
        argmax(m.logits(hidden))

    total = count_kernels(lambda: step(model))
    if total is None or layers < 2:
        return total, None
    one = LlamaModel(model.config, replace(model.weights, layers=model.weights.layers[:1]),
                     model.cos_sin.shape[0])
    single = count_kernels(lambda: step(one))
    return total, None if single is None else (total - single) / (layers - 1)


def time_decode(model: LlamaModel, batch: int, steps: int, dtype: torch.dtype,
                kernels: list | None = None, kernel_times: list | None = None) -> float:
    """Seconds per decode step for `batch` sequences at CONTEXT tokens (graph replay + greedy sample,
    tokens fed back on the device: the device-side cost of a step, without the engine's host work).
    `kernels`, when given, receives step_kernels()' (per step, per layer); `kernel_times`, the
    profile_kernels rows of replayed steps (after the timing)."""
    cfg = model.config
    per_seq = -(-(CONTEXT + steps + 8) // BLOCK)
    kv = KVCache.allocate(cfg.num_layers, batch * per_seq, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype, "cuda")
    graphs = DecodeGraphs(model, kv, batch, per_seq, buckets=(batch,))
    graphs.block_tables.copy_(torch.arange(batch * per_seq, dtype=torch.int32, device="cuda").view(batch, per_seq))
    graphs.capture()
    if kernels is not None:
        kernels.extend(step_kernels(graphs, batch))
    rows = torch.arange(batch, device="cuda")

    def step(i: int) -> None:
        pos = CONTEXT + i
        graphs.positions.fill_(pos)
        graphs.context_lens.fill_(pos + 1)
        graphs.slot_mapping.copy_(graphs.block_tables[rows, pos // BLOCK].long() * BLOCK + pos % BLOCK)
        graphs.graphs[batch].replay()
        graphs.input_ids.copy_(graphs.greedy[batch])  # greedy, inside the graph as in the runner: no host sync

    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    if kernel_times is not None:
        kernel_times.extend(profile_kernels(lambda: step(steps)))
    return dt


def time_engine(model: LlamaModel, batch: int, steps: int, dtype: torch.dtype, overlap: bool) -> float:
    """Seconds per decode step through the whole engine (scheduling, Python bookkeeping, graph replay,
    sampling, reading tokens back), with or without launching step N+1 before reading step N."""
    from edged.engine.block_manager import BlockManager
    from edged.engine.llm_engine import LLMEngine
    from edged.engine.model_runner import ModelRunner
    from edged.engine.request import GenerationRequest, SamplingParams
    from edged.scheduler.batcher import Batcher, BatchLimits

    cfg = model.config
    total = CONTEXT + steps + 16
    per_seq = -(-total // BLOCK)
    kv = KVCache.allocate(cfg.num_layers, batch * per_seq + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype, "cuda")
    runner = ModelRunner(model, kv)
    runner.graphs = DecodeGraphs(model, kv, batch, per_seq, buckets=(batch,))
    runner.graphs.capture()
    blocks = BlockManager(batch * per_seq + 1, BLOCK, prefix_caching=False)
    engine = LLMEngine(runner, blocks, Batcher(blocks, BatchLimits(batch, batch * CONTEXT)), total, [],
                       lambda _: None, overlap)
    step = engine.step_overlapped if overlap else engine.step
    for i in range(batch):
        prompt = [(i * 7919 + j) % cfg.vocab_size for j in range(CONTEXT)]
        engine._admit(GenerationRequest(f"b{i}", prompt, SamplingParams(temperature=0, max_tokens=steps + 8,
                                                                         ignore_eos=True)))
    while any(s.num_computed < s.num_prompt_tokens for s in engine._by_id.values()):
        step()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    del engine, runner, kv
    torch.cuda.empty_cache()
    return dt


def run_decode(shapes: list[str], quants: list[str], batches: list[int], steps: int,
               dtype: torch.dtype = torch.bfloat16, kernel_times: bool = False) -> tuple[float, list[DecodeResult]]:
    bw = copy_bandwidth()
    results = []
    for name in shapes:
        cfg = MODEL_SHAPES[name]
        for quant in quants:
            model = build_model(cfg, quant, dtype)
            nbytes = model.weights.nbytes
            for batch in batches:
                counts: list = []
                times: list[KernelTime] | None = [] if kernel_times else None
                dt = time_decode(model, batch, steps, dtype, counts, times)
                results.append(DecodeResult(name, quant, batch, batch / dt, dt * 1e3, nbytes / 1e9,
                                            batch * bw / nbytes, *counts, kernel_times=times))
            del model
            gc.collect()
            torch.cuda.empty_cache()
    return bw, results


def peer_tok_s(name: str, batch: int, steps: int, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Hugging Face transformers (static cache, eager) at the same shape, when importable. Its
    torch.compile + CUDA-graph mode is not used: on transformers 5 with torch 2.11 it crashed the
    process (segfault after a cudagraph skip on the cache's in-place length update)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
    except ImportError:
        return None
    c = MODEL_SHAPES[name]
    hf_cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                         num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                         max_position_embeddings=CONTEXT + steps + 16, tie_word_embeddings=c.tie_word_embeddings)
    with torch.device("cuda"):
        model = LlamaForCausalLM(hf_cfg).to(dtype).eval()
    cache = StaticCache(config=hf_cfg, max_batch_size=batch, max_cache_len=CONTEXT + steps + 16, device="cuda",
                        dtype=dtype)
    forward = model.forward
    ids = torch.randint(0, c.vocab_size, (batch, 1), device="cuda")
    with torch.inference_mode():
        for i in range(steps + 5):
            if i == 5:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            pos = torch.tensor([CONTEXT + i], device="cuda")
            logits = forward(ids, cache_position=pos, past_key_values=cache, use_cache=True).logits
            ids = logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    del model, cache
    torch.cuda.empty_cache()
    return batch / dt


def format_engine(shapes: list[str], quants: list[str], batches: list[int], steps: int,
                  dtype: torch.dtype = torch.bfloat16) -> str:
    """Decode tok/s through the whole engine, each step read back before the next (serial) or the next
    launched first (overlapped)."""
    lines = ["engine decode (scheduling + bookkeeping + graph replay + sampling + read-back)",
             f"{'shape':<14}{'quant':<6}{'batch':>6}{'serial tok/s':>14}{'overlapped tok/s':>18}{'gain':>7}"]
    for name in shapes:
        for quant in quants:
            model = build_model(MODEL_SHAPES[name], quant, dtype)
            for batch in batches:
                serial = batch / time_engine(model, batch, steps, dtype, overlap=False)
                overlapped = batch / time_engine(model, batch, steps, dtype, overlap=True)
                lines.append(f"{name:<14}{quant:<6}{batch:>6}{serial:>14,.0f}{overlapped:>18,.0f}"
                             f"{overlapped / serial:>6.2f}x")
            del model
            gc.collect()
            torch.cuda.empty_cache()
    return "\n".join(lines)


PEER_TITLES = {
    "transformers": "Hugging Face transformers, static cache, eager, bfloat16",
    "gpt-fast": "gpt-fast int8 weight-only, torch.compile reduce-overhead (inductor + CUDA graphs), static KV cache, "
                "bfloat16 activations, greedy",
}
PEER_QUANT = {"transformers": "none", "gpt-fast": "w8"}  # edged's rows in the peer's weight format


def format_peers(peers: dict[tuple[str, int], float | None], peer: str = "transformers",
                 results: list[DecodeResult] | None = None) -> str:
    """The peer's tok/s per (shape, batch) (None: it failed, the reason printed before), beside edged's
    rows at the same shape and batch, one column per weight format, and edged / peer in the peer's format."""
    edged: dict[tuple[str, int], dict[str, float]] = {}
    for r in results or []:
        edged.setdefault((r.shape, r.batch), {})[r.quant] = r.tok_s
    quants = list(dict.fromkeys(r.quant for r in results or []))
    match = PEER_QUANT.get(peer)
    lines = [f"peer: {PEER_TITLES.get(peer, peer)}; same random-weight shapes, context {CONTEXT} tokens",
             f"{'shape':<14}{'batch':>6}{'peer tok/s':>11}" + "".join(f"{'edged ' + q:>11}" for q in quants)
             + (f"{'edged ' + match + '/peer':>17}" if match in quants else "")]
    for (name, batch), tok_s in peers.items():
        row = edged.get((name, batch), {})
        line = f"{name:<14}{batch:>6}{'failed' if tok_s is None else f'{tok_s:,.0f}':>11}"
        line += "".join(f"{'-' if q not in row else f'{row[q]:,.0f}':>11}" for q in quants)
        if match in quants:
            line += f"{'-' if tok_s is None or match not in row else f'{row[match] / tok_s:.2f}x':>17}"
        lines.append(line)
    return "\n".join(lines)


def format_table(bw: float, results: list[DecodeResult], peers: dict[tuple[str, int], float],
                 steps: int | None = None) -> str:
    """The decode table; with `steps`, rows timed over less than SHORT_WINDOW_MS end in "*" and a note
    says so."""
    short = False
    lines = [f"copy bandwidth: {bw / 1e12:.2f} TB/s (read + write); context {CONTEXT} tokens; bfloat16 activations",
             f"{'shape':<14}{'quant':<6}{'batch':>6}{'tok/s':>11}{'step ms':>9}{'weights GB':>11}"
             f"{'roofline tok/s':>15}{'of roofline':>12}{'kernels/step':>13}{'/layer':>7}{'peer tok/s':>11}"]
    for r in results:
        peer = peers.get((r.shape, r.batch)) if r.quant == "none" else None
        count = "-" if r.kernels is None else str(r.kernels)
        per_layer = "-" if r.kernels_per_layer is None else f"{r.kernels_per_layer:.1f}"
        mark = " *" if steps is not None and steps * r.step_ms < SHORT_WINDOW_MS else ""
        short = short or bool(mark)
        lines.append(f"{r.shape:<14}{r.quant:<6}{r.batch:>6}{r.tok_s:>11,.0f}{r.step_ms:>9.3f}{r.weight_gb:>11.2f}"
                     f"{r.roofline_tok_s:>15,.0f}{r.fraction:>11.0%}{count:>13}{per_layer:>7}"
                     f"{'' if peer is None else f'{peer:>11,.0f}'}{mark}")
    if short:
        lines.append(f"* timed over less than {SHORT_WINDOW_MS:.0f} ms ({steps} steps): such a row swings with GPU "
                     f"clocks and host hiccups; raise --steps for a figure to quote")
    return "\n".join(lines)


def run_decode_bench(args: argparse.Namespace) -> int:
    device = getattr(args, "device", "auto")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        from edged.bench.decode_cpu import run_cpu_decode_bench
        return run_cpu_decode_bench(args)
    if not torch.cuda.is_available():
        print("edged bench decode --device cuda: no CUDA GPU here (--device cpu times the CPU path)")
        return 1
    if args.peer not in (None, "transformers", "gpt-fast"):
        print(f"edged bench decode: on CUDA the peer is transformers or gpt-fast, not {args.peer!r}")
        return 2
    gpt_fast_dir = getattr(args, "gpt_fast_dir", None) or os.environ.get("EDGED_GPT_FAST_DIR")
    if args.peer == "gpt-fast":  # checked before the long part: a missing checkout is a usage error
        missing = [f for f in ("model.py", "quantize.py") if not gpt_fast_dir or not os.path.isfile(
            os.path.join(gpt_fast_dir, f))]
        if missing:
            print("edged bench decode --peer gpt-fast: needs gpt-fast's model.py and quantize.py in --gpt-fast-dir "
                  f"DIR or $EDGED_GPT_FAST_DIR ({gpt_fast_dir or 'neither given'}: no {' or '.join(missing)})")
            return 2
    args.batch = args.batch or "1,8,32,64"
    args.steps = args.steps or 64
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in MODEL_SHAPES]
    if unknown:
        print(f"edged bench decode: unknown shape(s) {', '.join(unknown)}; known: {', '.join(MODEL_SHAPES)}")
        return 2
    quants = [q for q in args.quant.split(",") if q]
    batches = [int(b) for b in args.batch.split(",") if b]
    kernel_times = getattr(args, "kernel_times", False)
    bw, results = run_decode(shapes, quants, batches, args.steps, kernel_times=kernel_times)
    print(format_table(bw, results, {}, args.steps), flush=True)
    if kernel_times:
        print(format_kernel_times(results), flush=True)
    if getattr(args, "engine", False):
        print(format_engine(shapes, quants, batches, args.steps), flush=True)
    if args.peer == "gpt-fast":
        from edged.bench.gpt_fast_peer import gpt_fast_tok_s
        gf_peers: dict[tuple[str, int], float | None] = {}
        for name in shapes:  # batch 1, gpt-fast's own setting; a failure prints why and leaves "failed"
            gf_peers[(name, 1)] = gpt_fast_tok_s(name, args.steps, gpt_fast_dir, batch=1)
        print(format_peers(gf_peers, "gpt-fast", results), flush=True)
    elif args.peer:
        peers: dict[tuple[str, int], float | None] = {}
        for name in shapes:
            tok_s = peer_tok_s(name, 1, args.steps)
            if tok_s is not None:
                peers[(name, 1)] = tok_s
        print(format_peers(peers, "transformers", results))
    return 0
