"""The detokenizer's part of logprobs and of vLLM's stop rules: entries travel with their tokens
(each token's text added), the prompt's with the stream's start and in the done reply; a
``stop`` says what ended it (``stop_reason``)."""

from __future__ import annotations

from typing import Any

import pytest

from services.shell.event_hold import merge
from tests.detokenizer.helpers import STORY, T0, Decode, Harness, ev, info


def entry(token: int, k: int = 2) -> list[Any]:
    """An engine entry (shared/runtime/logprobs.py) with made-up values."""
    return [token, -0.5 - token / 1000, 3, [token + 1, token + 2][:k], [-0.1, -0.2][:k]]


def reply_entry(decode_one: Any, token: int, k: int = 2) -> list[Any]:
    _, lp, rank, ids, lps = entry(token, k)
    top = [[i, decode_one(i), v] for i, v in zip(ids, lps, strict=True)]
    return [token, decode_one(token), lp, rank, top]


@pytest.fixture
def one(decode: Decode) -> Any:
    return lambda t: decode([t])


def test_entries_follow_their_tokens_and_the_prompt_opens_the_stream(
    h: Harness, encode: Any, one: Any
) -> None:
    ids = encode(STORY)
    prompt = [[5, None, None, [], []], entry(6), entry(7)]
    h.step(T0, starts=[info("a", max_tokens=100, num_prompt_tokens=3)])
    first = ev("a", 0, ids[:1], logprobs=[entry(ids[0])], prompt_logprobs=prompt)
    h.step(T0 + 1, events=[first])
    h.step(T0 + 2, events=[ev("a", 1, ids[1:4], logprobs=[entry(t) for t in ids[1:4]])])
    h.step(T0 + 3, events=[ev("a", 4, ids[4:6], "length", logprobs=[entry(t) for t in ids[4:6]])])
    replies = h.tokens("a")
    assert [r.token_ids for r in replies] == [ids[:1], ids[1:4], ids[4:6]]
    for r in replies:
        assert r.logprobs == [reply_entry(one, t) for t in r.token_ids]
    want_prompt = [[5, one(5), None, None, []], reply_entry(one, 6), reply_entry(one, 7)]
    assert replies[0].prompt_logprobs == want_prompt
    assert replies[1].prompt_logprobs is None and replies[2].prompt_logprobs is None
    done = h.done("a")
    assert done.logprobs == [reply_entry(one, t) for t in ids[:6]]
    assert done.prompt_logprobs == want_prompt and done.stop_reason is None
    encoded = type(done).encode(done)
    assert b"stop_reason" not in encoded  # absent at None, as every addition


def test_a_request_asking_nothing_gets_no_entries(h: Harness, ids: list[int]) -> None:
    h.step(T0, starts=[info("a", max_tokens=3)])
    h.step(T0 + 1, events=[ev("a", 0, ids[:3], "length")])
    assert h.tokens("a")[0].logprobs is None
    assert h.done("a").logprobs is None and h.done("a").prompt_logprobs is None
    assert b"logprobs" not in h.tokens("a")[0].encode()


def test_a_stop_string_cuts_the_tokens_and_their_entries_alike(
    h: Harness, encode: Any, one: Any
) -> None:
    ids = encode(STORY)
    h.step(T0, starts=[info("a", max_tokens=100, stop=["END"], stream=False)])
    h.step(T0 + 1, events=[ev("a", 0, ids, logprobs=[entry(t, 0) for t in ids])])
    done = h.done("a")
    assert done.finish_reason == "stop" and done.stop_reason == "END"
    assert done.text == STORY[: STORY.index("END")]
    assert len(done.logprobs or []) == len(done.token_ids)
    assert done.logprobs == [reply_entry(one, t, 0) for t in done.token_ids]


def test_stop_reason_names_the_stop_token_but_not_eos(h: Harness, ids: list[int], eos: int) -> None:
    h.step(T0, starts=[info("a", stop_token_ids=[ids[2]]), info("b")])
    h.step(T0 + 1, events=[ev("a", 0, ids[:3], "stop"), ev("b", 0, [*ids[:2], eos], "stop")])
    assert h.done("a").stop_reason == ids[2]
    assert h.done("b").finish_reason == "stop" and h.done("b").stop_reason is None


def test_replayed_stream_keeps_every_entry_in_the_done_reply(
    h: Harness, ids: list[int], one: Any
) -> None:
    """Positions replayed silently (a crash, ``resume``) still count in the done reply."""
    from shared.wire.messages import StreamMark

    h.core.resume(StreamMark("a", 2, len(h.core._decode(ids[:2]))), T0)
    h.step(T0, starts=[info("a", max_tokens=4)])
    h.step(T0 + 1, events=[ev("a", 0, ids[:4], "length", logprobs=[entry(t) for t in ids[:4]])])
    (streamed,) = h.tokens("a")
    assert streamed.index == 2 and streamed.logprobs == [reply_entry(one, t) for t in ids[2:4]]
    assert h.done("a").logprobs == [reply_entry(one, t) for t in ids[:4]]


def test_a_stop_string_ends_the_text_and_is_the_stop_reason(h: Harness, encode: Any) -> None:
    """min_tokens holds back EOS and stop_token_ids in the engine, not stop strings (the
    contract): the detokenizer cuts at the first stop string whatever the count."""
    ids = encode(STORY)
    h.step(T0, starts=[info("a", max_tokens=100, stop=["river"])])
    h.step(T0 + 1, events=[ev("a", 0, ids, "length")])
    done = h.done("a")
    assert done.text == "The " and done.finish_reason == "stop" and done.stop_reason == "river"


def test_held_decode_steps_merge_their_entries() -> None:
    steps = [ev("a", i, [10 + i], logprobs=[entry(10 + i)]) for i in range(3)]
    steps.append(ev("b", 0, [1]))
    merged = merge(steps)
    assert [(e.request_id, e.token_ids) for e in merged] == [("a", [10, 11, 12]), ("b", [1])]
    assert merged[0].logprobs == [entry(10), entry(11), entry(12)]
    assert steps[0].logprobs == [entry(10)]  # the head event is left as it was
    assert merged[1].logprobs is None
