"""The host tier of the prefix cache: evicted blocks spill to host memory and come back on a hit."""
from __future__ import annotations

import random

import torch

from edged.engine.block_manager import BlockManager, chain_hash
from edged.engine.host_kv_tier import HostKVTier
from edged.engine.llm_engine import LLMEngine
from edged.engine.model_runner import ModelRunner
from edged.engine.request import GenerationRequest, SamplingParams
from edged.engine.sequence import Sequence
from edged.engine.setup import EngineSettings, host_tier
from edged.models.batch import KVCache
from edged.scheduler.batcher import Batcher, BatchLimits

from helpers.tiny_engine import request, run_to_completion, tiny_engine, tiny_model

BS = 4  # tokens per block


def tiered_engine(num_blocks: int = 16, host_blocks: int = 64, budget: int | None = None,
                  int8: bool = False, prefix_caching: bool = True) -> LLMEngine:
    """helpers.tiny_engine.tiny_engine with a host tier (host_blocks=0: none) and an int8 option."""
    model = tiny_model()
    c = model.config
    kv = KVCache.allocate(c.num_layers, num_blocks, BS, c.num_kv_heads, c.head_dim, torch.float32, "cpu", int8)
    tier = HostKVTier(kv, host_blocks) if host_blocks else None
    blocks = BlockManager(num_blocks, BS, prefix_caching, tier, budget)
    batcher = Batcher(blocks, BatchLimits(16, 64))
    return LLMEngine(ModelRunner(model, kv), blocks, batcher, c.max_position_embeddings, [], lambda _: None)


def prefix_hashes(tokens: list[int]) -> list[bytes]:
    hashes, h = [], b""
    for i in range(len(tokens) // BS):
        h = chain_hash(h, tokens[i * BS:(i + 1) * BS])
        hashes.append(h)
    return hashes


rng = random.Random(17)
PREFIX = [rng.randrange(256) for _ in range(12)]  # three whole blocks
FIRST, SECOND = PREFIX + [7, 8, 9], PREFIX + [10, 11]
OTHERS = [[rng.randrange(256) for _ in range(28)] for _ in range(3)]  # 8 blocks each with 4 new tokens


def evict_prefix(engine: LLMEngine) -> None:
    """Run A, then enough other requests to push A's prefix blocks out of the device pool."""
    run_to_completion(engine, [request("a", FIRST)])
    for i, p in enumerate(OTHERS):
        run_to_completion(engine, [request(f"x{i}", p, max_tokens=4)])
    assert not any(h in engine.blocks.cached for h in prefix_hashes(PREFIX))


def second_request(engine: LLMEngine) -> tuple[list[int], int, int]:
    """B's tokens, its prompt tokens computed and the prefix tokens it reused."""
    prefill, reused = engine.counters.prefill_tokens, engine.blocks.counters.prefix_tokens_reused
    out = run_to_completion(engine, [request("b", SECOND)])["b"]
    return out, engine.counters.prefill_tokens - prefill, engine.blocks.counters.prefix_tokens_reused - reused


def uncached(int8: bool = False) -> list[int]:
    return run_to_completion(tiered_engine(64, 0, int8=int8, prefix_caching=False), [request("b", SECOND)])["b"]


def test_an_evicted_prefix_comes_back_from_the_host_and_the_output_is_unchanged() -> None:
    engine = tiered_engine()
    evict_prefix(engine)
    tier = engine.blocks.host_tier
    assert tier.counters.spilled >= 3 and all(h in tier for h in prefix_hashes(PREFIX))
    out, prefilled, reused = second_request(engine)
    assert (tier.counters.restored, tier.counters.bytes_restored) == (3, 3 * tier.bytes_per_block)
    assert reused == len(PREFIX) and prefilled == len(SECOND) - len(PREFIX)
    assert out == uncached()
    assert engine.blocks.num_free == engine.blocks.num_blocks  # restored blocks were released like any other


def test_the_step_budget_caps_restores_and_the_rest_is_recomputed() -> None:
    c = tiny_model().config
    block_bytes = 2 * c.num_layers * BS * c.num_kv_heads * c.head_dim * 4  # K and V in float32
    engine = tiered_engine(budget=block_bytes)  # one block a step
    evict_prefix(engine)
    tier = engine.blocks.host_tier
    assert tier.bytes_per_block == block_bytes
    out, prefilled, reused = second_request(engine)
    assert tier.counters.restored == 1 and tier.counters.hits == 2  # the second hit fell outside the budget
    assert reused == BS and prefilled == len(SECOND) - BS
    assert out == uncached()


def test_the_budget_is_per_step() -> None:
    kv = KVCache.allocate(1, 4, BS, 1, 2, torch.float32, "cpu")
    tier = HostKVTier(kv, 8)
    blocks = BlockManager(4, BS, host_tier=tier, transfer_budget_bytes=tier.bytes_per_block)
    tokens = list(range(3 * BS + 1))

    def seq(rid: str, ids: list[int] = tokens) -> Sequence:
        return Sequence.from_request(GenerationRequest(rid, ids, SamplingParams()), 0, frozenset())

    a = seq("a")
    assert blocks.allocate(a, len(tokens))
    a.num_computed = len(tokens)
    blocks.commit(a)  # names its three full blocks
    blocks.release(a)
    x = seq("x", [300] * 4 * BS)
    assert blocks.allocate(x, 4 * BS)  # reuses every block: the named ones spill
    blocks.release(x)
    assert tier.counters.spilled == 3 and not blocks.cached

    blocks.begin_step()
    assert blocks.attach_prefix(seq("b")) == BS  # one block restored; the budget is spent
    assert blocks.attach_prefix(seq("c")) == BS  # that block is now a device hit; the next one waits
    blocks.begin_step()
    assert blocks.attach_prefix(seq("d")) == 2 * BS
    assert tier.counters.restored == 2 and blocks.step_restore_bytes == tier.bytes_per_block
    assert blocks.ref_count[blocks.cached[prefix_hashes(tokens)[0]]] == 3  # b, c and d share it


def test_int8_blocks_spill_and_restore_with_their_scales() -> None:
    kv = KVCache.allocate(2, 4, BS, 2, 64, torch.float32, "cpu", int8=True)
    assert kv.k_scale[0].shape == (4, BS, 2, 2) and kv.v_scale[0].shape == (4, BS, 2, 1)  # keys: per 32 channels
    for t in (*kv.k, *kv.v):
        t.copy_(torch.randint(-127, 128, t.shape, dtype=torch.int8))
    for t in (*kv.k_scale, *kv.v_scale):
        t.copy_(torch.rand(t.shape))
    tier = HostKVTier(kv, 2)
    assert tier.bytes_per_block == kv.bytes_per_block()
    tensors = [*kv.k, *kv.v, *kv.k_scale, *kv.v_scale]
    before = [t[1].clone() for t in tensors]
    tier.save(1, b"one")
    assert tier.restore(b"one", 3)
    assert all(torch.equal(t[3], b) for t, b in zip(tensors, before))
    assert not tier.restore(b"two", 0)


def test_int8_engine_output_is_unchanged_by_a_restored_prefix() -> None:
    engine = tiered_engine(int8=True)
    evict_prefix(engine)
    out, prefilled, reused = second_request(engine)
    assert engine.blocks.host_tier.counters.restored == 3 and reused == len(PREFIX)
    assert out == uncached(int8=True)


def test_a_full_tier_drops_its_least_recently_used_entry() -> None:
    kv = KVCache.allocate(1, 4, BS, 1, 2, torch.float32, "cpu")
    kv.k[0].copy_(torch.arange(kv.k[0].numel(), dtype=torch.float32).view_as(kv.k[0]))
    tier = HostKVTier(kv, 2)
    tier.save(0, b"a")
    tier.save(1, b"b")
    assert tier.lookup(b"a")  # a is now the most recent
    tier.save(2, b"c")
    assert (b"a" in tier, b"b" in tier, b"c" in tier) == (True, False, True)
    assert tier.counters.dropped == 1
    assert tier.restore(b"c", 0) and torch.equal(kv.k[0][0], kv.k[0][2])


def test_tier_off_behaves_exactly_as_before() -> None:
    engine = tiered_engine(host_blocks=0)
    reference = tiny_engine(num_blocks=16)
    evict_prefix(engine)
    evict_prefix(reference)
    out, prefilled, reused = second_request(engine)
    assert engine.blocks.host_tier is None and reused == 0 and prefilled == len(SECOND)
    assert out == second_request(reference)[0] == uncached()
    assert engine.blocks.counters == reference.blocks.counters
    kv = KVCache.allocate(1, 4, BS, 1, 2, torch.float32, "cpu")
    assert host_tier(EngineSettings(), kv) is None  # host_spill_bytes defaults to 0
    assert host_tier(EngineSettings(host_spill_bytes=10 * kv.bytes_per_block(), prefix_caching=False), kv) is None


def test_settings_map_the_spill_bytes_and_the_budget() -> None:
    from edged.config import parse_config
    from edged.engine.core import engine_settings

    s = engine_settings(parse_config({"model": {"block_size": 8, "max_num_seqs": 4}, "cache": {"host_spill_bytes": 1 << 20},
                                      "scheduler": {"transfer_budget_bytes": 4096}}))
    assert (s.block_size, s.max_num_seqs, s.host_spill_bytes, s.transfer_budget_bytes) == (8, 4, 1 << 20, 4096)
    d = engine_settings(parse_config({}))
    assert (d.host_spill_bytes, d.transfer_budget_bytes, d.prefix_caching) == (0, None, True)
    kv = KVCache.allocate(1, 4, BS, 1, 2, torch.float32, "cpu")
    tier = host_tier(EngineSettings(host_spill_bytes=10 * kv.bytes_per_block() + 1), kv)
    assert tier is not None and tier.capacity == 10 and not tier.pinned
