"""`edged bench serve` results: per-request records -> per-tier statistics -> table, JSON, PNG.

Definitions (all times in seconds inside, milliseconds in the table and JSON):
- admitted: the response began with HTTP 200. Rejections are counted by status (429, 503, other).
- TTFT: request sent on an established connection -> first chunk that carries generated text.
- handshake: QUIC connect -> connection established, per connection opened for the phase (warm-up
  included); reported for the phase as a whole, since one connection carries every tier.
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request with at least two output tokens.
- ITL: the gaps between consecutive text-bearing chunks, pooled over a tier's requests.
- end-to-end: request sent -> last byte of the response.
- SLA attainment: share of admitted requests whose TTFT <= the tier's target (an admitted request
  that never produced a token missed it).
- TPOT attainment: share of completed requests (two or more output tokens) whose TPOT <= the tier's
  time-per-output-token target.
- goodput: requests per second that were admitted and met their TTFT target.
- throughput: completed requests per second and output tokens per second over the phase's wall time.
- token events: SSE data events that carry generated text (one token each when the server keeps up,
  several when it batches them), summed over completed requests, per second of wall time.
- client CPU: each client process's CPU time over the phase as % of one core; near 100 means the
  load generator itself, not the server, set the pace (add --clients).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")
ALL = "all"


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it."""

    tier: str
    start: float  # monotonic send time
    status: int = 0  # HTTP status; 0 when no response headers came back
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    events: int = 0  # SSE data events that carried generated text
    prompt_tokens: int | None = None
    error: str | None = None  # transport failure, stream error event, or missing [DONE]

    @property
    def admitted(self) -> bool:
        return self.status == 200

    @property
    def completed(self) -> bool:
        return self.admitted and self.error is None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        if not self.completed or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def met(self, target_s: float) -> bool:
        return self.admitted and self.ttft is not None and self.ttft <= target_s


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default);
    None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


def latency_summary(values: Sequence[float]) -> dict[str, Any]:
    """{"p50": ms, "p90": ms, "p99": ms, "mean": ms, "n": count}."""
    out: dict[str, Any] = {f"p{q}": _ms(percentile(values, q)) for q in PERCENTILES}
    out["mean"] = _ms(sum(values) / len(values)) if values else None
    out["n"] = len(values)
    return out


def summarize_tier(results: Sequence[RequestResult], duration_s: float, target_ms: float | None,
                   tpot_target_ms: float | None = None) -> dict[str, Any]:
    """Statistics for one tier's (or all) requests of one phase."""
    admitted = [r for r in results if r.admitted]
    completed = [r for r in admitted if r.completed]
    rejected: dict[str, int] = {}
    for r in results:
        if r.status and r.status != 200:
            rejected[str(r.status)] = rejected.get(str(r.status), 0) + 1
    dur = max(duration_s, 1e-9)
    out: dict[str, Any] = {
        "sent": len(results),
        "admitted": len(admitted),
        "completed": len(completed),
        "rejected": dict(sorted(rejected.items())),
        "errors": sum(1 for r in results if r.status in (0, 200) and r.error is not None),
        "output_tokens": sum(r.output_tokens for r in completed),
        "request_throughput": len(completed) / dur,
        "output_token_throughput": sum(r.output_tokens for r in completed) / dur,
        "token_events": sum(r.events for r in completed),
        "token_event_throughput": sum(r.events for r in completed) / dur,
        "ttft_target_ms": target_ms,
    }
    samples = {
        "ttft": [r.ttft for r in admitted if r.ttft is not None],
        "tpot": [t for r in completed if (t := r.tpot) is not None],
        "itl": [g for r in completed for g in r.itls],
        "e2e": [r.e2e for r in completed if r.e2e is not None],
    }
    for name in LATENCIES:
        out[name] = latency_summary(samples[name])
    if target_ms is not None:
        met = sum(1 for r in admitted if r.met(target_ms / 1000))
        out["sla_met"] = met
        out["sla_attainment"] = met / len(admitted) if admitted else None
        out["goodput"] = met / dur
    else:
        out["sla_met"] = out["sla_attainment"] = out["goodput"] = None
    out["tpot_target_ms"] = tpot_target_ms
    paced = samples["tpot"]
    if tpot_target_ms is not None:
        out["tpot_met"] = sum(1 for t in paced if t <= tpot_target_ms / 1000)
        out["tpot_attainment"] = out["tpot_met"] / len(paced) if paced else None
    else:
        out["tpot_met"] = out["tpot_attainment"] = None
    return out


def summarize_phase(results: Sequence[RequestResult], duration_s: float, targets_ms: dict[str, float],
                    load: dict[str, Any], tier_order: Iterable[str] = (), handshakes: Sequence[float] = (),
                    client_cpu_s: Sequence[float] = (), tpot_targets_ms: dict[str, float] | None = None,
                    ) -> dict[str, Any]:
    """One phase (one offered load): per-tier statistics plus "all" (SLA against each request's own tier),
    the QUIC handshakes of the phase's connections and each client process's CPU seconds."""
    order = list(dict.fromkeys([*tier_order, *sorted({r.tier for r in results})]))
    tpot_targets_ms = tpot_targets_ms or {}
    tiers = {t: summarize_tier([r for r in results if r.tier == t], duration_s, targets_ms.get(t),
                               tpot_targets_ms.get(t))
             for t in order if any(r.tier == t for r in results)}
    overall = summarize_tier(results, duration_s, None)
    admitted = [r for r in results if r.admitted]
    met = sum(1 for r in admitted if r.tier in targets_ms and r.met(targets_ms[r.tier] / 1000))
    overall["sla_met"] = met
    overall["sla_attainment"] = met / len(admitted) if admitted else None
    overall["goodput"] = met / max(duration_s, 1e-9)
    paced = [(r.tier, t) for r in results if (t := r.tpot) is not None and r.tier in tpot_targets_ms]
    overall["tpot_met"] = sum(1 for tier, t in paced if t <= tpot_targets_ms[tier] / 1000)
    overall["tpot_attainment"] = overall["tpot_met"] / len(paced) if paced else None
    dur = max(duration_s, 1e-9)
    return {"load": load, "duration_s": duration_s, "tiers": tiers, ALL: overall,
            "handshake": latency_summary(handshakes),
            "client_cpu_pct": [round(100 * c / dur, 1) for c in client_cpu_s],
            "requests": [_request_record(r, results[0].start if results else 0.0) for r in results]}


def _request_record(r: RequestResult, t0: float) -> dict[str, Any]:
    d = asdict(r)
    d["start"] = round(r.start - t0, 6)
    d["ttft_ms"], d["e2e_ms"] = _ms(d.pop("ttft")), _ms(d.pop("e2e"))
    d["itl_ms"] = [_ms(g) for g in d.pop("itls")]
    return d


# ------------------------------------------------------------------------------------------ output


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Columns padded to their widest cell; the first `left` columns left-aligned, the rest right."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) if i < left else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def load_label(load: dict[str, Any]) -> str:
    if load.get("rate") is not None:
        return f"rate {load['rate']:g} req/s (Poisson)"
    return f"concurrency {load.get('concurrency')}"


def format_phase(phase: dict[str, Any]) -> str:
    """The human table for one phase: a summary per tier, then latency percentiles per tier."""
    groups = [*phase["tiers"].items(), (ALL, phase[ALL])]
    statuses = sorted({s for _, t in groups for s in t["rejected"]} | {"429", "503"})
    head = ["tier", "sent", "ok", *statuses, "err", "req/s", "tok/s", "target ms", "SLA %", "goodput/s",
            "TPOT target ms", "TPOT SLA %", "handshake p50 ms", "handshake p99 ms"]
    hs = phase.get("handshake") or {}
    rows = []
    for name, t in groups:
        att = t["sla_attainment"]
        # A connection carries every tier, so handshakes belong to the phase: shown on the "all" row.
        hs_cells = [_fmt(hs.get("p50"), 2), _fmt(hs.get("p99"), 2)] if name == ALL else ["", ""]
        rows.append([name, str(t["sent"]), str(t["completed"]), *(str(t["rejected"].get(s, 0)) for s in statuses),
                     str(t["errors"]), _fmt(t["request_throughput"], 2), _fmt(t["output_token_throughput"], 1),
                     _fmt(t["ttft_target_ms"], 0), "-" if att is None else f"{100 * att:.1f}",
                     _fmt(t["goodput"], 2), _fmt(t.get("tpot_target_ms"), 0),
                     "-" if t.get("tpot_attainment") is None else f"{100 * t['tpot_attainment']:.1f}", *hs_cells])
    lat_head = ["tier", "ms", *(f"p{q}" for q in PERCENTILES), "mean", "n"]
    lat_rows = []
    for name, t in groups:
        for i, metric in enumerate(LATENCIES):
            s = t[metric]
            lat_rows.append([name if i == 0 else "", metric.upper(), *(_fmt(s[f"p{q}"]) for q in PERCENTILES),
                             _fmt(s["mean"]), str(s["n"])])
    title = f"== {load_label(phase['load'])}: {phase[ALL]['sent']} requests in {phase['duration_s']:.1f} s"
    if phase.get("client_cpu_pct"):
        cpu = phase["client_cpu_pct"]
        title += f"; {len(cpu)} client process{'es' if len(cpu) > 1 else ''}, busiest at {max(cpu):.0f}% of a core"
    lines = [title, _table(head, rows), "", _table(lat_head, lat_rows, left=2)]
    if (probe := phase.get("handshake_under_load")) is not None:
        lines.append(f"handshakes of fresh connections during the phase: p50 {_fmt(probe['p50'], 2)} ms, "
                     f"p99 {_fmt(probe['p99'], 2)} ms, n {probe['n']}")
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    return "\n\n".join(format_phase(p) for p in report["phases"])


def write_json(path: str | Path, report: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def _x(load: dict[str, Any]) -> float:
    return float(load["rate"] if load.get("rate") is not None else load.get("concurrency") or 0)


def write_plot(path: str | Path, report: dict[str, Any]) -> None:
    """PNG of latency against load, one point per phase. Left: TTFT p99 (solid) and p50 (dashed) per
    tier, the tier's target dotted. Right: SLA attainment (solid) and rejected share (dashed) per tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    phases = report["phases"]
    xs = [_x(p["load"]) for p in phases]
    by_rate = bool(phases) and phases[0]["load"].get("rate") is not None
    tiers = list(dict.fromkeys(t for p in phases for t in p["tiers"]))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    nan = lambda v: math.nan if v is None else v  # noqa: E731
    for i, tier in enumerate(tiers):
        c = colors[i % len(colors)]
        stats = [p["tiers"].get(tier) for p in phases]
        for q, style in (("p99", "-"), ("p50", "--")):
            ax.plot(xs, [nan(s["ttft"][q]) if s else math.nan for s in stats], style, marker="o", color=c)
        target = next((s["ttft_target_ms"] for s in stats if s and s["ttft_target_ms"] is not None), None)
        if target is not None:
            ax.axhline(target, color=c, linestyle=":", linewidth=1)
        ax2.plot(xs, [100 * nan(s["sla_attainment"]) if s else math.nan for s in stats], "-", marker="o", color=c)
        ax2.plot(xs, [100 * sum(s["rejected"].values()) / s["sent"] if s and s["sent"] else math.nan
                      for s in stats], "--", marker="x", color=c)
    tier_handles = [Line2D([], [], color=colors[i % len(colors)], marker="o", label=t) for i, t in enumerate(tiers)]
    style = lambda ls, label, m="": Line2D([], [], color="gray", linestyle=ls, marker=m, label=label)  # noqa: E731
    xlabel = "offered load (requests/s)" if by_rate else "concurrent requests"
    ax.set(xlabel=xlabel, ylabel="TTFT (ms)", title="Time to first token against load")
    if any(p["tiers"] for p in phases):
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(handles=[*tier_handles, style("-", "p99"), style("--", "p50"), style(":", "target")], fontsize=7)
    ax2.set(xlabel=xlabel, ylabel="percent", title="SLA attainment and rejections", ylim=(-3, 103))
    ax2.grid(True, alpha=0.3)
    ax2.legend(handles=[*tier_handles, style("-", "within TTFT target", "o"), style("--", "rejected", "x")],
               fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
