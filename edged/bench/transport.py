"""`edged bench transport`: the daemon's front end alone, against a model that costs nothing.

    edged bench transport --workers auto --concurrency 1,16,64,128 --max-tokens 128 --json t.json

It writes a tiny random-weight model that carries the default model's tokenizer and chat template
(tiny_model.py: same tokens, same template, a step costs next to nothing), a config that serves it
on a free loopback UDP port from a temporary state directory, starts `edged serve --config ...`,
waits for its "ready " line, then sweeps closed-loop concurrency with the multi-process client of
`bench serve` (clients.py). Whatever limits tokens/s here is HTTP/3, TLS, SSE, detokenization and
the worker <-> core messaging: the part of the daemon that has to keep up with a fast GPU. Each
phase reports throughput, TTFT / ITL / handshake percentiles and every daemon process's CPU use
(transport_report.py). The daemon is stopped with SIGTERM at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edged.bench.serve import BenchConfig, add_client_arguments, clients_from_args, parse_numbers

TIER = "bench"  # one tier of our own: no TTFT target or queue bound of the defaults refuses the load
TRANSPORT_STREAMS_PER_CONNECTION = 4  # several connections per client, so SO_REUSEPORT spreads them


@dataclass(slots=True)
class TransportConfig:
    concurrencies: list[int]
    max_tokens: int = 128
    rounds: int = 4  # requests per phase = rounds x concurrency
    prompt_tokens: int = 32
    workers: str = "auto"
    model: str | None = None  # None: a tiny random-weight model made for the run
    ready_timeout_s: float = 300.0
    timeout_s: float = 300.0  # per request


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="1,16,64,128",
                   help="closed-loop requests in flight, one phase per value (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="tokens generated per request (greedy, ignore_eos: exactly this many; default: %(default)s)")
    p.add_argument("--rounds", type=int, default=4,
                   help="requests per phase = ROUNDS x concurrency, so every phase keeps its concurrency "
                        "for about as long (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="synthetic prompt length in words (default: "
                                                                "%(default)s)")
    p.add_argument("--workers", default="auto",
                   help="the daemon's server.workers: front-end worker processes, auto or 1-64 (default: %(default)s)")
    p.add_argument("--model", metavar="PATH", help="serve this .gguf file or Hugging Face directory instead of the "
                                                   "tiny random-weight model (then the model is measured too)")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds to wait for the daemon's \"ready\" log line (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default: %(default)s)")
    add_client_arguments(p, streams_per_connection=TRANSPORT_STREAMS_PER_CONNECTION)
    p.add_argument("--json", metavar="FILE", help="write the numbers as JSON here")


def config_from_args(args: argparse.Namespace) -> TransportConfig:
    """ValueError with the flag and the reason."""
    cfg = TransportConfig(parse_numbers(args.concurrency, "--concurrency", int), max_tokens=args.max_tokens,
                          rounds=args.rounds, prompt_tokens=args.prompt_tokens, workers=str(args.workers).strip(),
                          model=args.model, ready_timeout_s=args.ready_timeout, timeout_s=args.timeout)
    for flag, v in (("--max-tokens", cfg.max_tokens), ("--rounds", cfg.rounds), ("--prompt-tokens", cfg.prompt_tokens),
                    ("--ready-timeout", cfg.ready_timeout_s), ("--timeout", cfg.timeout_s)):
        if not v > 0:
            raise ValueError(f"{flag}: must be positive, got {v}")
    if not (cfg.workers == "auto" or (cfg.workers.isdigit() and 1 <= int(cfg.workers) <= 64)):
        raise ValueError(f"--workers: must be auto or a number from 1 to 64, got {cfg.workers!r}")
    if cfg.model and not Path(cfg.model).exists():
        raise ValueError(f"--model: {cfg.model} does not exist")
    return cfg


def context_length(cfg: TransportConfig) -> int:
    """Room for the prompt (words -> tokens, the nonce, the chat template) and every generated token."""
    need = 2 * cfg.prompt_tokens + 128 + cfg.max_tokens
    return -(-need // 256) * 256


def daemon_config(cfg: TransportConfig, port: int, state_dir: Path, model_path: Path | str) -> dict[str, Any]:
    """The config.yaml the daemon runs with: the engine never the limit (room for every stream in one
    batch, no result cache, no batching window), one tier that refuses nothing, no access log."""
    seqs = max(64, max(cfg.concurrencies))
    model: dict[str, Any] = {"path": str(model_path), "max_num_seqs": seqs}
    if not cfg.model:
        model["max_model_len"] = context_length(cfg)
    return {
        "server": {"listen": f"127.0.0.1:{port}", "state_dir": str(state_dir),
                   "workers": cfg.workers if cfg.workers == "auto" else int(cfg.workers)},
        "model": model,
        "scheduler": {"default_tier": TIER, "batch_cap": seqs},
        "tiers": {TIER: {"weight": 1, "ttft_target_ms": 3_600_000, "max_queue": 100_000,
                         "batch_window_ms": {"min": 0, "initial": 0, "max": 0}}},
        "cache": {"enabled": False},
        "logging": {"access_log": False},  # a log line per request is work for the benchmark's log reader
    }


def bench_config(cfg: TransportConfig, args: argparse.Namespace, port: int, ca_file: str) -> BenchConfig:
    bench = BenchConfig(port=port, ca_file=ca_file, concurrencies=cfg.concurrencies, tier_mix={TIER: 1.0},
                        targets_ms={}, prompt_tokens=cfg.prompt_tokens, output_tokens=cfg.max_tokens,
                        timeout_s=cfg.timeout_s, requests_per_stream=cfg.rounds)
    clients_from_args(args, bench)
    return bench


def _say(msg: str) -> None:
    print(f"bench transport: {msg}", file=sys.stderr, flush=True)


def run_transport(cfg: TransportConfig, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Model, config, daemon, sweep; the report. RuntimeError when the daemon fails to start."""
    import yaml

    from edged.bench.local_daemon import LocalDaemon, free_port
    from edged.bench.proc_cpu import TreeCpu
    from edged.bench.serve import run_bench
    from edged.bench.transport_report import phase_record
    from edged.server.tls import default_ca_file

    if cfg.model:
        model_path: Path | str = cfg.model
    else:
        from edged.bench.tiny_model import write_tiny_hf_dir

        _say("writing a tiny random-weight model with the default model's tokenizer ...")
        (workdir / "model").mkdir()
        model_path = write_tiny_hf_dir(workdir / "model", max_position_embeddings=context_length(cfg))
    port = free_port()
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(daemon_config(cfg, port, workdir / "state", model_path), sort_keys=False))
    t = time.perf_counter()
    daemon = LocalDaemon.start(config_path)
    records: list[dict[str, Any]] = []
    try:
        daemon.wait_ready(cfg.ready_timeout_s)
        cpu = TreeCpu(daemon.pid)
        _say(f"edged ready on 127.0.0.1:{port} in {time.perf_counter() - t:.1f} s, "
             f"{len(cpu.processes())} processes (workers: {cfg.workers})")
        ca_file = default_ca_file(workdir / "state")
        if ca_file is None:
            raise RuntimeError(f"the daemon wrote no certificate under {workdir / 'state'}")
        bench = bench_config(cfg, args, port, ca_file)

        def phase_done(phase: dict[str, Any]) -> None:
            # Over the phase's own duration: the sampler's window also holds the clients' start margin
            # and the hand-back of their results, when the daemon is idle.
            records.append(phase_record(phase, cpu.stop(phase["duration_s"])))
            r = records[-1]
            _say(f"concurrency {r['concurrency']}: {r['completed']}/{r['requests']} ok, "
                 f"{r['token_events_per_s']:.0f} events/s, daemon CPU {r['daemon_cpu_pct']:.0f}%")

        report = asyncio.run(run_bench(bench, progress=lambda m: _say(m + " ..."),
                                       before_phase=lambda load: cpu.start(), on_phase=phase_done))
    finally:
        status = daemon.stop()
    if status != 0:
        _say(f"edged serve exited with status {status} after SIGTERM:\n{daemon.log_tail()}")
    return {"config": {**report["config"], "workers": cfg.workers, "max_tokens": cfg.max_tokens,
                       "rounds": cfg.rounds, "model": cfg.model or "tiny random-weight (default tokenizer)"},
            "daemon_exit_status": status, "phases": records}


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _stop_on_sigterm() -> Any:
    """SIGTERM interrupts the benchmark like Ctrl-C, so that it still stops the daemon it started (which
    runs in a session of its own and hears neither). The previous handler; None off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _interrupt)


def run_transport_bench(args: argparse.Namespace) -> int:
    """`edged bench transport`: 0 when every phase ran; 1 on a usage error or a daemon that did not start."""
    from edged.bench.transport_report import format_table
    from edged.server.h3_client import ConnectError

    try:
        cfg = config_from_args(args)
        clients_from_args(args, BenchConfig())  # check --clients before anything starts
    except ValueError as e:
        print(f"edged bench transport: {e}", file=sys.stderr)
        return 1
    previous = _stop_on_sigterm()
    try:
        with tempfile.TemporaryDirectory(prefix="edged-transport-") as tmp:
            report = run_transport(cfg, args, Path(tmp))
    except (RuntimeError, ConnectError, OSError) as e:
        print(f"edged bench transport: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(format_table(report["phases"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
