"""The whole path, end to end: `edged serve` as a real process, real HTTP/3 clients over loopback."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edged.server.h3_client import H3Client, iter_sse
from helpers.daemon import DaemonProcess, free_port, start_daemon
from helpers.metrics import families, metric_sum, metric_value

pytestmark = pytest.mark.slow

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
           "What is 2 plus 2?", "Say hello in Spanish.", "What is a cat?", "List two planets.",
           "Why is the sky blue?"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("daemon"), "model:\n  max_num_seqs: 32\n")
    yield d
    assert d.stop() == 0, d.log_text()[-3000:]


def chat_body(content: str, max_tokens: int = 24, stream: bool = True, **extra) -> bytes:
    return json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}).encode()


async def stream_text(client: H3Client, body: bytes) -> str:
    rs = await client.stream("POST", "/v1/chat/completions", {"content-type": "application/json"}, body)
    assert rs.status == 200, await rs.read()
    text = ""
    events = [e async for e in iter_sse(rs)]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        for choice in json.loads(e)["choices"]:
            text += choice["delta"].get("content") or ""
    return text


def test_edged_chat_streams_an_answer_naming_paris(daemon: DaemonProcess) -> None:
    out = subprocess.run([sys.executable, "-m", "edged.cli", "chat", "What is the capital of France?",
                          "--port", str(daemon.port), "--state-dir", str(daemon.state_dir), "--temperature", "0",
                          "--max-tokens", "32"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_an_independent_http3_client_streams_paris(daemon: DaemonProcess) -> None:
    from curl_cffi import CurlHttpVersion, requests

    r = requests.post(f"https://127.0.0.1:{daemon.port}/v1/chat/completions", http_version=CurlHttpVersion.V3ONLY,
                      verify=daemon.ca_file, timeout=120, stream=True,
                      json={"messages": PARIS, "stream": True, "temperature": 0, "max_tokens": 32})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert "Paris" in text


def test_32_concurrent_greedy_streams_over_4_connections_equal_their_solo_runs(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) as c:
            alone = [await stream_text(c, chat_body(p)) for p in PROMPTS]
        clients = [H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) for _ in range(4)]
        for c in clients:
            await c.connect()
        try:
            together = await asyncio.wait_for(asyncio.gather(
                *[stream_text(c, chat_body(p)) for c in clients for p in PROMPTS]), 300)
        finally:
            for c in clients:
                await c.close()
        assert "Paris" in alone[0] and len(set(alone)) == len(PROMPTS)  # real, different answers
        assert together == alone * 4

    asyncio.run(main())


def test_non_streaming_and_msgpack_responses_carry_the_same_text(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) as c:
            sse = await stream_text(c, chat_body(PROMPTS[0]))
            r = await c.request("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                chat_body(PROMPTS[0], stream=False))
            assert r.status == 200 and r.headers.get("x-request-id")
            body = r.json()
            assert body["choices"][0]["message"]["content"] == sse
            assert body["usage"]["completion_tokens"] > 0
            rs = await c.stream("POST", "/v1/chat/completions",
                                {"content-type": "application/json", "accept": "application/x-msgpack"},
                                chat_body(PROMPTS[0]))
            assert rs.headers["content-type"] == "application/x-msgpack"
            data = await rs.read()
            frames, text = [], ""
            while data:
                n = int.from_bytes(data[:4], "big")
                frames.append(msgpack.unpackb(data[4:4 + n]))
                data = data[4 + n:]
            assert frames[-1] == {"done": True}
            for f in frames[:-1]:
                text += f["choices"][0]["delta"].get("content") or ""
            assert text == sse
            models = (await c.request("GET", "/v1/models")).json()
            assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
            assert (await c.request("GET", "/healthz")).json() == {"status": "ok"}

    asyncio.run(main())


BAD_REQUESTS = [
    # (method, path, headers, body, status, code, param)
    ("POST", "/v1/chat/completions", {}, b"{not json", 400, "invalid_json", None),
    ("POST", "/v1/chat/completions", {}, b'{"model": "x"}', 400, "missing_required_parameter", "messages"),
    ("POST", "/v1/chat/completions", {}, b'{"messages": "hi"}', 400, "invalid_type", "messages"),
    ("POST", "/v1/chat/completions", {}, b'{"messages": []}', 400, "invalid_value", "messages"),
    ("POST", "/v1/chat/completions", {}, b'{"messages": [{"role": "user", "content": 5}]}', 400, "invalid_type",
     "messages[0].content"),
    ("POST", "/v1/chat/completions", {}, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
     400, "invalid_type", "temperature"),
    ("POST", "/v1/chat/completions", {}, chat_body("hi", max_tokens=0), 400, "invalid_value", "max_tokens"),
    ("POST", "/v1/chat/completions", {}, chat_body("hi", max_tokens=-3), 400, "invalid_value", "max_tokens"),
    ("POST", "/v1/chat/completions", {}, chat_body("hi", max_tokens=10**9), 400, "invalid_value", "max_tokens"),
    ("POST", "/v1/chat/completions", {}, chat_body("word " * 9000), 400, "context_length_exceeded", "messages"),
    ("POST", "/v1/chat/completions", {}, json.dumps({"model": "gpt-17", "messages": PARIS}).encode(), 404,
     "model_not_found", "model"),
    ("GET", "/v1/chat/completions", {}, None, 405, "method_not_allowed", None),
    ("POST", "/v1/nothing-here", {}, b"{}", 404, "not_found", None),
    ("POST", "/v1/chat/completions", {}, b'{"messages": [{"role": "user", "content": "' + b"a" * (2 << 20) + b'"}]}',
     413, "request_too_large", None),
    ("POST", "/v1/chat/completions", {}, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400,
     "invalid_encoding", None),
    ("POST", "/v1/completions", {}, b'{"prompt": 12}', 400, "invalid_type", "prompt"),
]


def test_every_bad_input_gets_a_4xx_with_an_openai_error_and_the_daemon_keeps_serving(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) as c:
            for method, path, headers, body, status, code, param in BAD_REQUESTS:
                r = await c.request(method, path, {"content-type": "application/json", **headers}, body, timeout=60)
                assert r.status == status, (path, body[:80] if body else None, r.status, r.text[:300])
                err = r.json()["error"]
                assert (err["code"], err["param"]) == (code, param), (body[:80] if body else path, err)
                assert err["type"] == "invalid_request_error" and len(err["message"]) > 10
                assert r.headers.get("x-request-id")
            assert "Paris" in await stream_text(c, chat_body(PARIS[0]["content"], max_tokens=32))

    asyncio.run(main())
    assert daemon.proc.poll() is None


def test_edged_chat_reports_an_unreachable_daemon_and_exits_non_zero(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "edged.cli", "chat", "hi", "--port", str(free_port()),
                          "--insecure"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "could not reach edged" in out.stderr


def test_a_second_daemon_on_a_running_ones_port_exits_with_a_clear_error_and_the_first_keeps_serving(
        daemon: DaemonProcess, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "edged.cli", "serve", "--listen", f"127.0.0.1:{daemon.port}",
                          "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"cannot listen on udp 127.0.0.1:{daemon.port}: address already in use" in out.stderr
    assert "engine built" not in out.stderr  # refused before the model loads

    async def ask() -> str:
        async with H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) as c:
            return await stream_text(c, chat_body("What is the capital of France?", max_tokens=8))

    assert asyncio.run(ask())  # the first daemon still answers


# ------------------------------------------------------------------ stop strings, through the API

async def sse_chunks(client: H3Client, body: bytes) -> tuple[list[str], str | None, dict]:
    """(content pieces in order, finish_reason, usage) of a streamed chat completion."""
    rs = await client.stream("POST", "/v1/chat/completions", {"content-type": "application/json"}, body)
    assert rs.status == 200, await rs.read()
    pieces, finish, usage = [], None, {}
    async for e in iter_sse(rs):
        if e == "[DONE]":
            break
        obj = json.loads(e)
        usage = obj.get("usage") or usage
        for choice in obj["choices"]:
            if choice["delta"].get("content"):
                pieces.append(choice["delta"]["content"])
            finish = choice.get("finish_reason") or finish
    return pieces, finish, usage


def test_stop_strings_cut_the_answer_even_across_chunks_and_the_earliest_wins(daemon: DaemonProcess) -> None:
    question = "Describe a lighthouse on a stormy night in two sentences."
    usage_opts = {"stream_options": {"include_usage": True}}

    async def main() -> None:
        async with H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) as c:
            pieces, finish, usage = await sse_chunks(c, chat_body(question, max_tokens=32, ignore_eos=True,
                                                                  **usage_opts))
            full = "".join(pieces)
            assert finish == "length" and usage["completion_tokens"] == 32
            # A stop made of the end of one chunk and the start of the next: it spans two tokens.
            i = next(i for i in range(2, len(pieces) - 1)
                     if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
                     and full.find(pieces[i][-2:] + pieces[i + 1][:2]) == len("".join(pieces[:i + 1])) - 2)
            spanning = pieces[i][-2:] + pieces[i + 1][:2]
            cut = full.find(spanning)
            later = full[cut + 3:cut + 8]  # occurs only after the first stop: must not win
            never = "\u2603 no such text"
            body = chat_body(question, max_tokens=32, ignore_eos=True, stop=[later, never, spanning], **usage_opts)
            got, finish, usage = await sse_chunks(c, body)
            assert "".join(got) == full[:cut] and finish == "stop"
            assert usage["completion_tokens"] < 32  # generation ended at the stop, not at max_tokens
            r = await c.request("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                chat_body(question, max_tokens=32, stream=False, ignore_eos=True, stop=[spanning]))
            choice = r.json()["choices"][0]
            assert (choice["message"]["content"], choice["finish_reason"]) == (full[:cut], "stop")

    asyncio.run(main())


# ------------------------------------------------------ a seeded request from the result cache

def test_a_seeded_sampled_request_is_answered_from_the_result_cache(daemon: DaemonProcess) -> None:
    def body(seed: int) -> bytes:
        return chat_body("Invent a name for a friendly robot.", max_tokens=16, stream=False, temperature=0.9,
                         top_k=40, seed=seed)

    async def main() -> None:
        async with H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) as c:
            async def post(seed: int):
                r = await c.request("POST", "/v1/chat/completions", {"content-type": "application/json"}, body(seed))
                assert r.status == 200, r.text
                return r.headers.get("x-edged-cache"), r.json()

            first = await post(1234)
            generated = metric_value(await scrape(c), "edged_generated_tokens_total")
            again = await post(1234)
            assert (first[0], again[0]) == ("miss", "hit")
            assert again[1]["choices"] == first[1]["choices"] and again[1]["usage"] == first[1]["usage"]
            assert metric_value(await scrape(c), "edged_generated_tokens_total") == generated  # no engine work
            other = await post(99)
            assert other[0] == "miss"  # the seed is part of the key

    asyncio.run(main())


# ------------------------------------------------------------------ metrics after real requests

async def scrape(c: H3Client) -> str:
    r = await c.request("GET", "/metrics")
    assert r.status == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def test_metrics_after_real_requests_have_every_family_with_plausible_values(daemon: DaemonProcess) -> None:
    import psutil
    import torch

    from edged.config import Config

    tiers = Config().tiers
    gold = {"content-type": "application/json", "x-edged-tier": "gold"}
    bronze = {"content-type": "application/json", "x-edged-tier": "bronze"}
    shared = "Background: " + " ".join(f"Shelf {i} holds {i * 3} boxes of tea." for i in range(24))

    async def main() -> None:
        async with H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) as c:
            # tokens/s is computed between scrapes at least a second apart: make this pair the window
            await scrape(c)
            await asyncio.sleep(1.05)
            outer0 = time.monotonic()
            before = await scrape(c)
            inner0 = t0 = time.monotonic()
            for i, headers in enumerate([gold, gold, bronze]):  # three misses; the first two share a prefix
                rs = await c.stream("POST", "/v1/chat/completions", headers,
                                    chat_body(f"{shared} Question {i}: how many boxes on shelf {i}?", max_tokens=6,
                                              ignore_eos=True))
                assert rs.status == 200 and rs.headers["x-edged-cache"] == "miss"
                assert [e async for e in iter_sse(rs)][-1] == "[DONE]"
            r = await c.request("POST", "/v1/chat/completions", gold,
                                chat_body(f"{shared} Question 0: how many boxes on shelf 0?", max_tokens=6,
                                          ignore_eos=True, stream=False))
            assert r.headers["x-edged-cache"] == "hit"
            assert (await c.request("POST", "/v1/chat/completions", bronze, b"{bad")).status == 400
            await asyncio.sleep(max(0.0, 1.05 - (time.monotonic() - t0)))
            inner1 = time.monotonic()
            after = await scrape(c)
            outer1 = time.monotonic()
        return before, after, (inner1 - inner0, outer1 - outer0)

    before, after, (inner, outer) = asyncio.run(main())
    rss_now = psutil.Process(daemon.proc.pid).memory_info().rss
    fams = families(after)
    want = {"edged_requests", "edged_ttft_seconds", "edged_itl_seconds", "edged_request_seconds", "edged_queue_depth",
            "edged_running_requests", "edged_sla_attainment", "edged_batch_window_seconds", "edged_batch_size", "edged_step_seconds",
            "edged_tokens_per_second", "edged_kv_blocks", "edged_result_cache_lookups", "edged_prefix_tokens_reused",
            "edged_process_cpu_percent", "edged_process_rss_bytes", "edged_engine_steps", "edged_generated_tokens",
            "edged_prefill_tokens", "edged_result_cache_bytes", "edged_tier_ttft_target_seconds",
            "edged_max_tokens_limit"}
    assert want <= fams, want - fams
    assert ("edged_gpu_memory_bytes" in fams) == torch.cuda.is_available()

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, labels) - metric_sum(before, name, labels)

    # admitted and rejected, per tier and outcome (the cache hit is a completed request too)
    assert delta("edged_requests_total", tier="gold", outcome="length") == 3
    assert delta("edged_requests_total", tier="bronze", outcome="length") == 1
    assert delta("edged_requests_total", outcome="rejected") == 1
    # per-tier latency histograms: one observation per completed request, ITL for each multi-token one
    for tier, n in (("gold", 3), ("bronze", 1)):
        assert delta("edged_ttft_seconds_count", tier=tier) == n
        assert delta("edged_itl_seconds_count", tier=tier) == n
        assert delta("edged_request_seconds_count", tier=tier) == n
        assert 0 < delta("edged_ttft_seconds_sum", tier=tier) < delta("edged_request_seconds_sum", tier=tier)
        assert delta("edged_ttft_seconds_bucket", tier=tier, le="+Inf") == n
    # the engine did the work of exactly the three misses
    assert delta("edged_generated_tokens_total") == 3 * 6
    assert delta("edged_engine_steps_total") >= 6
    assert delta("edged_prefill_tokens_total") > 0
    assert delta("edged_prefix_tokens_reused_total") > 0 and delta("edged_prefix_tokens_reused_total") % 16 == 0
    assert (delta("edged_result_cache_lookups_total", result="miss"),
            delta("edged_result_cache_lookups_total", result="hit")) == (3, 1)
    assert metric_value(after, "edged_result_cache_bytes") > metric_value(before, "edged_result_cache_bytes")
    # gauges: the engine is idle again; its last step ran at least one sequence
    assert 1 <= metric_value(after, "edged_batch_size") <= 32
    assert 0 < metric_value(after, "edged_step_seconds") < outer
    used, free = (metric_value(after, "edged_kv_blocks", {"state": s}) for s in ("used", "free"))
    assert free > 0 and used + free == sum(metric_value(before, "edged_kv_blocks", {"state": s}) for s in ("used", "free"))
    # the tokens generated between the two scrapes over the time between them (as the server saw it)
    rate = metric_value(after, "edged_tokens_per_second")
    tokens = delta("edged_generated_tokens_total")
    assert tokens / outer * 0.999 <= rate <= tokens / inner * 1.001, (rate, tokens, inner, outer)
    for tier, t in tiers.items():
        assert metric_value(after, "edged_queue_depth", {"tier": tier}) == 0
        assert metric_value(after, "edged_running_requests", {"tier": tier}) == 0
        assert 0.0 <= metric_value(after, "edged_sla_attainment", {"tier": tier}) <= 1.0
        window = metric_value(after, "edged_batch_window_seconds", {"tier": tier})
        assert t.batch_window_ms.min / 1000 <= window <= t.batch_window_ms.max / 1000
        assert metric_value(after, "edged_tier_ttft_target_seconds", {"tier": tier}) == t.ttft_target_ms / 1000
    rss = metric_value(after, "edged_process_rss_bytes", {"process": "supervisor"})
    assert rss == pytest.approx(rss_now, rel=0.25)  # the supervisor's own memory
    roles = {s.labels["process"] for f in text_string_to_metric_families(after) for s in f.samples
             if s.name == "edged_process_rss_bytes"}
    assert roles == {"supervisor", "core", "w0"}  # every process of the daemon, by role
    for role in roles:
        assert 0 <= metric_value(after, "edged_process_cpu_percent", {"process": role}) <= 100 * psutil.cpu_count()
