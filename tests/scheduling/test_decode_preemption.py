"""Priority preemption with a full batch, its churn bound, and admission on projected resident
KV (issue 28; shared/scheduling/decode_scheduler.py). Recompute mode (no ``swap_out``): a victim
goes back to the waiting queue, which makes ping-pong observable within one scheduler."""

from __future__ import annotations

from shared.limits import StopRule
from shared.runtime.block_manager import BlockManager
from shared.scheduling import DecodeScheduler
from tests.scheduling.helpers import BS, EOS
from tests.scheduling.test_decode_scheduler import admit_loaded, handoff, step


def decode(
    num_blocks: int = 64, max_num_seqs: int = 2, gap: float = 3, min_steps: int = 0,
    lookahead: int = 0,
) -> DecodeScheduler:  # fmt: skip
    bm = BlockManager(num_blocks, BS, False)
    return DecodeScheduler(
        bm, max_num_seqs, 64, StopRule(frozenset({EOS}), 4096),
        priority_gap=gap, min_steps=min_steps, lookahead_tokens=lookahead,
    )  # fmt: skip


def test_a_request_that_outranks_by_the_gap_takes_the_lowest_slot() -> None:
    ds = decode()
    ds.add(handoff("a", 5, priority=1, arrival=1.0))
    ds.add(handoff("b", 5, priority=0, arrival=2.0))
    admit_loaded(ds)
    ds.add(handoff("urgent", 5, priority=9))
    assert [s.request_id for s in admit_loaded(ds)] == ["urgent"]
    assert ds.running.keys() == {"a", "urgent"}  # b: the lowest effective priority
    assert ds.preemptions_by_cause == {"priority_slot": 1}


def test_below_the_gap_the_full_batch_is_kept() -> None:
    ds = decode(gap=3)
    ds.add(handoff("a", 5, priority=2))
    ds.add(handoff("b", 5, priority=2))
    admit_loaded(ds)
    ds.add(handoff("w", 5, priority=4))  # outranks by 2 < 3
    assert ds.admit() == [] and ds.preemptions_by_cause == {}
    assert decode(gap=0).priority_gap == 0  # 0: off (only blocks preempt)


def test_a_sequence_admitted_within_min_steps_is_not_a_victim() -> None:
    ds = decode(max_num_seqs=1, min_steps=3)
    ds.add(handoff("low", 5, priority=0, max_tokens=50))
    admit_loaded(ds)
    ds.add(handoff("urgent", 5, priority=9))
    for _ in range(2):
        assert ds.admit() == []  # admitted 0, then 1 step ago... guarded
        step(ds)
    step(ds)
    assert [s.request_id for s in ds.admit()] == ["urgent"]  # 3 steps: fair game


def test_equal_priorities_never_trade_places() -> None:
    """Ping-pong: a victim re-queued at the same priority never preempts its preemptor back."""
    ds = decode(max_num_seqs=1)
    ds.add(handoff("low", 5, priority=0, max_tokens=50))
    admit_loaded(ds)
    ds.add(handoff("urgent", 5, priority=9, max_tokens=50))
    admit_loaded(ds)
    for _ in range(10):
        step(ds)
        admit_loaded(ds)
    assert ds.preemptions_by_cause == {"priority_slot": 1}
    assert list(ds.running) == ["urgent"]


def test_admission_on_projected_kv_keeps_room_for_the_batch_to_grow() -> None:
    """Every sequence fills its block exactly (4 tokens, BS 4): after one step, each needs a new
    block at once. Admitted on their current size, four fill the cache and the second step
    preempts (the lockstep); on projected KV two run and nothing is preempted."""
    for lookahead, running in ((0, 4), (1, 2)):
        ds = decode(num_blocks=5, max_num_seqs=8, gap=0, lookahead=lookahead)
        for rid in "abcd":
            ds.add(handoff(rid, 3, max_tokens=20))
        assert len(admit_loaded(ds)) == running
        for _ in range(2):
            step(ds)
            admit_loaded(ds)
        preempted = ds.preemptions_by_cause.get("kv_full", 0)
        assert (preempted > 0) == (lookahead == 0), (lookahead, preempted)


def test_projection_stops_at_max_tokens() -> None:
    ds = decode(num_blocks=3, max_num_seqs=8, gap=0, lookahead=16)
    for rid in "abc":
        ds.add(handoff(rid, 3, max_tokens=1))  # done at 4 tokens: never needs another block
    assert len(admit_loaded(ds)) == 3
