"""`edged bench transport`: the config it gives the daemon, the table it prints, how it names the daemon's
processes, and one run end to end against a real `edged serve` on a tiny random-weight model. Only
counts, presence and orderings are asserted: the numbers themselves belong to the benchmark."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from edged.bench.proc_cpu import ProcessCpu, short_label
from edged.bench.transport import (
    TIER,
    TransportConfig,
    add_arguments,
    config_from_args,
    context_length,
    daemon_config,
)
from edged.bench.transport_report import format_table, phase_record
from edged.config import load_config


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_defaults_sweep_1_16_64_128_with_128_tokens_and_auto_workers() -> None:
    cfg = config_from_args(parse())
    assert (cfg.concurrencies, cfg.max_tokens, cfg.workers) == ([1, 16, 64, 128], 128, "auto")
    assert parse().streams_per_connection < 16  # several connections, so SO_REUSEPORT can spread them
    assert parse().clients >= 1


@pytest.mark.parametrize("argv, flag", [(("--workers", "0"), "--workers"), (("--workers", "many"), "--workers"),
                                        (("--max-tokens", "0"), "--max-tokens"), (("--concurrency", "0"),
                                                                                  "--concurrency"),
                                        (("--model", "/nonexistent/model"), "--model")])
def test_bad_flags_name_themselves(argv: tuple[str, ...], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        config_from_args(parse(*argv))


def test_the_daemon_config_is_valid_and_never_lets_the_engine_or_admission_limit_the_load(tmp_path: Path) -> None:
    cfg = TransportConfig([1, 16, 200], max_tokens=128, prompt_tokens=32, workers="3")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(daemon_config(cfg, 4999, tmp_path / "state", tmp_path / "model")))
    c = load_config(path)
    assert c.server.listen == "127.0.0.1:4999" and str(c.server.workers) == "3"
    assert c.model.max_num_seqs >= 200 and c.scheduler.batch_cap >= 200
    assert c.model.max_model_len >= 2 * 32 + 128
    assert c.scheduler.default_tier == TIER and c.tiers[TIER].max_queue >= 200 * 4
    assert c.cache.enabled is False and c.logging.access_log is False
    assert context_length(TransportConfig([1], max_tokens=1000)) >= 1000


def test_processes_are_named_by_their_name_or_what_their_command_line_runs() -> None:
    assert short_label("edged-worker-2", ["python", "x"]) == "edged-worker-2"
    assert short_label("python3", ["/usr/bin/python3", "-m", "edged.cli", "serve", "--config", "c.yaml"]) == \
        "edged.cli serve"
    assert short_label("python", ["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()",
                                  "--multiprocessing-fork"]) == "spawn child"
    assert short_label("python3.11", ["python3.11", "/opt/edged/run.py"]) == "run.py"


def phase(concurrency: int, events: int) -> dict:
    latency = {"p50": 1.0, "p90": 2.0, "p99": 3.0, "mean": 1.5, "n": 4}
    return {"load": {"rate": None, "concurrency": concurrency}, "duration_s": 2.0,
            "all": {"sent": 4, "completed": 4, "rejected": {}, "errors": 0, "token_event_throughput": events / 2.0,
                    "output_token_throughput": events, "ttft": latency, "itl": latency},
            "handshake": latency, "client_cpu_pct": [10.0, 30.0]}


def test_the_table_has_a_row_per_concurrency_and_a_cpu_column_per_process_seen() -> None:
    core = ProcessCpu(10, "edged.cli serve", "python -m edged.cli serve", 0.2, 10.0)
    worker = ProcessCpu(11, "spawn child", "python -c spawn", 1.0, 50.0)
    late = ProcessCpu(12, "spawn child", "python -c spawn", 0.4, 20.0)  # restarted between the phases
    records = [phase_record(phase(1, 100), [core, worker]), phase_record(phase(8, 700), [core, late])]
    assert records[1]["daemon_cpu_pct"] == 30.0 and records[0]["processes"][1]["pid"] == 11
    lines = format_table(records).splitlines()
    head = lines[0].split("  ")
    assert "events/s" in lines[0] and "handshake p50" in lines[0] and "daemon CPU%" in lines[0]
    assert [h.strip() for h in head if h.strip().endswith("] %")] == \
        ["edged.cli serve[10] %", "spawn child[11] %", "spawn child[12] %"]
    rows = [line.split() for line in lines[2:4]]
    assert [r[0] for r in rows] == ["1", "8"]
    assert rows[0][-3:] == ["10", "50", "-"] and rows[1][-3:] == ["10", "-", "20"]
    assert rows[1][12:14] == ["-", "-"] and rows[1][14] == "30"  # no handshake probe; the busiest client
    assert any("spawn child[12]: python -c spawn" in line for line in lines)


# ------------------------------------------------------------------------------ end to end


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_transport_runs_a_real_daemon_and_prints_a_row_per_concurrency(tmp_path: Path, capsys) -> None:
    from edged.cli import main

    out_json = tmp_path / "t.json"
    assert main(["bench", "transport", "--concurrency", "1,4", "--rounds", "2", "--max-tokens", "8",
                 "--clients", "2", "--workers", "2", "--probe-handshakes", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("concurrency"))
    assert all(col in lines[header] for col in ("events/s", "tok/s", "TTFT p99", "ITL p50", "handshake p50",
                                                 "handshake p99", "daemon CPU%"))
    assert "edged.cli serve[" in lines[header]  # the daemon's own process, labelled by its command line
    rows = [line.split() for line in lines[header + 2: header + 4]]
    assert [r[0] for r in rows] == ["1", "4"] and not lines[header + 4].strip()

    report = json.loads(out_json.read_text())
    assert report["daemon_exit_status"] == 0  # SIGTERM: drained and exited cleanly
    phases = report["phases"]
    assert [p["concurrency"] for p in phases] == [1, 4] and [p["requests"] for p in phases] == [2, 8]
    for p in phases:
        assert p["completed"] == p["requests"] and p["errors"] == 0 and not p["rejected"]
        assert p["token_events_per_s"] > 0 and p["tokens_per_s"] >= p["token_events_per_s"] * 0.99
        assert p["ttft_ms"]["n"] == p["requests"] and p["ttft_ms"]["p50"] <= p["ttft_ms"]["p99"]
        assert p["itl_ms"]["p50"] <= p["itl_ms"]["p99"]
        assert p["handshake_ms"]["n"] >= 1 and 0 < p["handshake_ms"]["p50"] <= p["handshake_ms"]["p99"]
        assert p["processes"] and sum(q["cpu_pct"] for q in p["processes"]) == pytest.approx(p["daemon_cpu_pct"],
                                                                                            abs=0.5)
        assert p["daemon_cpu_pct"] > 0
        probe = p["handshake_under_load_ms"]  # fresh connections while the phase ran
        assert probe["n"] >= 1 and 0 < probe["p50"] <= probe["p99"]
    assert len(phases[1]["client_cpu_pct"]) == 2  # concurrency 4 over two client processes
