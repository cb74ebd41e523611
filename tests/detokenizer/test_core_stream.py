"""DetokenizerCore: ordering, deduplication, buffering and length of token streams."""

from __future__ import annotations

import random
from collections import Counter

from services.detokenizer.core import ORPHAN_EVENT_TTL_S
from shared.wire.messages import TokenReply
from tests.detokenizer.helpers import (
    MULTIBYTE,
    T0,
    Decode,
    Harness,
    ev,
    info,
    only_tokens,
)


def test_in_order_stream_one_reply_per_flush(
    h: Harness, ids: list[int], decode: Decode, eos: int
) -> None:
    h.step(T0, starts=[info("a", max_tokens=100)])
    assert h.replies == [] and h.core.num_active == 1
    text_ids, ids = ids, [*ids, eos]  # the engine's "stop" comes with its EOS token
    for i, t in enumerate(ids):
        finish = "stop" if i == len(ids) - 1 else None
        out = h.step(T0 + 1 + i, events=[ev("a", i, [t], finish)])
        toks = [r for _, r in out.replies if isinstance(r, TokenReply)]
        assert len(toks) <= 1 and all(r.index == i and r.token_ids == [t] for r in toks)
        assert all(q == "q-a" for q, _ in out.replies)
    done = h.done("a")
    assert done.finish_reason == "stop" and done.text == MULTIBYTE == decode(text_ids)
    assert done.token_ids == ids
    assert done.usage == {"prompt_tokens": 5, "completion_tokens": len(ids)}
    assert h.streamed_text("a") == MULTIBYTE
    assert all("\ufffd" not in r.text for r in h.tokens("a"))
    assert [r.index for r in h.tokens("a")] == list(range(len(ids)))
    assert h.aborts == [] and h.core.num_active == 0
    h.assert_one_terminal_each()


def test_several_events_in_one_batch_make_one_reply(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info("a", max_tokens=100)])
    h.step(T0 + 1, events=[ev("a", 0, ids[:2]), ev("a", 2, ids[2:3]), ev("a", 3, ids[3:5])])
    h.step(T0 + 2, events=[ev("a", 5, ids[5:6])])
    assert [(r.index, r.token_ids) for r in h.tokens("a")] == [(0, ids[:5]), (5, ids[5:6])]


def test_one_reply_per_request_per_flush_with_many_requests(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info(r, max_tokens=100) for r in "abc"])
    h.step(T0 + 1, events=[ev(r, 0, ids[:1]) for r in "abc"] + [ev("b", 1, ids[1:2])])
    out = h.step(T0 + 2, events=[ev("c", 1, ids[1:2])])
    by_rid = Counter(r.request_id for r in (x for _, x in h.replies))
    assert by_rid == {"a": 1, "b": 1, "c": 2}
    assert [(q, r.index) for q, r in only_tokens(out)] == [("q-c", 1)]
    assert h.tokens("b")[0].token_ids == ids[:2]


def test_out_of_order_events_applied_in_position_order(
    h: Harness, ids: list[int], decode: Decode, eos: int
) -> None:
    h.step(T0, starts=[info("a", max_tokens=100)])
    ids = [*ids, eos]  # the engine's "stop" comes with its EOS token
    events = [ev("a", i, ids[i : i + 3]) for i in range(0, len(ids), 3)]
    events[-1] = ev("a", events[-1].index, events[-1].token_ids, "stop")
    order = list(range(len(events)))
    random.Random(7).shuffle(order)
    assert order[0] != 0
    for k, i in enumerate(order):
        h.step(T0 + 1 + k, events=[events[i]])
    done = h.done("a")
    assert done.token_ids == ids and done.text == decode(ids)
    assert h.streamed_text("a") == done.text
    assert h.tokens("a")[0].index == 0
    h.assert_one_terminal_each()


def test_gap_waits_for_the_missing_event(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info("a", max_tokens=100)])
    h.step(T0 + 1, events=[ev("a", 0, ids[:2])])
    out = h.step(T0 + 2, events=[ev("a", 3, ids[3:4]), ev("a", 4, ids[4:5], "stop")])
    assert out.replies == []  # position 2 is missing
    h.step(T0 + 3, events=[ev("a", 2, ids[2:3])])
    assert h.done("a").token_ids == ids[:5]


def test_duplicate_and_overlapping_events_are_dropped(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info("a", max_tokens=100)])
    h.step(T0 + 1, events=[ev("a", 0, ids[:3])])
    h.step(T0 + 2, events=[ev("a", 0, ids[:3])])  # redelivered step
    h.step(T0 + 3, events=[ev("a", 1, ids[1:5])])  # overlaps 1..2, new 3..4
    h.step(T0 + 4, events=[ev("a", 2, ids[2:4]), ev("a", 0, ids[:1])])  # all stale
    h.step(T0 + 5, events=[ev("a", 0, ids[:6], "length")])  # a replay from the start
    done = h.done("a")
    assert done.token_ids == ids[:6]
    assert done.finish_reason == "length"
    assert [(r.index, r.token_ids) for r in h.tokens("a")] == [
        (0, ids[:3]),
        (3, ids[3:5]),
        (5, ids[5:6]),
    ]


def test_events_before_start_are_buffered_then_applied(h: Harness, ids: list[int]) -> None:
    out = h.step(T0 + 1, events=[ev("a", 1, ids[1:2]), ev("a", 0, ids[:1])])
    assert out.replies == [] and h.core.num_active == 0
    out = h.step(T0 + 2, starts=[info("a", max_tokens=100)])
    assert [(r.index, r.token_ids) for _, r in only_tokens(out)] == [(0, ids[:2])]
    h.step(T0 + 3, events=[ev("a", 2, ids[2:3], "stop")])
    assert h.done("a").token_ids == ids[:3]


def test_orphan_events_are_dropped_after_their_ttl(h: Harness, ids: list[int]) -> None:
    h.step(T0, events=[ev("a", 0, ids[:1])])
    h.step(T0 + ORPHAN_EVENT_TTL_S + 1)  # expire() drops them
    out = h.step(T0 + ORPHAN_EVENT_TTL_S + 2, starts=[info("a")])
    assert out.replies == [] and h.core.num_active == 1


def test_orphan_finish_event_finishes_at_start(h: Harness, ids: list[int]) -> None:
    h.step(T0, events=[ev("a", 0, ids[:2], "stop")])
    h.step(T0 + 1, starts=[info("a")])
    done = h.done("a")
    assert done.finish_reason == "stop"
    assert done.token_ids == ids[:2] and h.core.num_active == 0


def test_duplicate_start_is_ignored(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info("a", max_tokens=100)])
    h.step(T0 + 1, events=[ev("a", 0, ids[:2])])
    h.step(T0 + 2, starts=[info("a", max_tokens=100)])  # redelivered: progress kept
    h.step(T0 + 3, events=[ev("a", 2, ids[2:3], "stop")])
    assert h.done("a").token_ids == ids[:3]
    h.step(T0 + 4, starts=[info("a")])  # after finish: not a new request
    assert h.core.num_active == 0
    h.assert_one_terminal_each()


def test_max_tokens_reached_is_length(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info("a", max_tokens=3)])
    h.step(T0 + 1, events=[ev("a", 0, ids[:2])])
    assert h.core.num_active == 1
    h.step(T0 + 2, events=[ev("a", 2, ids[2:3])])  # no finish_reason: the limit decides
    done = h.done("a")
    assert done.finish_reason == "length"
    assert done.usage["completion_tokens"] == 3 and h.aborts == []


def test_an_event_never_takes_a_request_past_max_tokens(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info("a", max_tokens=3)])
    h.step(T0 + 1, events=[ev("a", 0, ids[:1])])
    h.step(T0 + 2, events=[ev("a", 1, ids[1:6])])
    done = h.done("a")
    assert done.finish_reason == "length"
    assert done.token_ids == ids[:3] and done.usage["completion_tokens"] == 3
    assert h.streamed_text("a") == done.text
    assert [r.token_ids for r in h.tokens("a")] == [ids[:1], ids[1:3]]


def test_finish_reason_comes_from_the_event(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info("a"), info("b")])
    h.step(T0 + 1, events=[ev("a", 0, ids[:1], "stop"), ev("b", 0, ids[:1], "length")])
    assert h.done("a").finish_reason == "stop"
    assert h.done("b").finish_reason == "length"


def test_empty_terminal_event(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info("a")])
    h.step(T0 + 1, events=[ev("a", 0, ids[:2])])
    h.step(T0 + 2, events=[ev("a", 2, [], "stop")])
    done = h.done("a")
    assert done.token_ids == ids[:2]
