"""Local caching against the real model and daemon: result-cache hits, restarts, SIGKILL, prefix reuse."""
from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edged.cache.result_cache import ResultCache, db_path
from edged.engine.request import GenerationRequest, SamplingParams
from edged.engine.setup import EngineSettings, build_engine
from edged.models.loader import LoadedModel
from edged.server.h3_client import H3Client, iter_sse
from helpers.daemon import start_daemon
from helpers.metrics import metric_value

pytestmark = pytest.mark.slow


def body(content: str, max_tokens: int = 48, **extra) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, **extra}).encode()


async def timed_stream(c: H3Client, data: bytes) -> tuple[str, float, str | None]:
    """(text, seconds to the first content chunk, x-edged-cache header)."""
    t0 = time.perf_counter()
    rs = await c.stream("POST", "/v1/chat/completions", {"content-type": "application/json"}, data)
    assert rs.status == 200
    text, ttft = "", None
    async for e in iter_sse(rs):
        if e == "[DONE]":
            break
        piece = json.loads(e)["choices"][0]["delta"].get("content")
        if piece:
            ttft = ttft or time.perf_counter() - t0
            text += piece
    return text, ttft, rs.headers.get("x-edged-cache")


def test_a_repeated_greedy_request_is_a_cache_hit_without_engine_work_and_survives_restart(
        tmp_path: Path) -> None:
    question = "Explain in two sentences why the sea is salty."
    # A long prompt makes the first request's prefill real work, as on a node under load.
    long_question = ("Context: " + "the tide comes in and goes out again. " * 60 + question)
    d = start_daemon(tmp_path)
    try:
        async def engine_work(c: H3Client) -> tuple[float, float]:
            text = (await c.request("GET", "/metrics")).text
            return (metric_value(text, "edged_prefill_tokens_total"), metric_value(text, "edged_generated_tokens_total"))

        async def first_run() -> tuple[str, float, float]:
            async with H3Client("127.0.0.1", d.port, ca_file=d.ca_file) as c:
                text1, ttft1, h1 = await timed_stream(c, body(long_question))
                work = await engine_work(c)
                text2, ttft2, h2 = await timed_stream(c, body(long_question))
                assert (h1, h2) == ("miss", "hit")
                assert await engine_work(c) == work  # the hit neither prefilled nor generated a token
                assert text2 == text1
                r = await c.request("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                    body(question, stream=False))
                assert r.headers["x-edged-cache"] == "miss"
                sampled = await c.request("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                          body(question, stream=False, temperature=0.7))
                assert "x-edged-cache" not in sampled.headers  # neither greedy nor seeded: not cacheable
                return text1, ttft1, ttft2

        text, ttft_miss, ttft_hit = asyncio.run(first_run())
        assert ttft_hit < ttft_miss, (ttft_miss, ttft_hit)  # no 600-token prefill before the first token
    finally:
        assert d.stop() == 0
    d = start_daemon(tmp_path)  # same state dir
    try:
        async def after_restart() -> None:
            async with H3Client("127.0.0.1", d.port, ca_file=d.ca_file) as c:
                again, _, header = await timed_stream(c, body(long_question))
                assert header == "hit" and again == text
                r = await c.request("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                    body(question, stream=False))
                assert r.headers["x-edged-cache"] == "hit"

        asyncio.run(after_restart())
        stats = subprocess.run([sys.executable, "-m", "edged.cli", "cache", "stats", "--state-dir",
                                str(d.state_dir)], capture_output=True, text=True, timeout=60)
        assert stats.returncode == 0 and "entries: 2" in stats.stdout
    finally:
        assert d.stop() == 0


@pytest.mark.timeout(600)
def test_sigkill_during_heavy_cache_writes_leaves_a_cache_that_opens_every_time(
        tmp_path: Path, tiny_hf_dir) -> None:
    # What is under test is the result cache, not the model: a tiny random-weight model (the real
    # tokenizer and template) loads in a moment. Four daemon rounds kill at four different moments;
    # the 20 kills in a row are test_result_cache's writer-process rounds (the same cache code, cheaper).
    config = f"model:\n  max_num_seqs: 32\n  path: {tiny_hf_dir('llama')}\n"
    rounds = 4
    for round_no in range(rounds):
        d = start_daemon(tmp_path, config)
        assert "moved aside" not in d.log_text()

        async def hammer() -> None:
            c = H3Client("127.0.0.1", d.port, ca_file=d.ca_file)
            await c.connect()
            answered = 0
            writing = asyncio.Event()

            async def one(i: int) -> None:
                nonlocal answered
                r = await c.request("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                    body(f"Round {round_no}, question {i}: name a fruit.", max_tokens=2, stream=False))
                answered += r.status == 200
                if answered >= 3:
                    writing.set()  # results are being written to the cache now

            tasks = [asyncio.create_task(one(i)) for i in range(64)]
            await asyncio.wait_for(writing.wait(), 45)
            await asyncio.sleep(0.08 * round_no)  # a different moment in every round
            d.proc.send_signal(signal.SIGKILL)
            for t in tasks:
                t.cancel()  # the daemon is gone: nothing will answer them
            await asyncio.wait(tasks, timeout=5)
            await asyncio.wait_for(c.close(), 5)

        asyncio.run(asyncio.wait_for(hammer(), 60))
        d.proc.wait(30)
        path = db_path(d.state_dir)
        with sqlite3.connect(path) as con:
            assert con.execute("PRAGMA quick_check").fetchone()[0] == "ok"
        with sqlite3.connect(path) as con:
            keys = [k for (k,) in con.execute("SELECT key FROM entries")]
        cache = ResultCache.open(path, max_bytes=None, ttl_s=None)
        try:
            assert cache.available
            # Every entry present reads back whole: its checksum holds and its text is a real answer.
            for key in keys:
                hit = cache.get(key)
                assert hit is not None and hit.completion_tokens == len(hit.token_ids) > 0
            assert cache.stats()["corrupt"] == 0
        finally:
            cache.close()
        assert not list(d.state_dir.glob("*.corrupt-*"))
    # Every round answered at least three requests before the kill: their results were kept.
    cache = ResultCache.open(db_path(d.state_dir), max_bytes=None, ttl_s=None)
    try:
        assert cache.stats()["entries"] >= 2 * rounds
    finally:
        cache.close()


def test_a_shared_1000_token_prefix_is_prefilled_once_and_the_output_is_unchanged(
        loaded_model: LoadedModel) -> None:
    tok = loaded_model.tokenizer
    prefix = tok.encode("Background notes. " + " ".join(f"Item {i} is stored on shelf {i % 7}." for i in range(200)))
    prefix = prefix[:1000]
    assert len(prefix) == 1000
    first = prefix + tok.encode(" Question: which shelf holds item 3?")
    second = prefix + tok.encode(" Question: which shelf holds item 12? Answer briefly.")

    def run(prefix_caching: bool) -> tuple[list[int], int, int]:
        engine = build_engine(loaded_model, EngineSettings(num_kv_blocks=256, max_num_seqs=4,
                                                           prefix_caching=prefix_caching))
        counters, blocks = engine.engine.counters, engine.engine.blocks

        async def gen(rid: str, ids: list[int]) -> list[int]:
            out: list[int] = []
            async for d in engine.generate(GenerationRequest(rid, ids, SamplingParams(temperature=0, max_tokens=16))):
                out += d.token_ids
            return out

        async def main() -> tuple[list[int], int, int]:
            engine.start()
            try:
                await gen("a", first)
                before = counters.prefill_tokens
                out = await gen("b", second)
                return out, counters.prefill_tokens - before, blocks.counters.prefix_tokens_reused
            finally:
                engine.engine.stop()

        return asyncio.run(main())

    with_cache, prefilled, reused = run(True)
    without_cache, prefilled_off, _ = run(False)
    block = 16
    assert reused == (1000 // block) * block
    assert prefilled == len(second) - reused
    assert prefilled_off == len(second)
    assert with_cache == without_cache
