"""The CUDA engine (Triton kernels, CUDA graphs) against the CPU reference engine."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from edged.engine.block_manager import BlockManager
from edged.engine.llm_engine import LLMEngine
from edged.engine.model_runner import ModelRunner
from edged.models.batch import KVCache
from edged.models.config import ModelConfig
from edged.kernels import LinearWeight
from edged.models.llama import LayerWeights, LlamaModel, LlamaWeights
from edged.models.runtime_weights import build_weights, random_named_weights
from edged.scheduler.batcher import Batcher, BatchLimits
from helpers.tiny_engine import request, run_to_completion

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SMALL = ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
                    num_kv_heads=2, max_position_embeddings=1024, name="small-gpu")


def as_cpu_float32(w: LlamaWeights) -> LlamaWeights:
    """The same weights on the CPU: packed data as is, every float tensor exactly widened to float32."""
    def lin(x: LinearWeight) -> LinearWeight:
        return x.to("cpu").astype(torch.float32)

    def f(t: torch.Tensor) -> torch.Tensor:
        return t.cpu().float()

    layers = [LayerWeights(f(l.input_norm), lin(l.qkv), lin(l.o), f(l.post_norm), lin(l.gate_up), lin(l.down))
              for l in w.layers]
    return LlamaWeights(f(w.embed), layers, f(w.final_norm), lin(w.lm_head))


def peaked_named_weights(seed: int = 3) -> dict:
    """Random layers, plus an LM head that maps each token's embedding to a fixed successor token.

    Greedy choices of a plain random model sit within float rounding of a tie every few tokens
    (measured: float32 on the GPU and on the CPU part within 3 tokens), so no two devices agree for
    long. Here each logit gap is about |e|^2 against a random dot product, far above any dtype's
    error, while every layer and kernel still adds to the hidden state: a kernel that returns
    garbage (NaN, a wrong block, a wrong head) changes the tokens. Subtler numeric errors are the
    job of the per-kernel tests in test_kernels_gpu.py.
    """
    named = random_named_weights(SMALL, seed=seed, std=0.05)
    g = torch.Generator().manual_seed(seed + 1)
    embed = torch.randn(SMALL.vocab_size, SMALL.hidden_size, generator=g)
    successor = torch.randperm(SMALL.vocab_size, generator=g)
    head = torch.empty_like(embed)
    head[successor] = embed
    named["model.embed_tokens.weight"] = embed
    named["lm_head.weight"] = head
    return named


def gpu_weights(dtype: torch.dtype, quant: str, device: str = "cuda") -> LlamaWeights:
    return build_weights(peaked_named_weights(), SMALL, quant, dtype, device)


def engine_on(weights: LlamaWeights, graphs: bool) -> LLMEngine:
    model = LlamaModel(SMALL, weights, 1024)
    dtype, device = weights.embed.dtype, weights.embed.device
    kv = KVCache.allocate(SMALL.num_layers, 256, 16, SMALL.num_kv_heads, SMALL.head_dim, dtype, device)
    runner = ModelRunner(model, kv)
    if graphs:
        runner.enable_cuda_graphs(8, 1024, 256)
    blocks = BlockManager(256, 16)
    return LLMEngine(runner, blocks, Batcher(blocks, BatchLimits(8, 256)), 1024, [], lambda _: None)


def spy_on_decode_replays(engine: LLMEngine) -> list[int]:
    """The bucket of each decode graph the engine replays from now on, in order."""
    graphs, replayed = engine.runner.graphs, []
    for bucket, graph in list(graphs.graphs.items()):
        graphs.graphs[bucket] = SimpleNamespace(replay=lambda b=bucket, g=graph: (replayed.append(b), g.replay()))
    return replayed


PROMPTS = [[5, 17, 300, 42, 7], list(range(100, 140)), [1999, 3, 3, 3], list(range(1, 70, 3))]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_engine_greedy_output_equals_the_cpu_reference_engine_for_64_tokens(dtype: torch.dtype) -> None:
    reqs = [request(f"r{i}", p, max_tokens=64) for i, p in enumerate(PROMPTS)]
    weights = gpu_weights(dtype, "none")
    cpu = run_to_completion(engine_on(as_cpu_float32(weights), False), reqs)
    gpu = run_to_completion(engine_on(weights, True), reqs)
    assert gpu == cpu


def test_steps_with_prompt_tokens_replay_graphs_and_give_the_eager_engines_tokens() -> None:
    """Prefill and mixed steps run from captured graphs (padded to a token bucket, with a padding
    sequence row): the tokens equal an engine without graphs, with a full batch of 8 sequences."""
    reqs = [request(f"r{i}", p, max_tokens=32) for i, p in enumerate(PROMPTS * 2)]
    weights = gpu_weights(torch.bfloat16, "w8")
    eager = run_to_completion(engine_on(weights, False), reqs)
    engine = engine_on(weights, True)
    assert run_to_completion(engine, reqs) == eager
    assert engine.runner.mixed_graphs.replays > 0


def test_a_mixed_step_graph_gives_the_eager_forwards_logits_for_each_sequences_last_token() -> None:
    """Two prompts and two decodes in one step (27 tokens, bucket 32): the replayed graph's logits for
    each sequence's last token equal the eager forward's, and the padding rows write no KV."""
    from edged.engine.cuda_graphs import MixedGraphs
    from edged.engine.step_inputs import StepInputs
    from edged.models.batch import AttentionMetadata

    weights = gpu_weights(torch.bfloat16, "w8")
    model = LlamaModel(SMALL, weights, 1024)
    kv = KVCache.allocate(SMALL.num_layers, 64, 16, SMALL.num_kv_heads, SMALL.head_dim, torch.bfloat16, "cuda")
    graphs = MixedGraphs(model, kv, 8, 16, 256)
    graphs.capture()
    assert graphs.buckets == (16, 32, 64, 128, 256) and graphs.bucket_for(27, 4) == 32
    assert graphs.bucket_for(27, 9) is None and graphs.bucket_for(300, 1) is None
    # sequences: prompt of 12 (blocks 1), prompt of 13 (blocks 2, 3), decodes at 20 and 40 (blocks 4-5, 6-8)
    lens, before = [12, 13, 1, 1], [0, 0, 19, 39]
    tables = [[1, 0, 0], [2, 3, 0], [4, 5, 0], [6, 7, 8]]
    ids, pos, slots, cu = [], [], [], [0]
    for i, (n, b) in enumerate(zip(lens, before)):
        ids += [(37 * i + 5 * j) % SMALL.vocab_size for j in range(n)]
        pos += list(range(b, b + n))
        slots += [tables[i][p // 16] * 16 + p % 16 for p in range(b, b + n)]
        cu.append(cu[-1] + n)

    def t(x: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device="cuda")

    meta = AttentionMetadata(False, t(slots, torch.int64), t(tables, torch.int32),
                             t([b + n for n, b in zip(lens, before)], torch.int32), t(cu, torch.int32))
    with torch.inference_mode():
        for i in range(SMALL.num_layers):  # keys before the step: something to attend over
            kv.k[i].normal_()
            kv.v[i].normal_()
        untouched = kv.k[0][9:].clone()
        want = model.logits(model.forward(t(ids, torch.int64), t(pos, torch.int64), meta, kv)[t(cu[1:], torch.int64) - 1])
        step = StepInputs(ids=ids, positions=pos, slots=slots, cu_seqlens=cu,
                          context_lens=[b + n for n, b in zip(lens, before)], tables=tables)
        got = graphs.replay_staged(*graphs.stage(step)).clone()
    assert graphs.replays == 1
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).norm() <= 1e-2 * want.norm()
    assert torch.equal(kv.k[0][9:], untouched)


@pytest.mark.parametrize("quant", ["w8", "w4"])
def test_quantized_gpu_engine_matches_the_cpu_engine_on_the_same_quantized_weights(quant: str) -> None:
    reqs = [request(f"r{i}", p, max_tokens=64) for i, p in enumerate(PROMPTS)]
    weights = gpu_weights(torch.float16, quant)
    cpu = run_to_completion(engine_on(as_cpu_float32(weights), False), reqs)
    gpu = run_to_completion(engine_on(weights, True), reqs)
    assert gpu == cpu


def test_overlapped_gpu_steps_equal_the_cpu_reference_engine() -> None:
    from helpers.tiny_engine import run_overlapped

    reqs = [request(f"r{i}", p, max_tokens=64) for i, p in enumerate(PROMPTS)]
    weights = gpu_weights(torch.bfloat16, "w8")
    cpu = run_to_completion(engine_on(as_cpu_float32(weights), False), reqs)
    engine = engine_on(weights, True)
    assert run_overlapped(engine, reqs) == cpu
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_overlapped_steps_fill_each_row_from_where_its_token_was_sampled() -> None:
    """Sequences that end at different lengths leave the batch mid-run, so a step's rows no longer
    line up with the rows of the step in flight: each placeholder is still filled from its own
    sequence's sampled token (the decode graph's staged inputs, an out-of-order fill)."""
    from helpers.tiny_engine import run_overlapped

    reqs = [request(f"r{i}", p, max_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS, [9, 40, 3, 25]))]
    weights = gpu_weights(torch.bfloat16, "w8")
    cpu = run_to_completion(engine_on(as_cpu_float32(weights), False), reqs)
    engine = engine_on(weights, True)
    replayed = spy_on_decode_replays(engine)
    assert run_overlapped(engine, reqs) == cpu
    assert [len(cpu[f"r{i}"]) for i in range(4)] == [9, 40, 3, 25]
    assert {4, 3, 2, 1} <= set(replayed), replayed  # 3 rows replay their own graph, not 4's with a padding row


def test_seeded_sampling_gives_the_same_tokens_with_and_without_overlapped_steps() -> None:
    """Sampled (not greedy) decode steps through the graphs: the tokens read back through the pinned
    ring, overlapped, equal those of one step at a time."""
    from helpers.tiny_engine import run_overlapped

    reqs = [request(f"r{i}", p, max_tokens=48, temperature=0.9, top_k=40, seed=100 + i, ignore_eos=True)
            for i, p in enumerate(PROMPTS)]
    weights = gpu_weights(torch.bfloat16, "w8")
    serial = run_to_completion(engine_on(weights, True), reqs)
    assert run_overlapped(engine_on(weights, True), reqs) == serial
    assert all(len(v) == 48 for v in serial.values())
