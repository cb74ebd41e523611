"""Crash safety of the detokenizer: replaying its inputs into a fresh core, the ledger that
keeps them, and the client's deduplication of what a replay re-sends."""

from __future__ import annotations

from typing import Any

from services.detokenizer.ledger import DeliveryLedger
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
    assert ledger.hold(a, ["r1", "r2"])  # type: ignore[arg-type]
    assert ledger.hold(b, ["r2"])  # type: ignore[arg-type]
    assert not ledger.hold(c, [])  # type: ignore[arg-type]  # nothing unanswered: ack now
    assert ledger.release("r1") == [] and len(ledger) == 2
    assert ledger.release("r2") == [a, b] and len(ledger) == 0
    assert ledger.release("r2") == []
    ledger.hold(a, ["r3"])  # type: ignore[arg-type]
    assert ledger.clear() == 1 and ledger.release("r3") == []


def test_fail_answers_one_request_and_reset_forgets_the_unanswered(
    h: Harness, ids: list[int]
) -> None:
    h.step(T0, starts=[info("a"), info("b")])
    out = h.step(T0 + 1, events=[ev("c", 0, ids[:1])])  # an orphan: no start yet
    assert h.core.is_live("a") and h.core.is_live("c")
    h.core.fail("a", "boom", out)
    h.replies += out.replies
    assert h.error("a").code == "internal" and not h.core.is_live("a")
    h.core.reset()
    assert not h.core.is_live("b") and not h.core.is_live("c") and h.core.num_active == 0
    h.step(T0 + 2, starts=[info("a")])  # answered before the reset: stays answered
    assert not h.core.is_live("a")
