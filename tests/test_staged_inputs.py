"""A graph step's inputs staged in one buffer, and tokens read back through a ring of buffers. On
the CPU here, through the graphs' own staging (no capture): the layout and bookkeeping that the CUDA
path copies through pinned memory."""
from __future__ import annotations

import pytest
import torch

from edged.engine.cuda_graphs import DecodeGraphs, MixedGraphs
from edged.engine.pinned_ring import PinnedRing
from edged.engine.staged_inputs import RING_DEPTH, StagedInputs
from edged.engine.step_inputs import StepInputs
from edged.engine.token_readback import TokenReadback
from edged.models.batch import KVCache
from helpers.tiny_engine import tiny_model

CPU = torch.device("cpu")


def graphs(kind: type, *args: int, **kwargs):
    model = tiny_model()
    c = model.config
    kv = KVCache.allocate(c.num_layers, 64, 16, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    return kind(model, kv, *args, **kwargs)


def decode_step(ids: list[int], positions: list[int], tables: list[list[int]], fills: tuple = ((), ())) -> StepInputs:
    return StepInputs(ids=ids, positions=positions, slots=[t[p // 16] * 16 + p % 16 for p, t in zip(positions, tables)],
                      cu_seqlens=list(range(len(ids) + 1)), context_lens=[p + 1 for p in positions], tables=tables,
                      fill_rows=list(fills[0]), fill_from=list(fills[1]))


def test_a_decode_step_lands_in_the_graph_inputs_and_padding_rows_write_no_kv() -> None:
    assert graphs(DecodeGraphs, 8, 6).bucket_for(3) == 3  # by default 3 rows have a graph of their own
    g = graphs(DecodeGraphs, 8, 6, buckets=(1, 2, 4))
    tables = [[12, 13, 14], [7], [20, 21, 22, 23, 24, 25]]
    g.stage(decode_step([11, 12, 13], [40, 7, 90], tables))
    assert g.bucket_for(3) == 4
    assert g.input_ids[:3].tolist() == [11, 12, 13]
    assert g.positions[:3].tolist() == [40, 7, 90]
    assert g.slot_mapping[:4].tolist() == [14 * 16 + 8, 7 * 16 + 7, 25 * 16 + 10, -1]
    assert g.context_lens[:4].tolist() == [41, 8, 91, 1]
    assert [g.block_tables[r, :len(t)].tolist() for r, t in enumerate(tables)] == tables
    assert g.input_ids.dtype == torch.int64 and g.block_tables.dtype == torch.int32
    assert g.block_tables.is_contiguous() and g.context_lens.is_contiguous()
    with pytest.raises(ValueError, match="no decode graph for 9 rows"):
        g.stage(decode_step(list(range(9)), [0] * 9, [[0]] * 9))


def test_every_step_through_the_ring_sees_its_own_rows() -> None:
    """More steps than ring buffers, with batches that shrink and grow: each step's rows are its own,
    and rows a smaller step leaves out become padding (no KV slot) up to its bucket."""
    g = graphs(DecodeGraphs, 8, 4)
    for step in range(3 * RING_DEPTH):
        n = 1 + step % 5
        b = g.bucket_for(n)
        tables = [[(step + r + j) % 50 for j in range(1 + (step + r) % 4)] for r in range(n)]
        g.stage(decode_step([100 * step + r for r in range(n)], [len(t) * 16 - 1 for t in tables], tables))
        assert g.input_ids[:n].tolist() == [100 * step + r for r in range(n)]
        assert g.slot_mapping[:b].tolist() == [t[-1] * 16 + 15 for t in tables] + [-1] * (b - n)
        assert g.context_lens[:b].tolist() == [len(t) * 16 for t in tables] + [1] * (b - n)
        assert [g.block_tables[r, :len(t)].tolist() for r, t in enumerate(tables)] == tables


def test_placeholders_are_filled_from_the_tokens_of_the_step_in_flight() -> None:
    g = graphs(DecodeGraphs, 4, 2)
    in_flight = torch.tensor([501, 502, 503], dtype=torch.int64)
    step = decode_step([0, 0, 0], [5, 6, 7], [[0], [1], [2]], ((0, 1, 2), (0, 1, 2)))
    assert step.fills_in_order
    g.stage(step)
    g.inputs.fill_placeholders(3, in_flight, in_order=True)
    assert g.input_ids[:3].tolist() == [501, 502, 503]
    # a sequence left the batch: rows 0 and 2 take the tokens of rows 2 and 0; row 1 is a known token
    step = decode_step([0, 77, 0], [5, 6, 7], [[0], [1], [2]], ((0, 2), (2, 0)))
    assert not step.fills_in_order
    g.stage(step)
    g.inputs.fill_placeholders(2, in_flight, in_order=False)
    assert g.input_ids[:3].tolist() == [503, 77, 501]


def test_a_prompt_step_is_padded_to_its_bucket_with_one_row_that_owns_the_padding_tokens() -> None:
    """Two prompts (5 and 3 tokens) and one decode in a bucket of 16 tokens: rows 3.. hold nothing but
    the last, which owns tokens 9..16; each sequence's last token is a logits row."""
    g = graphs(MixedGraphs, 8, 4, 64)
    assert g.buckets == (16, 32, 64) and g.rows_for(16) == 9
    step = StepInputs(ids=list(range(1, 10)), positions=[0, 1, 2, 3, 4, 0, 1, 2, 20],
                      slots=[16, 17, 18, 19, 20, 32, 33, 34, 52], cu_seqlens=[0, 5, 8, 9], context_lens=[5, 3, 21],
                      tables=[[1], [2], [0, 3]], sample_rows=[4, 7, 8])
    assert g.stage(step) == (16, 3)
    assert g.input_ids[:9].tolist() == list(range(1, 10))
    assert g.slot_mapping[:16].tolist() == step.slots + [-1] * 7
    assert g.cu_seqlens[:10].tolist() == [0, 5, 8, 9, 9, 9, 9, 9, 9, 16]
    assert g.context_lens[:9].tolist() == [5, 3, 21, 0, 0, 0, 0, 0, 7]
    assert g.last_rows[:9].tolist() == [4, 7, 8, 8, 8, 8, 8, 8, 15]
    assert g.block_tables[2, :2].tolist() == [0, 3]
    with pytest.raises(ValueError, match="no graph for a step of 65 tokens"):
        g.stage(StepInputs(ids=[1] * 65, positions=list(range(65)), slots=[0] * 65, cu_seqlens=[0, 65],
                           context_lens=[65], tables=[[0, 1, 2, 3, 4]]))


def test_a_block_table_longer_than_the_graphs_is_refused() -> None:
    inputs = StagedInputs({"input_ids": (torch.int64, 2)}, 2, 2, CPU)
    inputs.begin()
    with pytest.raises(ValueError, match="block table of 3 blocks"):
        inputs.write_tables([[0, 1, 2]])
    with pytest.raises(ValueError, match="only int64 and int32"):
        StagedInputs({"x": (torch.float32, 2)}, 1, 1, CPU)


def test_tokens_read_back_through_the_ring_and_an_overwritten_buffer_is_an_error() -> None:
    readback = TokenReadback(capacity=4, device=CPU)
    first = readback.start(torch.tensor([7, 8], dtype=torch.int64))
    assert readback.read(first, 2) == [7, 8]
    assert readback.start(torch.arange(5)) is None  # larger than a buffer: the caller pins its own
    tickets = [readback.start(torch.tensor([i], dtype=torch.int64)) for i in range(len(readback.ring.buffers))]
    assert [readback.read(t, 1) for t in tickets] == [[i] for i in range(len(tickets))]
    with pytest.raises(RuntimeError, match="overwritten"):
        readback.read(first, 2)  # its buffer was handed out again by the last start


def test_a_ring_hands_out_its_buffers_in_turn() -> None:
    ring = PinnedRing(16, 3, CPU)
    got = [ring.acquire() for _ in range(4)]
    assert [i for i, _ in got] == [0, 1, 2, 0]
    assert not ring.holds(*got[0]) and ring.holds(*got[3]) and ring.holds(*got[1])
    with pytest.raises(ValueError):
        PinnedRing(16, 1, CPU)
