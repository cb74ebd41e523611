"""DetokenizerCore: stop strings, cancels, deadlines, errors, timing — one terminal each."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from services.detokenizer.core import ORPHAN_EVENT_TTL_S, DetokenizerCore, Output
from shared.wire.messages import DoneReply, ErrorReply, TokenReply
from tests.detokenizer.helpers import STORY, T0, Decode, Harness, cut_at, ev, info


def test_stop_string_ends_the_request_and_aborts_workers(
    h: Harness, encode: Any, decode: Decode
) -> None:
    ids = encode(STORY)
    h.step(T0, starts=[info("a", stop=["END"], max_tokens=100)])
    cut = ids.index(encode(" END")[0])  # the token that starts " END"
    for i in range(len(ids)):
        h.step(T0 + 1 + i, events=[ev("a", i, ids[i : i + 1])])
        expected = cut_at(STORY, "END")
        assert expected.startswith(h.streamed_text("a"))
    done = h.done("a")
    assert done.finish_reason == "stop"
    assert done.text == cut_at(STORY, "END") == h.streamed_text("a")
    assert len(done.token_ids) <= cut + 3  # stopped within the stop string's tokens
    assert h.aborts == ["a"]
    h.assert_one_terminal_each()


def test_stop_string_in_a_single_event(h: Harness, encode: Any) -> None:
    ids = encode(STORY)
    h.step(T0, starts=[info("a", stop=["river"], max_tokens=100)])
    h.step(T0 + 1, events=[ev("a", 0, ids)])
    done = h.done("a")
    assert done.text == "The " == h.streamed_text("a")
    assert done.finish_reason == "stop" and h.aborts == ["a"]


def test_stop_completed_by_the_final_flush_is_a_stop(h: Harness, encode: Any) -> None:
    """An event ending in a split character holds all its text back; the flush at finish
    finds the stop string in it, and the reason says so."""
    ids = encode("x END🙂")[:-1]
    h.step(T0, starts=[info("a", stop=["END"], max_tokens=len(ids))])
    h.step(T0 + 1, events=[ev("a", 0, ids)])
    done = h.done("a")
    assert (done.finish_reason, done.text, h.streamed_text("a")) == ("stop", "x ", "x ")


def test_held_back_stop_prefix_is_streamed_at_finish(h: Harness, encode: Any) -> None:
    ids = encode("abc EN")
    h.step(T0, starts=[info("a", stop=["ENDX"], max_tokens=len(ids))])
    for i in range(len(ids) - 1):
        h.step(T0 + 1 + i, events=[ev("a", i, ids[i : i + 1])])
    # the last len("ENDX") - 1 characters are held back: they may start "ENDX"
    assert h.streamed_text("a") == "abc E"[:-3]
    h.step(T0 + 10, events=[ev("a", len(ids) - 1, ids[-1:])])  # max_tokens reached
    assert h.done("a").text == "abc EN" == h.streamed_text("a")


def test_cancel_releases_held_back_text_in_a_tail_reply(h: Harness, encode: Any) -> None:
    ids = encode("abc EN")
    h.step(T0, starts=[info("a", stop=["ENDX"], max_tokens=100)])
    h.step(T0 + 1, events=[ev("a", 0, ids)])
    assert h.streamed_text("a") == "abc"
    out = h.step(T0 + 2, cancels=["a"])
    tail = [r for _, r in out.replies if isinstance(r, TokenReply)]
    assert [(r.text, r.token_ids, r.index) for r in tail] == [(" EN", [], len(ids))]
    done = h.done("a")
    assert done.finish_reason == "cancelled"
    assert done.text == "abc EN" == h.streamed_text("a")


def test_non_stream_requests_get_only_the_done(
    h: Harness, ids: list[int], decode: Decode, eos: int
) -> None:
    h.step(T0, starts=[info("a", stream=False, max_tokens=100)])
    ids = [*ids, eos]  # the engine's "stop" comes with its EOS token
    for i, t in enumerate(ids):
        h.step(T0 + 1 + i, events=[ev("a", i, [t], "stop" if i == len(ids) - 1 else None)])
    assert h.tokens("a") == []
    assert [type(r) for _, r in h.replies] == [DoneReply]
    assert h.done("a").text == decode(ids)


def test_non_stream_stop_string(h: Harness, encode: Any) -> None:
    h.step(T0, starts=[info("a", stream=False, stop=["END"], max_tokens=100)])
    h.step(T0 + 1, events=[ev("a", 0, encode(STORY))])
    assert [type(r) for _, r in h.replies] == [DoneReply]
    assert h.done("a").text == cut_at(STORY, "END") and h.aborts == ["a"]


def test_cancel_before_start_is_answered_when_start_arrives(h: Harness, ids: list[int]) -> None:
    out = h.step(T0 + 1, cancels=["a"])
    assert out.replies == [] and out.aborts == []
    h.step(T0 + 2, events=[ev("a", 0, ids[:1])])  # an orphan event: never applied
    out = h.step(T0 + 3, starts=[info("a")])
    done = h.done("a")
    assert done.finish_reason == "cancelled"
    assert done.token_ids == [] and done.text == "" and h.aborts == ["a"]
    assert h.tokens("a") == []
    h.step(T0 + 4, events=[ev("a", 1, ids[1:2], "stop")])
    h.step(T0 + 5, starts=[info("a")])
    h.assert_one_terminal_each()
    with capture_logs() as logs:  # its orphan event went with it, not left to age out
        h.step(T0 + 2 * ORPHAN_EVENT_TTL_S)
    assert logs == []


def test_cancel_of_an_active_request(h: Harness, ids: list[int], decode: Decode) -> None:
    h.step(T0, starts=[info("a", max_tokens=100)])
    h.step(T0 + 1, events=[ev("a", 0, ids[:4])])
    h.step(T0 + 2, events=[ev("a", 4, ids[4:6])], cancels=["a"])
    done = h.done("a")
    assert done.finish_reason == "cancelled"
    assert done.token_ids == ids[:6] and done.text == decode(ids[:6])
    assert h.streamed_text("a") == done.text and h.aborts == ["a"]
    h.step(T0 + 3, events=[ev("a", 6, ids[6:7], "stop")], cancels=["a"])
    h.assert_one_terminal_each()


def test_cancel_of_a_finished_request_is_ignored(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info("a")])
    h.step(T0 + 1, events=[ev("a", 0, ids[:1], "stop")])
    h.step(T0 + 2, cancels=["a"])
    h.step(T0 + 3, starts=[info("a")])
    assert h.aborts == [] and h.core.num_active == 0
    h.assert_one_terminal_each()


def test_deadline_with_tokens_is_done_timeout(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info("a", deadline=T0 + 5, max_tokens=100)])
    h.step(T0 + 1, events=[ev("a", 0, ids[:3])])
    h.step(T0 + 4.99)
    assert h.core.num_active == 1
    h.step(T0 + 5)
    done = h.done("a")
    assert done.finish_reason == "timeout"
    assert done.token_ids == ids[:3] and h.aborts == ["a"]
    assert done.timing["e2e_s"] == pytest.approx(5.0)


def test_deadline_without_tokens_is_error_timeout(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info("a", deadline=T0 + 5)])
    h.step(T0 + 6)
    err = h.error("a")
    assert err.code == "timeout" and err.message
    assert h.aborts == ["a"] and h.core.num_active == 0
    h.step(T0 + 7, events=[ev("a", 0, ids[:1], "stop")])  # too late
    h.assert_one_terminal_each()


def test_deadline_already_passed_at_start(h: Harness) -> None:
    h.step(T0 + 10, starts=[info("a", deadline=T0 + 5)])
    assert isinstance(h.terminal("a"), ErrorReply)


def test_no_deadline_never_expires(h: Harness) -> None:
    h.step(T0, starts=[info("a")])
    h.step(T0 + 1e6)
    assert h.replies == [] and h.core.num_active == 1


@pytest.mark.parametrize("index", [0, 5])
def test_error_event_is_an_error_reply(h: Harness, ids: list[int], index: int) -> None:
    h.step(T0, starts=[info("a", max_tokens=100)])
    h.step(T0 + 1, events=[ev("a", 0, ids[:2])] if index else [])
    bad = ev("a", index, [], error_code="overloaded", error_message="decode is full")
    h.step(T0 + 2, events=[bad])
    err = h.error("a")
    assert (err.code, err.message, err.request_id) == ("overloaded", "decode is full", "a")
    assert [q for q, r in h.replies if r is err] == ["q-a"]
    h.step(T0 + 3, events=[ev("a", 2, ids[2:3], "stop")])
    h.assert_one_terminal_each()


def test_error_event_without_message(h: Harness) -> None:
    h.step(T0, starts=[info("a")])
    h.step(T0 + 1, events=[ev("a", 0, [], error_code="internal")])
    err = h.error("a")
    assert err.code == "internal" and err.message


def test_timing_fields(h: Harness, ids: list[int]) -> None:
    h.step(T0 + 0.5, starts=[info("a", max_tokens=4)])
    h.step(T0 + 2.0, events=[ev("a", 0, ids[:1], scheduled_at=T0 + 1.0)])
    h.step(T0 + 2.5, events=[ev("a", 1, ids[1:2])])
    h.step(T0 + 3.0, events=[ev("a", 2, ids[2:3])])
    h.step(T0 + 3.5, events=[ev("a", 3, ids[3:4])])
    done = h.done("a")
    assert done.timing == pytest.approx(
        {"queue_s": 1.0, "ttft_s": 2.0, "tpot_s": 0.5, "e2e_s": 3.5}
    )


def test_timing_without_tokens_is_zero_not_negative(h: Harness) -> None:
    h.step(T0, starts=[info("a", arrival_time=T0 + 3)])  # clocks may disagree
    h.step(T0 + 1, cancels=["a"])
    done = h.done("a")
    assert done.timing == {"queue_s": 0.0, "ttft_s": 0.0, "tpot_s": 0.0, "e2e_s": 0.0}


def test_finished_reports_every_terminal(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info("a"), info("b", deadline=T0 + 1), info("c")])
    h.step(T0 + 2, events=[ev("a", 0, ids[:1], "stop")], cancels=["c"])
    assert sorted(i.request_id for i, _ in h.finished) == ["a", "b", "c"]
    assert all(reply is h.terminal(i.request_id) for i, reply in h.finished)
    h.assert_one_terminal_each()


def test_many_requests_interleaved_each_answered_once(h: Harness, ids: list[int]) -> None:
    """Every path at once, in shuffled batches: each request gets exactly one terminal."""
    rids = [f"r{i}" for i in range(12)]
    h.step(T0, starts=[info(r, max_tokens=6, deadline=T0 + 50) for r in rids[:10]])
    h.step(T0 + 1, cancels=["r10", "r3"])
    for k in range(8):
        events = [ev(r, k, ids[k : k + 1]) for r in rids[::-1] if r not in ("r4", "r5")]
        events += [ev(r, k, ids[k : k + 1]) for r in rids[:2]]  # duplicates
        h.step(T0 + 2 + k, events=events)
    h.step(
        T0 + 20,
        starts=[info("r10"), info("r11", max_tokens=6)],
        events=[ev("r4", 0, [], error_code="x")],
    )
    h.step(T0 + 60)
    for r in rids:
        h.terminal(r)
    h.assert_one_terminal_each()
    assert h.error("r5").code == "timeout"
    assert h.done("r0").finish_reason == "length"
    assert h.done("r11").finish_reason == "length"
    assert h.done("r10").finish_reason == "cancelled"
    assert h.core.num_active == 0


def test_stream_interval_coalesces_replies_but_never_delays_first_or_last(
    decode: Decode, ids: list[int]
) -> None:
    core = DetokenizerCore(decode, stream_interval_s=0.05)
    out = Output()
    core.start(info("a", max_tokens=len(ids)), T0, out)
    replies: list[Any] = []
    for i, t in enumerate(ids):  # one token every 10 ms
        now = T0 + 0.01 * (i + 1)
        out = Output()
        core.event(ev("a", i, [t]), now, out)
        core.flush(out, now)
        replies += [r for _, r in out.replies]
    tokens = [r for r in replies if isinstance(r, TokenReply)]
    assert tokens[0].index == 0 and tokens[0].token_ids == [ids[0]]  # first token at once
    assert len(tokens) < len(ids) // 3  # ~one reply per 5 tokens
    assert [i for r in tokens for i in r.token_ids] == ids  # nothing lost, in order
    assert isinstance(replies[-1], DoneReply) and replies[-1].token_ids == ids
    assert "".join(r.text for r in tokens) == replies[-1].text
    assert not core.has_pending_stream()


def test_reply_budget_stretches_the_interval_with_the_number_of_streams(
    decode: Decode, ids: list[int]
) -> None:
    """10 streams under a budget of 100 replies/s: one reply per stream per 100 ms, not per
    50 ms; the interval comes back as streams end."""
    core = DetokenizerCore(decode, stream_interval_s=0.05, max_stream_replies_per_s=100.0)
    names = [f"r{i}" for i in range(10)]
    ids = (ids * 8)[:60]
    out = Output()
    for name in names:
        core.start(info(name, max_tokens=len(ids)), T0, out)
    core.start(info("quiet", max_tokens=len(ids), stream=False), T0, out)
    assert core.effective_stream_interval_s == pytest.approx(0.1)  # non-streaming ones are free
    replies: list[Any] = []
    for i, t in enumerate(ids):  # one token every 10 ms
        now = T0 + 0.01 * (i + 1)
        out = Output()
        for name in names:
            core.event(ev(name, i, [t]), now, out)
        core.flush(out, now)
        replies += [r for _, r in out.replies]
    per_stream = sum(isinstance(r, TokenReply) for r in replies) / len(names)
    assert per_stream <= 8  # the first token at once, then every 100 ms of 600 (50 ms: 13)
    done = [r.request_id for r in replies if isinstance(r, DoneReply)]
    assert sorted(done) == names
    assert core.effective_stream_interval_s == 0.05  # every stream ended
