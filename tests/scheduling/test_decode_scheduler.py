"""DecodeScheduler over the real BlockManager: admission, stops, preemption, recompute."""

from __future__ import annotations

import pytest

from shared.config import BatonConfig
from shared.limits import Limits, StopRule
from shared.runtime.block_manager import BlockManager
from shared.runtime.sequence import Sequence, SequenceStatus
from shared.scheduling import DecodeScheduler, DecodeStep
from tests.scheduling.helpers import BS, EOS, plan, seq

# --- DecodeScheduler --------------------------------------------------------------------------


def decode(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    budget: int = 64,
    prefix_caching: bool = True,
    max_model_len: int = 4096,
) -> DecodeScheduler:
    bm = BlockManager(num_blocks, BS, prefix_caching)
    return DecodeScheduler(bm, max_num_seqs, budget, StopRule(frozenset({EOS}), max_model_len))


def handoff(rid: str, num_prompt: int, **kw: object) -> Sequence:
    """A prefilled sequence as decode receives it: the prompt plus the first sampled token."""
    s = seq(rid, num_prompt + 1, num_prompt_tokens=num_prompt, **kw)  # type: ignore[arg-type]
    return s


def admit_loaded(ds: DecodeScheduler) -> list[Sequence]:
    """Admit, then mark the KV as loaded from the transport (all but the last token)."""
    admitted = ds.admit()
    for s in admitted:
        s.num_computed_tokens = s.num_tokens - 1
    return admitted


def step(ds: DecodeScheduler, token: int = 5) -> tuple[DecodeStep, list[tuple[str, str]]]:
    st = ds.schedule()
    finished = ds.update(st, [token] * len(st.decode))
    return st, [(f.seq.request_id, f.reason) for f in finished]


def ids_of(seqs: list[Sequence]) -> list[str]:
    return [s.request_id for s in seqs]


def test_admit_while_blocks_allow() -> None:
    ds = decode(num_blocks=8)
    for rid in "abc":
        ds.add(handoff(rid, 11))  # 12 tokens: 3 blocks
    assert ids_of(admit_loaded(ds)) == ["a", "b"]
    assert ds.num_running == 2 and ds.num_waiting == 1 and "c" in ds
    assert ds.block_manager.num_free_blocks == 2
    assert ds.running["a"].status is SequenceStatus.RUNNING
    assert ds.admit() == []  # equal priority never preempts


def test_admit_respects_max_num_seqs() -> None:
    ds = decode(max_num_seqs=2)
    for rid in "abc":
        ds.add(handoff(rid, 3))
    assert ids_of(ds.admit()) == ["a", "b"]
    assert ds.admit() == []


def test_admit_in_priority_order() -> None:
    ds = decode(max_num_seqs=1)
    ds.add(handoff("low", 3, priority=1))
    ds.add(handoff("high", 3, priority=8))
    assert ids_of(ds.admit()) == ["high"]


def test_decode_step_appends_slots_across_block_boundaries() -> None:
    ds = decode()
    ds.add(handoff("a", 6))  # 7 tokens: 2 blocks
    (a,) = admit_loaded(ds)
    lengths = []
    for _ in range(7):
        st = ds.schedule()
        assert st.decode == [a] and not st.recompute.seqs
        # the block table covers every token, growing exactly on a boundary
        lengths.append((a.num_tokens, len(a.block_table)))
        assert ds.update(st, [5]) == []
        assert a.num_computed_tokens == a.num_tokens - 1
    assert lengths == [(7, 2), (8, 2), (9, 3), (10, 3), (11, 3), (12, 3), (13, 4)]
    assert a.output_token_ids == [a.token_ids[6]] + [5] * 7


def test_finish_on_eos() -> None:
    ds = decode()
    ds.add(handoff("a", 3))
    admit_loaded(ds)
    st, finished = step(ds, token=EOS)
    assert finished == [("a", "stop")]
    a = st.decode[0]
    assert a.status is SequenceStatus.FINISHED and a.block_table == []
    assert ds.num_running == 0 and ds.block_manager.num_used_blocks == 0 and not ds.has_work()


def test_ignore_eos_keeps_going_until_max_tokens() -> None:
    ds = decode()
    ds.add(handoff("a", 3, ignore_eos=True, max_tokens=4))  # 1 output token already
    admit_loaded(ds)
    reasons = [step(ds, token=EOS)[1] for _ in range(3)]
    assert reasons == [[], [], [("a", "length")]]


def test_finish_on_max_tokens() -> None:
    ds = decode()
    ds.add(handoff("a", 3, max_tokens=3))
    (a,) = admit_loaded(ds)
    assert step(ds)[1] == []
    assert step(ds)[1] == [("a", "length")]
    assert a.num_output_tokens == 3


def test_finish_at_max_model_len_whatever_max_tokens_asks() -> None:
    """max_tokens is trusted (the tokenizer clamped it to its own limits), but a handoff may come
    from a worker with a larger cache: the stop rule still ends the sequence at this engine's
    max_model_len."""
    limits = Limits.build(BatonConfig(), 4096, num_cache_tokens=10)
    ds = decode(max_model_len=limits.max_model_len)
    a = handoff("a", 7)  # 8 tokens, asking for 100
    ds.add(a)
    admit_loaded(ds)
    assert step(ds)[1] == []
    assert step(ds)[1] == [("a", "length")]
    assert a.num_tokens == limits.max_model_len == 10


def test_several_sequences_decode_together() -> None:
    ds = decode()
    for rid, mt in [("a", 2), ("b", 4), ("c", 3)]:
        ds.add(handoff(rid, 5, max_tokens=mt))
    admit_loaded(ds)
    done = []
    for _ in range(3):
        st, finished = step(ds)
        done.append(finished)
    assert done == [[("a", "length")], [("c", "length")], [("b", "length")]]
    assert ds.block_manager.num_used_blocks == 0


def test_preemption_when_blocks_run_out() -> None:
    ds = decode(num_blocks=4, prefix_caching=False)
    ds.add(handoff("first", 7, arrival=1.0))  # 8 tokens: 2 blocks
    ds.add(handoff("late", 7, arrival=2.0))
    first, late = admit_loaded(ds)
    assert ds.block_manager.num_free_blocks == 0
    st, _ = step(ds)  # 8 tokens each still fit 2 blocks
    assert ids_of(st.decode) == ["first", "late"]
    st, _ = step(ds)  # first needs a 3rd block: the latest arrival is the victim
    assert ids_of(st.decode) == ["first"]
    assert ds.num_preemptions == 1
    assert late.status is SequenceStatus.PREEMPTED and late.block_table == []
    assert late.num_computed_tokens == 0 and late.num_cached_tokens == 0
    assert ds.waiting.peek() is late and "late" in ds and "late" not in ds.running
    assert len(first.block_table) == 3


def test_preemption_victim_is_lowest_priority_first() -> None:
    ds = decode(num_blocks=6, prefix_caching=False)
    ds.add(handoff("vip_late", 7, priority=5, arrival=3.0))
    ds.add(handoff("low_early", 7, priority=1, arrival=1.0))
    ds.add(handoff("mid", 7, priority=3, arrival=2.0))
    admit_loaded(ds)
    step(ds)
    st, _ = step(ds)  # everyone needs a 3rd block; there are none
    assert ids_of(st.decode) == ["vip_late", "mid"]
    assert ds.running.keys() == {"vip_late", "mid"}
    assert ds.waiting.peek().request_id == "low_early"  # type: ignore[union-attr]


def test_preempted_sequence_is_requeued_in_front_of_its_class() -> None:
    ds = decode(num_blocks=4, prefix_caching=False)
    ds.add(handoff("a", 7, arrival=1.0))
    ds.add(handoff("b", 7, arrival=2.0))
    admit_loaded(ds)
    ds.add(handoff("newer", 1, arrival=3.0))  # same priority, queued before b is preempted
    step(ds)
    step(ds)
    assert [ds.waiting.pop().request_id for _ in range(2)] == ["b", "newer"]


def test_lone_sequence_finishes_at_cache_capacity_instead_of_preempting_itself() -> None:
    limits = Limits.build(BatonConfig(), 4096, num_cache_tokens=8)
    ds = decode(num_blocks=2, prefix_caching=False, max_model_len=limits.max_model_len)
    assert not limits.fits(8)  # 8 tokens could never take another step: the engine refuses
    a = handoff("a", 6)  # 7 tokens, asking for 100: the stop rule ends it at 8
    assert limits.fits(a.num_tokens)
    ds.add(a)
    (a,) = admit_loaded(ds)
    st, finished = step(ds)
    assert st.decode == [a] and finished == [("a", "length")]
    assert a.status is SequenceStatus.FINISHED and ds.block_manager.num_free_blocks == 2


def test_readmitted_victim_recomputes_in_chunks_then_decodes() -> None:
    ds = decode(num_blocks=6, budget=5, prefix_caching=False)
    ds.add(handoff("a", 7, arrival=1.0, max_tokens=3))
    ds.add(handoff("b", 7, arrival=2.0))
    ds.add(handoff("c", 7, arrival=3.0, max_tokens=3))
    a, b, c = admit_loaded(ds)
    step(ds)
    st, _ = step(ds)  # three need a 3rd block: c preempted, then a finishes
    assert ids_of(st.decode) == ["a", "b"] and c.status is SequenceStatus.PREEMPTED
    assert a.status is SequenceStatus.FINISHED
    assert c.num_tokens == 9  # prompt + 2 outputs survive preemption
    assert ids_of(ds.admit()) == ["c"]
    assert c.num_computed_tokens == 0 and len(c.block_table) == 3
    # c recomputes positions 0..7 (8 tokens) at most 5 per step, sharing the budget
    recomputed = []
    while c.num_computed_tokens < c.num_tokens - 1:
        st = ds.schedule()
        assert c not in st.decode and st.recompute.num_tokens <= 5
        assert st.decode == [b]
        recomputed.append(dict(plan(st.recompute)))
        ds.update(st, [5])
    assert recomputed == [{"c": 5}, {"c": 3}]
    n = c.num_tokens
    st, finished = step(ds)
    assert ids_of(st.decode) == ["b", "c"] and c.num_tokens == n + 1
    assert finished == [("c", "length")]  # max_tokens 3: the 3rd output token


def test_readmission_with_prefix_caching_reuses_published_blocks() -> None:
    ds = decode(num_blocks=4, budget=64, prefix_caching=True)
    ds.add(handoff("a", 6, arrival=1.0, max_tokens=4))
    ds.add(handoff("b", 6, arrival=2.0))
    a, b = admit_loaded(ds)
    step(ds)
    step(ds)
    st, finished = step(ds)  # a needs a 3rd block: b preempted, then a finishes
    assert st.decode == [a] and finished == [("a", "length")]
    assert b.status is SequenceStatus.PREEMPTED  # its published blocks stay cached-free
    (b2,) = ds.admit()
    assert b2 is b and 0 < b.num_computed_tokens < b.num_tokens - 1
    assert b.num_computed_tokens % BS == 0
    st = ds.schedule()
    assert st.recompute.seqs == [b]
    assert st.recompute.num_new_tokens == [b.num_tokens - 1 - b.num_computed_tokens]


def test_higher_priority_waiting_preempts_lower_running() -> None:
    ds = decode(num_blocks=4, prefix_caching=False)
    ds.add(handoff("low", 6, priority=1))
    ds.add(handoff("low2", 6, priority=2))
    admit_loaded(ds)
    ds.add(handoff("high", 6, priority=7))
    assert ids_of(admit_loaded(ds)) == ["high"]
    assert ds.running.keys() == {"low2", "high"}  # the lowest priority was the victim
    assert ds.num_preemptions == 1 and ds.waiting.peek().request_id == "low"  # type: ignore[union-attr]


@pytest.mark.parametrize("prio", [0, 2])
def test_equal_or_lower_priority_waiting_never_preempts(prio: int) -> None:
    ds = decode(num_blocks=4, prefix_caching=False)
    ds.add(handoff("a", 6, priority=2))
    ds.add(handoff("b", 6, priority=2))
    admit_loaded(ds)
    ds.add(handoff("w", 6, priority=prio))
    assert ds.admit() == [] and ds.num_preemptions == 0 and ds.num_running == 2


def test_decode_abort_waiting_and_running() -> None:
    ds = decode(num_blocks=4, max_num_seqs=1)
    ds.add(handoff("run", 6))
    ds.add(handoff("wait", 2))
    admit_loaded(ds)
    assert ds.block_manager.num_used_blocks == 2
    w = ds.abort("wait")
    assert w is not None and w.status is SequenceStatus.FINISHED and "wait" not in ds
    r = ds.abort("run")
    assert r is not None and r.status is SequenceStatus.FINISHED and r.block_table == []
    assert ds.block_manager.num_free_blocks == 4 and not ds.has_work()
    assert ds.abort("run") is None and ds.abort("nope") is None
    assert not ds.schedule()


def test_update_counts_decode_and_recompute() -> None:
    ds = decode(budget=3)
    ds.add(handoff("ready", 4))
    ds.add(handoff("cold", 8))  # no KV: recompute
    ready, cold = ds.admit()
    ready.num_computed_tokens = ready.num_tokens - 1
    st = ds.schedule()
    assert st.decode == [ready] and st.recompute.seqs == [cold]
    assert st.recompute.num_new_tokens == [3]
    assert ds.update(st, [42]) == []
    assert ready.token_ids[-1] == 42 and ready.num_computed_tokens == ready.num_tokens - 1
    assert cold.num_computed_tokens == 3 and cold.num_tokens == 9
    st = ds.schedule()
    assert st.recompute.num_new_tokens == [3] and st.decode == [ready]


def test_no_preemption_when_it_cannot_make_room() -> None:
    ds = decode(num_blocks=6, prefix_caching=False)
    ds.add(handoff("low", 6, priority=0))  # 2 blocks
    ds.add(handoff("high", 10, priority=5))  # 3 blocks
    admit_loaded(ds)
    ds.add(handoff("mid", 18, priority=3))  # 5 blocks: only preempting "high" would make room
    assert ds.admit() == []
    assert ds.num_preemptions == 0 and ds.running.keys() == {"low", "high"}


def test_recompute_budget_is_shared_in_running_order() -> None:
    ds = decode(budget=5)
    ds.add(handoff("x", 7))
    ds.add(handoff("y", 7))
    x, y = ds.admit()  # no KV loaded: both recompute 7 positions
    plans = []
    for _ in range(4):
        st = ds.schedule()
        recompute = dict(plan(st.recompute))
        plans.append((recompute, ids_of(st.decode)))
        ds.update(st, [5] * len(st.decode))
    assert plans == [
        ({"x": 5}, []),
        ({"x": 2, "y": 3}, []),
        ({"y": 4}, ["x"]),  # x is ready: it decodes while y finishes recomputing
        ({}, ["x", "y"]),
    ]
