"""The engine loop: one thread that admits requests, runs steps and reports new tokens.

Requests and cancels arrive through a thread-safe inbox; once per step the new tokens of every
sequence go out in a single `on_outputs` call, so the event loop is woken once per step.
"""
from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

from edged.log import fields
from edged.scheduler.batcher import Batcher

from .block_manager import BlockManager
from .model_runner import PLACEHOLDER, LaunchedStep, ModelRunner
from .request import GenerationRequest, StepOutput
from .sequence import Sequence, SequenceStatus

log = logging.getLogger("edged.engine")


@dataclass(slots=True)
class EngineCounters:
    steps: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    decode_tokens: int = 0
    preemptions: int = 0
    last_step_s: float = 0.0
    last_batch_size: int = 0
    last_progress: float = 0.0  # monotonic time the loop last completed an iteration


class LLMEngine:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, batcher: Batcher, max_model_len: int,
                 eos_token_ids: list[int], on_outputs: Callable[[list[StepOutput]], None],
                 overlap: bool = False) -> None:
        self.runner = runner
        self.blocks = blocks
        self.batcher = batcher
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.on_outputs = on_outputs
        self.counters = EngineCounters(last_progress=time.monotonic())
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._by_id: dict[str, Sequence] = {}
        self._rng = random.Random()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.overlap = overlap  # launch step N+1 before reading step N's tokens (CUDA)
        self._inflight: LaunchedStep | None = None

    # --- called from any thread ---
    def add_request(self, request: GenerationRequest) -> None:
        self._inbox.put(("add", request))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn on the engine thread between steps (live reconfiguration)."""
        self._inbox.put(("call", fn))

    def start(self, on_thread_start: Callable[[], None] | None = None) -> None:
        def main() -> None:
            if on_thread_start is not None:
                on_thread_start()
            self.run()

        self._thread = threading.Thread(target=main, name="edged-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- engine thread ---
    def _drain_inbox(self, block: bool) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return outputs
        while True:
            kind, payload = item
            if kind == "add":
                self._admit(payload)  # type: ignore[arg-type]
            elif kind == "cancel":
                out = self._cancel(payload)  # type: ignore[arg-type]
                if out:
                    outputs.append(out)
            elif kind == "call":
                payload()  # type: ignore[operator]
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return outputs

    def _admit(self, request: GenerationRequest) -> None:
        seed = request.sampling.seed if request.sampling.seed is not None else self._rng.getrandbits(32)
        seq = Sequence.from_request(request, seed, self.eos_token_ids)
        self._by_id[request.request_id] = seq
        self.batcher.add(seq)

    def _cancel(self, request_id: str) -> StepOutput | None:
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return None
        self.batcher.remove(seq)
        seq.status = SequenceStatus.FINISHED
        log.debug("cancelled %s", fields(request_id=request_id, step=self.counters.steps))
        return StepOutput(request_id, [], True, "cancelled")

    def step(self) -> list[StepOutput]:
        """Run one step and read its tokens back before returning."""
        outputs, launched = self._schedule_and_launch(None)
        if launched is not None:
            outputs.extend(self._resolve(launched))
        return outputs

    def step_overlapped(self) -> list[StepOutput]:
        """Schedule and launch the next step, then read back the one in flight: the host's work for
        step N+1 (scheduling, building its tensors, launching) runs while the device computes step N.

        Step N+1 takes each decoding sequence's step-N token straight from the device (a placeholder
        in token_ids until it is read). A sequence that ends on that token has one wasted row in
        step N+1; one that ends by length is not scheduled again.
        """
        prev = self._inflight
        outputs, self._inflight = self._schedule_and_launch(prev)
        if prev is not None:
            outputs.extend(self._resolve(prev))
        return outputs

    def _schedule_and_launch(self, prev: LaunchedStep | None) -> tuple[list[StepOutput], LaunchedStep | None]:
        self.blocks.begin_step()  # the host -> device restore budget is per step
        plan = self.batcher.schedule()
        for seq in plan.rejected:
            self._by_id.pop(seq.request_id, None)
        outputs = [StepOutput(s.request_id, [], True, "error", "the request needs more KV cache than the node has")
                   for s in plan.rejected]
        self.counters.preemptions += len(plan.preempted)
        if not plan.chunks:
            return outputs, None
        launched = self.runner.launch(plan, prev)
        self._advance(launched)
        return outputs, launched

    def _advance(self, launched: LaunchedStep) -> None:
        """Book what a launched step computes before its tokens are known."""
        now = time.monotonic()
        for chunk in launched.plan.chunks:
            seq = chunk.seq
            if seq.first_scheduled_at is None:
                seq.first_scheduled_at = now
            if seq.num_computed < seq.num_prompt_tokens:
                self.counters.prefill_tokens += min(chunk.num_new_tokens, seq.num_prompt_tokens - seq.num_computed)
            seq.num_computed += chunk.num_new_tokens
        for seq, index in zip(launched.sampled, launched.index):
            if not seq.reaches_length(index, self.max_model_len):
                seq.token_ids.append(PLACEHOLDER)  # decoded next step from the device copy

    def _resolve(self, launched: LaunchedStep) -> list[StepOutput]:
        """Read a finished step's tokens into its sequences and report them."""
        tokens = launched.result()
        now = time.monotonic()
        outputs = []
        for seq, index, token in zip(launched.sampled, launched.index, tokens):
            if seq.status is SequenceStatus.FINISHED:
                continue  # ended (or was cancelled) while this step was in flight
            self.counters.decode_tokens += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
            seq.record(index, token, self.max_model_len)
            out = StepOutput(seq.request_id, [token], seq.status is SequenceStatus.FINISHED, seq.finish_reason)
            if out.finished:
                self.batcher.remove(seq)  # a step in flight may still write its blocks: stream order keeps that safe
                self._by_id.pop(seq.request_id, None)
            outputs.append(out)
        # Every token below num_computed is known now (the step in flight reads only tokens
        # resolved here), so full blocks can be named for the prefix cache.
        for chunk in launched.plan.chunks:
            if chunk.seq.status is not SequenceStatus.FINISHED:
                self.blocks.commit(chunk.seq)
        self.counters.steps += 1
        self.counters.last_step_s = time.perf_counter() - launched.launched_at
        self.counters.last_batch_size = len(launched.plan.chunks)
        self.batcher.step_done(launched.plan, self.counters.last_step_s)  # step-time model, TTFT per tier
        return outputs

    def has_work(self) -> bool:
        return self.batcher.has_work() or self._inflight is not None

    def run(self) -> None:
        log.info("engine loop started")
        step = self.step_overlapped if self.overlap else self.step
        while not self._stop.is_set():
            outputs = self._drain_inbox(block=not self.has_work())
            if self.has_work():
                try:
                    outputs.extend(step())
                except Exception as exc:  # a failed step ends its sequences, not the daemon
                    log.exception("engine step failed")
                    outputs.extend(self._fail_all(str(exc)))
            self.counters.last_progress = time.monotonic()
            if outputs:
                self.on_outputs(outputs)
        log.info("engine loop stopped")

    def _fail_all(self, reason: str) -> list[StepOutput]:
        self._inflight = None
        outputs = []
        for request_id, seq in list(self._by_id.items()):
            self.batcher.remove(seq)
            outputs.append(StepOutput(request_id, [], True, "error", f"engine step failed: {reason}"))
        self._by_id.clear()
        return outputs
