"""One request never harms another.

Requests whose fields would break a step (a token id past the vocabulary, a seed or top_k past
int64) are refused at the edge with a 400 naming the field while a stream runs on untouched. And
if a step fails anyway (here: a sampler that raises for one sequence), only that sequence ends,
with a generic message and its request id; the others finish exactly as they would have alone.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from edged import kernels
from edged.engine.async_engine import AsyncEngine
from edged.engine.llm_engine import LLMEngine, internal_error
from edged.engine.request import GenerationRequest, StepOutput
from edged.engine.token_readback import TokenReadback
from edged.models.loader import LoadedModel
from edged.server.h3_client import H3Client, iter_sse
from edged.server.settings import ServerSettings
from edged.server.tls import ensure_cert
from helpers.daemon import DaemonProcess, start_daemon
from helpers.fake_engine import ServerThread
from helpers.tiny_engine import request, tiny_engine

JSON = {"content-type": "application/json"}
CULPRIT_SEED = 666  # the fake sampler raises for the sequence with this seed...
FAILS_FROM = 3  # ...once it has generated this many tokens


# ------------------------------------------------------------------ the edge, against the daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    # No result cache: the same request twice must run twice.
    d = start_daemon(tmp_path_factory.mktemp("isolation"), "model:\n  max_num_seqs: 8\ncache:\n  enabled: false\n")
    yield d
    assert d.stop() == 0, d.log_text()[-3000:]


async def sse(c: H3Client, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[Any]:
    rs = await c.stream("POST", path, {**JSON, **(headers or {})}, json.dumps(body).encode())
    assert rs.status == 200, await rs.read()
    return [e if e == "[DONE]" else json.loads(e) async for e in iter_sse(rs)]


def text_of(events: list[Any]) -> str:
    return "".join(c.get("delta", {}).get("content") or c.get("text") or ""
                   for e in events[:-1] if "choices" in e for c in e["choices"])


BAD = [  # (body, the field the 400 names)
    ({"prompt": [49152], "max_tokens": 2}, "prompt"),
    ({"prompt": "Hi", "max_tokens": 2, "seed": 9223372036854775808}, "seed"),
    ({"prompt": "Hi", "max_tokens": 2, "top_k": 9223372036854775808}, "top_k"),
]


def test_bad_fields_get_400_and_a_running_stream_finishes_whole(daemon: DaemonProcess) -> None:
    story = {"messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}], "max_tokens": 48,
             "temperature": 0, "ignore_eos": True, "stream": True}

    async def main() -> None:
        async with H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) as c:
            alone = await sse(c, "/v1/chat/completions", story)
            rs = await c.stream("POST", "/v1/chat/completions", JSON, json.dumps(story).encode())
            stream = iter_sse(rs)
            events: list[Any] = []
            while not text_of([*events, "[DONE]"]):  # until the first generated text arrived
                events.append(json.loads(await anext(stream)))
            for body, field in BAD:
                r = await c.request("POST", "/v1/completions", JSON, json.dumps(body).encode())
                assert r.status == 400, (field, r.text)
                err = r.json()["error"]
                assert err["param"] == field and field in err["message"], err
            async for e in stream:
                events.append(e if e == "[DONE]" else json.loads(e))
        assert events[-1] == "[DONE]"
        assert not any("error" in e for e in events[:-1])
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert text_of(events) == text_of(alone) != ""

    asyncio.run(main())
    assert daemon.proc.poll() is None


def test_top_k_above_the_vocabulary_is_clamped_not_refused(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with H3Client("127.0.0.1", daemon.port, ca_file=daemon.ca_file) as c:
            body = {"prompt": "Once upon a time", "max_tokens": 4, "seed": 3, "temperature": 0.7}
            plain = await c.request("POST", "/v1/completions", JSON, json.dumps(body).encode())
            huge = await c.request("POST", "/v1/completions", JSON,
                                   json.dumps({**body, "top_k": 2**63 - 1}).encode())
            assert plain.status == huge.status == 200, huge.text
            assert huge.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]

    asyncio.run(main())


# ------------------------------------------------------------------ a step that fails, in the engine


def failing_sampler(real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if ((seeds == CULPRIT_SEED) & (offsets >= FAILS_FROM)).any():
            raise RuntimeError("fake sampler: cannot sample this sequence")
        return real(logits, temperature, top_k, top_p, seeds, offsets)
    return sample


def seeded(rid: str, seed: int, max_tokens: int = 10) -> GenerationRequest:
    return request(rid, [5 + seed % 50, 17, 33, 2, 90][: 3 + seed % 3], max_tokens=max_tokens,
                   temperature=0.8, seed=seed)


def drive(engine: LLMEngine, requests: list[GenerationRequest], overlap: bool) -> dict[str, list[StepOutput]]:
    """Run the engine synchronously; every StepOutput of each request."""
    engine.overlap = overlap
    out: dict[str, list[StepOutput]] = {r.request_id: [] for r in requests}
    for r in requests:
        assert engine._admit(r) is None
    step = engine.step_overlapped if overlap else engine.step
    for _ in range(1000):
        for o in step():
            out[o.request_id].append(o)
        if all(outs and outs[-1].finished for outs in out.values()) and not engine.has_work():
            return out
    raise AssertionError("the engine did not finish")


def tokens(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def engine_reading_back(ring: bool) -> LLMEngine:
    """The tiny engine; ring: its tokens come back through a ring of two buffers (as CUDA steps' do,
    through eight), so the trial steps that find a culprit wrap it while a step is in flight."""
    engine = tiny_engine()
    if ring:
        engine.runner.readback = TokenReadback(64, torch.device("cpu"), depth=2)
    return engine


@pytest.mark.parametrize("overlap,ring", [(False, False), (True, False), (True, True)],
                         ids=["serial", "overlapped", "overlapped-ring"])
def test_a_step_failure_ends_only_the_sequence_that_causes_it(overlap: bool, ring: bool,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    good = [seeded(f"good-{i}", seed) for i, seed in enumerate((1, 2, 3, 4, 5))]
    alone = {rid: tokens(outs) for rid, outs in drive(engine_reading_back(ring), good, overlap).items()}
    monkeypatch.setattr(kernels, "sample", failing_sampler(kernels.sample))
    culprit = seeded("culprit", CULPRIT_SEED)
    with caplog.at_level(logging.INFO, logger="edged.engine"):
        together = drive(engine_reading_back(ring), [*good[:2], culprit, *good[2:]], overlap)
    for r in good:
        assert tokens(together[r.request_id]) == alone[r.request_id]
        assert together[r.request_id][-1].finish_reason == "length"
    last = together["culprit"][-1]
    assert (last.finish_reason, last.error) == ("error", internal_error("culprit"))
    assert "fake sampler" not in last.error and "culprit" in last.error
    # What it had before its step failed (overlapped: the token of the step in flight is dropped).
    assert FAILS_FROM - overlap <= len(tokens(together["culprit"])) <= FAILS_FROM
    failed = [r.getMessage() for r in caplog.records if "sequence failed" in r.getMessage()]
    assert len(failed) == 1 and "request_id=culprit" in failed[0] and "fake sampler" in failed[0]


def test_the_engine_refuses_an_unrunnable_request_alone() -> None:
    engine = tiny_engine()
    vocab = engine.vocab_size
    for bad in (request("big-id", [1, vocab]), request("seed", [1, 2], temperature=0.5, seed=2**64),
                request("top-k", [1, 2], temperature=0.5, top_k=2**70), request("empty", [])):
        out = engine._admit(bad)
        assert out is not None and out.finished and out.finish_reason == "error", bad.request_id
    assert not engine.has_work()
    assert tokens(drive(engine, [seeded("fine", 1)], False)["fine"])


# ------------------------------------------------------------------ the same, over HTTP/3


@pytest.fixture
def tiny_server(tmp_path: Path, loaded_model: LoadedModel) -> Iterator[ServerThread]:
    """The real AsyncEngine and router around the tiny engine (vocabulary 256), on a real HTTP/3 server."""
    engine = tiny_engine()
    aengine = AsyncEngine(engine, loaded_model.tokenizer, loaded_model.chat_template, "tiny", engine.max_model_len)
    with ServerThread(aengine, *ensure_cert(tmp_path), settings=ServerSettings(default_max_tokens=8)) as st:
        yield st
    engine.stop()


def test_over_http3_the_failing_stream_gets_a_generic_error_and_the_others_their_text(
        tiny_server: ServerThread, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def body(seed: int) -> dict[str, Any]:
        return {"prompt": [5, 17, 33 + seed % 7], "max_tokens": 10, "temperature": 0.8, "seed": seed, "stream": True}

    async def run(with_culprit: bool) -> dict[str, list[Any]]:
        async with H3Client("127.0.0.1", tiny_server.port, insecure=True) as c:
            seeds = {"a": 1, "b": 2, "c": 3, **({"victim": CULPRIT_SEED} if with_culprit else {})}
            results = await asyncio.gather(*[sse(c, "/v1/completions", body(s), {"x-request-id": rid})
                                             for rid, s in seeds.items()])
            return dict(zip(seeds, results))

    alone = asyncio.run(run(False))
    monkeypatch.setattr(kernels, "sample", failing_sampler(kernels.sample))
    with caplog.at_level(logging.INFO, logger="edged.engine"):
        together = asyncio.run(run(True))
    for rid in "abc":
        assert together[rid][-1] == "[DONE]" and not any("error" in e for e in together[rid][:-1])
        assert text_of(together[rid]) == text_of(alone[rid])
    victim = together["victim"]
    assert victim[-1] == "[DONE]"
    assert victim[-2]["error"]["message"] == "Internal error while generating (request id victim)."
    assert "fake sampler" not in json.dumps(victim)
    assert "fake sampler" in caplog.text and "request_id=victim" in caplog.text  # the detail is in the log
