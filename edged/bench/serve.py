"""`edged bench serve`: a load generator over HTTP/3 that reports per-tier latency and SLA attainment.

    edged bench serve --rate 0.5,1,2,4 --requests 64 --tier-mix gold=1,silver=2,bronze=4 \
        --json bench.json --plot bench.png

Each phase sends `--requests` streaming chat completions, either as a Poisson process at one
`--rate` (open loop: arrivals do not wait for answers, so overload shows as queueing and
rejections) or from `--concurrency` closed-loop workers. A comma list of rates (or concurrencies)
runs one phase per value: a sweep of latency against load. Each request's tier is sent as
`x-edged-tier`; the tiers follow `--tier-mix` weights exactly (largest remainder), shuffled by
`--seed`, as are the arrival times and the synthetic prompts.

The load comes from `--clients` processes (clients.py), each with its own connections and an even
share of every phase, so that one client core does not cap what the daemon shows. The QUIC
handshake is timed apart from the requests: TTFT starts once a request has its connection.

Requests are greedy (`temperature: 0`) with `ignore_eos: true`, so each yields exactly its
`max_tokens`. Deterministic requests are what the daemon's result cache answers from disk, so
every prompt starts with a short per-run nonce (leave it out with --allow-cache-hits).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from edged.bench.clients import default_clients, open_clients, split_phase
from edged.bench.handshake_probe import probe_handshakes
from edged.bench.load import DEFAULT_TIMEOUT_S, STREAMS_PER_CONNECTION, ClientSettings, WorkItem
from edged.bench.report import format_phase, latency_summary, load_label, summarize_phase, write_json, write_plot

_WORDS = (
    "the quick brown fox jumps over a lazy dog while river stones glitter under morning light and "
    "old maps describe mountains forests cities harbors bridges towers markets gardens libraries "
    "engineers write careful notes about engines pumps valves circuits signals batteries sensors "
    "farmers plant wheat barley corn beans apples pears plums grapes in spring summer autumn winter "
    "children read stories about dragons castles ships pirates islands storms stars planets comets "
    "music drums violin piano trumpet song dance painter canvas color blue green red yellow purple "
    "history science language number question answer reason system network memory window door "
    "kitchen bread cheese soup coffee tea sugar salt pepper garlic onion tomato lemon honey butter"
).split()


@dataclass(slots=True)
class BenchConfig:
    host: str = "127.0.0.1"
    port: int = 4433
    ca_file: str | None = None
    insecure: bool = False
    rates: list[float] | None = None  # Poisson phases; None: concurrency phases
    concurrencies: list[int] = field(default_factory=lambda: [8])
    requests: int = 64  # per phase
    tier_mix: dict[str, float] = field(default_factory=lambda: {"gold": 1.0, "silver": 1.0, "bronze": 1.0})
    prompt_tokens: int = 64
    output_tokens: int = 32
    dataset: str | None = None
    targets_ms: dict[str, float] = field(default_factory=dict)
    tpot_targets_ms: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S  # per request
    model: str | None = None
    cache_bust: bool = True
    streams_per_connection: int = STREAMS_PER_CONNECTION
    clients: int = 1  # client processes; 1: this process's event loop
    requests_per_stream: int | None = None  # closed loop: requests = this x concurrency (else `requests`)
    probe_handshakes: bool = False  # also time fresh connections' handshakes while each phase runs

    def client_settings(self) -> ClientSettings:
        return ClientSettings(self.host, self.port, self.ca_file, self.insecure, self.model, self.timeout_s,
                              self.streams_per_connection)

    def phase_requests(self, load: dict[str, Any]) -> int:
        if self.requests_per_stream and load.get("concurrency"):
            return self.requests_per_stream * load["concurrency"]
        return self.requests


# ------------------------------------------------------------------------------------- arguments


def parse_weights(text: str, what: str = "--tier-mix") -> dict[str, float]:
    """"gold=1,silver=2" -> {"gold": 1.0, "silver": 2.0}; ValueError saying what is wrong."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        try:
            v = float(value)
        except ValueError:
            v = math.nan
        if not sep or not name or not math.isfinite(v) or v < 0:
            raise ValueError(f"{what}: expected NAME=NUMBER pairs separated by commas, got {part!r}")
        out[name] = v
    if not out or not any(out.values()):
        raise ValueError(f"{what}: needs at least one entry with a positive value, got {text!r}")
    return out


def parse_numbers(text: Any, what: str, cast: Callable[[str], Any] = float) -> list[Any]:
    """"0.5,1,2" (or a number) -> [0.5, 1.0, 2.0], each positive."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = cast(part) if cast is not int else int(float(part))
        except ValueError:
            raise ValueError(f"{what}: expected a positive number or a comma list, got {part!r}") from None
        if not v > 0 or (isinstance(v, float) and not math.isfinite(v)):
            raise ValueError(f"{what}: values must be positive, got {part!r}")
        out.append(v)
    if not out:
        raise ValueError(f"{what}: expected a positive number or a comma list, got {text!r}")
    return out


def default_targets() -> dict[str, float]:
    """TTFT targets of the built-in tiers (config.yaml's defaults)."""
    from edged.config import default_tiers

    return {name: t.ttft_target_ms for name, t in default_tiers().items()}


def default_tpot_targets() -> dict[str, float]:
    """Time-per-output-token targets of the built-in tiers (config.yaml's defaults)."""
    from edged.config import default_tiers

    return {name: t.tpot_target_ms for name, t in default_tiers().items() if t.tpot_target_ms is not None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `bench serve` flags (besides --host/--port/--ca-file/--insecure/--state-dir)."""
    p.add_argument("--rate", help="Poisson arrivals per second; a comma list (0.5,1,2,4) runs one phase per rate "
                                  "(default: closed loop at --concurrency)")
    p.add_argument("--concurrency", default="8", help="closed-loop requests in flight when no --rate; a comma "
                                                       "list runs one phase each (default: %(default)s)")
    p.add_argument("--requests", type=int, default=64, help="requests per phase (default: %(default)s)")
    p.add_argument("--tier-mix", default="gold=1,silver=1,bronze=1",
                   help="tier weights, sent as x-edged-tier (default: %(default)s)")
    p.add_argument("--targets", help="TTFT targets in ms per tier, e.g. gold=500,silver=2000,bronze=10000 "
                                     "(default: config.yaml's built-in tiers)")
    p.add_argument("--tpot-targets", help="time-per-output-token targets in ms per tier, e.g. gold=40,silver=100 "
                                          "(default: config.yaml's built-in tiers)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="synthetic prompt length in words (~tokens)")
    p.add_argument("--output-tokens", type=int, default=32, help="tokens generated per synthetic request")
    p.add_argument("--dataset", help="JSONL, one {\"prompt\": ..., \"max_tokens\": ...} per line "
                                     "(optional \"tier\"); replaces the synthetic prompts")
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals, tier order and prompts")
    add_client_arguments(p)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request")
    p.add_argument("--model", help="the \"model\" field to send (default: the daemon's only model)")
    p.add_argument("--allow-cache-hits", action="store_true",
                   help="send prompts verbatim (no per-run nonce): repeats may come from the result cache")
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--plot", help="write a PNG of latency against load here")


def add_client_arguments(p: argparse.ArgumentParser, streams_per_connection: int = STREAMS_PER_CONNECTION) -> None:
    """The flags of the load generator itself (shared by `bench serve` and `bench transport`)."""
    p.add_argument("--clients", type=int, default=default_clients(),
                   help="client processes that drive the load, each with its own connections and an even share "
                        "of each phase; 1 runs it in this process (default: half the cores, 1 to 8: %(default)s)")
    p.add_argument("--probe-handshakes", action="store_true",
                   help="while each phase runs, also open fresh connections one after another from this process "
                        "and report their QUIC handshake p50/p99 under load")
    p.add_argument("--streams-per-connection", type=int, default=streams_per_connection,
                   help="requests in flight per QUIC connection before a client opens another; more "
                        "connections spread over more of the daemon's worker processes (default: %(default)s)")


def clients_from_args(args: argparse.Namespace, cfg: BenchConfig) -> None:
    """--clients and --streams-per-connection into cfg (ValueError with the flag and the reason)."""
    clients, spc = getattr(args, "clients", None), getattr(args, "streams_per_connection", None)
    cfg.clients = 1 if clients is None else int(clients)
    cfg.probe_handshakes = bool(getattr(args, "probe_handshakes", False))
    cfg.streams_per_connection = STREAMS_PER_CONNECTION if spc is None else int(spc)
    if not 1 <= cfg.clients <= 64:
        raise ValueError(f"--clients: must be 1 to 64, got {cfg.clients}")
    if cfg.streams_per_connection <= 0:
        raise ValueError(f"--streams-per-connection: must be positive, got {cfg.streams_per_connection}")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """argparse Namespace -> BenchConfig (ValueError with the flag and the reason)."""
    g = lambda name, default=None: getattr(args, name, default)  # noqa: E731  (flags the CLI may lack)
    from edged.daemon import resolve_ca_file

    cfg = BenchConfig(host=_connect_host(g("host", "127.0.0.1")), port=g("port", 4433),
                      ca_file=resolve_ca_file(g("ca_file"), bool(g("insecure")), g("state_dir")),
                      insecure=bool(g("insecure")))
    if g("rate") is not None:
        cfg.rates = parse_numbers(g("rate"), "--rate")
    cfg.concurrencies = parse_numbers(g("concurrency", 8), "--concurrency", int)
    cfg.requests = int(g("requests", 64))
    if cfg.requests <= 0:
        raise ValueError(f"--requests: must be positive, got {cfg.requests}")
    cfg.tier_mix = parse_weights(g("tier_mix") or "gold=1,silver=1,bronze=1")
    cfg.targets_ms = default_targets()
    if g("targets"):
        cfg.targets_ms.update(parse_weights(g("targets"), "--targets"))
    cfg.tpot_targets_ms = default_tpot_targets()
    if g("tpot_targets"):
        cfg.tpot_targets_ms.update(parse_weights(g("tpot_targets"), "--tpot-targets"))
    cfg.prompt_tokens = int(g("prompt_tokens", 64))
    cfg.output_tokens = int(g("output_tokens", 32))
    if cfg.prompt_tokens <= 0 or cfg.output_tokens <= 0:
        raise ValueError("--prompt-tokens and --output-tokens must be positive")
    cfg.dataset = g("dataset")
    cfg.seed = int(g("seed", 0))
    cfg.timeout_s = float(g("timeout", DEFAULT_TIMEOUT_S))
    cfg.model = g("model")
    cfg.cache_bust = not g("allow_cache_hits", False)
    clients_from_args(args, cfg)
    return cfg


def _connect_host(host: str) -> str:
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host.strip("[]"))


# -------------------------------------------------------------------------------------- workload


def tier_sequence(mix: dict[str, float], n: int, rng: random.Random) -> list[str]:
    """n tier names in the mix's proportions (largest remainder, ties to the earlier tier), shuffled."""
    total = sum(mix.values())
    exact = {t: n * w / total for t, w in mix.items()}
    counts = {t: int(math.floor(v)) for t, v in exact.items()}
    order = sorted(mix, key=lambda t: (-(exact[t] - counts[t]), list(mix).index(t)))
    for t in order[: n - sum(counts.values())]:
        counts[t] += 1
    tiers = [t for t in mix for _ in range(counts[t])]
    rng.shuffle(tiers)
    return tiers


def synthetic_prompt(rng: random.Random, words: int) -> str:
    """`words` words of varied text (roughly as many tokens for this tokenizer family)."""
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def load_dataset(path: str) -> list[tuple[str, int, str | None]]:
    """JSONL lines {"prompt": str, "max_tokens": int, optional "tier": str} -> (prompt, max_tokens, tier)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                prompt, max_tokens = obj["prompt"], int(obj["max_tokens"])
                tier = obj.get("tier")
                if not isinstance(prompt, str) or not prompt or max_tokens <= 0:
                    raise ValueError("prompt must be a non-empty string and max_tokens positive")
                if tier is not None and not isinstance(tier, str):
                    raise ValueError("tier must be a string")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i}: {e if not isinstance(e, KeyError) else f'missing {e}'}") from None
            out.append((prompt, max_tokens, tier))
    if not out:
        raise ValueError(f"{path}: no requests in the dataset")
    return out


def build_workload(cfg: BenchConfig, rng: random.Random, n: int,
                   dataset: list[tuple[str, int, str | None]] | None = None) -> list[WorkItem]:
    """n requests: tiers from the mix; prompts from the dataset (cycled, shuffled) or synthetic."""
    tiers = tier_sequence(cfg.tier_mix, n, rng)
    nonce = os.urandom(3).hex()
    items = []
    if dataset:
        picks = [dataset[i % len(dataset)] for i in range(n)]
        rng.shuffle(picks)
    for i, tier in enumerate(tiers):
        if dataset:
            prompt, max_tokens, own_tier = picks[i]
            tier = own_tier or tier
        else:
            prompt, max_tokens = synthetic_prompt(rng, cfg.prompt_tokens), cfg.output_tokens
        if cfg.cache_bust:
            prompt = f"[{nonce}-{i}] {prompt}"
        items.append(WorkItem(prompt, max_tokens, tier))
    return items


def arrival_offsets(rng: random.Random, rate: float, n: int) -> list[float]:
    """Send times of a Poisson process at `rate`, seconds after the phase start (the first at 0)."""
    out, at = [], 0.0
    for i in range(n):
        if i:
            at += rng.expovariate(rate)
        out.append(at)
    return out


async def run_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None,
                    on_phase: Callable[[dict[str, Any]], None] | None = None,
                    before_phase: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every phase of the benchmark; the report (see report.py) with one entry per phase.
    `progress` hears when a phase starts, `before_phase` is called once the phase's connections are
    open, just before its requests go out, and `on_phase` gets each phase's summary as it ends."""
    rng = random.Random(cfg.seed)
    dataset = load_dataset(cfg.dataset) if cfg.dataset else None
    loads: Iterable[dict[str, Any]] = ([{"rate": r, "concurrency": None} for r in cfg.rates] if cfg.rates else
                                       [{"rate": None, "concurrency": c} for c in cfg.concurrencies])
    clients = open_clients(cfg.client_settings(), cfg.clients)
    phases = []
    try:
        for load in loads:
            items = build_workload(cfg, rng, cfg.phase_requests(load), dataset)
            offsets = arrival_offsets(rng, load["rate"], len(items)) if load["rate"] is not None else None
            shares = split_phase(items, cfg.clients, concurrency=load["concurrency"], offsets=offsets,
                                 streams_per_connection=cfg.streams_per_connection)
            await clients.prepare(shares)
            if progress:
                progress(f"{load_label(load)}, {len(items)} requests from {len(shares)} "
                         f"client{'s' if len(shares) > 1 else ''}")
            if before_phase:
                before_phase(load)
            stop = asyncio.Event()
            probe = asyncio.create_task(probe_handshakes(cfg.host, cfg.port, cfg.ca_file, cfg.insecure, stop)) \
                if cfg.probe_handshakes else None
            run = await clients.run()
            stop.set()
            phases.append(summarize_phase(run.results, run.duration_s, cfg.targets_ms, load, tier_order=cfg.tier_mix,
                                          handshakes=run.handshakes, client_cpu_s=run.client_cpu_s,
                                          tpot_targets_ms=cfg.tpot_targets_ms))
            if probe is not None:
                phases[-1]["handshake_under_load"] = latency_summary(await probe)
            if on_phase:
                on_phase(phases[-1])
    finally:
        await clients.close()
    return {"config": _config_record(cfg), "phases": phases}


def _config_record(cfg: BenchConfig) -> dict[str, Any]:
    return {"host": cfg.host, "port": cfg.port, "rates": cfg.rates, "concurrencies": None if cfg.rates else
            cfg.concurrencies, "requests_per_phase": cfg.requests if not cfg.requests_per_stream else None,
            "requests_per_stream": cfg.requests_per_stream, "tier_mix": cfg.tier_mix,
            "targets_ms": cfg.targets_ms, "tpot_targets_ms": cfg.tpot_targets_ms,
            "prompt_tokens": None if cfg.dataset else cfg.prompt_tokens,
            "output_tokens": None if cfg.dataset else cfg.output_tokens, "dataset": cfg.dataset, "seed": cfg.seed,
            "clients": cfg.clients, "streams_per_connection": cfg.streams_per_connection}


def run_serve_bench(args: argparse.Namespace) -> int:
    """`edged bench serve`: 0 when every phase ran (rejections are results, not failures); 1 on a usage
    error or when the daemon cannot be reached."""
    from edged.server.h3_client import ConnectError

    try:
        cfg = config_from_args(args)
        if cfg.dataset:
            load_dataset(cfg.dataset)  # fail before connecting
    except (ValueError, OSError) as e:
        print(f"edged bench serve: {e}", file=sys.stderr)
        return 1
    try:
        report = asyncio.run(run_bench(cfg, progress=lambda m: print(f"bench serve: {m} ...", file=sys.stderr,
                                                                     flush=True),
                                       on_phase=lambda p: print(format_phase(p) + "\n", flush=True)))
    except ConnectError as e:
        print(f"edged bench serve: could not reach edged at {cfg.host}:{cfg.port} over HTTP/3: {e}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if getattr(args, "json", None):
        write_json(args.json, report)
        print(f"wrote {args.json}")
    if getattr(args, "plot", None):
        try:
            write_plot(args.plot, report)
        except ImportError:
            print("edged bench serve: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 1
        print(f"wrote {args.plot}")
    return 0
