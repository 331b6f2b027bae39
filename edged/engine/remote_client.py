"""The worker's `EngineClient`: requests go to the engine core process, token ids come back.

One task reads the core's messages (ipc.py) and puts each stream's outputs on its queue; the
stream's text is assembled by `DeltaStream` on this worker's event loop (detokenization, stop
strings, coalescing), so the core never touches text.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import threading

import zmq

from edged.log import fields

from . import ipc
from .client import DeltaStream, EngineRefused, PromptEncoding
from .request import GenerationRequest, StepOutput

log = logging.getLogger("edged.engine")


class RemoteEngineClient(PromptEncoding):
    def __init__(self, info: Any, run_dir: str, worker: str) -> None:
        self.model_id: str = info.model_id
        self.max_model_len: int = info.max_model_len
        self._vocab_size: int = info.vocab_size
        self.tokenizer = info.tokenizer
        self.chat_template = info.chat_template
        self.worker = worker
        self._context = zmq.Context()
        self._push = self._context.socket(zmq.PUSH)  # sends never block the loop: no high-water mark
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(ipc.address(run_dir, ipc.CORE_IN))
        self._dealer = self._context.socket(zmq.DEALER)  # read on its own thread (see _read)
        self._dealer.setsockopt(zmq.IDENTITY, worker.encode())
        self._dealer.setsockopt(zmq.RCVHWM, 0)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(ipc.address(run_dir, ipc.CORE_OUT))
        self._queues: dict[str, asyncio.Queue[StepOutput]] = {}
        self._acks: dict[str, asyncio.Future[list | None]] = {}
        self._asks: dict[int, asyncio.Future[Any]] = {}  # rate-limit and stats questions to the core
        self._ask_ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine_stats: dict[str, Any] | None = None  # the core's latest EngineSnapshot, as a dict
        self.engine_stats_at: float | None = None  # monotonic time it came
        self.engine_alive = False  # the core's engine loop makes progress (as of engine_stats_at)

    # ---- EngineClient

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def active_requests(self) -> int:
        return len(self._queues)

    async def submit(self, request: GenerationRequest) -> DeltaStream:
        self._ensure_reader()
        rid = request.request_id
        if rid in self._queues:
            raise ValueError(f"request id {rid} is already running")
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        ack = asyncio.get_running_loop().create_future()
        self._queues[rid], self._acks[rid] = queue, ack
        try:
            self._push.send(ipc.add_message(request, self.worker), zmq.NOBLOCK)
            err = await ack
        except BaseException:
            self._queues.pop(rid, None)
            self._acks.pop(rid, None)
            self.cancel(rid)
            raise
        if err is not None:
            self._queues.pop(rid, None)
            status, code, message, retry_after = err
            raise EngineRefused(status, code, message, retry_after)
        return DeltaStream(request, queue, self.tokenizer, self.cancel, lambda: self._queues.pop(rid, None))

    def cancel(self, request_id: str) -> None:
        try:
            self._push.send(ipc.pack({"t": "abort", "ids": [ipc.wire_id(request_id, self.worker)]}), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("abort not sent %s", fields(rid=request_id, error=str(e)))

    async def rate_limit(self, key: str, rps: float, burst: int) -> float | None:
        return await self._ask({"t": "rate", "key": key, "rps": rps, "burst": burst})

    async def fresh_stats(self, timeout: float = 1.0) -> dict[str, Any] | None:
        """The engine's numbers as of now (for a /metrics scrape); the last ones if the core is slow."""
        try:
            await asyncio.wait_for(self._ask({"t": "stats"}), timeout)
        except TimeoutError:
            pass
        return self.engine_stats

    async def _ask(self, message: dict[str, Any]) -> Any:
        self._ensure_reader()
        q = next(self._ask_ids)
        fut = self._asks[q] = asyncio.get_running_loop().create_future()
        try:
            self._push.send(ipc.pack({**message, "w": self.worker, "q": q}), zmq.NOBLOCK)
            return await fut
        finally:
            self._asks.pop(q, None)

    # ---- the core's messages

    def start(self) -> None:
        """Start reading the core's messages (on the running loop)."""
        self._ensure_reader()

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._loop = asyncio.get_running_loop()
            self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
            self._reader.start()

    def _read(self) -> None:
        """A thread blocked on the socket hands each message (one per engine step) to the event loop:
        one wake-up per message, with no dependence on the loop polling ZeroMQ's edge-triggered fd."""
        assert self._loop is not None
        while True:
            try:
                data = self._dealer.recv()
            except zmq.ContextTerminated:  # close(): this thread owns the socket, so it closes it
                self._dealer.close(0)
                return
            except zmq.ZMQError as e:
                log.warning("engine socket failed %s", fields(worker=self.worker, error=str(e)))
                return
            try:
                self._loop.call_soon_threadsafe(self._dispatch, ipc.unpack(data))
            except RuntimeError:  # the loop is closed: the worker is stopping
                return

    def _dispatch(self, msg: dict[str, Any]) -> None:
        try:
            kind = msg["t"]
            if kind == "out":
                for rid, ids, reason, error in msg["o"]:
                    if (queue := self._queues.get(rid)) is not None:
                        queue.put_nowait(StepOutput(rid, ids, reason is not None, reason, error))
            elif kind == "ack":
                if (fut := self._acks.pop(msg["id"], None)) is not None and not fut.done():
                    fut.set_result(msg["err"])
            elif kind == "stats":
                self.engine_stats, self.engine_alive = msg["s"], msg["alive"]
                self.engine_stats_at = time.monotonic()
                self._answer(msg["q"], msg["s"])
            elif kind == "rate":
                self._answer(msg["q"], msg["wait"])
        except Exception:  # a bad message must not end every stream of this worker
            log.exception("engine message failed")

    def _answer(self, query: int | None, value: Any) -> None:
        if query is not None and (fut := self._asks.get(query)) is not None and not fut.done():
            fut.set_result(value)

    def close(self) -> None:
        self._push.close()
        if self._reader is None:
            self._dealer.close(0)
        self._context.term()  # a reader blocked in recv() sees ContextTerminated and closes the dealer
