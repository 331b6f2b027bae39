"""The CUDA engine (Triton kernels, CUDA graphs) against the CPU reference engine."""
from __future__ import annotations

import pytest
import torch

from edged.engine.block_manager import BlockManager
from edged.engine.llm_engine import LLMEngine
from edged.engine.model_runner import ModelRunner
from edged.models.batch import KVCache
from edged.models.config import ModelConfig
from edged.models.llama import LlamaModel
from edged.models.runtime_weights import build_weights, random_named_weights
from edged.scheduler.batcher import Batcher, BatchLimits
from engine_fixtures import request, run_to_completion

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SMALL = ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
                    num_kv_heads=2, max_position_embeddings=1024, name="small-gpu")


def engine_on(device: str, dtype: torch.dtype, quant: str, graphs: bool) -> LLMEngine:
    # A large std gives peaked logits, so greedy choices sit far from ties in every dtype.
    named = random_named_weights(SMALL, seed=3, std=0.25)
    model = LlamaModel(SMALL, build_weights(named, SMALL, quant, dtype, device), 1024)
    kv = KVCache.allocate(SMALL.num_layers, 256, 16, SMALL.num_kv_heads, SMALL.head_dim, dtype, device)
    runner = ModelRunner(model, kv)
    if graphs:
        runner.enable_cuda_graphs(8, 1024)
    blocks = BlockManager(256, 16)
    return LLMEngine(runner, blocks, Batcher(blocks, BatchLimits(8, 256)), 1024, [], lambda _: None)


PROMPTS = [[5, 17, 300, 42, 7], list(range(100, 140)), [1999, 3, 3, 3], list(range(1, 70, 3))]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_engine_greedy_output_equals_the_cpu_reference_engine_for_64_tokens(dtype: torch.dtype) -> None:
    reqs = [request(f"r{i}", p, max_tokens=64) for i, p in enumerate(PROMPTS)]
    cpu = run_to_completion(engine_on("cpu", torch.float32, "none", False), reqs)
    gpu = run_to_completion(engine_on("cuda", dtype, "none", True), reqs)
    assert gpu == cpu


@pytest.mark.parametrize("quant", ["w8", "w4"])
def test_quantized_gpu_engine_matches_the_cpu_engine_on_the_same_quantized_weights(quant: str) -> None:
    reqs = [request(f"r{i}", p, max_tokens=64) for i, p in enumerate(PROMPTS)]
    cpu = run_to_completion(engine_on("cpu", torch.float32, quant, False), reqs)
    gpu = run_to_completion(engine_on("cuda", torch.float16, quant, True), reqs)
    assert gpu == cpu
