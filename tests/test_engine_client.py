"""The seam between the HTTP layer and the engine: one protocol, and the stream of one request's text.

Coalescing: a stream that keeps up gets one delta per engine step; one that is behind gets all of
its pending tokens in one delta (never a queue of single-token events), and a stop string still
cuts exactly where it starts.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from edged.engine.async_engine import AsyncEngine
from edged.engine.client import DeltaStream, EngineClient
from edged.engine.remote_client import RemoteEngineClient
from edged.engine.request import GenerationRequest, SamplingParams, StepOutput
from helpers.fake_engine import FakeEngine
from helpers.char_tokenizer import CharTokenizer


def request(stop: list[str] | None = None) -> GenerationRequest:
    return GenerationRequest("r1", [1, 2, 3], SamplingParams(max_tokens=100, stop=stop or []))


def out(text: str, finish: str | None = None) -> StepOutput:
    return StepOutput("r1", [ord(c) for c in text], finish is not None, finish)


def test_every_engine_front_implements_the_protocol(tmp_path) -> None:
    info = SimpleNamespace(model_id="m", max_model_len=64, vocab_size=100, tokenizer=None, chat_template=None)
    remote = RemoteEngineClient(info, str(tmp_path), "w0")  # ipc sockets connect lazily: no core needed
    try:
        for front in (FakeEngine(), remote, AsyncEngine(SimpleNamespace(vocab_size=100), None, None, "m", 64)):
            assert isinstance(front, EngineClient), type(front).__name__
    finally:
        remote.close()


def test_a_stream_that_keeps_up_gets_a_delta_per_step_and_one_behind_gets_one_delta() -> None:
    async def go() -> tuple[list, list, list[str]]:
        cancelled: list[str] = []
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        live = DeltaStream(request(), q, CharTokenizer(), cancelled.append)
        steps = []
        for piece in ("Hel", "lo", " wor"):
            q.put_nowait(out(piece))
            steps.append(await live.__anext__())  # the consumer reads each step as it comes
        q.put_nowait(out("ld", "length"))
        steps.append(await live.__anext__())
        behind_q: asyncio.Queue[StepOutput] = asyncio.Queue()
        behind = DeltaStream(request(), behind_q, CharTokenizer(), cancelled.append)
        for piece in ("Hel", "lo", " wor"):
            behind_q.put_nowait(out(piece))  # three steps pile up before the consumer reads
        first = await behind.__anext__()
        behind_q.put_nowait(out("ld", "length"))
        rest = [d async for d in behind]
        return steps, [first, *rest], cancelled

    steps, behind, cancelled = asyncio.run(go())
    assert [d.text for d in steps] == ["Hel", "lo", " wor", "ld"] and steps[-1].finish_reason == "length"
    assert [d.text for d in behind] == ["Hello wor", "ld"]
    assert [len(d.token_ids) for d in behind] == [9, 2] and behind[-1].completion_tokens == 11
    assert cancelled == []  # both ended by the engine: nothing to cancel


def test_a_stop_string_inside_a_coalesced_delta_cuts_there_and_cancels_once() -> None:
    async def go() -> tuple[list, list[str]]:
        cancelled: list[str] = []
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        stream = DeltaStream(request(stop=["STOP"]), q, CharTokenizer(), cancelled.append)
        for piece in ("abc", "dST", "OPef", "gh"):
            q.put_nowait(out(piece))
        deltas = [d async for d in stream]
        await stream.aclose()  # the router closes it again: no second cancel
        return deltas, cancelled

    deltas, cancelled = asyncio.run(go())
    assert [(d.text, d.finish_reason) for d in deltas] == [("abcd", "stop")]
    assert deltas[0].completion_tokens == len("abcdSTOPef")  # counted up to the step that held the stop
    assert cancelled == ["r1"]


def test_closing_a_stream_before_the_engine_finished_cancels_it_once() -> None:
    async def go() -> list[str]:
        cancelled: list[str] = []
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        stream = DeltaStream(request(), q, CharTokenizer(), cancelled.append)
        q.put_nowait(out("abc"))
        await stream.__anext__()
        await stream.aclose()
        await stream.aclose()
        return cancelled

    assert asyncio.run(go()) == ["r1"]


def test_warm_up_takes_the_tokenizers_first_use_cost_off_the_first_request(tiny_hf_dir) -> None:
    """Each worker process has its own tokenizer, whose first encode compiles its pre-tokenizer (~100 ms
    here): a worker warms up before it reports ready, so its first request does not pay for that."""
    import time

    from edged.engine.client import PromptEncoding
    from edged.models.loader import load_model

    class Front(PromptEncoding):
        def __init__(self) -> None:
            loaded = load_model(tiny_hf_dir("llama"))
            self.tokenizer, self.chat_template = loaded.tokenizer, loaded.chat_template

    def first_request_s(front: Front) -> float:
        t = time.perf_counter()
        front.render_chat([{"role": "user", "content": "Name three rivers in France."}])
        return time.perf_counter() - t

    cold, warm = Front(), Front()
    warm.warm_up()
    assert first_request_s(warm) * 10 < first_request_s(cold)
