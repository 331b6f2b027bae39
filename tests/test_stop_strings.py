"""Stop strings: the filter's hold-back across chunks and several stops, and AsyncEngine using it.

(Through the HTTP/3 API against the real model: tests/test_daemon_e2e.py.)
"""
from __future__ import annotations

import asyncio
import random

import pytest

from edged.engine.async_engine import AsyncEngine
from helpers.char_tokenizer import CharTokenizer
from edged.engine.request import GenerationRequest, SamplingParams, StepOutput
from edged.engine.text_stream import StopStringFilter


def run_filter(stops: list[str], chunks: list[str]) -> tuple[list[str], bool]:
    """What the client sees for each chunk (the last one final), and whether a stop was found."""
    f = StopStringFilter(stops)
    out, stopped = [], False
    for i, chunk in enumerate(chunks):
        piece = f.push(chunk, final=i == len(chunks) - 1)
        out.append(piece.text)
        if piece.stopped:
            stopped = True
            break
    return out, stopped


def test_without_stops_text_passes_through_at_once() -> None:
    assert run_filter([], ["Hel", "lo", "!"]) == (["Hel", "lo", "!"], False)
    assert run_filter(["", ""], ["ab", "c"]) == (["ab", "c"], False)  # empty stops are ignored


def test_text_that_could_start_a_stop_is_held_back_but_never_more_than_the_stop_length_minus_one() -> None:
    f = StopStringFilter(["END", "x"])
    pushed = released = ""
    for chunk in ["abcE", "N", "X", "yz", "E", "E"]:
        released += f.push(chunk).text
        pushed += chunk
        assert pushed.startswith(released)
        assert len(pushed) - len(released) <= len("END") - 1  # bounded hold-back
    assert released == "abcENXyz"  # "EE" is held: it could still become "END"
    assert f.push("", final=True).text == "EE"  # the end of the stream flushes what is held


def test_a_stop_split_across_chunks_is_found_and_never_shown() -> None:
    out, stopped = run_filter(["STOP"], ["Hel", "lo S", "T", "OP and more"])
    assert stopped and "".join(out) == "Hello "
    assert all("S" not in piece for piece in out)  # no part of the stop ever reached the client


def test_with_several_stops_the_earliest_occurrence_wins() -> None:
    out, stopped = run_filter(["world", "lo"], ["hello world"])
    assert stopped and "".join(out) == "hel"
    out, stopped = run_filter(["\n\n", "User:", "###"], ["Answer: 4", "2.\nUs", "er: next"])
    assert stopped and "".join(out) == "Answer: 42.\n"
    f = StopStringFilter(["x"])
    assert f.push("axb").text == "a" and f.push("more").text == "" and f.push("", final=True).stopped


def test_a_stop_in_the_final_chunk_still_cuts() -> None:
    out, stopped = run_filter(["</s>"], ["one two", " three</s>four"])
    assert stopped and "".join(out) == "one two three"


@pytest.mark.parametrize("seed", range(20))
def test_random_texts_and_chunkings_give_the_text_before_the_first_stop(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab c\n"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 80)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 12)))) if len(text) > 1 else []
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])] or [""]
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    out, stopped = run_filter(stops, chunks)
    assert stopped == bool(hits)
    assert "".join(out) == (text[:min(hits)] if hits else text)


# ------------------------------------------------------------------------------- in AsyncEngine



class ScriptedEngine:
    """Stands in for LLMEngine: each request gets `steps` (token chunks) as one StepOutput per step."""

    def __init__(self, steps: list[str], finish_reason: str = "length") -> None:
        self.steps = steps
        self.finish_reason = finish_reason
        self.on_outputs = None
        self.cancelled: list[str] = []

    def is_alive(self) -> bool:
        return True

    def start(self, on_thread_start=None) -> None:
        pass

    def add_request(self, request: GenerationRequest) -> None:
        for i, chunk in enumerate(self.steps):
            last = i == len(self.steps) - 1
            self.on_outputs([StepOutput(request.request_id, [ord(c) for c in chunk], last,
                                        self.finish_reason if last else None)])

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


def generate(steps: list[str], stop: list[str], finish_reason: str = "length"):
    engine = ScriptedEngine(steps, finish_reason)
    front = AsyncEngine(engine, CharTokenizer(), None, "m", 1024)

    async def main():
        req = GenerationRequest("r1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=100, stop=stop))
        return [d async for d in front.generate(req)]

    return asyncio.run(main()), engine


def test_the_engine_front_cuts_at_a_stop_split_across_steps_and_cancels_the_sequence() -> None:
    deltas, engine = generate(["The ans", "wer is 4", "2.", "\n\nQ", "uestion: more", " and more"],
                              ["\n\nQuestion", "###"])
    assert "".join(d.text for d in deltas) == "The answer is 42."
    assert deltas[-1].finish_reason == "stop"
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].completion_tokens == len("The answer is 42.\n\nQuestion: more")
    assert engine.cancelled == ["r1"]  # the engine did not finish it: the stop string did


def test_a_near_miss_is_released_whole_and_the_engine_finish_reason_stays() -> None:
    deltas, engine = generate(["stay ST", "AY here", " ST"], ["STOP"])
    assert "".join(d.text for d in deltas) == "stay STAY here ST"  # the held " ST" is flushed at the end
    assert deltas[-1].finish_reason == "length" and engine.cancelled == []
