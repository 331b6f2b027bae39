"""`edged bench network`: a --quick run in real network namespaces (root, `ip` and `nft` needed) gives
the table and the JSON for HTTP/3 and HTTP/2, every stream complete, and nftables really dropped
packets; without root it says why and exits 77."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edged.bench.netns_lab import missing_requirements

CLI = [sys.executable, "-m", "edged.cli", "bench", "network"]


def test_quick_run_applies_loss_and_reports_both_protocols(tmp_path: Path, tiny_hf_dir) -> None:
    why = missing_requirements()
    if why is not None:
        pytest.skip(f"edged bench network {why}")
    out = tmp_path / "net.json"
    r = subprocess.run([*CLI, "--quick", "--loss", "10", "--model", str(tiny_hf_dir("llama")), "--json", str(out)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    table = r.stdout
    h3 = "h3/reno-floor+dup1500/loss"  # the daemon's defaults: reno-floor, datagrams sent twice after a loss
    assert "ttft p50" in table and "gap p99" in table and h3 in table and "h2/bbr" in table, table
    assert "returning client" in table and "h3 0-RTT" in table, table

    report = json.loads(out.read_text())
    assert report["config"]["losses_pct"] == [10] and report["config"]["delays_ms"] == [0.0]
    cases = {c["proto"]: c for c in report["cases"]}
    assert set(cases) == {h3, "h2/bbr"}
    for proto, c in cases.items():
        assert c["loss_pct"] == 10 and c["errors"] == 0 and c["streams"] == 4, c  # --quick: 4 streams, 1 run
        for key in ("ttft_p50_ms", "ttft_p99_ms", "gap_p99_ms", "gap_max_ms", "total_s"):
            assert c[key] is not None and c[key] > 0, (proto, key, c)
        # nftables dropped packets of this protocol's run: about 10% of what crossed the wire.
        assert c["packets_dropped"] > 0, c
        assert c["packets_dropped"] < 0.4 * c["packets_on_wire"], c
    runs = [r for r in report["runs"] if "streams" in r]
    assert len(runs) == 2
    for run in runs:
        for s in run["streams"]:
            assert s["error"] is None and 1 <= s["events"] <= 32 and s["total_s"] >= s["ttft_s"], s
    # The returning client (no loss): a full handshake and 0-RTT, whose early data the daemon accepted.
    modes = {r["mode"]: r for r in report["returning"]}
    assert set(modes) == {"h3 full handshake", "h3 0-RTT", "h2 new TLS/TCP"}
    assert all(m["errors"] == 0 and m["ttft_p50_ms"] > 0 for m in modes.values()), modes
    assert modes["h3 0-RTT"]["early_data_accepted"] == 1, modes
    # Nothing left behind: the namespaces are gone.
    assert "edged-bench-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout


def test_without_root_it_says_why_and_exits_77(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from edged.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["bench", "network", "--quick"]) == 77
    assert "skipped: needs root" in capsys.readouterr().err
