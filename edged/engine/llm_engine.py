"""The engine loop: one thread that admits requests, runs steps and reports new tokens.

Requests and cancels arrive through a thread-safe inbox; once per step the new tokens of every
sequence go out in a single `on_outputs` call, so the event loop is woken once per step.

One request never ends another: a request the model cannot take (a token id outside the
vocabulary, a seed outside int64) is refused alone at admission, and a step that raises is retried
on halves of its batch until the sequences that make it fail are found; only those end, with a
generic error naming their request id (the exception goes to the log), and the step runs again
without them.

On the CPU, where the host computes a step layer by layer, a step gives way to a more important
request: one of a tier above every sequence in the step that arrives while it runs ends the step
between two layers (nothing of it is kept: its KV writes lie past each sequence's num_computed and
are redone), and the next step is that request's. Its first token then waits for one layer, not for
the rest of a step of up to the step bound. On a GPU the host has queued every layer before a check
could act, and steps are short.
"""
from __future__ import annotations

import contextlib

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

from edged.log import fields
from edged.scheduler.batcher import Batcher, ScheduledChunk, StepPlan

from .block_manager import BlockCounters, BlockManager
from .model_runner import PLACEHOLDER, LaunchedStep, ModelRunner
from .request import GenerationRequest, StepOutput
from .sequence import Sequence, SequenceStatus

log = logging.getLogger("edged.engine")


class StepYielded(Exception):
    """Raised between a CPU step's layers: a request more important than the whole step arrived."""


def _fits_int64(value: int) -> bool:  # seeds and top_k are packed into int64 tensors
    return -(2**63) <= value < 2**63


def internal_error(request_id: str) -> str:
    """What a client sees when its sequence failed inside a step: no exception text."""
    return f"Internal error while generating (request id {request_id})."


@dataclass(slots=True)
class EngineCounters:
    steps: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    decode_tokens: int = 0
    preemptions: int = 0
    yielded_steps: int = 0  # CPU steps abandoned between layers for a more important arrival
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
        self._arrival_lock = threading.Lock()
        self._arrived_rank = float("inf")  # most important tier added since the inbox was last drained
        self._by_id: dict[str, Sequence] = {}
        self._rng = random.Random()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.overlap = overlap  # launch step N+1 before reading step N's tokens (CUDA)
        self._inflight: LaunchedStep | None = None
        self._last_resolved = 0.0  # perf_counter when the last step's tokens were read

    # --- called from any thread ---
    def add_request(self, request: GenerationRequest) -> None:
        self._inbox.put(("add", request))
        rank = self.batcher.tier_rank(request.tier)  # after the put: a drain in between leaves a harmless signal
        with self._arrival_lock:
            self._arrived_rank = min(self._arrived_rank, rank)

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def forget_counters(self) -> None:
        """Zero the engine's and the block manager's counters (engine thread, between steps: `call`): the
        daemon's warm-up steps are not service."""
        self.counters = EngineCounters(last_progress=time.monotonic())
        self.blocks.counters = BlockCounters()

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

    @property
    def vocab_size(self) -> int:
        return self.runner.model.config.vocab_size

    # --- engine thread ---
    def _drain_inbox(self, block: bool) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        with self._arrival_lock:
            self._arrived_rank = float("inf")
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return outputs
        while True:
            kind, payload = item
            if kind == "add":
                out = self._admit(payload)  # type: ignore[arg-type]
                if out:
                    outputs.append(out)
            elif kind == "cancel":
                out = self._cancel(payload)  # type: ignore[arg-type]
                if out:
                    outputs.append(out)
            elif kind == "call":
                try:
                    payload()  # type: ignore[operator]
                except Exception:  # a failed reconfiguration must not stop the loop
                    log.exception("engine call failed")
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return outputs

    def _admit(self, request: GenerationRequest) -> StepOutput | None:
        """Queue a request; a request the model cannot run is refused here, alone (None: queued)."""
        rid = request.request_id
        if reason := self._unrunnable(request):
            log.warning("request refused by the engine %s", fields(request_id=rid, reason=reason))
            return StepOutput(rid, [], True, "error", reason)
        try:
            seed = request.sampling.seed if request.sampling.seed is not None else self._rng.getrandbits(32)
            seq = Sequence.from_request(request, seed, self.eos_token_ids)
            self._by_id[rid] = seq
            self.batcher.add(seq)
        except Exception as exc:
            log.exception("admission failed %s", fields(request_id=rid, error=repr(exc)))
            self._by_id.pop(rid, None)
            return StepOutput(rid, [], True, "error", internal_error(rid))
        return None

    def _unrunnable(self, request: GenerationRequest) -> str | None:
        """Why the model cannot take this request (the server validates first; this is the backstop)."""
        ids, sp, vocab = request.prompt_token_ids, request.sampling, self.vocab_size
        if not ids:
            return "the prompt is empty"
        if not 0 <= min(ids) <= max(ids) < vocab:
            return f"a prompt token id is outside the vocabulary (0..{vocab - 1})"
        if sp.seed is not None and not _fits_int64(sp.seed):
            return "the seed does not fit in 64 bits"
        if not _fits_int64(sp.top_k):
            return "top_k does not fit in 64 bits"
        return None

    def _cancel(self, request_id: str) -> StepOutput | None:
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return None
        self.batcher.remove(seq)
        seq.status = SequenceStatus.FINISHED
        log.debug("cancelled %s", fields(request_id=request_id, step=self.counters.steps))
        return StepOutput(request_id, [], True, "cancelled")

    def cancel_matching(self, matches: Callable[[str], bool]) -> int:
        """Engine thread: cancel every sequence whose request id matches (a worker died); returns how many."""
        ids = [rid for rid in self._by_id if matches(rid)]
        for rid in ids:
            self._cancel(rid)
        if ids:
            log.info("sequences of a lost worker cancelled %s", fields(count=len(ids)))
        return len(ids)

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
        scheduled_at = time.perf_counter()
        self.blocks.begin_step()  # the host -> device restore budget is per step
        plan = self.batcher.schedule()
        for seq in plan.rejected:
            self._by_id.pop(seq.request_id, None)
        outputs = [StepOutput(s.request_id, [], True, "error", "the request needs more KV cache than the node has")
                   for s in plan.rejected]
        self.counters.preemptions += len(plan.preempted)
        if not plan.chunks:
            return outputs, None
        try:
            launched = self.runner.launch(plan, prev, self._yield_check(plan))
        except StepYielded:
            self.counters.yielded_steps += 1
            log.info("step yielded to a more important request %s", fields(
                step=self.counters.steps, batch=len(plan.chunks), tokens=sum(c.num_new_tokens for c in plan.chunks),
                ms=round((time.perf_counter() - scheduled_at) * 1000, 1)))
            return outputs, None
        except Exception as exc:
            log.exception("engine step failed, isolating %s", fields(step=self.counters.steps,
                                                                     batch=len(plan.chunks), error=repr(exc)))
            plan, failed = self._without_culprits(plan, prev)
            outputs += failed
            if not plan.chunks:
                return outputs, None
            try:
                launched = self.runner.launch(plan, prev)
            except Exception as again:  # fails only together: end this batch, not the engine
                log.exception("engine step failed again %s", fields(batch=len(plan.chunks), error=repr(again)))
                return outputs + self._fail([c.seq for c in plan.chunks], again), None
        self._advance(launched)
        # A step's cost starts when it is scheduled: a CPU "launch" computes the whole step, and
        # scheduling and input preparation are part of what a waiting request waits for.
        launched.scheduled_at = scheduled_at  # type: ignore[attr-defined]
        return outputs, launched

    def _yield_check(self, plan: StepPlan) -> Callable[[], None] | None:
        """On the CPU: a check for between the step's layers that raises StepYielded once a request of a
        more important tier than any in the plan waits in the inbox."""
        if self.runner.device.type != "cpu":
            return None
        rank = self.batcher.plan_rank(plan)

        def check() -> None:
            if self._arrived_rank < rank:
                raise StepYielded

        return check

    def _without_culprits(self, plan: StepPlan, prev: LaunchedStep | None) -> tuple[StepPlan, list[StepOutput]]:
        """Find the chunks whose step fails on its own (bisecting the batch), end their sequences,
        and return the plan without them."""
        culprits: list[tuple[ScheduledChunk, Exception]] = []
        if prev is not None:  # read now: the trial steps reuse the read-back buffers prev's tokens wait in
            with contextlib.suppress(Exception):  # a failed read is _resolve's to report
                prev.result()

        def search(chunks: list[ScheduledChunk]) -> None:
            if (exc := self._trial(chunks, prev)) is None:
                return
            if len(chunks) == 1:
                culprits.append((chunks[0], exc))
                return
            mid = len(chunks) // 2
            search(chunks[:mid])
            search(chunks[mid:])

        mid = len(plan.chunks) // 2  # the whole batch already failed: start with its halves
        for half in (plan.chunks[:mid], plan.chunks[mid:]) if mid else (plan.chunks,):
            search(half)
        outputs = [out for chunk, exc in culprits for out in self._fail([chunk.seq], exc)]
        bad = {id(chunk) for chunk, _ in culprits}
        return StepPlan([c for c in plan.chunks if id(c) not in bad], plan.preempted, plan.rejected), outputs

    def _trial(self, chunks: list[ScheduledChunk], prev: LaunchedStep | None) -> Exception | None:
        """Run a part of a failed step to see whether it fails (its KV writes are redone by the retry)."""
        try:
            self.runner.launch(StepPlan(list(chunks)), prev).result()
        except Exception as exc:
            return exc
        return None

    def _fail(self, seqs: list[Sequence], exc: BaseException) -> list[StepOutput]:
        """End these sequences with a generic error; the exception goes to the log, once per sequence."""
        outputs = []
        for seq in seqs:
            rid = seq.request_id
            log.error("sequence failed %s", fields(request_id=rid, error=repr(exc)))
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
            self.batcher.remove(seq)
            self._by_id.pop(rid, None)
            outputs.append(StepOutput(rid, [], True, "error", internal_error(rid)))
        return outputs

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
        try:
            tokens = launched.result()
        except Exception as exc:  # the device failed this step: its sequences end, the others go on
            log.exception("engine step read-back failed %s", fields(batch=len(launched.plan.chunks)))
            live = [c.seq for c in launched.plan.chunks if c.seq.status is not SequenceStatus.FINISHED]
            return self._fail(live, exc)
        now = time.monotonic()
        outputs = []
        for seq, index, token in zip(launched.sampled, launched.index, tokens):
            if seq.status is SequenceStatus.FINISHED:
                continue  # ended (or was cancelled) while this step was in flight
            self.counters.decode_tokens += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
            if not 0 <= token < self.vocab_size:  # a broken kernel must not feed the next step
                outputs += self._fail([seq], ValueError(f"sampled token id {token} is outside the vocabulary"))
                continue
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
        # Wall time this step added: from its scheduling, or from the previous read-back when steps
        # overlap (step N+1 is scheduled while step N runs): the same figure on CPU and GPU.
        t = time.perf_counter()
        self.counters.last_step_s = t - max(getattr(launched, "scheduled_at", launched.launched_at),
                                            self._last_resolved)
        self._last_resolved = t
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
                except Exception as exc:  # outside the model (scheduling, bookkeeping): end what runs
                    log.exception("engine step failed outside the model")
                    outputs.extend(self._fail_all(exc))
            self.counters.last_progress = time.monotonic()
            if outputs:
                self.on_outputs(outputs)
        log.info("engine loop stopped")

    def _fail_all(self, exc: BaseException) -> list[StepOutput]:
        self._inflight = None
        return self._fail(list(self._by_id.values()), exc)
