"""Detokenizer: incremental UTF-8-safe decoding with exact stop cuts, and the core's ordering,
deduplication and one-terminal-reply rule, with the real tiny tokenizer."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from structlog.testing import capture_logs
from tokenizers import Tokenizer

from services.common import resolve_model_dir
from services.detokenizer.core import ORPHAN_EVENT_TTL_S, DetokenizerCore, Output
from services.detokenizer.incremental import IncrementalDetokenizer
from services.detokenizer.service import make_decoder
from shared.config import BatonConfig
from shared.protocol import DoneReply, ErrorReply, StartInfo, TokenEvent, TokenReply

Decode = Callable[[Sequence[int]], str]
MULTIBYTE = "héllo wörld — 你好 🙂"
STORY = "The river town woke slowly. END of story"
T0 = 1000.0  # arrival wall clock of every request


@pytest.fixture(scope="module")
def decode() -> Decode:
    return make_decoder(resolve_model_dir(BatonConfig()))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def encode() -> Callable[[str], list[int]]:
    tok = Tokenizer.from_file(str(resolve_model_dir(BatonConfig()) / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed ``ids`` ``chunk`` at a time, taking a delta after each; finish; take the rest."""
    deltas = []
    for i in range(0, len(ids), chunk):
        detok.add(ids[i : i + chunk])
        deltas.append(detok.take_delta())
    detok.finish()
    deltas.append(detok.take_delta(final=True))
    return deltas


# --- IncrementalDetokenizer -------------------------------------------------------------------


def test_tokenizer_splits_multibyte_characters(decode: Decode, encode: Any) -> None:
    """The premise of the other tests: single tokens of this text decode to U+FFFD halves."""
    ids = encode(MULTIBYTE)
    assert decode(ids) == MULTIBYTE
    assert any("\ufffd" in decode([t]) for t in ids)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 100])
def test_multibyte_stream_never_yields_replacement_halves(
    decode: Decode, encode: Any, chunk: int
) -> None:
    ids = encode(MULTIBYTE)
    detok = IncrementalDetokenizer(decode)
    deltas = stream(detok, ids, chunk)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE == detok.text == decode(ids)
    assert detok.token_ids == ids and not detok.stopped


def test_streamed_text_is_always_a_prefix_of_the_full_decode(decode: Decode, encode: Any) -> None:
    ids = encode(MULTIBYTE + " " + STORY)
    detok = IncrementalDetokenizer(decode)
    sent = ""
    for i, t in enumerate(ids):
        detok.add([t])
        sent += detok.take_delta()
        assert decode(ids[: i + 1]).startswith(sent)
    assert sent  # something was streamed before the end


def test_finish_flushes_an_incomplete_character(decode: Decode, encode: Any) -> None:
    ids = encode("ok 🙂")[:-1]  # the emoji cut short: decodes to U+FFFD at the end
    assert decode(ids).endswith("\ufffd")
    detok = IncrementalDetokenizer(decode)
    deltas = stream(detok, ids)
    assert "\ufffd" not in "".join(deltas[:-1])
    assert "".join(deltas) == detok.text == decode(ids)


def test_take_delta_is_empty_until_new_text(decode: Decode, encode: Any) -> None:
    detok = IncrementalDetokenizer(decode)
    assert detok.take_delta() == "" and detok.take_delta(final=True) == ""
    detok.add(encode("hello"))
    assert detok.take_delta() == "hello"
    assert detok.take_delta() == ""


def cut_at(text: str, stop: str) -> str:
    assert stop in text
    return text[: text.find(stop)]


@pytest.mark.parametrize("chunk", [1, 2, 7])
@pytest.mark.parametrize("stop", ["END", " slowly.", "y. E", "D of", "story"])
def test_stop_string_across_token_boundaries(
    decode: Decode, encode: Any, chunk: int, stop: str
) -> None:
    ids = encode(STORY)
    detok = IncrementalDetokenizer(decode, [stop])
    expected = cut_at(STORY, stop)
    sent = ""
    for i in range(0, len(ids), chunk):
        detok.add(ids[i : i + chunk])
        sent += detok.take_delta()
        assert expected.startswith(sent), "streamed text beyond the stop cut"
    detok.finish()
    sent += detok.take_delta(final=True)
    assert detok.stopped
    assert detok.text == sent == expected


def test_stop_at_the_very_start(decode: Decode, encode: Any) -> None:
    detok = IncrementalDetokenizer(decode, ["STOP"])
    deltas = stream(detok, encode("STOP here"))
    assert detok.stopped and detok.text == "" and deltas == [""] * len(deltas)


def test_stop_in_the_first_token(decode: Decode, encode: Any) -> None:
    ids = encode("The river")
    detok = IncrementalDetokenizer(decode, ["T"])
    detok.add(ids[:1])
    assert detok.stopped and detok.text == "" and detok.take_delta() == ""


@pytest.mark.parametrize("chunk", [1, 100])
def test_several_stop_strings_earliest_wins(decode: Decode, encode: Any, chunk: int) -> None:
    detok = IncrementalDetokenizer(decode, ["story", "END", "town", "zzz"])
    deltas = stream(detok, encode(STORY), chunk)
    assert detok.stopped and detok.text == "".join(deltas) == "The river "


def test_tokens_after_a_stop_are_ignored(decode: Decode, encode: Any) -> None:
    detok = IncrementalDetokenizer(decode, ["END"])
    detok.add(encode(STORY))
    text = detok.text
    detok.add(encode(" more END text"))
    detok.finish()
    assert detok.text == text == cut_at(STORY, "END")


def test_stop_prefix_held_back_then_released(decode: Decode, encode: Any) -> None:
    """ "END" could start "ENDX": held back while ambiguous, streamed once it is not."""
    ids = encode(STORY)
    detok = IncrementalDetokenizer(decode, ["ENDX"])
    sent = ""
    for t in ids:
        detok.add([t])
        sent += detok.take_delta()
        if detok.text.endswith("END"):
            assert not sent.endswith("E") and not sent.endswith("END")
            assert len(detok.text) - len(sent) <= len("ENDX") - 1
    detok.finish()
    sent += detok.take_delta(final=True)
    assert not detok.stopped and sent == detok.text == STORY


def test_held_back_stop_prefix_flushed_at_finish(decode: Decode, encode: Any) -> None:
    detok = IncrementalDetokenizer(decode, ["ENDX"])
    deltas = stream(detok, encode("abc EN"))
    assert deltas[-1].endswith("EN") and "".join(deltas) == "abc EN"


def test_stop_string_with_multibyte_characters(decode: Decode, encode: Any) -> None:
    detok = IncrementalDetokenizer(decode, ["你好"])
    deltas = stream(detok, encode(MULTIBYTE))
    assert "\ufffd" not in "".join(deltas)
    assert detok.text == "".join(deltas) == cut_at(MULTIBYTE, "你好")


# --- DetokenizerCore --------------------------------------------------------------------------


class Harness:
    """A core plus a record of every reply, so a test can assert exactly one terminal each."""

    def __init__(self, decode: Decode) -> None:
        self.core = DetokenizerCore(decode)
        self.replies: list[tuple[str, Any]] = []
        self.aborts: list[str] = []
        self.finished: list[tuple[StartInfo, Any]] = []

    def step(
        self,
        now: float,
        starts: Sequence[StartInfo] = (),
        events: Sequence[TokenEvent] = (),
        cancels: Sequence[str] = (),
    ) -> Output:
        """One micro-batch, in the service's order: starts, events, cancels, expire, flush."""
        out = Output()
        for info in starts:
            self.core.start(info, now, out)
        for ev in events:
            self.core.event(ev, now, out)
        for rid in cancels:
            self.core.cancel(rid, now, out)
        self.core.expire(now, out)
        self.core.flush(out)
        self.replies += out.replies
        self.aborts += out.aborts
        self.finished += out.finished
        return out

    def tokens(self, rid: str) -> list[TokenReply]:
        return [r for _, r in self.replies if isinstance(r, TokenReply) and r.request_id == rid]

    def terminal(self, rid: str) -> DoneReply | ErrorReply:
        terms = [
            r for _, r in self.replies if not isinstance(r, TokenReply) and r.request_id == rid
        ]
        assert len(terms) == 1, f"{rid}: {len(terms)} terminal replies"
        return terms[0]

    def done(self, rid: str) -> DoneReply:
        reply = self.terminal(rid)
        assert isinstance(reply, DoneReply), reply
        return reply

    def error(self, rid: str) -> ErrorReply:
        reply = self.terminal(rid)
        assert isinstance(reply, ErrorReply), reply
        return reply

    def streamed_text(self, rid: str) -> str:
        return "".join(r.text for r in self.tokens(rid))

    def assert_one_terminal_each(self) -> None:
        counts = Counter(r.request_id for _, r in self.replies if not isinstance(r, TokenReply))
        assert all(n == 1 for n in counts.values()), counts
        assert [info.request_id for info, _ in self.finished] == list(counts)


def only_tokens(out: Output) -> list[tuple[str, TokenReply]]:
    """The batch's replies, asserted to be token replies (no terminal among them)."""
    assert all(isinstance(r, TokenReply) for _, r in out.replies), out.replies
    return [(q, r) for q, r in out.replies if isinstance(r, TokenReply)]


def info(rid: str, **kw: Any) -> StartInfo:
    kw.setdefault("reply_to", f"q-{rid}")
    kw.setdefault("num_prompt_tokens", 5)
    kw.setdefault("arrival_time", T0)
    return StartInfo(request_id=rid, **kw)


def ev(rid: str, index: int, ids: list[int], finish: str | None = None, **kw: Any) -> TokenEvent:
    return TokenEvent(rid, index, list(ids), finish_reason=finish, **kw)


@pytest.fixture
def h(decode: Decode) -> Harness:
    return Harness(decode)


@pytest.fixture
def ids(encode: Any) -> list[int]:
    ids = encode(MULTIBYTE)
    assert len(ids) >= 12  # the tests below slice it
    return ids  # type: ignore[no-any-return]


def test_in_order_stream_one_reply_per_flush(h: Harness, ids: list[int], decode: Decode) -> None:
    h.step(T0, starts=[info("a", max_tokens=100)])
    assert h.replies == [] and h.core.num_active == 1
    for i, t in enumerate(ids):
        finish = "stop" if i == len(ids) - 1 else None
        out = h.step(T0 + 1 + i, events=[ev("a", i, [t], finish)])
        toks = [r for _, r in out.replies if isinstance(r, TokenReply)]
        assert len(toks) <= 1 and all(r.index == i and r.token_ids == [t] for r in toks)
        assert all(q == "q-a" for q, _ in out.replies)
    done = h.done("a")
    assert done.finish_reason == "stop" and done.text == MULTIBYTE == decode(ids)
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
    h: Harness, ids: list[int], decode: Decode
) -> None:
    h.step(T0, starts=[info("a", max_tokens=100)])
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


def test_non_stream_requests_get_only_the_done(h: Harness, ids: list[int], decode: Decode) -> None:
    h.step(T0, starts=[info("a", stream=False, max_tokens=100)])
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
