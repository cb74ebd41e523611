"""Crash safety of the detokenizer: replaying its inputs into a fresh core, the ledger that
keeps them, and the client's deduplication of what a replay re-sends."""

from __future__ import annotations

from typing import Any

import pytest

from services.detokenizer.ledger import DeliveryLedger
from services.detokenizer.marks import stream_marks
from shared.client.dedup import StreamDeduplicator
from shared.wire.messages import TokenReply
from tests.detokenizer.helpers import MULTIBYTE, STORY, T0, Decode, Harness, ev, info


def _events(rid: str, ids: list[int]) -> list[Any]:
    return [ev(rid, i, [t], "length" if i == len(ids) - 1 else None) for i, t in enumerate(ids)]


def test_a_replay_into_a_fresh_core_re_emits_the_same_positions_and_offsets(
    decode: Decode, encode: Any
) -> None:
    """The first core streams part of a request and dies; a fresh core gets every input again
    (its inputs were never acked) in different batches. What the client keeps is the done
    reply exactly, and every re-sent reply agrees with what it already had."""
    ids = encode(MULTIBYTE + " " + STORY)
    start = info("a", max_tokens=len(ids), stop=["zzz"])
    events = _events("a", ids)
    first = Harness(decode)
    first.step(T0, starts=[start])
    cut = len(ids) // 2
    for i, e in enumerate(events[:cut]):
        first.step(T0 + i, events=[e])
    replay = Harness(decode)  # the replica that took over: everything from the start
    replay.step(T0 + 50, starts=[start], events=events[:3])
    replay.step(T0 + 51, events=events[3:])
    done = replay.done("a")
    assert done.token_ids == ids and done.text == decode(ids)

    client = StreamDeduplicator()
    got_ids: list[int] = []
    got_text = ""
    for r in first.tokens("a") + replay.tokens("a"):
        assert r.token_ids == done.token_ids[r.index : r.index + len(r.token_ids)]
        assert r.text == done.text[r.text_offset : r.text_offset + len(r.text)]
        fresh = client.accept(r)
        if fresh is not None:
            assert fresh.index == len(got_ids) and fresh.text_offset == len(got_text)
            got_ids += fresh.token_ids
            got_text += fresh.text
    assert got_ids == ids and got_text == done.text
    assert client.num_duplicates >= 1


@pytest.mark.parametrize("stop", [[], ["zzz"], ["END"]])
@pytest.mark.parametrize("cut_frac", [0.2, 0.5, 0.9])
def test_a_replay_resumes_after_the_mark_each_position_once(
    decode: Decode, encode: Any, stop: list[str], cut_frac: float
) -> None:
    """The first core streams part of a request (its marks committed with its replies) and
    dies; the replica reads the newest mark before the replayed inputs, cut into other
    batches. A client that simply appends every token reply — no dedup, no offsets — gets
    each position and character once, in order, and exactly the done reply."""
    ids = encode(MULTIBYTE + " " + STORY)
    start = info("a", max_tokens=len(ids), stop=stop)
    events = _events("a", ids)
    first = Harness(decode)
    marks = stream_marks(first.step(T0, starts=[start]))
    cut = int(len(events) * cut_frac)
    for i in range(0, cut, 3):
        marks += stream_marks(first.step(T0 + i, events=events[i : min(i + 3, cut)]))
    assert marks, "the first core streamed something"
    replay = Harness(decode)
    for mark in marks:  # all of them, as the broker hands the held ones over: newest wins
        replay.core.resume(mark, T0 + 50)
    replay.step(T0 + 50, starts=[start], events=events[:2])
    for i in range(2, len(events), 5):
        replay.step(T0 + 51 + i, events=events[i : i + 5])
    done = replay.done("a")
    stream = first.tokens("a") + replay.tokens("a")
    position, offset = 0, 0
    for r in stream:  # each reply starts where the previous one ended
        assert (r.index, r.text_offset) == (position, offset), (r, position, offset)
        position, offset = position + len(r.token_ids), offset + len(r.text)
    assert [t for r in stream for t in r.token_ids] == done.token_ids
    assert "".join(r.text for r in stream) == done.text


def test_dedup_cuts_a_partly_new_reply_and_passes_a_server_without_offsets() -> None:
    d = StreamDeduplicator()
    assert d.accept(TokenReply("r", "ab", [1, 2], 0, 0)) is not None
    cut = d.accept(TokenReply("r", "abcd", [1, 2, 3, 4], 0, 0))
    assert cut == TokenReply("r", "cd", [3, 4], 2, 2)
    assert d.accept(TokenReply("r", "cd", [3, 4], 2, 2)) is None  # all seen
    assert d.accept(TokenReply("r", "", [], 4, 4)) is not None  # empty, nothing skipped
    old = StreamDeduplicator()
    reply = TokenReply("r", "x", [1], 0)  # no text_offset: an older server never replays
    assert old.accept(reply) is reply and old.accept(reply) is reply


class _Delivery:
    pass


def test_the_ledger_acks_a_message_once_every_request_in_it_is_answered() -> None:
    ledger = DeliveryLedger()
    a, b, c = _Delivery(), _Delivery(), _Delivery()
    assert ledger.hold(a, ["r1", "r2"]) == []  # type: ignore[arg-type]
    assert ledger.hold(b, ["r2"]) == []  # type: ignore[arg-type]
    assert ledger.hold(c, []) == [c]  # type: ignore[arg-type]  # nothing unanswered: ack now
    assert ledger.release("r1") == [] and len(ledger) == 2
    assert ledger.release("r2") == [a, b] and len(ledger) == 0
    assert ledger.release("r2") == []
    ledger.hold(a, ["r3"])  # type: ignore[arg-type]
    assert ledger.clear() == 1 and ledger.release("r3") == []


def test_a_newer_mark_frees_the_older_one_and_an_answer_frees_the_newest() -> None:
    ledger = DeliveryLedger()
    start, m1, m2, m3 = _Delivery(), _Delivery(), _Delivery(), _Delivery()
    ledger.hold(start, ["a"])  # type: ignore[arg-type]
    assert ledger.hold(m1, [], marks=["a", "b"]) == []  # type: ignore[arg-type]
    assert ledger.hold(m2, [], marks=["a"]) == []  # type: ignore[arg-type]  # m1 still has b
    assert ledger.hold(m3, [], marks=["b"]) == [m1]  # type: ignore[arg-type]  # m1 superseded
    assert ledger.release("a") == [start, m2]
    assert ledger.release("b") == [m3] and len(ledger) == 0
