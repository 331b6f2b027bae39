"""`edged bench transport` results: one record per concurrency, one table row each.

Per phase: token events/s (SSE data events that carry text, summed over requests), delivered
tokens/s (completion tokens), TTFT, ITL and QUIC handshake percentiles in ms (definitions in
report.py), the busiest client process's CPU, and each daemon process's CPU in % of one core.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from edged.bench.proc_cpu import ProcessCpu
from edged.bench.report import ALL, _fmt, _table


def phase_record(phase: dict[str, Any], processes: list[ProcessCpu]) -> dict[str, Any]:
    """A `bench serve` phase summary (report.summarize_phase) and the daemon's CPU over it."""
    a = phase[ALL]
    return {
        "concurrency": phase["load"]["concurrency"],
        "duration_s": round(phase["duration_s"], 3),
        "requests": a["sent"],
        "completed": a["completed"],
        "rejected": a["rejected"],
        "errors": a["errors"],
        "token_events_per_s": round(a["token_event_throughput"], 1),
        "tokens_per_s": round(a["output_token_throughput"], 1),
        "ttft_ms": a["ttft"],
        "itl_ms": a["itl"],
        "handshake_ms": phase["handshake"],
        "handshake_under_load_ms": phase.get("handshake_under_load"),
        "client_cpu_pct": phase["client_cpu_pct"],
        "daemon_cpu_pct": round(sum(p.cpu_pct for p in processes), 1),
        "processes": [asdict(p) for p in processes],
    }


def _column(p: dict[str, Any]) -> str:
    return f"{p['label']}[{p['pid']}]"


def format_table(records: list[dict[str, Any]]) -> str:
    """One row per concurrency; a CPU column per daemon process (every process seen in any phase),
    then a legend with each process's command line."""
    procs: dict[int, dict[str, Any]] = {}
    for r in records:
        for p in r["processes"]:
            procs.setdefault(p["pid"], p)
    head = ["concurrency", "requests", "ok", "err", "events/s", "tok/s", "TTFT p50", "TTFT p99", "ITL p50",
            "ITL p99", "handshake p50", "handshake p99", "probe hs p50", "probe hs p99", "client CPU%", "daemon CPU%",
            *(f"{_column(p)} %" for p in procs.values())]
    rows = []
    for r in records:
        cpu = {p["pid"]: p["cpu_pct"] for p in r["processes"]}
        refused = sum(r["rejected"].values())
        probe = r.get("handshake_under_load_ms") or {}
        rows.append([str(r["concurrency"]), str(r["requests"]), str(r["completed"]), str(r["errors"] + refused),
                     _fmt(r["token_events_per_s"], 1), _fmt(r["tokens_per_s"], 1),
                     _fmt(r["ttft_ms"]["p50"], 1), _fmt(r["ttft_ms"]["p99"], 1),
                     _fmt(r["itl_ms"]["p50"], 2), _fmt(r["itl_ms"]["p99"], 2),
                     _fmt(r["handshake_ms"]["p50"], 1), _fmt(r["handshake_ms"]["p99"], 1),
                     _fmt(probe.get("p50"), 1), _fmt(probe.get("p99"), 1),
                     _fmt(max(r["client_cpu_pct"], default=None), 0), _fmt(r["daemon_cpu_pct"], 0),
                     *(_fmt(cpu.get(pid), 0) for pid in procs)])
    legend = [f"  {_column(p)}: {p['cmdline'][:160] or '?'}" for p in procs.values()]
    return "\n".join([_table(head, rows, left=0), "",
                      "times in ms; probe hs: handshakes of fresh connections made during the phase (--probe-handshakes); "
                      "CPU in % of one core (client: the busiest client process); processes:", *legend])
