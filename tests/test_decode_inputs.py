"""A decode step's inputs staged in one buffer, and tokens read back through a ring of buffers (on
the CPU here: the same layout and bookkeeping the CUDA path copies through pinned memory)."""
from __future__ import annotations

import pytest
import torch

from edged.engine.decode_inputs import RING_DEPTH, DecodeInputs
from edged.engine.pinned_ring import PinnedRing
from edged.engine.token_readback import TokenReadback

CPU = torch.device("cpu")


def test_staged_rows_land_in_the_graph_inputs_and_padding_rows_write_no_kv() -> None:
    inputs = DecodeInputs(max_batch=8, max_blocks_per_seq=6, device=CPU)
    tables = [[12, 13, 14], [7], [20, 21, 22, 23, 24, 20]]
    inputs.stage([11, 12, 13], [40, 7, 99], [201, 118, 333], [41, 8, 100], tables, [], [], bucket=4)
    assert inputs.input_ids[:3].tolist() == [11, 12, 13]
    assert inputs.positions[:3].tolist() == [40, 7, 99]
    assert inputs.slot_mapping[:4].tolist() == [201, 118, 333, -1]
    assert inputs.context_lens[:4].tolist() == [41, 8, 100, 1]
    assert inputs.block_tables[0, :3].tolist() == [12, 13, 14]
    assert inputs.block_tables[1, :1].tolist() == [7]
    assert inputs.block_tables[2].tolist() == [20, 21, 22, 23, 24, 20]
    assert inputs.input_ids.dtype == torch.int64 and inputs.block_tables.dtype == torch.int32
    assert inputs.block_tables.is_contiguous() and inputs.context_lens.is_contiguous()


def test_every_step_through_the_ring_sees_its_own_rows() -> None:
    """More steps than ring buffers, with batches that shrink and grow: each step's rows are its own,
    and rows a smaller step leaves out become padding (no KV slot) up to its bucket."""
    inputs = DecodeInputs(max_batch=8, max_blocks_per_seq=4, device=CPU)
    for step in range(3 * RING_DEPTH):
        n = 1 + step % 5
        ids = [100 * step + r for r in range(n)]
        tables = [[(step + r + j) % 50 for j in range(1 + (step + r) % 4)] for r in range(n)]
        inputs.stage(ids, [step] * n, [step * 16 + r for r in range(n)], [step + 1] * n, tables, [], [], bucket=8)
        assert inputs.input_ids[:n].tolist() == ids
        assert inputs.slot_mapping.tolist() == [step * 16 + r for r in range(n)] + [-1] * (8 - n)
        assert inputs.context_lens.tolist() == [step + 1] * n + [1] * (8 - n)
        assert [inputs.block_tables[r, :len(t)].tolist() for r, t in enumerate(tables)] == tables


def test_placeholders_are_filled_from_the_tokens_of_the_step_in_flight() -> None:
    inputs = DecodeInputs(max_batch=4, max_blocks_per_seq=2, device=CPU)
    in_flight = torch.tensor([501, 502, 503], dtype=torch.int64)
    inputs.stage([0, 0, 0], [5, 6, 7], [5, 6, 7], [6, 7, 8], [[0], [0], [0]], [0, 1, 2], [0, 1, 2], bucket=4)
    inputs.fill_placeholders(3, in_flight, in_order=True)
    assert inputs.input_ids[:3].tolist() == [501, 502, 503]
    # a sequence left the batch: rows 0 and 2 take the tokens of rows 2 and 0; row 1 is a known token
    inputs.stage([0, 77, 0], [5, 6, 7], [5, 6, 7], [6, 7, 8], [[0], [0], [0]], [0, 2], [2, 0], bucket=4)
    inputs.fill_placeholders(2, in_flight, in_order=False)
    assert inputs.input_ids[:3].tolist() == [503, 77, 501]


def test_a_step_that_does_not_fit_is_refused() -> None:
    inputs = DecodeInputs(max_batch=4, max_blocks_per_seq=2, device=CPU)
    with pytest.raises(ValueError, match="in a bucket of 2"):
        inputs.stage([1, 2, 3], [0, 0, 0], [0, 0, 0], [1, 1, 1], [[0], [0], [0]], [], [], bucket=2)
    with pytest.raises(ValueError, match="block table of 3 blocks"):
        inputs.stage([1], [0], [0], [1], [[0, 1, 2]], [], [], bucket=1)


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
