"""A tiny random-weight engine on the CPU: fast, deterministic, with the real engine parts."""
from __future__ import annotations

import torch

from edged.engine.block_manager import BlockManager
from edged.engine.llm_engine import LLMEngine
from edged.engine.model_runner import ModelRunner
from edged.engine.request import GenerationRequest, SamplingParams, StepOutput
from edged.models.batch import KVCache
from edged.models.config import ModelConfig
from edged.models.llama import LlamaModel
from edged.models.runtime_weights import build_weights, random_named_weights
from edged.scheduler.batcher import Batcher, BatchLimits

TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, max_position_embeddings=512, name="tiny")
_WEIGHTS = {}


def tiny_model(config: ModelConfig = TINY) -> LlamaModel:
    if config.name not in _WEIGHTS:
        # A large std makes logits peaked, so greedy choices are far from ties.
        _WEIGHTS[config.name] = build_weights(random_named_weights(config, seed=1, std=0.3), config, "none")
    return LlamaModel(config, _WEIGHTS[config.name], config.max_position_embeddings)


def tiny_engine(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 16, max_batch_tokens: int = 64,
                prefix_caching: bool = True) -> LLMEngine:
    model = tiny_model()
    c = model.config
    kv = KVCache.allocate(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    blocks = BlockManager(num_blocks, block_size, prefix_caching)
    batcher = Batcher(blocks, BatchLimits(max_num_seqs, max_batch_tokens))
    return LLMEngine(ModelRunner(model, kv), blocks, batcher, c.max_position_embeddings, [], lambda _: None)


def request(rid: str, prompt: list[int], max_tokens: int = 12, tier: str = "default",
            **sampling) -> GenerationRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, **sampling), tier=tier)


def run_to_completion(engine: LLMEngine, requests: list[GenerationRequest],
                      max_steps: int = 10_000) -> dict[str, list[int]]:
    """Drive the engine synchronously (no thread) and collect each request's tokens."""
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    done: set[str] = set()
    for r in requests:
        engine._admit(r)
    for _ in range(max_steps):
        if len(done) == len(requests):
            return out
        for o in engine.step():
            collect(out, done, o)
    raise AssertionError("engine did not finish")


def collect(out: dict[str, list[int]], done: set[str], o: StepOutput) -> None:
    out[o.request_id].extend(o.new_token_ids)
    if o.finished:
        done.add(o.request_id)


def run_overlapped(engine: LLMEngine, requests: list[GenerationRequest], max_steps: int = 10_000) -> dict[str, list[int]]:
    """As run_to_completion, with steps launched before the previous one is read back."""
    engine.overlap = True
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    done: set[str] = set()
    for r in requests:
        engine._admit(r)
    for _ in range(max_steps):
        if len(done) == len(requests) and not engine.has_work():
            return out
        for o in engine.step_overlapped():
            collect(out, done, o)
    raise AssertionError("engine did not finish")
