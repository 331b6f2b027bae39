"""`edged bench network`'s numbers: per case (protocol x loss x delay) the pooled statistics of its
repetitions, the acceptance checks of issue 17, the table and the plot."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edged.bench.report import percentile

GAP_RATIO_TARGET = 0.5  # issue 17: HTTP/3 inter-token gap p99 <= 0.5x HTTP/2's at 3% loss
ZERO_RTT_SAVING_TARGET_MS = 50.0  # issue 17: 0-RTT TTFT at least one round trip below a full handshake at 25 ms
ACCEPTANCE_LOSS_PCT = 3
STALL_GROUP_S = 0.015  # stalls of different streams that end this close together are one stall event


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 1)


@dataclass(slots=True)
class CaseSummary:
    proto: str  # "h3/reno", "h3/cubic", "h2/cubic" (QUIC's or the kernel's TCP congestion control)
    loss_pct: int
    delay_ms: float
    reps: int
    streams: int  # streams that completed, over all repetitions
    errors: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    gap_p50_ms: float | None
    gap_p99_ms: float | None
    gap_max_ms: float | None  # the longest stall of any stream
    slowest_stream_stall_ms: float | None  # the longest stall of each run's slowest stream, max over runs
    stalled_pct: float | None  # gaps longer than stall_ms, in % of all gaps
    streams_per_stall: float | None  # mean streams that stall together (ends within STALL_GROUP_S): 1 with
    # no head-of-line blocking at all, every stream when each loss blocks the whole connection
    total_s: float | None  # median over repetitions: all streams done, connection set-up excluded
    connect_ms: float | None  # median: handshake + GET /healthz
    packets_dropped: int
    packets_on_wire: int


def stall_events(streams: list[dict[str, Any]], stall_s: float) -> list[int]:
    """How many streams each stall event of one run held up: gaps longer than stall_s, grouped by the
    time they ended (from the request's start)."""
    ends: list[tuple[float, int]] = []
    for i, s in enumerate(streams):
        t = s["ttft_s"]
        for g in s["gaps_s"]:
            t += g
            if g > stall_s:
                ends.append((t, i))
    events: list[tuple[float, set[int]]] = []
    for t, i in sorted(ends):
        if events and t - events[-1][0] < STALL_GROUP_S:
            events[-1][1].add(i)
        else:
            events.append((t, {i}))
    return [len(held) for _, held in events]


def summarize_case(proto: str, loss_pct: int, delay_ms: float, runs: list[dict[str, Any]],
                   counters: dict[str, int], stall_s: float) -> CaseSummary:
    ttfts: list[float] = []
    gaps: list[float] = []
    slowest_stalls: list[float] = []
    totals: list[float] = []
    connects: list[float] = []
    held: list[int] = []
    done = errors = 0
    for run in runs:
        if run.get("error"):
            errors += 1
            continue
        connects.append(run["connect_s"])
        totals.append(run["total_s"])
        ok = [s for s in run["streams"] if not s["error"] and s["ttft_s"] is not None]
        errors += len(run["streams"]) - len(ok)
        done += len(ok)
        for s in ok:
            ttfts.append(s["ttft_s"])
            gaps.extend(s["gaps_s"])
        held.extend(stall_events(ok, stall_s))
        if ok:
            slowest = max(ok, key=lambda s: s["ttft_s"] + sum(s["gaps_s"]))
            slowest_stalls.append(max(slowest["gaps_s"], default=0.0))
    return CaseSummary(
        proto=proto, loss_pct=loss_pct, delay_ms=delay_ms, reps=len(runs), streams=done, errors=errors,
        ttft_p50_ms=_ms(percentile(ttfts, 50)), ttft_p99_ms=_ms(percentile(ttfts, 99)),
        gap_p50_ms=_ms(percentile(gaps, 50)), gap_p99_ms=_ms(percentile(gaps, 99)),
        gap_max_ms=_ms(max(gaps, default=None)), slowest_stream_stall_ms=_ms(max(slowest_stalls, default=None)),
        stalled_pct=round(100.0 * sum(g > stall_s for g in gaps) / len(gaps), 2) if gaps else None,
        streams_per_stall=round(statistics.mean(held), 1) if held else None,
        total_s=round(statistics.median(totals), 3) if totals else None,
        connect_ms=_ms(statistics.median(connects) if connects else None),
        packets_dropped=counters.get("dropped", 0), packets_on_wire=counters.get("wire_packets", 0))


@dataclass(slots=True)
class ReturningSummary:
    delay_ms: float
    mode: str  # "h3 full handshake", "h3 0-RTT", "h2 new TLS/TCP"
    reps: int
    ttft_p50_ms: float | None
    early_data_accepted: int  # runs whose early data the server accepted (0-RTT mode)
    errors: int
    note: str = ""


def summarize_returning(delay_ms: float, mode: str, runs: list[dict[str, Any]]) -> ReturningSummary:
    ok = [r for r in runs if not r.get("error") and r.get("ttft_s") is not None]
    accepted = sum(1 for r in ok if r.get("early_data_accepted"))
    note = ""
    if mode == "h3 0-RTT" and ok and not accepted:
        offered = any(r.get("early_data_offered") for r in ok)
        note = ("not measured: the server's tickets allow no early data" if any(r.get("ticket_offered") for r in ok)
                and not offered else "not measured: the server sent no session ticket" if not offered
                else "not measured: the server rejected the early data")
    return ReturningSummary(delay_ms, mode, len(runs), _ms(statistics.median([r["ttft_s"] for r in ok]) if ok else None),
                            accepted, len(runs) - len(ok), note)


def acceptance(cases: list[CaseSummary], returning: list[ReturningSummary]) -> list[dict[str, Any]]:
    """Issue 17's checks, one row per HTTP/3 variant and delay (3% loss) and per delay (0-RTT)."""
    out: list[dict[str, Any]] = []
    for c in cases:
        if c.loss_pct != ACCEPTANCE_LOSS_PCT or not c.proto.startswith("h3"):
            continue
        h2 = next((x for x in cases if x.proto.startswith("h2") and x.loss_pct == c.loss_pct
                   and x.delay_ms == c.delay_ms), None)
        if h2 is None or None in (c.gap_p99_ms, h2.gap_p99_ms, c.gap_max_ms, h2.slowest_stream_stall_ms):
            continue
        ratio = c.gap_p99_ms / h2.gap_p99_ms if h2.gap_p99_ms else float("inf")  # type: ignore[operator]
        out.append({"check": f"{c.proto} vs {h2.proto}, {c.loss_pct}% loss, +{c.delay_ms:g} ms: gap p99 ratio",
                    "value": round(ratio, 2), "target": f"<= {GAP_RATIO_TARGET}", "met": ratio <= GAP_RATIO_TARGET})
        out.append({"check": f"{c.proto} vs {h2.proto}, {c.loss_pct}% loss, +{c.delay_ms:g} ms: worst h3 stall vs "
                             f"h2 slowest stream's stall (ms)",
                    "value": f"{c.gap_max_ms} vs {h2.slowest_stream_stall_ms}", "target": "h3 <= h2",
                    "met": c.gap_max_ms <= h2.slowest_stream_stall_ms})  # type: ignore[operator]
    for full in (r for r in returning if r.mode == "h3 full handshake"):
        zero = next((r for r in returning if r.mode == "h3 0-RTT" and r.delay_ms == full.delay_ms), None)
        if zero is None or full.delay_ms <= 0:
            continue
        if zero.note or zero.ttft_p50_ms is None or full.ttft_p50_ms is None:
            out.append({"check": f"+{full.delay_ms:g} ms: 0-RTT TTFT saving (ms)", "value": None,
                        "target": f">= {ZERO_RTT_SAVING_TARGET_MS:g}", "met": None, "note": zero.note or "no data"})
            continue
        saving = full.ttft_p50_ms - zero.ttft_p50_ms
        out.append({"check": f"+{full.delay_ms:g} ms: 0-RTT TTFT saving (ms)", "value": round(saving, 1),
                    "target": f">= {ZERO_RTT_SAVING_TARGET_MS:g}", "met": saving >= ZERO_RTT_SAVING_TARGET_MS})
    return out


def _f(v: Any, width: int) -> str:
    return f"{'-' if v is None else v:>{width}}"


def format_table(cases: list[CaseSummary], returning: list[ReturningSummary], checks: list[dict[str, Any]],
                 streams: int, stall_ms: float) -> str:
    w = max([21] + [len(c.proto) for c in cases])  # the protocol column fits the longest variant label
    head = (f"{'protocol':<{w}} {'loss%':>5} {'+delay':>6} {'ok':>5} {'err':>3} {'ttft p50':>8} {'ttft p99':>8} "
            f"{'gap p50':>7} {'gap p99':>7} {'gap max':>7} {'slowest':>7} {'stall%':>6} {'str/st':>6} {'total s':>7} "
            f"{'conn ms':>7} {'drops':>6}")
    title = (f"{streams} streams on one connection, times in ms unless marked. slowest: the longest stall of each "
             f"run's slowest stream; stall%: gaps over {stall_ms:g} ms; str/st: streams held up per stall")
    lines = [title, head, "-" * len(head)]
    for c in cases:
        lines.append(f"{c.proto:<{w}} {c.loss_pct:>5} {c.delay_ms:>6g} {c.streams:>5} {c.errors:>3} "
                     f"{_f(c.ttft_p50_ms, 8)} {_f(c.ttft_p99_ms, 8)} {_f(c.gap_p50_ms, 7)} {_f(c.gap_p99_ms, 7)} "
                     f"{_f(c.gap_max_ms, 7)} {_f(c.slowest_stream_stall_ms, 7)} {_f(c.stalled_pct, 6)} "
                     f"{_f(c.streams_per_stall, 6)} {_f(c.total_s, 7)} "
                     f"{_f(c.connect_ms, 7)} {c.packets_dropped:>6}")
    if returning:
        lines += ["", "returning client: a new connection, one request, TTFT from before the handshake (median)",
                  f"{'+delay':>6} {'mode':<18} {'runs':>4} {'ttft ms':>8} {'0-RTT ok':>8}  note"]
        for r in returning:
            lines.append(f"{r.delay_ms:>6g} {r.mode:<18} {r.reps:>4} {_f(r.ttft_p50_ms, 8)} "
                         f"{r.early_data_accepted:>8}  {r.note}")
    if checks:
        lines += ["", "issue 17 acceptance"]
        for c in checks:
            verdict = {True: "met", False: "MISSED", None: "not measured"}[c["met"]]
            lines.append(f"  {verdict:<12} {c['check']}: {c['value']} (target {c['target']})"
                         + (f" - {c['note']}" if c.get("note") else ""))
    return "\n".join(lines)


def write_plot(cases: list[CaseSummary], path: Path) -> str | None:
    """Inter-token gap p99 and worst stall against loss, one line per protocol and delay. None when
    written, else why not (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot written"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    series = sorted({(c.proto, c.delay_ms) for c in cases})
    for proto, delay in series:
        pts = sorted((c for c in cases if c.proto == proto and c.delay_ms == delay), key=lambda c: c.loss_pct)
        style = "-" if proto.startswith("h3") else "--"
        label = f"{proto} +{delay:g} ms"
        for ax, attr in zip(axes, ("gap_p99_ms", "gap_max_ms", "ttft_p99_ms")):
            ys = [float("nan") if getattr(c, attr) is None else getattr(c, attr) for c in pts]
            ax.plot([c.loss_pct for c in pts], ys, style, marker="o", label=label)
    for ax, title in zip(axes, ("inter-token gap p99 (ms)", "longest stall (ms)", "TTFT p99 (ms)")):
        ax.set_title(title)
        ax.set_xlabel("packet loss each way (%)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("edged bench network: 8 streams on one connection, HTTP/3 vs HTTP/2 over TLS/TCP")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def report_dict(meta: dict[str, Any], cases: list[CaseSummary], returning: list[ReturningSummary],
                checks: list[dict[str, Any]], raw: list[dict[str, Any]]) -> dict[str, Any]:
    return {"config": meta, "cases": [asdict(c) for c in cases], "returning": [asdict(r) for r in returning],
            "acceptance": checks, "runs": raw}
