"""`edged bench serve`: a load generator over HTTP/3 that reports per-tier latency and SLA attainment.

    edged bench serve --rate 0.5,1,2,4 --requests 64 --tier-mix gold=1,silver=2,bronze=4 \
        --json bench.json --plot bench.png

Each phase sends `--requests` streaming chat completions, either as a Poisson process at one
`--rate` (open loop: arrivals do not wait for answers, so overload shows as queueing and
rejections) or from `--concurrency` closed-loop workers. A comma list of rates (or concurrencies)
runs one phase per value: a sweep of latency against load. Each request's tier is sent as
`x-edged-tier`; the tiers follow `--tier-mix` weights exactly (largest remainder), shuffled by
`--seed`, as are the arrival times and the synthetic prompts.

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
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from edged.bench.report import RequestResult, format_phase, load_label, summarize_phase, write_json, write_plot

STREAMS_PER_CONNECTION = 16
MAX_CONNECTIONS = 64
DEFAULT_TIMEOUT_S = 300.0

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
class WorkItem:
    prompt: str
    max_tokens: int
    tier: str


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
    seed: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S  # per request
    model: str | None = None
    cache_bust: bool = True
    streams_per_connection: int = STREAMS_PER_CONNECTION


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
    p.add_argument("--prompt-tokens", type=int, default=64, help="synthetic prompt length in words (~tokens)")
    p.add_argument("--output-tokens", type=int, default=32, help="tokens generated per synthetic request")
    p.add_argument("--dataset", help="JSONL, one {\"prompt\": ..., \"max_tokens\": ...} per line "
                                     "(optional \"tier\"); replaces the synthetic prompts")
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals, tier order and prompts")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request")
    p.add_argument("--model", help="the \"model\" field to send (default: the daemon's only model)")
    p.add_argument("--allow-cache-hits", action="store_true",
                   help="send prompts verbatim (no per-run nonce): repeats may come from the result cache")
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--plot", help="write a PNG of latency against load here")


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
    cfg.prompt_tokens = int(g("prompt_tokens", 64))
    cfg.output_tokens = int(g("output_tokens", 32))
    if cfg.prompt_tokens <= 0 or cfg.output_tokens <= 0:
        raise ValueError("--prompt-tokens and --output-tokens must be positive")
    cfg.dataset = g("dataset")
    cfg.seed = int(g("seed", 0))
    cfg.timeout_s = float(g("timeout", DEFAULT_TIMEOUT_S))
    cfg.model = g("model")
    cfg.cache_bust = not g("allow_cache_hits", False)
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


def request_body(item: WorkItem, model: str | None) -> bytes:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": item.prompt}], "max_tokens": item.max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    return json.dumps(body).encode()


# ------------------------------------------------------------------------------------ connections


class ConnectionPool:
    """QUIC connections opened as the load needs them: one more whenever every open one carries
    `per_connection` requests in flight (up to `max_connections`)."""

    def __init__(self, host: str, port: int, ca_file: str | None, insecure: bool,
                 per_connection: int = STREAMS_PER_CONNECTION, max_connections: int = MAX_CONNECTIONS,
                 idle_timeout_s: float = 120.0) -> None:
        from edged.server.h3_client import H3Client

        # A queued request may see no packets for a long while: keep the connection past its timeout.
        self._make = lambda: H3Client(host, port, ca_file=ca_file, insecure=insecure, idle_timeout=idle_timeout_s)
        self.per_connection = per_connection
        self.max_connections = max_connections
        self.inflight: dict[Any, int] = {}
        self._lock = asyncio.Lock()

    async def acquire(self) -> Any:
        async with self._lock:
            for c in [c for c in self.inflight if not c.connected]:
                self.inflight.pop(c)
            best = min(self.inflight, key=self.inflight.__getitem__, default=None)
            if best is None or (self.inflight[best] >= self.per_connection
                                and len(self.inflight) < self.max_connections):
                best = self._make()
                await best.connect()
                self.inflight[best] = 0
            self.inflight[best] += 1
            return best

    def release(self, c: Any) -> None:
        if c in self.inflight:
            self.inflight[c] -= 1

    async def warm(self, n: int) -> None:
        """Open enough connections for n requests in flight before timing starts."""
        want = min(self.max_connections, max(1, math.ceil(n / self.per_connection)))
        while len(self.inflight) < want:
            c = self._make()
            await c.connect()
            self.inflight[c] = 0

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.inflight), return_exceptions=True)
        self.inflight.clear()


# --------------------------------------------------------------------------------------- requests


async def run_request(pool: ConnectionPool, item: WorkItem, model: str | None, timeout_s: float) -> RequestResult:
    """Send one streaming chat completion and time it."""
    from edged.server.h3_client import H3ClientError, error_message, iter_sse

    body = request_body(item, model)
    headers = {"content-type": "application/json", "accept": "text/event-stream", "x-edged-tier": item.tier}
    try:
        client = await pool.acquire()
    except (H3ClientError, OSError) as e:
        return RequestResult(item.tier, time.perf_counter(), error=f"connect: {e}")
    res = RequestResult(item.tier, time.perf_counter())
    chunks, usage_tokens, done, last = 0, None, False, 0.0
    try:
        async with asyncio.timeout(timeout_s):
            rs = await client.stream("POST", "/v1/chat/completions", headers, body, timeout=None)
            res.status = rs.status
            async with rs:
                if rs.status != 200:
                    res.error = f"HTTP {rs.status}: {error_message(rs.status, await rs.read())}"
                    return res
                async for data in iter_sse(rs):
                    now = time.perf_counter()
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        res.error = (obj["error"] or {}).get("message") or "error event"
                        break
                    if obj.get("usage"):
                        usage_tokens = obj["usage"].get("completion_tokens")
                        res.prompt_tokens = obj["usage"].get("prompt_tokens")
                    if any((c.get("delta") or {}).get("content") or c.get("text") for c in obj.get("choices") or []):
                        chunks += 1
                        if res.ttft is None:
                            res.ttft = now - res.start
                        else:
                            res.itls.append(now - last)
                        last = now
                if done:
                    res.e2e = time.perf_counter() - res.start
                elif res.error is None:
                    res.error = "the stream ended without [DONE]"
    except TimeoutError:
        res.error = f"no complete response within {timeout_s:g}s"
    except (H3ClientError, ValueError) as e:  # ValueError: a malformed SSE payload
        res.error = str(e) or type(e).__name__
    finally:
        pool.release(client)
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    return res


async def run_phase(pool: ConnectionPool, items: list[WorkItem], *, rate: float | None = None,
                    concurrency: int | None = None, rng: random.Random | None = None, model: str | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[list[RequestResult], float]:
    """Send items at a Poisson `rate` (open loop) or from `concurrency` workers; (results, wall seconds)."""
    rng = rng or random.Random(0)
    t0 = time.perf_counter()
    if rate is not None:
        tasks = []
        next_at = t0
        for i, item in enumerate(items):
            if i:
                next_at += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(run_request(pool, item, model, timeout_s)))
        results = list(await asyncio.gather(*tasks))
    else:
        queue = list(reversed(items))
        results = []

        async def worker() -> None:
            while queue:
                results.append(await run_request(pool, queue.pop(), model, timeout_s))

        await asyncio.gather(*(worker() for _ in range(max(1, concurrency or 1))))
    return results, time.perf_counter() - t0


async def run_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None,
                    on_phase: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every phase of the benchmark; the report (see report.py) with one entry per phase.
    `progress` hears when a phase starts, `on_phase` gets each phase's summary as it ends."""
    rng = random.Random(cfg.seed)
    dataset = load_dataset(cfg.dataset) if cfg.dataset else None
    pool = ConnectionPool(cfg.host, cfg.port, cfg.ca_file, cfg.insecure, cfg.streams_per_connection,
                          idle_timeout_s=max(120.0, cfg.timeout_s + 30))
    loads: Iterable[dict[str, Any]] = ([{"rate": r, "concurrency": None} for r in cfg.rates] if cfg.rates else
                                       [{"rate": None, "concurrency": c} for c in cfg.concurrencies])
    phases = []
    try:
        for load in loads:
            items = build_workload(cfg, rng, cfg.requests, dataset)
            await pool.warm(load["concurrency"] or min(cfg.requests, cfg.streams_per_connection))
            if progress:
                progress(f"bench serve: {load_label(load)}, {len(items)} requests ...")
            results, wall = await run_phase(pool, items, rate=load["rate"], concurrency=load["concurrency"],
                                            rng=rng, model=cfg.model, timeout_s=cfg.timeout_s)
            phases.append(summarize_phase(results, wall, cfg.targets_ms, load, tier_order=cfg.tier_mix))
            if on_phase:
                on_phase(phases[-1])
    finally:
        await pool.close()
    return {"config": _config_record(cfg), "phases": phases}


def _config_record(cfg: BenchConfig) -> dict[str, Any]:
    return {"host": cfg.host, "port": cfg.port, "rates": cfg.rates, "concurrencies": None if cfg.rates else
            cfg.concurrencies, "requests_per_phase": cfg.requests, "tier_mix": cfg.tier_mix,
            "targets_ms": cfg.targets_ms, "prompt_tokens": None if cfg.dataset else cfg.prompt_tokens,
            "output_tokens": None if cfg.dataset else cfg.output_tokens, "dataset": cfg.dataset, "seed": cfg.seed}


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
        report = asyncio.run(run_bench(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True),
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
