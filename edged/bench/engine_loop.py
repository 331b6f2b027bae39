"""`edged bench engine`: the engine alone under the serving benchmark's closed loop.

    edged bench engine --model smollm2.gguf --concurrency 1,16,64 --max-tokens 128

`edged bench decode --engine` times decode steps only; a server's requests also need their
prefill, and in a closed loop a new request's prefill joins the batch every few steps. This runs
that workload in-process - `concurrency` requests in flight, each finished one replaced by a new
one, greedy, `max_tokens` each - through the real engine (scheduler, chunked prefill, CUDA graphs
for decode, overlapped steps), with no HTTP, no worker process, no IPC. What `edged bench serve`
delivers at the same concurrency, divided by this, is the share the front end lets through.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import numpy as np

PROMPT_TOKENS = 96  # about what a `bench serve` prompt of 64 words is after the chat template
WARMUP_TOKENS = 8


@dataclass(slots=True)
class LoopResult:
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    ttft_ms: list[float]
    steps: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def closed_loop(engine, vocab: int, concurrency: int, requests: int, prompt_tokens: int, max_tokens: int,
                seed: int = 0) -> LoopResult:
    """Run `requests` requests, `concurrency` at a time, on the calling thread (the engine's own
    thread is not started)."""
    from edged.engine.request import GenerationRequest, SamplingParams

    rng = random.Random(seed)
    sent = done = tokens = steps = 0
    started: dict[str, float] = {}
    ttft: list[float] = []

    def admit() -> None:
        nonlocal sent
        rid = f"loop{seed}-{sent}"
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        started[rid] = time.perf_counter()
        engine._admit(GenerationRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                    ignore_eos=True)))
        sent += 1

    step = engine.step_overlapped if engine.overlap else engine.step
    t0 = time.perf_counter()
    for _ in range(min(concurrency, requests)):
        admit()
    while done < requests:
        outputs = step()
        steps += 1
        now = time.perf_counter()
        for out in outputs:
            tokens += len(out.new_token_ids)
            if out.request_id in started and out.new_token_ids:
                ttft.append((now - started.pop(out.request_id)) * 1000)
            if out.finished:
                done += 1
                if sent < requests:
                    admit()
    while engine.has_work():  # a step still in flight (overlap) belongs to no request
        step()
    return LoopResult(concurrency, requests, tokens, time.perf_counter() - t0, ttft, steps)


def format_results(results: list[LoopResult], device: str, model_id: str) -> str:
    lines = [f"engine closed loop on {device}: {model_id}, greedy, every finished request replaced at once",
             f"{'concurrency':>11}  {'requests':>8}  {'tok/s':>9}  {'TTFT p50 ms':>11}  {'TTFT p99 ms':>11}  "
             f"{'mean step ms':>12}"]
    for r in results:
        p50, p99 = (np.percentile(r.ttft_ms, q) if r.ttft_ms else float("nan") for q in (50, 99))
        lines.append(f"{r.concurrency:>11}  {r.requests:>8}  {r.tok_s:>9,.0f}  {p50:>11.1f}  {p99:>11.1f}  "
                     f"{r.seconds / max(1, r.steps) * 1000:>12.2f}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a .gguf file or HF directory (default: the embedded SmolLM2)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the engine runs")
    p.add_argument("--concurrency", default="1,16,64", help="requests in flight, a comma list (default: %(default)s)")
    p.add_argument("--requests", type=int, help="requests per phase (default: 4 x concurrency, at least 16)")
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                   help="random prompt tokens per request (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (default: %(default)s)")


def run_engine_loop_command(args: argparse.Namespace) -> int:
    from edged.engine.setup import EngineSettings, build_engine
    from edged.models.loader import load_model

    try:
        concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        print(f"edged bench engine: --concurrency must be a comma list of integers, got {args.concurrency!r}")
        return 2
    if not concurrencies or min(concurrencies) < 1 or args.max_tokens < 1 or args.prompt_tokens < 1:
        print("edged bench engine: --concurrency, --max-tokens and --prompt-tokens must be at least 1")
        return 2
    loaded = load_model(args.model)
    settings = EngineSettings(device=args.device, max_num_seqs=max(concurrencies),
                              max_model_len=args.prompt_tokens + args.max_tokens + WARMUP_TOKENS,
                              prefix_caching=False)
    front = build_engine(loaded, settings)
    engine, vocab = front.engine, loaded.config.vocab_size
    results = []
    for c in concurrencies:
        closed_loop(engine, vocab, c, c, args.prompt_tokens, WARMUP_TOKENS, seed=-c)  # compile, capture, warm
        n = args.requests or max(16, 4 * c)
        results.append(closed_loop(engine, vocab, c, n, args.prompt_tokens, args.max_tokens, seed=c))
    print(format_results(results, str(engine.runner.device), loaded.model_id), flush=True)
    return 0
