"""The engine core process: the device, the KV cache, the SLA batcher with admission, the step loop.

The supervisor (edged/daemon.py) starts it first. It loads the model, builds the engine, runs one
warm-up step, binds the two sockets of ipc.py and reports "ready" with what the workers need to
tokenize (tokenizer, chat template, model id, context length). Then:

- the main thread receives the workers' messages: a request is admitted (SLA admission and the
  per-key rate limits are here, so each is counted once for the whole daemon) and queued, or
  refused at once with its 429; aborts cancel sequences;
- the engine thread runs steps and sends each worker one message per step with all of its new
  tokens (`_send_outputs`);
- the control pipe from the supervisor brings config reloads, "a worker died" (its sequences are
  cancelled, their KV blocks freed) and "stop"; the core answers with heartbeats while the engine
  loop makes progress (the supervisor's systemd watchdog depends on them).

The core ignores SIGINT and SIGTERM: the supervisor stops it after the workers have drained.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable

import zmq

from edged.config import Config
from edged.log import fields, setup_logging
from edged.metrics import EngineSnapshot
from edged.scheduler.rate_limit import RateLimiter, RatePolicy

from . import ipc
from .request import GenerationRequest, SamplingParams, StepOutput

log = logging.getLogger("edged.core")

GIL_SWITCH_S = 0.0005
# Prompt lengths run one at a time before READY on CUDA. Triton compiles a kernel per launch config
# (kernels/triton_linear.choose_config buckets M at 16/32/64/128) and per M divisible by 16 or not:
# one length of each kind per bucket, so a burst of new prompt sizes finds them compiled.
WARMUP_PROMPT_TOKENS = (5, 16, 24, 32, 40, 64, 100, 128, 200, 256)
# Then batches, as a burst makes them: Triton also specializes a kernel on an integer argument equal to
# 1 (the sequence count of every single-prompt step above), so a few sequences, then sixteen joining
# while those decode (a mixed prefill + decode step), some of them sampled (the sampling kernels).
WARMUP_BATCHES = ((3, 7), (16, 6))  # (prompts, tokens each)
HEARTBEAT_S = 0.5  # heartbeats to the supervisor and engine metrics, this often
ENGINE_STALL_S = 20.0  # no engine-loop iteration for this long: stop sending heartbeats


@dataclass(slots=True)
class ModelInfo:
    """What a worker needs of the model: sent by the core once it is ready (pickled)."""

    model_id: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    chat_template: Any
    device: str
    # What a request that omits temperature / top_p / top_k / max_tokens gets: the model's
    # recommendation with model.sampling_defaults laid over it (a plain dict: pickles anywhere).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)


def engine_settings(config: Config):
    """The engine's build settings from the config (resolved once, here)."""
    from .setup import EngineSettings

    m = config.model
    return EngineSettings(
        quant=m.quant, group_size=m.group_size, dtype=m.dtype, kv_cache_dtype=m.kv_cache_dtype,
        max_model_len=m.max_model_len, device=m.device, gpu_memory_fraction=m.gpu_memory_fraction,
        block_size=m.block_size, max_num_seqs=m.max_num_seqs, max_batch_tokens=m.max_batch_tokens,
        prefix_caching=config.cache.prefix_cache, cuda_graphs=m.cuda_graphs,
        host_spill_bytes=config.cache.host_spill_bytes, transfer_budget_bytes=config.scheduler.transfer_budget_bytes)


def gpu_memory() -> dict[str, int]:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


class EngineCore:
    def __init__(self, config: Config, run_dir: str, control: Connection, workers: list[str]) -> None:
        self.config = config
        self.workers = workers  # names of the front-end workers ("w0", ...): where engine stats go
        self.run_dir = run_dir
        self.control = control
        self.topology_cap: int | None = None
        self.transfer_budget: int | None = None
        self.pinned_cpus: list[int] = []
        self._send_lock = threading.Lock()  # core.out is written by the main and the engine thread
        self._stop = False

    # ---- start

    def build(self) -> ModelInfo:
        from edged.models.loader import load_model, with_overrides
        from .setup import build_engine

        cfg = self.config
        loaded = load_model(cfg.model.path)
        loaded = with_overrides(loaded, cfg.model.served_name, cfg.model.tokenizer, cfg.model.chat_template,
                                cfg.model.sampling_defaults.as_dict())
        self.front = build_engine(loaded, engine_settings(cfg))
        self.engine = self.front.engine
        self._topology(cfg)
        self._apply_scheduler_config(cfg)
        self.admission = self.engine.batcher.admission()
        self.limiter = RateLimiter()
        self._warm_up()
        return ModelInfo(loaded.model_id, self.front.max_model_len, self.engine.vocab_size, loaded.tokenizer,
                         loaded.chat_template, str(self.engine.runner.device), dict(loaded.sampling_defaults))

    def _warm_up(self) -> None:
        """Real steps through every layer before READY, so the first clients do not pay for them: one
        prompt of each length alone (batched together they would make one step of their summed size),
        then batches (WARMUP_BATCHES); run twice, the second time to measure the step model (on the CPU,
        where nothing compiles per shape, the batches run in that pass only)."""
        cuda = self.engine.runner.device.type == "cuda"
        # The CPU kernels compile once, not per shape: one short prompt warms everything there.
        lengths = WARMUP_PROMPT_TOKENS if cuda else WARMUP_PROMPT_TOKENS[:1]
        fits = [n for n in lengths if n < self.front.max_model_len - 2]
        vocab = self.engine.vocab_size
        made = 0

        def request(n: int, max_tokens: int = 2, sampled: bool = False) -> GenerationRequest:
            nonlocal made
            made += 1
            # distinct first tokens: a prompt sharing a cached prefix block would prefill fewer tokens than n
            ids = [(made * 131 + i * 17) % vocab for i in range(n)]
            sampling = (SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=made, max_tokens=max_tokens)
                        if sampled else SamplingParams(temperature=0.0, max_tokens=max_tokens))
            return GenerationRequest(f"warmup-{made}", ids, sampling)

        pending: set[str] = set()
        stepped, finished = threading.Event(), threading.Event()

        def on_outputs(outputs: list[StepOutput]) -> None:
            stepped.set()
            pending.difference_update(o.request_id for o in outputs if o.finished)
            if not pending:
                finished.set()

        def submit(batch: list[GenerationRequest]) -> None:
            finished.clear()
            stepped.clear()
            pending.update(r.request_id for r in batch)
            for r in batch:
                self.engine.add_request(r)

        def wait(event: threading.Event, what: str) -> None:
            if not event.wait(600):
                raise RuntimeError(f"the warm-up {what} did not finish")

        def run_all(measuring: bool) -> None:
            for n in fits:
                submit([request(n)])
                wait(finished, f"prompt of {n} tokens")
            if cuda or measuring:
                # on the CPU only to measure: batches' decode steps, without which the step model knows
                # one row's cost only (admission would judge a first burst by its prior)
                (few, few_len), (many, many_len) = WARMUP_BATCHES
                submit([request(few_len, max_tokens=12) for _ in range(few)])
                wait(stepped, "batch's first step")
                submit([request(many_len, max_tokens=4, sampled=i % 2 == 1) for i in range(many)])
                wait(finished, "batches")

        self.engine.on_outputs = on_outputs
        self.engine.start(self._pin_engine_thread)
        stats = self.engine.batcher.step_stats
        with self.engine.batcher.board.warming_up():  # no TTFT, pace or counts of warm-up requests in the tiers
            run_all(measuring=False)  # compiles: these step times are compile stalls
            stats.reset()
            run_all(measuring=True)  # the same steps compiled: admission starts from what they really cost
        stats.reset(steps=False)  # but not from warm-up sequences' few tokens each
        counters_zeroed = threading.Event()
        self.engine.call(lambda: (self.engine.forget_counters(), counters_zeroed.set()))
        wait(counters_zeroed, "counters' reset")  # /metrics counts served steps and tokens only
        self.engine.on_outputs = self._send_outputs

    def _pin_engine_thread(self) -> None:
        if self.pinned_cpus:
            from edged.scheduler.topology import pin_engine_thread
            pin_engine_thread(self.pinned_cpus)

    def _topology(self, config: Config) -> None:
        """On a GPU node: batch cap and per-step PCIe budget from the topology; the engine thread
        pinned to the GPU's local CPUs."""
        if self.engine.runner.device.type != "cuda":
            return
        import torch

        from edged.scheduler.topology import plan

        topo, limits = plan(device_index=torch.cuda.current_device())  # the config's cap applies in batch_limits
        self.topology_cap = limits.batch_cap
        self.transfer_budget = limits.step_transfer_budget_bytes
        if config.scheduler.pin_threads:
            self.pinned_cpus = limits.pinned_cpus
        log.info("topology %s", fields(bus=topo.bus_id, hops=topo.hops, gen=topo.link_gen, width=topo.link_width,
                                       batch_cap=limits.batch_cap, step_budget_mb=limits.step_transfer_budget_bytes >> 20,
                                       cpus=len(self.pinned_cpus)))

    def batch_limits(self, config: Config):
        """The per-step limits: the batch cap is the config's, else the topology's, never above
        model.max_num_seqs (the CUDA graphs' largest batch)."""
        from edged.scheduler.batcher import BatchLimits

        cap = config.scheduler.batch_cap or self.topology_cap or config.model.max_num_seqs
        return BatchLimits(min(cap, config.model.max_num_seqs),
                           config.scheduler.step_token_budget or config.model.max_batch_tokens)

    def _apply_scheduler_config(self, config: Config) -> None:
        """Tiers, default tier, limits and preemption into the batcher (engine thread or before start)."""
        self.engine.batcher.reconfigure(config.tiers, config.scheduler.default_tier, self.batch_limits(config),
                                        preemption=config.scheduler.preemption)
        self.engine.blocks.transfer_budget_bytes = config.scheduler.transfer_budget_bytes or self.transfer_budget

    # ---- run

    def serve(self, on_bound: Callable[[], None]) -> None:
        ctx = zmq.Context(io_threads=1)
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(ipc.address(self.run_dir, ipc.CORE_IN))
        self.out = ctx.socket(zmq.ROUTER)
        self.out.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes over its name
        self.out.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow worker's token messages
        self.out.bind(ipc.address(self.run_dir, ipc.CORE_OUT))
        on_bound()
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        poller.register(self.control.fileno(), zmq.POLLIN)
        next_beat = 0.0
        try:
            while not self._stop:
                ready = dict(poller.poll(int(HEARTBEAT_S * 1000)))
                if self.pull in ready:
                    self._drain_requests()
                if self.control.fileno() in ready:
                    self._control_message()
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + HEARTBEAT_S
                    self._heartbeat()
        finally:
            self.engine.stop()
            self.pull.close(0)
            self.out.close(0)
            ctx.term()

    def _send(self, worker: str, message: bytes) -> None:
        with self._send_lock:
            try:
                self.out.send_multipart([worker.encode(), message], zmq.NOBLOCK)
            except zmq.ZMQError as e:  # the worker is gone; its sequences are cancelled by the supervisor
                log.debug("send to worker failed %s", fields(worker=worker, error=str(e)))

    def _drain_requests(self) -> None:
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = ipc.unpack(data)
                kind = msg["t"]
                if kind == "add":
                    self._add(msg)
                elif kind == "abort":
                    for wid in msg["ids"]:
                        self.engine.cancel(wid)
                        self.admission.release(wid)
                elif kind == "rate":
                    self._rate(msg)
                elif kind == "stats":  # a /metrics scrape: the engine as of now
                    self._send(msg["w"], self._stats_message(msg["q"]))
                else:
                    log.warning("unknown message from a worker %s", fields(type=kind))
            except Exception:  # one bad message must not stop the core
                log.exception("worker message failed")

    def _add(self, msg: dict[str, Any]) -> None:
        request = ipc.request_from(msg)
        wid = request.request_id
        rid, worker = ipc.split_wire_id(wid)
        try:
            self.admission.admit(request)
        except Exception as e:
            status = getattr(e, "http_status", None)
            if status is None:
                raise
            self._send(worker, ipc.pack({"t": "ack", "id": rid, "err": [status, getattr(e, "code", None), str(e),
                                                                       getattr(e, "retry_after", None)]}))
            return
        self._send(worker, ipc.pack({"t": "ack", "id": rid, "err": None}))
        self.engine.add_request(request)

    def _rate(self, msg: dict[str, Any]) -> None:
        wait = self.limiter.take(RatePolicy(msg["key"], msg["rps"], msg["burst"]))
        self._send(msg["w"], ipc.pack({"t": "rate", "q": msg["q"], "wait": wait}))

    def _send_outputs(self, outputs: list[StepOutput]) -> None:
        """Engine thread, once per step: one message per worker with every new token of its streams."""
        by_worker: dict[str, list[list[Any]]] = {}
        for o in outputs:
            rid, worker = ipc.split_wire_id(o.request_id)
            by_worker.setdefault(worker, []).append([rid, o.new_token_ids, o.finish_reason if o.finished else None,
                                                     o.error])
        for worker, items in by_worker.items():
            if worker:
                self._send(worker, ipc.pack({"t": "out", "o": items}))

    def _stats_message(self, query: int | None) -> bytes:
        return ipc.pack({"t": "stats", "q": query, "s": EngineSnapshot.of(self.engine, gpu_memory()).to_dict(),
                         "alive": self.engine_alive()})

    def _control_message(self) -> None:
        try:
            kind, *args = self.control.recv()
        except (EOFError, OSError):  # the supervisor is gone: stop, do not linger as an orphan
            log.error("supervisor gone, stopping")
            self._stop = True
            return
        if kind == "stop":
            self._stop = True
        elif kind == "config":
            new: Config = args[0]
            self.config = new
            setup_logging(new.logging.level)
            applied = threading.Event()

            def apply() -> None:
                try:
                    self._apply_scheduler_config(new)
                finally:
                    applied.set()

            self.engine.call(apply)
            applied.wait(5.0)  # between two steps: at most a step's time
            self.control.send(("applied",))
        elif kind == "worker_gone":
            suffix = "@" + args[0]
            self.engine.call(lambda: self.engine.cancel_matching(lambda rid: rid.endswith(suffix)))

    def engine_alive(self) -> bool:
        return self.engine.is_alive() and time.monotonic() - self.engine.counters.last_progress < ENGINE_STALL_S

    def _heartbeat(self) -> None:
        try:
            stats = self._stats_message(None)
            for worker in self.workers:
                self._send(worker, stats)
        except Exception:
            log.exception("engine metrics failed")
        if self.engine_alive():
            try:
                self.control.send(("beat",))
            except (BrokenPipeError, OSError):
                self._stop = True


def run_engine_core(config: Config, run_dir: str, workers: list[str], control: Connection) -> None:
    """Entry point of the engine core process (multiprocessing "spawn")."""
    from edged.processes import child_setup, register_process

    child_setup("core", config.logging.level)
    register_process(run_dir, "core")
    # The main thread answers the workers while the engine thread runs Python between kernel
    # launches: a request's admission must not wait out the default 5 ms GIL switch interval.
    sys.setswitchinterval(GIL_SWITCH_S)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the supervisor stops the core after the workers drained
    core = EngineCore(config, run_dir, control, workers)
    try:
        info = core.build()
    except Exception as e:
        log.error("engine core failed to start %s", fields(error=repr(e)), exc_info=e)
        control.send(("failed", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    started = time.monotonic()
    try:
        # Bound first, then "ready": a worker started on "ready" finds the sockets there.
        def ready() -> None:
            control.send(("ready", info))
            log.info("engine core ready %s", fields(pid=os.getpid(), workers=len(workers)))

        core.serve(on_bound=ready)
    finally:
        log.info("engine core stopped %s", fields(uptime_s=round(time.monotonic() - started, 1), pid=os.getpid()))
