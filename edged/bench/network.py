"""`edged bench network`: HTTP/3 against HTTP/2 over TLS/TCP on a lossy, slow path (issue 17).

    edged bench network --loss 0,1,3,5 --delay 0,25 --reps 3 --json net.json --plot net.png

As root it creates two network namespaces joined by a delay line (netns_lab.py, delay_wire.py):
`edged serve` runs in one, on a tiny random-weight model with the default model's tokenizer
(tiny_model.py), its steps paced to --step-ms like a GPU's (lab_daemon.py), so that the path,
not the model or a busy CPU, sets the pace; a client process runs in the other
(network_client.py). nftables drops N% of the UDP and TCP packets each way; the delay line adds the
one-way delay. Per case (protocol x loss x delay), REPS runs of STREAMS concurrent streaming
chat completions of TOKENS tokens on one connection: TTFT p50/p99, inter-token gap p50/p99/max
(stalls), total time. Then a returning client at each delay: TTFT of one request on a new
connection with a full QUIC handshake, with 0-RTT (a session ticket from the previous
connection), and over a new TLS/TCP connection. --quic-cc runs the HTTP/3 cases once per server
congestion control (lab_daemon.py sets it). Output: the table on stdout, --json, --plot.

Loss comes from the kernel's random numbers (nftables `numgen random` cannot be seeded), so runs
differ; the prompts and seeds are fixed, the protocol order alternates between repetitions, and
--reps pools more runs per case.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TIER = "bench"
SERVER_PORT = 4433  # inside the daemon's own namespace: always free
QUIC_CCS = ("reno", "cubic", "reno-floor")  # aioquic's two, and edged's (server/quic_congestion.py)


@dataclass(slots=True)
class NetworkConfig:
    losses: list[int] = field(default_factory=lambda: [0, 1, 3, 5])
    delays_ms: list[float] = field(default_factory=lambda: [0.0, 25.0])
    streams: int = 8
    max_tokens: int = 256
    reps: int = 3
    quic_ccs: list[str] = field(default_factory=lambda: ["reno-floor"])
    quic_duplicates: list[int] = field(default_factory=lambda: [1500])  # server.quic.duplicate_datagram_bytes
    quic_after_loss_s: list[float] = field(default_factory=lambda: [30.0])  # server.quic.duplicate_after_loss_s
    returning_reps: int = 5
    quic_initial_rtt_ms: float | None = None
    step_ms: float = 20.0
    tcp_cc: str | None = None  # None: the namespace's default (the host's)
    warm_up: bool = True

    @property
    def stall_ms(self) -> float:
        """A gap counts as a stall above this: four steps (a lost packet costs at least a round trip)."""
        return 4 * self.step_ms if self.step_ms > 0 else 80.0
    model: str | None = None
    ready_timeout_s: float = 300.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loss",
                   help="packet loss in percent, each way, for UDP and TCP alike (nftables `numgen random` "
                        "drops in both namespaces); one case per value (default: 0,1,3,5)")
    p.add_argument("--delay",
                   help="added one-way delay in ms (the round trip grows by twice this), one case per value "
                        "(default: 0,25)")
    p.add_argument("--streams", type=int, help="concurrent streaming requests on ONE connection per run (default: 8)")
    p.add_argument("--tokens", type=int,
                   help="tokens per stream (greedy, ignore_eos: exactly this many; default: 256)")
    p.add_argument("--reps", type=int, help="runs per case; the statistics pool every stream of every run (default: 3)")
    p.add_argument("--quic-cc", default="reno-floor",
                   help="the daemon's QUIC congestion control, comma-separated to compare: reno, cubic (aioquic's "
                        "two), reno-floor (New Reno whose window never drops below the initial 10 datagrams); "
                        "the HTTP/3 cases run once per value, the daemon restarted for each (default: "
                        "%(default)s, the daemon's default)")
    p.add_argument("--quic-duplicate", default="1500", metavar="BYTES",
                   help="the daemon's server.quic.duplicate_datagram_bytes (1-RTT datagrams up to this size sent "
                        "twice; 0: off), comma-separated to compare: the HTTP/3 cases run once per congestion "
                        "control and value (default: %(default)s, the daemon's default)")
    p.add_argument("--quic-duplicate-after-loss", default="30", metavar="SECONDS",
                   help="the daemon's server.quic.duplicate_after_loss_s (copies only this long after a "
                        "connection's last loss; 0: loss or not), comma-separated to compare: once more per "
                        "value where --quic-duplicate is not 0 (default: %(default)s, the daemon's default)")
    p.add_argument("--tcp-cc", metavar="NAME",
                   help="the kernel's TCP congestion control in both namespaces, for HTTP/2: one of "
                        "net.ipv4.tcp_allowed_congestion_control (default: the host's default, which a new "
                        "namespace starts with)")
    p.add_argument("--quic-initial-rtt", type=float, metavar="MS",
                   help="the daemon's QUIC initial RTT estimate in ms (aioquic: 100), which sets the probe "
                        "timeout until the first RTT sample")
    p.add_argument("--step-ms", type=float, default=20.0,
                   help="every engine step takes at least this long (the tiny model's own steps take a few ms): "
                        "tokens come at a GPU's pace, 1000/STEP_MS per second per stream, and the CPU stays free "
                        "for the network stacks; 0 for as fast as the model goes (default: %(default)s)")
    p.add_argument("--returning-reps", type=int,
                   help="returning-client requests per mode and delay, 0 to skip them (default: 5)")
    p.add_argument("--model", metavar="PATH", help="serve this .gguf file or Hugging Face directory instead of "
                                                   "the tiny random-weight model")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run for tests: --loss 5 --delay 0 --streams 4 --tokens 32 --reps 1 "
                        "--returning-reps 1 and no warm-up run (flags given explicitly still win)")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds to wait for the daemon's \"ready\" log line (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the summaries, acceptance checks and every run as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot gap p99, longest stall and TTFT p99 against loss "
                                                      "(needs matplotlib)")


DEFAULTS = {"loss": "0,1,3,5", "delay": "0,25", "streams": 8, "tokens": 256, "reps": 3, "returning_reps": 5}
QUICK = {"loss": "5", "delay": "0", "streams": 4, "tokens": 32, "reps": 1, "returning_reps": 1}


def parse_list(text: str, flag: str, kind: type[int | float]) -> list[Any]:
    """'0,1,3' -> [0, 1, 3]; ValueError naming the flag."""
    try:
        values = [kind(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}: a comma-separated list of numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag}: no values in {text!r}")
    return values


def config_from_args(args: argparse.Namespace) -> NetworkConfig:
    """ValueError with the flag and the reason. Flags not given take DEFAULTS, or QUICK with --quick."""
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    cfg = NetworkConfig(losses=parse_list(args.loss, "--loss", int), delays_ms=parse_list(args.delay, "--delay", float),
                        streams=args.streams, max_tokens=args.tokens, reps=args.reps,
                        quic_ccs=[c.strip() for c in args.quic_cc.split(",") if c.strip()],
                        quic_duplicates=parse_list(args.quic_duplicate, "--quic-duplicate", int),
                        quic_after_loss_s=parse_list(args.quic_duplicate_after_loss, "--quic-duplicate-after-loss",
                                                     float),
                        returning_reps=args.returning_reps, quic_initial_rtt_ms=args.quic_initial_rtt, step_ms=args.step_ms,
                        tcp_cc=args.tcp_cc, warm_up=not args.quick,
                        model=args.model, ready_timeout_s=args.ready_timeout)
    if any(not 0 <= v < 100 for v in cfg.losses):
        raise ValueError(f"--loss: percentages from 0 to 99, got {args.loss}")
    if any(v < 0 for v in cfg.delays_ms):
        raise ValueError(f"--delay: must not be negative, got {args.delay}")
    for flag, v in (("--streams", cfg.streams), ("--tokens", cfg.max_tokens), ("--reps", cfg.reps)):
        if v < 1:
            raise ValueError(f"{flag}: must be positive, got {v}")
    if cfg.step_ms < 0:
        raise ValueError(f"--step-ms: must not be negative, got {cfg.step_ms}")
    if cfg.returning_reps < 0:
        raise ValueError(f"--returning-reps: must not be negative, got {cfg.returning_reps}")
    bad = [c for c in cfg.quic_ccs if c not in QUIC_CCS]
    if bad or not cfg.quic_ccs:
        raise ValueError(f"--quic-cc: one or more of {', '.join(QUIC_CCS)}, got {args.quic_cc!r}")
    if any(not 0 <= v <= 1500 for v in cfg.quic_duplicates) or not cfg.quic_duplicates:
        raise ValueError(f"--quic-duplicate: datagram sizes from 0 (off) to 1500, got {args.quic_duplicate!r}")
    if any(v < 0 for v in cfg.quic_after_loss_s):
        raise ValueError(f"--quic-duplicate-after-loss: seconds, 0 or more, got {args.quic_duplicate_after_loss!r}")
    if cfg.model and not Path(cfg.model).exists():
        raise ValueError(f"--model: {cfg.model} does not exist")
    return cfg


def _say(msg: str) -> None:
    print(f"bench network: {msg}", file=sys.stderr, flush=True)


def context_length(cfg: NetworkConfig) -> int:
    return -(-(cfg.max_tokens + 160) // 256) * 256  # the prompt and chat template take well under 160 tokens


def daemon_config(cfg: NetworkConfig, state_dir: Path, model_path: Path | str, listen: str) -> dict[str, Any]:
    """One worker (the box may have 2 cores: the engine core, a worker, the client and the wire share
    them), one tier that refuses nothing, no batching window, no access log."""
    model: dict[str, Any] = {"path": str(model_path), "max_num_seqs": max(64, cfg.streams)}
    if not cfg.model:
        model["max_model_len"] = context_length(cfg)
    return {
        "server": {"listen": listen, "state_dir": str(state_dir), "workers": 1},
        "model": model,
        "scheduler": {"default_tier": TIER},
        "tiers": {TIER: {"weight": 1, "ttft_target_ms": 3_600_000, "max_queue": 100_000,
                         "batch_window_ms": {"min": 0, "initial": 0, "max": 0}}},
        "logging": {"access_log": False},
    }


@dataclass
class ClientProcess:
    """network_client.py in the client's namespace: a JSON command in, a JSON result out."""

    proc: subprocess.Popen[str]

    @classmethod
    def start(cls, prefix: list[str], host: str, port: int, ca_file: str) -> ClientProcess:
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "edged.bench.network_client", host, str(port), ca_file],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return cls(proc)

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the client process exited (status {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_daemon(prefix: list[str], config_path: Path, env: dict[str, str]) -> Any:
    """`edged serve` (through lab_daemon, which applies the QUIC settings in `env`) in the
    daemon's namespace, as a LocalDaemon: the same log pump, readiness wait and SIGTERM stop."""
    import threading

    from edged.bench.local_daemon import LocalDaemon

    proc = subprocess.Popen([*prefix, sys.executable, "-m", "edged.bench.lab_daemon", "serve", "--config",
                             str(config_path)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    daemon = LocalDaemon(proc)  # `ip netns exec` execs the command: proc.pid is the daemon itself
    threading.Thread(target=daemon._pump, name="edged-log", daemon=True).start()
    return daemon


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


RETURNING_MODES = (("h3 full handshake", {"op": "returning", "mode": "full"}),
                   ("h3 0-RTT", {"op": "returning", "mode": "0rtt"}),
                   ("h2 new TLS/TCP", {"op": "first_h2"}))


@dataclass
class NetworkRun:
    """One run of the benchmark: the lab and the client process, a daemon per QUIC congestion
    control, and what they measured."""

    cfg: NetworkConfig
    lab: Any  # NetnsLab
    client: ClientProcess
    config_path: Path
    tcp_cc: str
    cases: list[Any] = field(default_factory=list)  # CaseSummary
    returning: list[Any] = field(default_factory=list)  # ReturningSummary
    raw: list[dict[str, Any]] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    calls: int = 0  # streams calls so far: each one's seed

    def daemon_env(self, cc: str) -> dict[str, str]:
        from edged.bench.lab_daemon import CC_ENV, INITIAL_RTT_ENV, STEP_MS_ENV

        env = {CC_ENV: cc, STEP_MS_ENV: str(self.cfg.step_ms)}
        if self.cfg.quic_initial_rtt_ms is not None:
            env[INITIAL_RTT_ENV] = str(self.cfg.quic_initial_rtt_ms)
        return env

    def variant_config(self, duplicate: int, after_loss_s: float) -> Path:
        """A copy of config.yaml with server.quic.duplicate_datagram_bytes and duplicate_after_loss_s set."""
        import yaml

        data = yaml.safe_load(self.config_path.read_text())
        quic = data["server"].setdefault("quic", {})
        quic["duplicate_datagram_bytes"] = duplicate
        quic["duplicate_after_loss_s"] = after_loss_s
        path = self.config_path.with_name(f"config-duplicate-{duplicate}-{after_loss_s:g}.yaml")
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def run_variant(self, cc: str, duplicate: int, after_loss_s: float, first: bool) -> None:
        """A daemon with QUIC congestion control `cc` (and small datagrams sent twice when `duplicate`, for
        after_loss_s after a connection's last loss, or always if 0),
        every case over HTTP/3 (and HTTP/2 and the returning client on the `first` daemon only: they do
        not depend on it), SIGTERM."""
        from edged.bench.netns_lab import SERVER_ADDR

        self.lab.set_delay(0)
        self.lab.set_loss(0)
        after_loss = bool(duplicate and after_loss_s)  # copies only after a connection's loss
        t = time.perf_counter()
        daemon = start_daemon(self.lab.netns_exec(self.lab.server_ns), self.variant_config(duplicate, after_loss_s),
                              self.daemon_env(cc))
        try:
            daemon.wait_ready(self.cfg.ready_timeout_s)
            _say(f"edged ready in its namespace at {SERVER_ADDR}:{SERVER_PORT} in {time.perf_counter() - t:.1f} s "
                 f"(QUIC congestion control: {cc}, datagrams sent twice up to {duplicate} bytes"
                 + (f", {after_loss_s:g} s after a loss)" if after_loss else ")"))
            h3 = f"h3/{cc}" + (f"+dup{duplicate}" if duplicate else "") + ("/loss" if after_loss else "")
            protos = [("h3", h3)] + ([("h2", f"h2/{self.tcp_cc}")] if first else [])
            if self.cfg.warm_up:  # not counted: the first batch of a fresh daemon is slow
                for proto, _ in protos:
                    self.client.call({"op": "streams", "proto": proto, "streams": self.cfg.streams, "max_tokens": 16})
            for delay in self.cfg.delays_ms:
                self.lab.set_delay(delay)
                for loss in self.cfg.losses:
                    for proto, label in protos:
                        self.run_case(proto, label, loss, delay)
                if first and self.cfg.returning_reps:
                    self.run_returning(delay)
        finally:
            status = daemon.stop()
            if status != 0:
                _say(f"edged serve exited with status {status} after SIGTERM:\n{daemon.log_tail()}")

    def run_case(self, proto: str, label: str, loss: int, delay: float) -> None:
        from edged.bench.network_report import summarize_case

        self.lab.set_loss(loss)  # also zeroes the drop counters: each case counts its own
        runs = []
        for rep in range(self.cfg.reps):
            # The same prompts for every protocol and variant of a case and rep, so they are compared on
            # the same tokens; a seed of its own per call, so no answer comes from the result cache.
            self.calls += 1
            res = self.client.call({"op": "streams", "proto": proto, "streams": self.cfg.streams,
                                    "max_tokens": self.cfg.max_tokens, "seed": self.calls,
                                    "prompts": f"{loss}-{delay:g}-{rep}"})
            runs.append(res)
            self.raw.append({"proto": label, "loss_pct": loss, "delay_ms": delay, "rep": rep, **res})
        case = summarize_case(label, loss, delay, runs, self.lab.counters(), self.cfg.stall_ms / 1000)
        self.cases.append(case)
        self.loads.append(load_average())
        _say(f"{label} loss {loss}% +{delay:g} ms: gap p99 {case.gap_p99_ms} ms, max {case.gap_max_ms} ms, "
             f"ttft p50 {case.ttft_p50_ms} ms, {case.errors} errors, {case.packets_dropped} packets dropped")

    def run_returning(self, delay: float) -> None:
        from edged.bench.network_report import summarize_returning

        self.lab.set_loss(0)
        for mode, cmd in RETURNING_MODES:
            runs = [self.client.call({**cmd, "seed": 100 + i}) for i in range(self.cfg.returning_reps)]
            self.raw.extend({"mode": mode, "delay_ms": delay, **r} for r in runs)
            r = summarize_returning(delay, mode, runs)
            self.returning.append(r)
            _say(f"returning client +{delay:g} ms, {mode}: ttft {r.ttft_p50_ms} ms {r.note}")


def prepare_daemon_files(cfg: NetworkConfig, workdir: Path, server_addr: str) -> tuple[Path, str]:
    """The model (unless --model), a certificate valid for the daemon's address (the daemon finds and
    reuses it) and config.yaml; (config path, CA file)."""
    import yaml

    from edged.server.tls import ensure_cert

    if cfg.model:
        model_path: Path | str = cfg.model
    else:
        from edged.bench.tiny_model import write_tiny_hf_dir

        _say("writing a tiny random-weight model with the default model's tokenizer ...")
        (workdir / "model").mkdir()
        model_path = write_tiny_hf_dir(workdir / "model", max_position_embeddings=context_length(cfg))
    state_dir = workdir / "state"
    ca_file, _ = ensure_cert(state_dir, extra_names=[server_addr])
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(daemon_config(cfg, state_dir, model_path, f"{server_addr}:{SERVER_PORT}"),
                                          sort_keys=False))
    return config_path, ca_file


def run_network(cfg: NetworkConfig, workdir: Path) -> dict[str, Any]:
    """The lab, the daemon(s), the cases; the report dict. RuntimeError when something fails to start."""
    from edged.bench.netns_lab import SERVER_ADDR, NetnsLab
    from edged.bench.network_report import acceptance, report_dict

    config_path, ca_file = prepare_daemon_files(cfg, workdir, SERVER_ADDR)
    lab = NetnsLab()
    lab.create()
    started = time.perf_counter()
    try:
        if cfg.tcp_cc:
            lab.set_tcp_congestion_control(cfg.tcp_cc)
        client = ClientProcess.start(lab.netns_exec(lab.client_ns), SERVER_ADDR, SERVER_PORT, ca_file)
        run = NetworkRun(cfg, lab, client, config_path, lab.tcp_congestion_control(), loads=[load_average()])
        try:
            variants = [(cc, dup, after) for cc in cfg.quic_ccs for dup in cfg.quic_duplicates
                        for after in (cfg.quic_after_loss_s if dup else [0.0])]
            for k, (cc, dup, after) in enumerate(variants):
                run.run_variant(cc, dup, after, first=k == 0)
        finally:
            client.close()
        if lab.wire is not None and lab.wire.error is not None:
            raise RuntimeError(f"the delay line failed: {lab.wire.error}")
    finally:
        lab.close()
    checks = acceptance(run.cases, run.returning)
    meta = {"losses_pct": cfg.losses, "delays_ms": cfg.delays_ms, "streams": cfg.streams, "tokens": cfg.max_tokens,
            "reps": cfg.reps, "step_ms": cfg.step_ms, "stall_ms": cfg.stall_ms, "quic_ccs": cfg.quic_ccs,
            "quic_duplicate_datagram_bytes": cfg.quic_duplicates, "quic_duplicate_after_loss_s": cfg.quic_after_loss_s,
            "quic_initial_rtt_ms": cfg.quic_initial_rtt_ms, "tcp_congestion_control": run.tcp_cc,
            "model": cfg.model or "tiny random-weight (default tokenizer)", "cpus": os.cpu_count(),
            "load_average_1m": run.loads, "duration_s": round(time.perf_counter() - started, 1)}
    return {"report": report_dict(meta, run.cases, run.returning, checks, run.raw), "cases": run.cases,
            "returning": run.returning, "checks": checks}


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_network_bench(args: argparse.Namespace) -> int:
    """`edged bench network`: 0 when it ran; 1 on a usage error or a failure; 77 when it cannot run
    here (not root, no `ip`/`nft`), with the reason on stderr."""
    from edged.bench.netns_lab import missing_requirements
    from edged.bench.network_report import format_table, write_plot

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"edged bench network: {e}", file=sys.stderr)
        return 1
    why = missing_requirements()
    if why is not None:
        print(f"edged bench network: skipped: {why}", file=sys.stderr)
        return 77
    previous = signal.signal(signal.SIGTERM, _interrupt)  # still tear down the namespaces and the daemon
    try:
        with tempfile.TemporaryDirectory(prefix="edged-network-") as tmp:
            out = run_network(cfg, Path(tmp))
    except (RuntimeError, OSError) as e:
        print(f"edged bench network: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_table(out["cases"], out["returning"], out["checks"], cfg.streams, cfg.stall_ms), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out["report"], indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        why_not = write_plot(out["cases"], Path(args.plot))
        print(why_not or f"wrote {args.plot}")
    return 0
