"""Requests with ``n`` > 1 in the detokenizer's core: a stream and a done reply per choice
(``choice_index``), the request closed once every choice is done, aborts of one choice (a stop
string) or of all (cancel, error), and a replay that answers each choice exactly once."""

from __future__ import annotations

from typing import Any

from services.detokenizer.marks import stream_marks
from shared.wire.messages import DoneReply, ErrorReply, StreamMark, TokenReply
from tests.detokenizer.helpers import STORY, T0, Decode, Harness, ev, info


def _choice_events(rid: str, ids: list[int], choice: int) -> list[Any]:
    last = len(ids) - 1
    return [
        ev(rid, i, [t], "length" if i == last else None, choice_index=choice)
        for i, t in enumerate(ids)
    ]


def _dones(h: Harness, rid: str) -> dict[int, DoneReply]:
    dones = [r for _, r in h.replies if isinstance(r, DoneReply) and r.request_id == rid]
    by_choice = {d.choice_index: d for d in dones}
    assert len(by_choice) == len(dones), "a choice answered twice"
    return by_choice  # type: ignore[return-value]


def test_each_choice_streams_and_ends_once(h: Harness, decode: Decode, encode: Any) -> None:
    a, b = encode("The river town"), encode("woke slowly. END")
    start = info("r", n=2, max_tokens=max(len(a), len(b)) + 4)
    h.step(T0, starts=[start])
    ea, eb = _choice_events("r", a, 0), _choice_events("r", b, 1)
    out = h.step(T0 + 1, events=ea[:2] + eb[:1])
    assert {r.choice_index for _, r in out.replies} == {0, 1}
    assert {(m.choice_index, m.next_index) for m in stream_marks(out)} == {(0, 2), (1, 1)}
    out = h.step(T0 + 2, events=eb[1:])  # choice 1 is done; the request is not
    assert not out.closed and h.core.num_active == 1
    marks = {m.choice_index: m for m in stream_marks(out)}
    assert marks[1].done and marks[0] == StreamMark("r", 2, len(decode(a[:2])), 0)
    out = h.step(T0 + 3, events=ea[2:])
    assert out.closed == ["r"] and h.core.num_active == 0 and not stream_marks(out)
    dones = _dones(h, "r")
    assert (dones[0].token_ids, dones[1].token_ids) == (a, b)
    assert dones[0].text == decode(a) and dones[1].text == decode(b)
    for i in (0, 1):
        streamed = [r for _, r in h.replies if isinstance(r, TokenReply) and r.choice_index == i]
        assert "".join(r.text for r in streamed) == dones[i].text
    assert h.aborts == []


def test_a_stop_string_aborts_its_choice_alone(h: Harness, encode: Any) -> None:
    ids = encode(STORY)
    h.step(T0, starts=[info("r", n=2, max_tokens=len(ids) + 5, stop=["END"])])
    out = h.step(T0 + 1, events=_choice_events("r", ids, 1)[:-1])
    assert out.choice_aborts == [("r", 1)] and out.aborts == [] and not out.closed
    assert _dones(h, "r")[1].finish_reason == "stop"


def test_cancel_and_error_end_every_choice(h: Harness, encode: Any) -> None:
    ids = encode("The river")
    h.step(T0, starts=[info("c", n=3), info("e", n=2)])
    h.step(T0 + 1, events=_choice_events("c", ids, 0) + _choice_events("e", ids, 1))
    out = h.step(T0 + 2, cancels=["c"])
    assert out.closed == ["c"] and out.aborts == ["c"]
    assert {i: d.finish_reason for i, d in _dones(h, "c").items()} == {
        0: "length", 1: "cancelled", 2: "cancelled",
    }  # fmt: skip
    error = ev("e", 0, [], error_code="internal", error_message="decode failed")
    out = h.step(T0 + 3, events=[error])
    assert out.closed == ["e"] and out.aborts == ["e"]
    assert [type(r) for _, r in out.replies] == [ErrorReply]


def test_a_replay_answers_each_choice_once(decode: Decode, encode: Any) -> None:
    """Choice 0 is done (its done reply and mark committed), choice 1 streamed half; the core
    dies. The replica replays every held input: choice 0 is not answered again, choice 1
    resumes after its mark."""
    a, b = encode("The river town"), encode("woke slowly and then")
    start = info("r", n=2, max_tokens=len(b))
    ea, eb = _choice_events("r", a, 0), _choice_events("r", b, 1)
    first = Harness(decode)
    marks = stream_marks(first.step(T0, starts=[start]))
    marks += stream_marks(first.step(T0 + 1, events=ea + eb[:3]))
    assert {m.choice_index: m.done for m in marks} == {0: True, 1: False}
    replay = Harness(decode)
    for mark in marks:
        replay.core.resume(mark, T0 + 50)
    replay.step(T0 + 50, starts=[start], events=ea + eb[:2])
    replay.step(T0 + 51, events=eb[2:])
    assert set(_dones(replay, "r")) == {1} and _dones(first, "r")[0].token_ids == a
    resumed = [r for _, r in replay.replies if isinstance(r, TokenReply)]
    assert resumed and resumed[0].index == 3  # after the committed mark, nothing before
    streamed = [r for _, r in first.replies + replay.replies if isinstance(r, TokenReply)]
    assert "".join(r.text for r in streamed if r.choice_index == 1) == decode(b)
