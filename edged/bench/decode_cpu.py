"""`edged bench decode --device cpu [--peer llama.cpp]`: the real model on the CPU, beside llama.cpp.

edged runs as the daemon builds it (`build_engine`: model.quant auto, float32 activations, the
paged KV cache, the engine's step loop with its scheduling and bookkeeping) and llama.cpp runs
through llama-cpp-python's low-level API on the same GGUF file, each in a process of its own so
that RSS is each one's own. Both get the same thread count and the same token ids (random, seeded):

- prefill tok/s: one prompt of `--prompt-tokens` tokens in one step (median of `--repeat` runs);
- decode tok/s at each batch size: that many streams, each with a `--context`-token prompt
  already prefilled, then `--steps` greedy decode steps timed (tokens/s over all streams);
- RSS after the run and the process's peak RSS.

llama-cpp-python is an optional bench dependency: `pip install llama-cpp-python` (a source build).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

PROMPT_TOKENS = 128
CONTEXT = 32
STEPS = 64
PEERS = ("llama.cpp",)


def token_ids(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MB."""
    import resource

    import psutil

    return psutil.Process().memory_info().rss / 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- workers: one process each -----------------------------------------------------------------------

def edged_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from edged.engine.request import GenerationRequest, SamplingParams
    from edged.engine.setup import EngineSettings, build_engine
    from edged.models.loader import load_model

    loaded = load_model(cfg["model"])
    vocab = loaded.config.vocab_size
    batches, steps, ctx, prompt = cfg["batches"], cfg["steps"], cfg["context"], cfg["prompt_tokens"]
    settings = EngineSettings(device="cpu", quant="auto", dtype="auto", prefix_caching=False,
                              max_num_seqs=max(batches), max_batch_tokens=max(prompt, ctx * max(batches)),
                              max_model_len=max(prompt, ctx + steps + 16) + 16)
    async_engine = build_engine(loaded, settings)
    del loaded
    torch.set_num_threads(cfg["threads"])
    engine = async_engine.engine
    weights = engine.runner.model.weights
    formats = sorted({w.format for layer in weights.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)})
    n = 0

    def admit(ids: list[int], max_tokens: int) -> None:
        nonlocal n
        n += 1
        engine._admit(GenerationRequest(f"r{n}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                      ignore_eos=True)))

    def drain() -> None:
        while engine._by_id:
            engine.step()

    prefill = []
    for rep in range(3):
        admit(token_ids(prompt, 1000 + rep, vocab), 1)
        t0 = time.perf_counter()
        engine.step()  # the whole prompt is one chunk; the step samples its first token
        prefill.append(prompt / (time.perf_counter() - t0))
        drain()
    decode = {}
    for b in batches:
        for i in range(b):
            admit(token_ids(ctx, 2000 + 97 * b + i, vocab), steps + 4)
        for _ in range(3):  # the prompts, then two decode steps
            engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        dt = time.perf_counter() - t0
        decode[str(b)] = {"tok_s": b * steps / dt, "step_ms": dt / steps * 1e3}
        drain()
    rss, peak = rss_mb()
    return {"system": "edged", "weights": "+".join(formats) + f" (head {weights.lm_head.format})",
            "threads": torch.get_num_threads(), "prefill_tok_s": statistics.median(prefill), "decode": decode,
            "rss_mb": rss, "peak_rss_mb": peak}


def llama_cpp_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp as L
    import numpy as np

    from edged.models.default_model import default_model_path

    path = str(cfg["model"] or default_model_path())
    batches, steps, ctx, prompt = cfg["batches"], cfg["steps"], cfg["context"], cfg["prompt_tokens"]
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cp = L.llama_context_default_params()
    per_seq = max(prompt, ctx + steps + 8) + 8
    cp.n_ctx = per_seq * max(batches)
    cp.n_batch = cp.n_ubatch = max(prompt, ctx * max(batches))
    cp.n_seq_max = max(batches)
    cp.n_threads = cp.n_threads_batch = cfg["threads"]
    cp.no_perf = True
    lctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(cp.n_batch, 0, cp.n_seq_max)
    memory = L.llama_get_memory(lctx)

    def decode_step(rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """rows of (token, position, sequence, wants logits) -> greedy next token of each logits row."""
        batch.n_tokens = len(rows)
        for i, (tok, pos, seq, out) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
            batch.seq_id[i][0] = seq
        if L.llama_decode(lctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.ctypeslib.as_array(L.llama_get_logits_ith(lctx, i), shape=(vocab,)).argmax())
                for i, row in enumerate(rows) if row[3]]

    prefill = []
    for rep in range(3):
        L.llama_memory_clear(memory, True)
        ids = token_ids(prompt, 1000 + rep, vocab)
        t0 = time.perf_counter()
        decode_step([(t, p, 0, p == prompt - 1) for p, t in enumerate(ids)])
        prefill.append(prompt / (time.perf_counter() - t0))
    decode = {}
    for b in batches:
        L.llama_memory_clear(memory, True)
        prompts = [token_ids(ctx, 2000 + 97 * b + s, vocab) for s in range(b)]
        rows = [(t, p, s, p == ctx - 1) for s in range(b) for p, t in enumerate(prompts[s])]
        toks = decode_step(rows)
        pos = ctx
        for i in range(2 + steps):
            if i == 2:
                t0 = time.perf_counter()
            toks = decode_step([(toks[s], pos, s, True) for s in range(b)])
            pos += 1
        dt = time.perf_counter() - t0
        decode[str(b)] = {"tok_s": b * steps / dt, "step_ms": dt / steps * 1e3}
    rss, peak = rss_mb()  # while the model and context are alive, as for edged
    L.llama_batch_free(batch)
    L.llama_free(lctx)
    L.llama_model_free(model)
    return {"system": "llama.cpp", "weights": f"GGUF as stored ({L.__version__})",
            "threads": cfg["threads"], "prefill_tok_s": statistics.median(prefill), "decode": decode,
            "rss_mb": rss, "peak_rss_mb": peak}


WORKERS = {"edged": edged_worker, "llama.cpp": llama_cpp_worker}


# --- the command --------------------------------------------------------------------------------------

def run_worker(system: str, cfg: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)  # the same for both systems (llama.cpp's CPU backend runs on OpenMP too)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `edged` sets it: see edged/cli.py
    proc = subprocess.run([sys.executable, "-m", "edged.bench.decode_cpu", system, json.dumps(cfg)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} benchmark failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median_result(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over repeated runs (separate processes)."""
    out = dict(runs[0])
    for key in ("prefill_tok_s", "rss_mb", "peak_rss_mb"):
        out[key] = statistics.median(r[key] for r in runs)
    out["decode"] = {b: {k: statistics.median(r["decode"][b][k] for r in runs) for k in ("tok_s", "step_ms")}
                     for b in runs[0]["decode"]}
    out["runs"] = len(runs)
    return out


def format_table(results: list[dict[str, Any]], cfg: dict[str, Any]) -> str:
    lines = [f"CPU decode, real model ({cfg['model'] or 'embedded SmolLM2-135M-Instruct Q4_1 GGUF'}); "
             f"{cfg['threads']} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'PASSIVE')}; "
             f"prefill of {cfg['prompt_tokens']} tokens; decode from {cfg['context']}-token "
             f"contexts, {cfg['steps']} greedy steps; median of {cfg['repeat']} run(s)",
             f"{'system':<10}{'weights':<36}{'batch':>6}{'decode tok/s':>14}{'step ms':>9}{'prefill tok/s':>15}"
             f"{'RSS MB':>8}{'peak MB':>9}"]
    for r in results:
        for i, (b, d) in enumerate(r["decode"].items()):
            head = (f"{r['system']:<10}{r['weights']:<36}" if i == 0 else " " * 46)
            tail = f"{r['prefill_tok_s']:>15,.0f}{r['rss_mb']:>8,.0f}{r['peak_rss_mb']:>9,.0f}" if i == 0 else ""
            lines.append(f"{head}{b:>6}{d['tok_s']:>14,.1f}{d['step_ms']:>9.2f}{tail}")
    edged = results[0]
    b1 = edged["decode"].get("1")
    if b1:
        for b, d in edged["decode"].items():
            if b != "1":
                lines.append(f"edged batch {b} / batch 1 aggregate tok/s: {d['tok_s'] / b1['tok_s']:.2f}x")
    for peer in results[1:]:
        if b1 and "1" in peer["decode"]:
            lines.append(f"edged / {peer['system']}: batch-1 decode {b1['tok_s'] / peer['decode']['1']['tok_s']:.2f}x, "
                         f"prefill {edged['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x")
    return "\n".join(lines)


def run_cpu_decode_bench(args: argparse.Namespace) -> int:
    import psutil

    peer = getattr(args, "peer", None)
    if peer and peer not in PEERS:
        print(f"edged bench decode --device cpu: unknown peer {peer!r} (known: {', '.join(PEERS)})")
        return 2
    if peer == "llama.cpp":
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("edged bench decode --peer llama.cpp: needs llama-cpp-python (pip install llama-cpp-python)")
            return 2
    cfg = {"model": getattr(args, "model", None), "batches": [int(b) for b in (args.batch or "1,4,8").split(",") if b],
           "steps": args.steps or STEPS, "context": args.context, "prompt_tokens": args.prompt_tokens,
           "threads": args.threads or psutil.cpu_count(logical=False) or 1, "repeat": max(1, args.repeat)}
    results = []
    for system in ["edged", *([peer] if peer else [])]:
        results.append(median_result([run_worker(system, cfg) for _ in range(cfg["repeat"])]))
    print(format_table(results, cfg))
    return 0


if __name__ == "__main__":  # a worker: python -m edged.bench.decode_cpu SYSTEM CONFIG_JSON
    print(json.dumps(WORKERS[sys.argv[1]](json.loads(sys.argv[2]))))
