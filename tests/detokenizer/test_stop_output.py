"""What ends the text (vLLM's rules): a stop string is cut off unless
``include_stop_str_in_output``; the token an engine stopped on (EOS, a ``stop_token_ids`` entry)
counts as an output token but adds no text, unless the client asked for it."""

from __future__ import annotations

from typing import Any

import pytest

from services.detokenizer.incremental import IncrementalDetokenizer
from tests.detokenizer.helpers import (
    MULTIBYTE,
    STORY,
    T0,
    Decode,
    Harness,
    cut_at,
    ev,
    info,
    stream,
)


@pytest.mark.parametrize("chunk", [1, 3, 100])
@pytest.mark.parametrize("stop", ["END", " slowly.", "y. E"])
def test_stop_string_kept_with_include_stop(
    decode: Decode, encode: Any, chunk: int, stop: str
) -> None:
    detok = IncrementalDetokenizer(decode, [stop], include_stop=True)
    deltas = stream(detok, encode(STORY), chunk)
    assert detok.stopped and detok.text == "".join(deltas) == cut_at(STORY, stop) + stop


def test_earliest_stop_string_is_the_one_kept(decode: Decode, encode: Any) -> None:
    detok = IncrementalDetokenizer(decode, ["story", "town", "river town"], include_stop=True)
    stream(detok, encode(STORY))
    assert detok.text == "The river town"  # "river town" starts first


@pytest.mark.parametrize("lazy", [False, True])
def test_hidden_last_token_adds_no_text(decode: Decode, encode: Any, lazy: bool) -> None:
    ids = encode(MULTIBYTE)
    detok = IncrementalDetokenizer(decode, lazy=lazy)
    detok.add(ids[:-1])
    sent = detok.take_delta()
    detok.add(ids[-1:], hide_last=True)
    sent += detok.take_delta()
    detok.finish()
    sent += detok.take_delta(final=True)
    assert detok.text == sent == decode(ids[:-1]) and detok.token_ids == ids


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stream_", [True, False])
def test_engine_stop_token_text_follows_include_stop(
    h: Harness, encode: Any, decode: Decode, include: bool, stream_: bool
) -> None:
    ids = encode(STORY)  # the last one plays a stop_token_ids entry: an ordinary token
    start = info("a", max_tokens=100, stream=stream_, include_stop_str_in_output=include)
    h.step(T0, starts=[start])
    h.step(T0 + 1, events=[ev("a", 0, ids[:5])])
    h.step(T0 + 2, events=[ev("a", 5, ids[5:], "stop")])
    done = h.done("a")
    assert done.finish_reason == "stop" and done.token_ids == ids
    assert done.text == decode(ids if include else ids[:-1])
    assert done.usage["completion_tokens"] == len(ids)
    if stream_:
        assert h.streamed_text("a") == done.text
        assert [i for r in h.tokens("a") for i in r.token_ids] == ids
    h.assert_one_terminal_each()


def test_a_length_finish_keeps_its_last_token(h: Harness, encode: Any, decode: Decode) -> None:
    ids = encode(STORY)
    h.step(T0, starts=[info("a", max_tokens=len(ids))])
    h.step(T0 + 1, events=[ev("a", 0, ids, "length")])
    assert h.done("a").text == decode(ids)
