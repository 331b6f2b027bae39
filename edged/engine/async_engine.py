"""The engine in this process behind the `EngineClient` protocol (tests, benchmarks, `edged bench`).

The daemon runs the engine in its own process and its workers use `RemoteEngineClient`; this one
drives an `LLMEngine` thread directly and delivers its outputs on the event loop.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable

from edged.models.chat_template import ChatTemplate
from edged.models.tokenizer import Tokenizer
from edged.scheduler.rate_limit import RateLimiter, RatePolicy

from .client import DeltaStream, PromptEncoding, TextDelta
from .llm_engine import LLMEngine
from .request import GenerationRequest, StepOutput

log = logging.getLogger("edged.engine")

__all__ = ["AsyncEngine", "TextDelta"]


class AsyncEngine(PromptEncoding):
    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer, chat_template: ChatTemplate, model_id: str,
                 max_model_len: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.admission = None  # an AdmissionController: SLA admission in submit()
        self._queues: dict[str, asyncio.Queue[StepOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._limiter = RateLimiter()
        engine.on_outputs = self._from_engine_thread

    def start(self, on_thread_start: Callable[[], None] | None = None) -> None:
        """Bind to the running event loop and start the engine thread (on_thread_start runs on it)."""
        self._loop = asyncio.get_running_loop()
        if not self.engine.is_alive():
            self.engine.start(on_thread_start)

    def _from_engine_thread(self, outputs: list[StepOutput]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    @property
    def active_requests(self) -> int:
        return len(self._queues)

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding: every token id that reaches the model must be below this."""
        return self.engine.vocab_size

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    async def rate_limit(self, key: str, rps: float, burst: int) -> float | None:
        return self._limiter.take(RatePolicy(key, rps, burst))

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TextDelta]:
        """Admit (raises AdmissionError when refused) and start the request; its deltas follow."""
        if self.admission is not None:
            self.admission.admit(request)
        return self.generate(request)

    def generate(self, request: GenerationRequest) -> DeltaStream:
        """Stream the request's text without admission control; closing the iterator early cancels it."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            if not self.engine.is_alive():
                self.engine.start()
        rid = request.request_id
        if rid in self._queues:
            raise ValueError(f"request id {rid} is already running")
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._queues[rid] = q
        self.engine.add_request(request)
        return DeltaStream(request, q, self.tokenizer, self.engine.cancel, lambda: self._queues.pop(rid, None))

