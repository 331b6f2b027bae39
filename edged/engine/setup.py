"""Build a running engine from a loaded model and the `model` section of the config."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from edged.log import fields
from edged.models.batch import KVCache
from edged.models.llama import LlamaModel
from edged.models.loader import LoadedModel
from edged.models.runtime_weights import build_weights
from edged.scheduler.batcher import Batcher, BatchLimits

from .async_engine import AsyncEngine
from .block_manager import BlockManager
from .host_kv_tier import HostKVTier
from .llm_engine import LLMEngine
from .model_runner import ModelRunner

log = logging.getLogger("edged.engine")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_KV_BUDGET_BYTES = 768 << 20  # the CPU path shares RAM with everything else on the node


@dataclass(slots=True)
class EngineSettings:
    quant: str = "auto"
    group_size: int = 64  # w4 groups when edged quantizes (GGUF Q4 keeps its 32)
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    device: str = "auto"
    gpu_memory_fraction: float = 0.85
    block_size: int = 16
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    prefix_caching: bool = True
    num_kv_blocks: int | None = None  # None: sized from free memory
    cuda_graphs: bool = True
    overlap_steps: bool = True  # on CUDA: launch step N+1 before reading back step N's tokens
    host_spill_bytes: int = 0  # host tier for evicted prefix blocks (pinned on CUDA); 0: off
    transfer_budget_bytes: int | None = None  # host -> device restore bytes per step; None: unlimited


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device is cuda but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be auto or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def kv_block_count(settings: EngineSettings, bytes_per_block: int, max_model_len: int, device: torch.device) -> int:
    """Blocks for the KV pool: what memory allows, but no more than max_num_seqs full contexts."""
    if settings.num_kv_blocks:
        return settings.num_kv_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - settings.gpu_memory_fraction) * total
    else:
        budget = min(CPU_KV_BUDGET_BYTES, psutil.virtual_memory().available // 4)
    useful = settings.max_num_seqs * -(-max_model_len // settings.block_size)
    return max(1, min(int(budget // bytes_per_block), useful))


def host_tier(settings: EngineSettings, kv: KVCache) -> HostKVTier | None:
    """The host tier that cache.host_spill_bytes buys, or None (off, or prefix caching off)."""
    capacity = settings.host_spill_bytes // kv.bytes_per_block() if settings.prefix_caching else 0
    if settings.host_spill_bytes and not capacity:
        log.warning("no host KV tier %s", fields(host_spill_bytes=settings.host_spill_bytes,
                                                 block_bytes=kv.bytes_per_block(),
                                                 prefix_caching=settings.prefix_caching))
    return HostKVTier(kv, capacity) if capacity else None


def build_engine(loaded: LoadedModel, settings: EngineSettings) -> AsyncEngine:
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, psutil.cpu_count(logical=False) or 1))
    cfg = loaded.config
    max_model_len = min(settings.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    weights = build_weights(loaded.named_weights, cfg, settings.quant, dtype, device, settings.group_size)
    model = LlamaModel(cfg, weights, max_model_len)
    int8_kv = settings.kv_cache_dtype == "int8"
    probe = KVCache.allocate(cfg.num_layers, 1, settings.block_size, cfg.num_kv_heads, cfg.head_dim, dtype,
                             device, int8_kv)
    num_blocks = kv_block_count(settings, probe.bytes_per_block(), max_model_len, device)
    del probe
    kv = KVCache.allocate(cfg.num_layers, num_blocks, settings.block_size, cfg.num_kv_heads, cfg.head_dim, dtype,
                          device, int8_kv)
    tier = host_tier(settings, kv)
    blocks = BlockManager(num_blocks, settings.block_size, settings.prefix_caching, tier,
                          settings.transfer_budget_bytes)
    batcher = Batcher(blocks, BatchLimits(settings.max_num_seqs, settings.max_batch_tokens))
    runner = ModelRunner(model, kv)
    if settings.cuda_graphs:
        runner.enable_cuda_graphs(settings.max_num_seqs, max_model_len, settings.max_batch_tokens)
    overlap = settings.overlap_steps and device.type == "cuda"
    engine = LLMEngine(runner, blocks, batcher, max_model_len, cfg.eos_token_ids, lambda _: None, overlap)
    log.info("engine built %s", fields(model=loaded.model_id, device=device, dtype=str(dtype).removeprefix("torch."),
                                       quant=settings.quant, weight_mb=weights.nbytes >> 20, kv_blocks=num_blocks,
                                       block_size=settings.block_size, max_model_len=max_model_len,
                                       host_kv_blocks=tier.capacity if tier else 0))
    return AsyncEngine(engine, loaded.tokenizer, loaded.chat_template, loaded.model_id, max_model_len)
