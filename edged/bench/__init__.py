"""`edged bench decode | engine | kernels | sass | serve | transport | network | accuracy`: each kind in its own module, imported when run."""
from __future__ import annotations

import argparse


def run_bench_command(args: argparse.Namespace) -> int:
    """Dispatch on `args.bench`; returns the exit status."""
    if args.bench == "serve":
        from edged.bench.serve import run_serve_bench

        return run_serve_bench(args)
    if args.bench == "transport":
        from edged.bench.transport import run_transport_bench

        return run_transport_bench(args)
    if args.bench == "network":
        from edged.bench.network import run_network_bench

        return run_network_bench(args)
    if args.bench == "decode":
        from edged.bench.decode import run_decode_bench

        return run_decode_bench(args)
    if args.bench == "engine":
        from edged.bench.engine_loop import run_engine_loop_command

        return run_engine_loop_command(args)
    if args.bench == "kernels":
        from edged.bench.kernels import run_kernels_bench

        return run_kernels_bench(args)
    if args.bench == "sass":
        from edged.bench.sass import run_sass_bench

        return run_sass_bench(args)
    if args.bench == "accuracy":
        from edged.bench.accuracy import run_accuracy_bench

        return run_accuracy_bench(args)
    raise ValueError(f"unknown benchmark {args.bench!r}")
