"""The engine's batching, paging and sampling, on a tiny random-weight model."""
from __future__ import annotations

import random


from helpers.tiny_engine import request, run_overlapped, run_to_completion, tiny_engine


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def test_batched_greedy_equals_each_request_alone() -> None:
    ps = prompts(12)
    together = run_to_completion(tiny_engine(), [request(f"r{i}", p) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        alone = run_to_completion(tiny_engine(), [request(f"r{i}", p)])
        assert together[f"r{i}"] == alone[f"r{i}"]
        assert len(alone[f"r{i}"]) == 12


def test_chunked_prefill_gives_the_same_tokens_as_one_chunk() -> None:
    p = prompts(1, seed=3)[0] * 4
    whole = run_to_completion(tiny_engine(max_batch_tokens=512), [request("a", p)])
    chunked = run_to_completion(tiny_engine(max_batch_tokens=5), [request("a", p)])
    assert whole == chunked


def test_preempted_requests_finish_with_the_output_they_would_have_had() -> None:
    ps = prompts(8, seed=5)
    reqs = [request(f"r{i}", p, max_tokens=20) for i, p in enumerate(ps)]
    roomy = run_to_completion(tiny_engine(num_blocks=128), reqs)
    engine = tiny_engine(num_blocks=24)  # far too few blocks for 8 sequences at once
    tight = run_to_completion(engine, [request(r.request_id, r.prompt_token_ids, max_tokens=20) for r in reqs])
    assert engine.counters.preemptions > 0
    assert tight == roomy


def test_seeded_sampling_is_reproducible_and_independent_of_batching() -> None:
    ps = prompts(4, seed=7)
    kw = dict(temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    batch = run_to_completion(tiny_engine(), [request(f"r{i}", p, **kw) for i, p in enumerate(ps)])
    alone = run_to_completion(tiny_engine(), [request("r2", ps[2], **kw)])
    assert batch["r2"] == alone["r2"]
    other_seed = run_to_completion(tiny_engine(), [request("r2", ps[2], **{**kw, "seed": 99})])
    assert other_seed["r2"] != alone["r2"]


def test_finished_and_cancelled_sequences_free_their_blocks() -> None:
    engine = tiny_engine()
    total = engine.blocks.num_blocks
    run_to_completion(engine, [request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=5)])
    assert engine.blocks.num_free == total
    engine._admit(request("b", list(range(20)), max_tokens=100))
    engine.step()
    engine.step()
    assert engine.blocks.num_used > 0
    engine.cancel("b")
    engine._drain_inbox(block=False)
    assert engine.blocks.num_free == total
    assert not engine.batcher.has_work()


def test_max_tokens_and_stop_token_ids_end_a_sequence() -> None:
    p = prompts(1, seed=11)[0]
    free_run = run_to_completion(tiny_engine(), [request("a", p, max_tokens=10)])["a"]
    stop_at = free_run[4]
    stopped = run_to_completion(tiny_engine(), [request("a", p, max_tokens=10, stop_token_ids=[stop_at])])["a"]
    assert stopped == free_run[:free_run.index(stop_at) + 1]


def test_a_request_larger_than_the_whole_kv_pool_fails_alone() -> None:
    engine = tiny_engine(num_blocks=4, block_size=4)
    engine._admit(request("big", list(range(40))))
    outs = engine.step()
    assert outs[0].finish_reason == "error"
    assert engine.blocks.num_free == 4


def test_a_shared_prefix_is_reused_and_the_output_is_unchanged() -> None:
    prefix = prompts(1, seed=13)[0] * 3  # whole blocks of 4 tokens
    first, second = prefix + [7, 8, 9], prefix + [10, 11]
    off = run_to_completion(tiny_engine(prefix_caching=False), [request("b", second)])
    engine = tiny_engine()
    run_to_completion(engine, [request("a", first)])
    before = engine.counters.prefill_tokens
    on = run_to_completion(engine, [request("b", second)])
    reused = (len(prefix) // 4) * 4
    assert engine.blocks.counters.prefix_tokens_reused == reused
    assert engine.counters.prefill_tokens - before == len(second) - reused
    assert on == off


def test_overlapped_steps_give_the_same_tokens_as_one_step_at_a_time() -> None:
    ps = prompts(12, seed=21)
    stop_at = run_to_completion(tiny_engine(), [request("probe", ps[0], max_tokens=12)])["probe"][5]
    reqs = [request(f"r{i}", p, max_tokens=12 + i) for i, p in enumerate(ps)]
    reqs.append(request("stopper", ps[0], max_tokens=12, stop_token_ids=[stop_at]))
    reqs.append(request("seeded", ps[1], temperature=0.8, top_k=40, seed=7))
    serial = run_to_completion(tiny_engine(max_batch_tokens=40), reqs)
    engine = tiny_engine(max_batch_tokens=40)
    overlapped = run_overlapped(engine, reqs)
    assert overlapped == serial
    assert overlapped["stopper"][-1] == stop_at and len(overlapped["stopper"]) == 6
    assert engine.blocks.num_free == engine.blocks.num_blocks  # wasted rows of finished sequences freed too


def test_overlapped_steps_survive_preemption_and_reuse_prefixes() -> None:
    ps = prompts(8, seed=5)
    reqs = [request(f"r{i}", p, max_tokens=20) for i, p in enumerate(ps)]
    roomy = run_to_completion(tiny_engine(num_blocks=128), reqs)
    tight = tiny_engine(num_blocks=24)
    assert run_overlapped(tight, reqs) == roomy
    assert tight.counters.preemptions > 0
    prefix = prompts(1, seed=13)[0] * 3
    engine = tiny_engine()
    run_overlapped(engine, [request("a", prefix + [1, 2, 3])])
    again = run_overlapped(engine, [request("b", prefix + [4, 5])])
    assert engine.blocks.counters.prefix_tokens_reused > 0
    assert again == run_to_completion(tiny_engine(prefix_caching=False), [request("b", prefix + [4, 5])])


def test_a_cancel_during_an_overlapped_step_frees_every_block() -> None:
    engine = tiny_engine()
    engine.overlap = True
    engine._admit(request("long", list(range(30)), max_tokens=200))
    for _ in range(5):
        engine.step_overlapped()
    assert engine.blocks.num_used > 0
    engine.cancel("long")
    engine._drain_inbox(block=False)
    engine.step_overlapped()  # reads back the step in flight; the cancelled sequence is skipped
    assert not engine.has_work()
    assert engine.blocks.num_free == engine.blocks.num_blocks


def arriving_mid_step(engine, arrival) -> None:
    """The engine's next CPU step sees `arrival` added between its first and second layer."""
    make_check, pending = engine._yield_check, [arrival]

    def check_after_arrival(plan):
        check = make_check(plan)

        def arrive_then_check() -> None:
            while pending:
                engine.add_request(pending.pop())
            check()

        return arrive_then_check

    engine._yield_check = check_after_arrival


def test_a_cpu_step_gives_way_to_a_more_important_arrival_and_every_output_is_unchanged() -> None:
    ps = prompts(5, seed=31)
    bronze = [request(f"b{i}", p * 3, max_tokens=8, tier="bronze") for i, p in enumerate(ps[:4])]
    gold = request("gold", ps[4], max_tokens=8, tier="gold")
    alone = {r.request_id: run_to_completion(tiny_engine(), [r])[r.request_id] for r in [*bronze, gold]}
    engine = tiny_engine()
    for r in bronze:
        engine._admit(r)
    arriving_mid_step(engine, gold)
    assert engine.step() == []  # the bronze step stopped between layers: no tokens, nothing computed
    assert engine.counters.yielded_steps == 1
    assert engine.batcher.running and not any(s.num_computed for s in engine.batcher.running)
    engine._drain_inbox(block=False)
    first = engine.step()  # gold's prompt, in a step of its own
    assert [(o.request_id, len(o.new_token_ids)) for o in first] == [("gold", 1)]
    tokens = {r.request_id: [] for r in [*bronze, gold]}
    tokens["gold"] += first[0].new_token_ids
    for _ in range(10_000):
        if not engine.has_work():
            break
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    assert tokens == alone
    assert engine.counters.yielded_steps == 1


def test_a_cpu_step_does_not_give_way_to_an_arrival_of_its_own_or_a_lower_tier() -> None:
    engine = tiny_engine()
    for i, p in enumerate(prompts(3, seed=33)):
        engine._admit(request(f"s{i}", p * 3, max_tokens=4, tier="silver"))
    arriving_mid_step(engine, request("b", [1, 2, 3], max_tokens=4, tier="bronze"))
    engine.step()
    arriving_mid_step(engine, request("s", [4, 5, 6], max_tokens=4, tier="silver"))
    engine.step()
    assert engine.counters.yielded_steps == 0
    assert all(s.num_computed > 0 for s in engine.batcher.running)
