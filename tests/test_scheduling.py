"""Schedulers over the real BlockManager and Sequence; model outputs are fixed token lists."""

from __future__ import annotations

import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.sequence import SamplingParams, Sequence, SequenceStatus
from shared.scheduling import DecodeScheduler, DecodeStep, PrefillBatch, PrefillScheduler
from shared.scheduling.waiting_queue import WaitingQueue

BS = 4
EOS = 0


def seq(
    rid: str,
    n: int | list[int],
    priority: int = 0,
    arrival: float = 0.0,
    max_tokens: int = 100,
    ignore_eos: bool = False,
    num_prompt_tokens: int | None = None,
) -> Sequence:
    """A sequence of ``n`` tokens (distinct per request, so no accidental prefix hits)."""
    base = 1000 * (1 + sum(map(ord, rid)))
    tokens = n if isinstance(n, list) else [base + i for i in range(n)]
    return Sequence(
        rid,
        tokens,
        SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
        priority=priority,
        num_prompt_tokens=num_prompt_tokens,
        arrival_time=arrival,
        block_size=BS,
    )


def plan(batch: PrefillBatch) -> list[tuple[str, int]]:
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]


# --- WaitingQueue -----------------------------------------------------------------------------


def test_waiting_queue_priority_then_fifo() -> None:
    q = WaitingQueue()
    for rid, prio in [("a", 0), ("b", 5), ("c", 0), ("d", 9), ("e", 5)]:
        q.push(seq(rid, 1, priority=prio))
    assert len(q) == 5 and "c" in q and "z" not in q
    assert q.max_priority() == 9
    assert [q.pop().request_id for _ in range(5)] == ["d", "b", "e", "a", "c"]
    assert len(q) == 0 and q.peek() is None and q.max_priority() is None


def test_waiting_queue_front_goes_ahead_of_its_class_only() -> None:
    q = WaitingQueue()
    q.push(seq("a", 1, priority=1))
    q.push(seq("hi", 1, priority=5))
    q.push(seq("b", 1, priority=1))
    q.push(seq("p1", 1, priority=1), front=True)
    q.push(seq("p2", 1, priority=1), front=True)  # the latest front push is first
    assert [q.pop().request_id for _ in range(5)] == ["hi", "p2", "p1", "a", "b"]


def test_waiting_queue_lazy_remove() -> None:
    q = WaitingQueue()
    a, b, c = seq("a", 1), seq("b", 1), seq("c", 1)
    for s in (a, b, c):
        q.push(s)
    assert q.remove("a") is a and q.remove("a") is None and q.remove("zz") is None
    assert len(q) == 2 and "a" not in q
    assert q.peek() is b
    q.remove("c")
    assert q.pop() is b and q.peek() is None and len(q) == 0


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


def test_chunked_prompt_continues_before_new_work() -> None:
    ps = prefill(budget=8)
    ps.add(seq("long", 20, priority=0))
    batch = ps.schedule()
    ps.update(batch, [None])
    ps.add(seq("urgent", 3, priority=9))
    assert plan(ps.schedule()) == [("long", 8)]  # it holds blocks: finish it first


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
    assert ps.fits_ever(seq("x", 16)) and not ps.fits_ever(seq("y", 17))


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


# --- DecodeScheduler --------------------------------------------------------------------------


def decode(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    budget: int = 64,
    max_model_len: int = 1000,
    prefix_caching: bool = True,
) -> DecodeScheduler:
    bm = BlockManager(num_blocks, BS, prefix_caching)
    return DecodeScheduler(bm, max_num_seqs, budget, (EOS,), max_model_len)


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


def test_finish_on_max_model_len() -> None:
    ds = decode(max_model_len=10)
    ds.add(handoff("a", 7))  # 8 tokens
    admit_loaded(ds)
    assert step(ds)[1] == []
    assert step(ds)[1] == [("a", "length")]


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
    ds = decode(num_blocks=2, prefix_caching=False)  # 8 tokens of cache
    assert not ds.add(handoff("full", 7))  # 8 tokens: could never take another step
    assert ds.add(handoff("a", 6))  # 7 tokens
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


def test_decode_refuses_a_sequence_that_can_never_fit() -> None:
    ds = decode(num_blocks=4, prefix_caching=False)  # 4 blocks of 4 tokens = 16 tokens at most
    assert not ds.add(handoff("huge", 16))
    assert ds.num_waiting == 0
    assert ds.add(handoff("fits", 10))


def test_waiting_queue_remove_then_push_goes_to_the_back() -> None:
    from shared.scheduling.waiting_queue import WaitingQueue

    q = WaitingQueue()
    a, b = handoff("a", 3), handoff("b", 3)
    q.push(a)
    q.remove("a")
    q.push(b)
    q.push(a)
    assert [q.pop().request_id, q.pop().request_id] == ["b", "a"]
