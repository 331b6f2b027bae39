"""The event loop's face of the engine: submit a request, get its text as an async stream."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from edged.log import fields
from edged.models.chat_template import ChatTemplate
from edged.models.tokenizer import Tokenizer

from .llm_engine import LLMEngine
from .request import GenerationRequest, StepOutput
from .text_stream import StopStringFilter

log = logging.getLogger("edged.engine")


@dataclass(slots=True)
class TextDelta:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "error"; set on the last delta
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer, chat_template: ChatTemplate, model_id: str,
                 max_model_len: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_id = model_id
        self.max_model_len = max_model_len
        self._queues: dict[str, asyncio.Queue[StepOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
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

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TextDelta]:
        """Stream the request's text; closing the iterator early cancels the sequence."""
        if self._loop is None:
            self.start()
        rid = request.request_id
        if rid in self._queues:
            raise ValueError(f"request id {rid} is already running")
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._queues[rid] = q
        self.engine.add_request(request)
        detok = self.tokenizer.detokenizer()
        stops = StopStringFilter(list(request.sampling.stop))
        n_prompt, n_done = len(request.prompt_token_ids), 0
        engine_done = False  # the engine has freed the sequence itself
        try:
            while True:
                out = await q.get()
                engine_done = out.finished
                n_done += len(out.new_token_ids)
                text = detok.add(out.new_token_ids) + (detok.flush() if out.finished else "")
                piece = stops.push(text, final=out.finished)
                if piece.stopped:
                    yield TextDelta(piece.text, out.new_token_ids, "stop", n_prompt, n_done)
                    return
                if piece.text or out.new_token_ids or out.finished:
                    yield TextDelta(piece.text, out.new_token_ids, out.finish_reason, n_prompt, n_done, out.error)
                if out.finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not engine_done:
                self.engine.cancel(rid)
                log.debug("sequence cancelled by its stream %s", fields(request_id=rid, tokens=n_done))
