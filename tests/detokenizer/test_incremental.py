"""IncrementalDetokenizer: UTF-8-safe incremental decoding and exact stop-string cuts."""

from __future__ import annotations

from typing import Any

import pytest

from services.detokenizer.incremental import IncrementalDetokenizer
from tests.detokenizer.helpers import (
    MULTIBYTE,
    STORY,
    Decode,
    cut_at,
    stream,
)

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


@pytest.mark.parametrize("text", [MULTIBYTE, STORY, "ok 🙂"])
def test_lazy_decodes_once_at_the_end_to_the_same_text(
    decode: Decode, encode: Any, text: str
) -> None:
    """Nothing streamed and no stop string: ``add`` keeps the ids, ``finish`` decodes once."""
    ids = encode(text)
    calls: list[int] = []

    def counting(token_ids: Any) -> str:
        calls.append(len(token_ids))
        return decode(token_ids)

    lazy, eager = IncrementalDetokenizer(counting, lazy=True), IncrementalDetokenizer(decode)
    for t in ids:
        lazy.add([t])
        eager.add([t])
    assert calls == [] and lazy.text == ""
    lazy.finish()
    eager.finish()
    assert calls == [len(ids)]
    assert lazy.text == eager.text == decode(ids) and lazy.token_ids == ids


def test_lazy_refuses_stop_strings(decode: Decode) -> None:
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(decode, ["END"], lazy=True)
