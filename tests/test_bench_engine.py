"""`edged bench engine`: the closed loop the serving benchmark puts on the daemon, run on the engine alone."""
from __future__ import annotations

from edged.bench.engine_loop import closed_loop, format_results
from helpers.tiny_engine import tiny_engine


def test_the_closed_loop_keeps_concurrency_requests_in_flight_until_all_are_done() -> None:
    engine = tiny_engine(num_blocks=128, max_num_seqs=4, max_batch_tokens=64)
    vocab = engine.vocab_size
    r = closed_loop(engine, vocab, concurrency=3, requests=7, prompt_tokens=5, max_tokens=6)
    assert (r.requests, r.tokens, len(r.ttft_ms)) == (7, 7 * 6, 7)  # every token of every request, one TTFT each
    assert not engine.has_work() and engine.blocks.num_used == 0
    # at most 3 in flight: 7 requests of 6 tokens need at least ceil(7 / 3) * 6 steps
    assert r.steps >= 3 * 6
    one = closed_loop(engine, vocab, concurrency=1, requests=2, prompt_tokens=5, max_tokens=6)
    assert one.steps >= 2 * 6 and one.tokens == 12
    table = format_results([one, r], "cpu", "tiny").splitlines()
    assert [line.split()[0] for line in table[2:]] == ["1", "3"]
