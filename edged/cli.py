"""`edged` command line: serve, chat, bench, check-config, models, topology, cache."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_PORT = 4433
API_KEY_ENV = "EDGED_API_KEY"  # `edged chat`'s key when --api-key is not given
MAKE_RUN_STATE_DIR = ".state"  # the Makefile's STATE_DIR: where `make run` keeps the daemon's certificate


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="daemon address (default: %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="daemon UDP port (default: %(default)s)")
    tls = p.add_mutually_exclusive_group()
    tls.add_argument("--ca-file", help="CA or self-signed certificate to trust (default: the local daemon's "
                                       "certificate under --state-dir when it exists; chat: else ./.state's, "
                                       "where `make run` keeps it)")
    tls.add_argument("--insecure", action="store_true", help="do not verify the server certificate")
    p.add_argument("--state-dir", help="where a local daemon keeps its certificate (default: as `serve`)")


def build_parser(bench_arguments: bool = True) -> argparse.ArgumentParser:
    """The whole command line. bench_arguments=False leaves out the options of `bench serve`,
    `bench transport` and `bench engine`, whose modules import numpy and more: `main` skips them
    for every other command, so that `edged chat` starts in a fraction of a second."""
    parser = argparse.ArgumentParser(
        prog="edged",
        description="Embedded LLM inference daemon for GPU edge nodes: an OpenAI-compatible API over HTTP/3.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser("serve", help="run the daemon", description=(
        "Load the model, warm it up and serve the OpenAI-compatible API over HTTP/3 (QUIC). "
        "Flags override the config file. SIGHUP reloads the config; SIGTERM drains and exits."))
    serve.add_argument("--config", help="config.yaml (default: built-in defaults; see the repo's config.yaml)")
    serve.add_argument("--listen", metavar="HOST:PORT", help="address to listen on: UDP for HTTP/3, and TCP on the "
                                                             "same port for HTTP/2 and 1.1 unless server.tcp is "
                                                             "false (default: server.listen, 0.0.0.0:4433)")
    serve.add_argument("--state-dir", metavar="DIR", help="certificates, the result cache and QUIC session tickets "
                                                          "live here (default: server.state_dir, else "
                                                          "$STATE_DIRECTORY under systemd, /var/lib/edged as root, "
                                                          "else $XDG_STATE_HOME/edged or ~/.local/state/edged)")
    serve.add_argument("--model", metavar="PATH", help="a .gguf file or a Hugging Face model directory "
                                                        "(default: model.path, else the embedded "
                                                        "SmolLM2-135M-Instruct)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                       help="log verbosity (default: logging.level, info)")

    chat = sub.add_parser("chat", help="ask the daemon and stream the answer", description=(
        "Send one chat message to a running edged over HTTP/3 and stream the answer to the terminal. "
        "Without a message, a conversation: one message per line, the history kept, Ctrl-D to leave. "
        "Sampling fields not given here take the model's defaults (GET /v1/models shows them)."))
    chat.add_argument("prompt", nargs="?", help="the user message (default: a conversation on standard input)")
    _add_client_flags(chat)
    chat.add_argument("--system", help="an optional system message")
    chat.add_argument("--max-tokens", type=int, help="most tokens to generate")
    chat.add_argument("--temperature", type=float, help="0 for greedy decoding (default: the model's)")
    chat.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                      help=f"API key, when the daemon has auth on (default: ${API_KEY_ENV}, which keeps the key "
                           "out of the process list)")
    chat.add_argument("--no-0rtt", dest="zero_rtt", action="store_false",
                      help="neither use nor keep QUIC session tickets (by default the ticket from the last run, "
                           "kept per server under $XDG_STATE_HOME/edged or ~/.local/state/edged, sends the "
                           "request in 0-RTT data)")

    check = sub.add_parser("check-config", help="validate a config file offline",
                           description="Validate config.yaml with the same messages a live reload logs.")
    check.add_argument("file", help="the config file")

    hk = sub.add_parser("hash-key", help="print the sha256 of an API key for auth.keys[].sha256",
                        description="Read an API key from standard input (or the argument) and print the "
                                    "sha256 hex digest that config.yaml stores instead of the key.")
    hk.add_argument("key", nargs="?", help="the key (default: read one line from standard input)")

    models = sub.add_parser("models", help="show the model the daemon would load",
                            description="Print the configured (or embedded default) model and its shape.")
    models.add_argument("--config", help="config.yaml")
    models.add_argument("--model", metavar="PATH", help="a .gguf file or a Hugging Face model directory")

    topo = sub.add_parser("topology", help="show the GPU's PCIe/NUMA topology and the limits it implies")
    topo.add_argument("--sysfs", default="/sys", help="sysfs root (default: %(default)s)")
    topo.add_argument("--batch-cap", type=int, help="a configured batch cap override")

    cache = sub.add_parser("cache", help="inspect or clear the result cache", description=(
        "The persistent result cache: result_cache.sqlite3 under the state directory."))
    cache.add_argument("action", choices=["stats", "clear"],
                       help="stats: the file's path, entries and bytes; clear: delete every entry")
    cache.add_argument("--state-dir", help="the daemon's state directory (default: --config's server.state_dir, "
                                           "else the daemon's default, as `serve --help` lists)")
    cache.add_argument("--config", help="config.yaml, for its server.state_dir")

    bench = sub.add_parser("bench", help="benchmarks that print a table")
    bench_sub = bench.add_subparsers(dest="bench", metavar="KIND", required=True)
    decode = bench_sub.add_parser("decode", help="decode and prefill tokens/s: random weights against the HBM "
                                                 "roofline on CUDA; the real model beside llama.cpp on the CPU")
    decode.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="cuda: random-weight shapes (default when a GPU is present); cpu: the real model")
    decode.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b,llama-3-8b", help="CUDA: model shapes")
    decode.add_argument("--quant", default="none,w8,w4", help="CUDA: weight formats")
    decode.add_argument("--batch", help="batch sizes (default: 1,8,32,64 on CUDA; 1,4,8 on the CPU)")
    decode.add_argument("--steps", type=int, help="decode steps timed (default 64)")
    decode.add_argument("--peer", nargs="?", const="transformers", metavar="PEER",
                        help="also time a peer. CUDA, at batch 1 and the same random-weight shapes: transformers "
                             "(the default with a bare --peer; eager, static cache) or gpt-fast (its int8 "
                             "weight-only decode under torch.compile reduce-overhead; needs --gpt-fast-dir). "
                             "CPU: llama.cpp (needs pip install llama-cpp-python)")
    decode.add_argument("--gpt-fast-dir", metavar="DIR",
                        help="--peer gpt-fast: a directory holding gpt-fast's model.py and quantize.py "
                             "(github.com/pytorch-labs/gpt-fast; not shipped with edged) "
                             "(default: $EDGED_GPT_FAST_DIR)")
    decode.add_argument("--engine", action="store_true",
                        help="CUDA: also time the whole engine step, serial and overlapped")
    decode.add_argument("--kernel-times", action="store_true",
                        help="CUDA: also print where each step's device time goes: per kernel name, launches and "
                             "microseconds a step (torch.profiler over 5 replayed steps; under PDL a kernel's wait "
                             "for the one before counts as its time: EDGED_PDL=0 for times that add up)")
    decode.add_argument("--model", help="CPU: a .gguf file (default: the embedded SmolLM2)")
    decode.add_argument("--threads", type=int, help="CPU: threads for edged and the peer (default: physical cores)")
    decode.add_argument("--prompt-tokens", type=int, default=128, help="CPU: prompt length timed for prefill")
    decode.add_argument("--context", type=int, default=32, help="CPU: each stream's prompt before decode is timed")
    decode.add_argument("--repeat", type=int, default=1, help="CPU: runs (fresh processes); medians are printed")
    kern = bench_sub.add_parser("kernels", help="each kernel's GB/s or TFLOP/s against measured ceilings")
    kern.add_argument("--w4-tensor-cores", action="store_true", help="only time the tensor-core w4 decode GEMV "
                      "(kernels/triton_w4_dot.py, which linear does not launch) against linear's w4 and w8 GEMVs at "
                      "the SmolLM2, Llama-3.2-1B and Llama-3-8B decode shapes")
    kern.add_argument("--split-sweep", action="store_true", help="only time the batched decode matmul's launch "
                      "at every K split 1-16 (M = 32 and 64, w8 and w4, each Llama-3.2-1B and Llama-3-8B linear) "
                      "against the built-in split, with the step sums")
    kern.add_argument("--sweep", action="store_true", help="also time every decode GEMV launch configuration (rows a program, columns a step, warps, K splits) at each decode shape of SmolLM2, Llama-3.2-1B and Llama-3-8B against the built-in choice")
    sass = bench_sub.add_parser("sass", help="the decode GEMV's inner loop compiled for sm_90 here (no GPU needed): "
                                             "instructions per weight, shared-memory and shuffle traffic, registers, "
                                             "programs an SM keeps and waves")
    if bench_arguments:
        from edged.bench.sass import add_arguments as add_sass_arguments
        add_sass_arguments(sass)
    acc = bench_sub.add_parser("accuracy", help="teacher-forced top-1 agreement with float32, per dtype and format")
    acc.add_argument("--model", help="a .gguf file or HF directory (default: the embedded SmolLM2)")
    acc.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="where to run (default: cuda when available)")
    acc.add_argument("--peer", action="store_true", help="also measure transformers bf16 and fp32 on the same file")
    srv = bench_sub.add_parser("serve", help="load generator over HTTP/3 with per-tier SLA report")
    _add_client_flags(srv)
    if bench_arguments:
        from edged.bench.serve import add_arguments as add_serve_arguments
        add_serve_arguments(srv)
    trn = bench_sub.add_parser(
        "transport", help="the front end alone: a tiny model served by a daemon this starts, swept over concurrency",
        description="Start `edged serve` on a tiny random-weight model (the default model's tokenizer and chat "
                    "template) on a free loopback port, sweep closed-loop concurrency from several client "
                    "processes, and print per phase: token events/s, tokens/s, TTFT, ITL and QUIC handshake "
                    "percentiles, and each daemon process's CPU use. Stops the daemon with SIGTERM at the end.")
    if bench_arguments:
        from edged.bench.transport import add_arguments as add_transport_arguments
        add_transport_arguments(trn)
    net = bench_sub.add_parser(
        "network", help="HTTP/3 vs HTTP/2 over TLS/TCP under packet loss and added delay (root: network namespaces)",
        description="As root, create two network namespaces joined by a delay line, run `edged serve` on a tiny "
                    "random-weight model in one and a client in the other, drop packets with nftables and add "
                    "one-way delay, and compare 8 streams on one connection over HTTP/3 and over HTTP/2 (TLS/TCP): "
                    "TTFT p50/p99, inter-token gap p99 and max (stalls), total time; then a returning client's "
                    "TTFT with a full handshake and with 0-RTT. Prints the table and issue 17's acceptance checks; "
                    "exits 77 with the reason when it cannot run here (not root, no ip or nft).")
    if bench_arguments:
        from edged.bench.network import add_arguments as add_network_arguments
        add_network_arguments(net)
    eng = bench_sub.add_parser(
        "engine", help="the engine alone under a closed loop of requests (prefill + decode), no HTTP",
        description="Run CONCURRENCY requests at a time through the engine in this process, each finished one "
                    "replaced at once (the load `bench serve --concurrency` puts on the daemon), and print tok/s "
                    "and engine-side TTFT: the ceiling for what the daemon can deliver at that concurrency.")
    if bench_arguments:
        from edged.bench.engine_loop import add_arguments as add_engine_loop_arguments
        add_engine_loop_arguments(eng)
    _describe_from_help(parser)
    return parser


def _describe_from_help(parser: argparse.ArgumentParser) -> None:
    """A command without a description of its own shows its one-line help atop `edged CMD --help`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                sub = action.choices[choice.dest]
                sub.description = sub.description or choice.help[0].upper() + choice.help[1:] + "."
                _describe_from_help(sub)


def _chat_ca_file(args: argparse.Namespace) -> str | None:
    """The certificate `edged chat` trusts: --ca-file; else the local daemon's, under --state-dir or the
    default state directory; else, with neither flag, the one `make run` made under ./.state.
    (edged.daemon's resolve_ca_file does the first two, but importing the supervisor's module costs
    start-up time.)"""
    if args.ca_file or args.insecure:
        return args.ca_file
    from edged.config import default_state_dir
    from edged.server.tls import default_ca_file

    ca_file = default_ca_file(args.state_dir or default_state_dir())
    if ca_file is None and not args.state_dir:
        local = Path(MAKE_RUN_STATE_DIR) / "tls" / "cert.pem"
        if local.is_file():
            ca_file = str(local)
    return ca_file


def main(argv: list[str] | None = None) -> int:
    # OpenMP threads (torch's, the CPU kernels', llama.cpp's in `bench decode --peer`) that wait for work
    # sleep instead of spinning: on a CPU box whose cores are shared, a spinning waiter holds the core
    # that the thread it waits for needs, and a step took 5-10x longer (docs/BENCHMARKS.md). Set before
    # anything loads torch; an explicit OMP_WAIT_POLICY in the environment wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    words = sys.argv[1:] if argv is None else argv
    args = build_parser(bench_arguments=bool(words) and words[0] == "bench").parse_args(argv)
    if args.command == "serve":
        from edged.daemon import run_serve_command
        return run_serve_command(args)
    if args.command == "chat":
        from edged.server.h3_client import run_chat_command
        return run_chat_command(args.prompt, host=args.host, port=args.port, ca_file=_chat_ca_file(args),
                                insecure=args.insecure, max_tokens=args.max_tokens, temperature=args.temperature,
                                system=args.system, api_key=args.api_key, zero_rtt=args.zero_rtt)
    if args.command == "check-config":
        from edged.config import run_check_config
        return run_check_config(args.file)
    if args.command == "hash-key":
        from edged.config import hash_api_key
        key = args.key if args.key is not None else sys.stdin.readline().rstrip("\n")
        if not key:
            print("edged hash-key: empty key", file=sys.stderr)
            return 2
        print(hash_api_key(key))
        return 0
    if args.command == "models":
        from edged.daemon import run_models_command
        return run_models_command(args)
    if args.command == "topology":
        from edged.scheduler.topology import run_topology_command
        return run_topology_command(args.sysfs, args.batch_cap)
    if args.command == "cache":
        from edged.daemon import state_dir_for
        from edged.cache.result_cache import run_cache_command
        return run_cache_command(args.action, state_dir_for(args.config, args.state_dir))
    if args.command == "bench":
        from edged.bench import run_bench_command
        return run_bench_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
