"""What the HTTP layer sees of the engine: the `EngineClient` protocol and the text of a stream.

Two implementations: `RemoteEngineClient` (remote_client.py), which a front-end worker uses to
talk to the engine core process, and `AsyncEngine` (async_engine.py), the engine in this process
(tests, benchmarks). The tests' fake engine implements the same protocol.

A stream's text is assembled here, in the worker: incremental detokenization, stop strings, and
coalescing. Coalescing rule: whatever a stream has received from the engine and not yet written
goes out as one delta. A stream that keeps up gets one delta per engine step (every token the
moment it is decoded); one whose client or worker is behind gets all of its pending tokens in one
delta the next time it writes, never a growing queue of single-token events.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from .request import GenerationRequest, StepOutput
from .text_stream import StopStringFilter


@dataclass(slots=True)
class TextDelta:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "error"; set on the last delta
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


class EngineRefused(Exception):
    """The engine core refused a request before running it (SLA admission, rate limit): `http_status`
    (429, tier queue full or deadline unreachable), `retry_after` seconds and an error `code`, which the
    router maps to its response."""

    def __init__(self, status: int, code: str | None, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.http_status = status
        self.code = code
        self.retry_after = retry_after


class PromptEncoding:
    """Tokenization as every engine front does it (expects `tokenizer` and `chat_template`)."""

    tokenizer: Any
    chat_template: Any

    def encode(self, text: str) -> list[int]:
        """A client's text: special-token strings in it are plain text, never control tokens."""
        return self.tokenizer.encode_plain(text)

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """A trusted client's text, in which special-token strings are the control tokens."""
        return self.tokenizer.encode(text)

    def render_chat(self, messages: list[dict]) -> list[int]:
        """Apply the model's chat template (ValueError on malformed messages) and tokenize; only the
        template's own markup yields control tokens, message content is plain text."""
        pieces = self.chat_template.render_pieces(messages, self.tokenizer.special_token_pattern)
        return self.tokenizer.encode_markup(pieces)

    def warm_up(self) -> None:
        """Pay the first-use costs before serving: a tokenizer's first encode compiles its pre-tokenizer
        (~100 ms for SmolLM2's), which would otherwise land on each worker's first request."""
        self.tokenizer.decode(self.render_chat([{"role": "user", "content": "Hello, what is 1 + 1?"}]))


@runtime_checkable
class EngineClient(Protocol):
    model_id: str
    max_model_len: int

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """A client's text: special-token strings in it stay plain text."""

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """A trusted client's text, in which special-token strings are control tokens."""

    def render_chat(self, messages: list[dict]) -> list[int]:
        """The chat template applied and tokenized (ValueError on malformed messages)."""

    def warm_up(self) -> None:
        """Pay first-use costs (the tokenizer's) before the first request does."""

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TextDelta]:
        """Hand the request to the engine; returns once it is admitted (raises `EngineRefused`
        when it is not), with the stream of its deltas. Closing the stream early cancels it."""

    def cancel(self, request_id: str) -> None:
        """End a running request (idempotent)."""

    async def rate_limit(self, key: str, rps: float, burst: int) -> float | None:
        """Take one request from an API key's bucket, shared by every worker: None, or the seconds
        until the key may send again."""


class DeltaStream:
    """The deltas of one admitted request, read from its queue of engine outputs (coalesced as the
    module docstring says). It alone ends the sequence early: `aclose()` before the engine finished
    it, or a stop string, cancels it once."""

    def __init__(self, request: GenerationRequest, outputs: asyncio.Queue[StepOutput], tokenizer: Any,
                 cancel: Callable[[str], None], on_close: Callable[[], None] | None = None) -> None:
        self.request = request
        self._outputs = outputs
        self._detok = tokenizer.detokenizer()
        self._stops = StopStringFilter(list(request.sampling.stop))
        self._cancel = cancel
        self._on_close = on_close
        self._n_prompt = len(request.prompt_token_ids)
        self._n_done = 0
        self._engine_done = False  # the engine ended the sequence itself
        self._ended = False  # the last delta was returned
        self._closed = False

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> TextDelta:
        while not self._ended:
            out = await self._outputs.get()
            texts: list[str] = []
            ids: list[int] = []
            while True:  # behind: everything pending goes in one delta, a stop string still cuts exactly
                ids += out.new_token_ids
                self._n_done += len(out.new_token_ids)
                self._engine_done = out.finished
                text = self._detok.add(out.new_token_ids) + (self._detok.flush() if out.finished else "")
                piece = self._stops.push(text, final=out.finished)
                texts.append(piece.text)
                if piece.stopped:
                    self._ended = True
                    await self.aclose()  # the engine would go on: end the sequence now
                    return TextDelta("".join(texts), ids, "stop", self._n_prompt, self._n_done)
                if out.finished:
                    self._ended = True
                    return TextDelta("".join(texts), ids, out.finish_reason, self._n_prompt, self._n_done, out.error)
                if self._outputs.empty():
                    break
                out = self._outputs.get_nowait()
            text = "".join(texts)
            if text or ids:
                return TextDelta(text, ids, None, self._n_prompt, self._n_done)
        await self.aclose()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._engine_done:
            self._cancel(self.request.request_id)
        if self._on_close is not None:
            self._on_close()
