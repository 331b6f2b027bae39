"""For the HTTP/3 tests: a fake engine with AsyncEngine's API, and a server on its own thread.

The fake tokenizes one token per character (token id = code point), so tests can reason about
lengths exactly. The prompt text selects behaviours:
  "[slow]"   one token every 50 ms until max_tokens (for resets and back-pressure)
  "[held]"   one token, then the rest of max_tokens only once the test calls `engine.release.set()`
  "[fail]"   two tokens, then a delta with finish_reason "error"
  "[refuse]" raise an admission error (http_status 429, retry_after 2) before the first delta
  "[crash]"  raise RuntimeError after the first delta
otherwise it streams SCRIPT, finishing "stop", or "length" when max_tokens cuts it short.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from edged.engine.request import GenerationRequest
from edged.scheduler.rate_limit import RateLimiter, RatePolicy
from edged.server.h3_server import EdgedServer, serve
from edged.server.routes import Router
from edged.server.settings import ServerSettings

SCRIPT = ["Hello", ",", " wor", "ld", "!", " ✓"]


@dataclass
class FakeDelta:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


class AdmissionRefused(Exception):
    http_status = 429
    retry_after = 2.0
    code = "tier_queue_full"


class FakeStream:
    """The fake's DeltaStream: `aclose()` before the last delta cancels the request, once."""

    def __init__(self, engine: FakeEngine, request_id: str, deltas: AsyncIterator[FakeDelta]) -> None:
        self.engine, self.request_id, self.deltas = engine, request_id, deltas
        self.finished = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> FakeDelta:
        d = await self.deltas.__anext__()
        self.finished = d.finish_reason is not None
        return d

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.cancel(self.request_id)
        await self.deltas.aclose()


class FakeEngine:
    model_id = "fake-model"

    def __init__(self, max_model_len: int = 256, delay: float = 0.005) -> None:
        self.max_model_len = max_model_len
        self.delay = delay
        self.requests: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self.closed: list[str] = []  # generators closed before finishing
        self.active: set[str] = set()
        self.peak_active = 0
        self.release = threading.Event()  # lets "[held]" streams finish
        self._lock = threading.Lock()
        self._limiter = RateLimiter()

    # -- tokenizer
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_with_special_tokens(self, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def render_chat(self, messages: list[dict]) -> list[int]:
        if messages[-1]["role"] == "assistant" and messages[-1]["content"] == "[template-error]":
            raise ValueError("conversation must end with a user message")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return self.encode(text)

    def warm_up(self) -> None:
        """Nothing to compile: encode is byte-level."""

    # -- generation
    def cancel(self, request_id: str) -> None:
        with self._lock:
            self.cancelled.append(request_id)

    @property
    def vocab_size(self) -> int:
        return 0x110000  # every code point

    async def rate_limit(self, key: str, rps: float, burst: int) -> float | None:
        return self._limiter.take(RatePolicy(key, rps, burst))

    async def submit(self, request: GenerationRequest) -> FakeStream:
        """As the real clients: refused before any delta, and the stream cancels itself when closed early."""
        with self._lock:
            self.requests.append(request)
        if "[refuse]" in self.decode(request.prompt_token_ids):
            raise AdmissionRefused("tier queue is full")
        return FakeStream(self, request.request_id, self.generate(request))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[FakeDelta]:
        prompt = self.decode(request.prompt_token_ids)
        rid = request.request_id
        self.active.add(rid)
        self.peak_active = max(self.peak_active, len(self.active))
        n_prompt = len(request.prompt_token_ids)
        limit = request.sampling.max_tokens
        done = False
        try:
            if "[slow]" in prompt:
                for i in range(limit):
                    await asyncio.sleep(0.05)
                    last = i == limit - 1
                    yield FakeDelta("x", [120], "length" if last else None, n_prompt, i + 1)
                done = True
                return
            if "[held]" in prompt:
                for i in range(limit):
                    last = i == limit - 1
                    done = last
                    yield FakeDelta("x", [120], "length" if last else None, n_prompt, i + 1)
                    while not self.release.is_set():
                        await asyncio.sleep(0.01)
                return
            if "[fail]" in prompt:
                yield FakeDelta("a", [97], None, n_prompt, 1)
                await asyncio.sleep(self.delay)
                yield FakeDelta("b", [98], None, n_prompt, 2)
                done = True
                yield FakeDelta("", [], "error", n_prompt, 2, error="CUDA error: out of memory")
                return
            if "[crash]" in prompt:
                yield FakeDelta("a", [97], None, n_prompt, 1)
                raise RuntimeError("engine thread died")
            n = 0
            for i, piece in enumerate(SCRIPT):
                await asyncio.sleep(self.delay)
                n += 1
                if n >= limit or i == len(SCRIPT) - 1:
                    done = True
                    yield FakeDelta(piece, [0], "length" if i < len(SCRIPT) - 1 else "stop", n_prompt, n)
                    return
                yield FakeDelta(piece, [0], None, n_prompt, n)
        finally:
            self.active.discard(rid)
            if not done:
                with self._lock:
                    self.closed.append(rid)


def expected_text(max_tokens: int | None = None) -> str:
    return "".join(SCRIPT[: max_tokens or len(SCRIPT)])


class ServerThread:
    """Run `serve()` on a uvloop loop in a background thread, as the daemon does on its main loop.

    tcp=True also serves HTTP/1.1 and HTTP/2 over TLS/TCP on the same port number (tcp_server.py)."""

    def __init__(self, engine: Any, certfile: str, keyfile: str, settings: ServerSettings | None = None,
                 host: str = "127.0.0.1", tcp: bool = False) -> None:
        self.engine = engine
        self.tcp = tcp
        self.certfile, self.keyfile = certfile, keyfile
        self.settings = settings or ServerSettings()
        self.host = host
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: EdgedServer | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, name="h3-server", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def _run(self) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.server = self.loop.run_until_complete(
                serve(Router(self.engine, self.settings), self.host, 0, self.certfile, self.keyfile, tcp=self.tcp))
            self.port = self.server.port
        except BaseException as e:  # noqa: BLE001 - reported to the test thread
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("server did not start")
        if self._error is not None:
            raise self._error
        return self

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __exit__(self, *exc: Any) -> None:
        async def stop() -> None:
            assert self.server is not None
            self.server.close()
            await self.server.wait_closed()

        if self.server is not None:
            self.call(stop())
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def wait_until(pred: Any, timeout: float = 5.0, interval: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())
