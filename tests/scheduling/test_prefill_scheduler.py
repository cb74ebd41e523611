"""PrefillScheduler over the real BlockManager: budgets, chunking, priority, prefix hits."""

from __future__ import annotations

import pytest

from shared.runtime.block_manager import BlockManager
from shared.runtime.sequence import SequenceStatus
from shared.scheduling import PrefillScheduler
from tests.scheduling.helpers import BS, plan, seq

# --- PrefillScheduler -------------------------------------------------------------------------


def prefill(num_blocks: int = 64, budget: int = 16, max_num_seqs: int = 8) -> PrefillScheduler:
    return PrefillScheduler(BlockManager(num_blocks, BS), budget, max_num_seqs)


def run_prefill(ps: PrefillScheduler, max_steps: int = 100) -> list[list[tuple[str, int]]]:
    """Schedule and complete until idle; every completed prompt samples token 7."""
    steps: list[list[tuple[str, int]]] = []
    for _ in range(max_steps):
        if not ps.has_work():
            return steps
        batch = ps.schedule()
        assert batch.num_tokens <= ps.max_num_batched_tokens and len(batch) <= ps.max_num_seqs
        steps.append(plan(batch))
        sampled = [
            7 if s.num_computed_tokens + n == s.num_tokens else None
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        ]
        for s in ps.update(batch, sampled):
            ps.free(s)
    raise AssertionError("prefill did not finish")


def test_short_prompts_batch_within_the_budget() -> None:
    ps = prefill(budget=16)
    for rid, n in [("a", 5), ("b", 6), ("c", 4), ("d", 3)]:
        ps.add(seq(rid, n))
    batch = ps.schedule()
    # a + b + c = 15; d gets the last token of the budget (chunked)
    assert plan(batch) == [("a", 5), ("b", 6), ("c", 4), ("d", 1)]
    assert batch.num_tokens == 16 and len(batch) == 4
    done = ps.update(batch, [1, 2, 3, None])
    assert [s.request_id for s in done] == ["a", "b", "c"]
    assert [s.token_ids[-1] for s in done] == [1, 2, 3]
    assert all(s.num_computed_tokens == s.num_tokens - 1 for s in done)
    assert ps.num_running == 1 and "d" in ps and "a" not in ps


def test_long_prompt_is_chunked_and_completed() -> None:
    ps = prefill(budget=8)
    s = seq("long", 21)
    ps.add(s)
    chunks = []
    while True:
        batch = ps.schedule()
        chunks.append(plan(batch))
        done = ps.update(batch, [5 if s.num_computed_tokens + 8 >= 21 else None])
        if done:
            break
    assert chunks == [[("long", 8)], [("long", 8)], [("long", 5)]]
    assert done == [s] and s.num_computed_tokens == 21 and s.token_ids[-1] == 5
    assert s.num_tokens == 22 and s.num_output_tokens == 1
    assert len(s.block_table) == 6  # blocks for the 21 prompt tokens, held until free()
    assert ps.num_running == 0 and not ps.has_work()
    ps.free(s)
    assert ps.block_manager.num_free_blocks == 64 and s.status is SequenceStatus.FINISHED


def test_chunked_prompt_keeps_half_the_budget_beside_new_work() -> None:
    ps = prefill(budget=8)
    ps.add(seq("long", 20, priority=0))
    batch = ps.schedule()
    ps.update(batch, [None])
    ps.add(seq("urgent", 3, priority=9))
    ps.add(seq("next", 3, priority=9))
    # urgent fits whole beside the chunk's half; next would leave the chunk less than half
    assert plan(ps.schedule()) == [("long", 5), ("urgent", 3)]


def test_whole_prompts_overtake_a_prompt_that_must_be_chunked() -> None:
    """A long prompt ahead in the queue does not hold short ones behind it for its whole
    prefill: they pass it for up to half the budget, and keep their own order."""
    ps = prefill(budget=16)
    ps.add(seq("long", 40))
    ps.add(seq("long2", 30))
    for rid in ("s1", "s2", "s3"):
        ps.add(seq(rid, 3))
    batch = ps.schedule()
    assert plan(batch) == [("s1", 3), ("s2", 3), ("long", 10)]  # s3 would make the passing > 8
    for s in ps.update(batch, [7, 7, None]):
        ps.free(s)
    batch = ps.schedule()
    assert plan(batch) == [("long", 13), ("s3", 3)]  # s3 passes long2; long keeps more than half
    ps.update(batch, [None, 7])
    batch = ps.schedule()
    assert plan(batch) == [("long", 16)]
    ps.update(batch, [None])
    assert plan(ps.schedule()) == [("long", 1), ("long2", 15)]  # long2 kept its place


def test_a_passed_over_prompt_is_not_starved_by_a_stream_of_short_ones() -> None:
    ps = prefill(budget=16, max_num_seqs=64)
    ps.add(seq("long", 40))
    for step in range(20):
        for i in range(6):
            ps.add(seq(f"short-{step}-{i}", 3))
        batch = ps.schedule()
        sampled = [7 if s.num_computed_tokens + n == s.num_tokens else None
                   for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]  # fmt: skip
        done = ps.update(batch, sampled)
        for s in done:
            ps.free(s)
        if any(s.request_id == "long" for s in done):
            break
    assert step + 1 <= 5  # 40 tokens at >= 8 a step: half the budget, whatever keeps arriving


def test_chunked_prompt_and_new_prompts_share_a_budget() -> None:
    ps = prefill(budget=8)
    ps.add(seq("long", 10))
    ps.update(ps.schedule(), [None])
    ps.add(seq("short", 3))
    assert plan(ps.schedule()) == [("long", 2), ("short", 3)]


def test_every_prompt_completes_within_the_budget() -> None:
    ps = prefill(budget=10, max_num_seqs=3)
    sizes = {"a": 3, "b": 17, "c": 1, "d": 10, "e": 9, "f": 2}
    for rid, n in sizes.items():
        ps.add(seq(rid, n))
    steps = run_prefill(ps)
    totals: dict[str, int] = {}
    for step in steps:
        assert sum(n for _, n in step) <= 10 and len(step) <= 3
        for rid, n in step:
            totals[rid] = totals.get(rid, 0) + n
    assert totals == sizes
    assert ps.block_manager.num_used_blocks == 0


def test_prefill_priority_order() -> None:
    ps = prefill(budget=4, max_num_seqs=1)
    for rid, prio in [("low1", 0), ("mid", 3), ("high", 7), ("low2", 0), ("mid2", 3)]:
        ps.add(seq(rid, 4, priority=prio))
    order = [step[0][0] for step in run_prefill(ps)]
    assert order == ["high", "mid", "mid2", "low1", "low2"]


def test_prefill_max_num_seqs() -> None:
    ps = prefill(budget=100, max_num_seqs=2)
    for rid in "abcde":
        ps.add(seq(rid, 2))
    assert [rid for rid, _ in plan(ps.schedule())] == ["a", "b"]
    assert ps.num_waiting == 3


def test_prefill_max_num_seqs_counts_chunked_sequences() -> None:
    ps = prefill(budget=12, max_num_seqs=2)
    ps.add(seq("a", 10))
    ps.add(seq("b", 10))
    batch = ps.schedule()
    assert plan(batch) == [("a", 10), ("b", 2)]
    ps.update(batch, [7, None])
    for rid in "cde":
        ps.add(seq(rid, 1))
    assert plan(ps.schedule()) == [("b", 8), ("c", 1)]
    assert ps.num_waiting == 2


def test_prefill_stops_at_the_first_prompt_that_does_not_fit() -> None:
    ps = prefill(num_blocks=4, budget=100)
    ps.add(seq("a", 12))  # 3 blocks
    ps.add(seq("big", 8))  # 2 blocks: does not fit next to a
    ps.add(seq("small", 2))  # would fit, but must not overtake big
    assert plan(ps.schedule()) == [("a", 12)]
    assert ps.num_waiting == 2


def test_prefix_cache_hit_reduces_computed_tokens() -> None:
    ps = prefill(budget=64)
    shared = list(range(1, 13))  # 3 full blocks
    a = seq("a", shared + [50, 51])
    ps.add(a)
    (done,) = ps.update(ps.schedule(), [9])
    a_blocks = list(a.block_table)
    ps.free(done)  # KV handed off; hashed blocks stay reusable
    b = seq("b", shared + [60, 61, 62])
    ps.add(b)
    batch = ps.schedule()
    assert plan(batch) == [("b", 3)]
    assert b.num_cached_tokens == b.num_computed_tokens == 12
    assert b.block_table[:3] == a_blocks[:3]
    assert ps.block_manager.num_prefix_hit_tokens == 12


def test_prefix_hit_never_covers_the_last_token() -> None:
    ps = prefill(budget=64)
    shared = list(range(1, 9))  # exactly 2 blocks
    ps.add(seq("a", shared))
    ps.free(ps.update(ps.schedule(), [9])[0])
    b = seq("b", list(shared))
    ps.add(b)
    assert plan(ps.schedule()) == [("b", 4)]  # last block recomputed: the forward needs a token


def test_prefill_abort_waiting_and_running() -> None:
    ps = prefill(num_blocks=16, budget=4)
    ps.add(seq("run", 10))
    ps.add(seq("wait", 10))
    ps.update(ps.schedule(), [None])
    assert ps.block_manager.num_used_blocks == 3
    w = ps.abort("wait")
    assert w is not None and w.status is SequenceStatus.FINISHED and w.block_table == []
    r = ps.abort("run")
    assert r is not None and r.status is SequenceStatus.FINISHED and r.block_table == []
    assert ps.block_manager.num_free_blocks == 16
    assert ps.abort("run") is None and ps.abort("nope") is None
    assert not ps.has_work() and len(ps.schedule()) == 0


def test_prefill_update_requires_a_token_for_a_completed_prompt() -> None:
    ps = prefill()
    ps.add(seq("a", 3))
    with pytest.raises(AssertionError):
        ps.update(ps.schedule(), [None])
