"""The contract's sampling additions (vLLM's min_p, penalties, min_tokens, stop_token_ids,
include_stop_str_in_output): validated with ranges, neutral when absent, and absent from the
messages of requests that do not use them, so old and new builds read each other's."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgpack
import pytest

from shared.config import BatonConfig
from shared.wire.errors import ProtocolError
from shared.wire.messages import (
    DetokMsg,
    HandoffMsg,
    PrefillMsg,
    RequestMsg,
    SamplingParams,
    StartInfo,
)
from shared.wire.validation import MAX_STOP_TOKEN_IDS, parse_request

CONFIG = BatonConfig(max_tokens_limit=100)
ADDED = {
    "min_p": 0.1, "repetition_penalty": 1.3, "presence_penalty": -0.5,
    "frequency_penalty": 2.0, "min_tokens": 4, "stop_token_ids": [9, 3, 9],
}  # fmt: skip


def parse(**fields: Any) -> RequestMsg:
    body = {"request_id": "r1", "prompt": "hello", "max_tokens": 10, **fields}
    return parse_request(msgpack.packb(body), CONFIG)


def test_every_addition_parses_and_round_trips() -> None:
    msg = parse(**ADDED, include_stop_str_in_output=True)
    s = msg.sampling
    assert (s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (
        0.1, 1.3, -0.5, 2.0,
    )  # fmt: skip
    assert s.min_tokens == 4 and s.stop_token_ids == (9, 3)  # duplicates dropped, order kept
    assert msg.include_stop_str_in_output and s.processes_logits
    assert parse_request(msg.encode(), CONFIG) == msg


def test_absent_or_null_means_neutral() -> None:
    plain = parse()
    assert plain.sampling == SamplingParams(max_tokens=10) and not plain.sampling.processes_logits
    assert not plain.include_stop_str_in_output
    assert parse(**{k: None for k in ADDED}, include_stop_str_in_output=None) == plain
    assert not parse(min_p=0.5, stop_token_ids=[1]).sampling.processes_logits  # nothing to do


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("min_p", 1.5, "min_p must be in [0.0, 1.0]"),
        ("min_p", -0.1, "min_p must be in"),
        ("repetition_penalty", 0, "repetition_penalty must be in (0.0, 10.0]"),
        ("repetition_penalty", 11, "repetition_penalty must be in"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2.0, 2.0]"),
        ("frequency_penalty", -3, "frequency_penalty must be in"),
        ("frequency_penalty", float("nan"), "frequency_penalty must be in"),
        ("min_tokens", 11, "min_tokens must be in [0, 10]"),  # more than max_tokens
        ("min_tokens", -1, "min_tokens must be in"),
        ("min_tokens", True, "min_tokens must be an integer"),
        ("stop_token_ids", 5, "stop_token_ids must be a list"),
        ("stop_token_ids", [1, "2"], "stop_token_ids must contain only non-negative integers"),
        ("stop_token_ids", [-1], "non-negative"),
        ("stop_token_ids", [True], "non-negative integers"),
        ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)), "the limit is 128"),
        ("include_stop_str_in_output", 1, "include_stop_str_in_output must be a boolean"),
    ],
)
def test_refusals_name_the_field(field: str, value: Any, fragment: str) -> None:
    with pytest.raises(ProtocolError) as err:
        parse(**{field: value})
    assert err.value.message.startswith(field) and fragment in err.value.message


def test_requests_without_additions_travel_as_before() -> None:
    """An old consumer builds SamplingParams / StartInfo from the map's keys: keys it does not
    know would be refused, so they are sent only when a request sets them."""
    plain = SamplingParams(max_tokens=5, temperature=0.5, seed=3)
    old_keys = {"max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos"}
    for msg in (
        PrefillMsg("r", "q", [1, 2], plain),
        HandoffMsg("r", [1, 2], [3], plain, kv=None),
    ):
        assert set(msgpack.unpackb(msg.encode())["sampling"]) == old_keys
    detok = msgpack.unpackb(DetokMsg(starts=[StartInfo("r", "q", 2)]).encode())
    assert "include_stop_str_in_output" not in detok["starts"][0]
    request = msgpack.unpackb(RequestMsg("r", plain, prompt="x").encode())
    assert not {"min_p", "stop_token_ids", "include_stop_str_in_output"} & set(request)


def test_internal_messages_carry_the_additions() -> None:
    sampling = replace(SamplingParams(), min_p=0.2, min_tokens=3, stop_token_ids=(4, 5))
    handoff = HandoffMsg("r", [1, 2], [3], sampling, kv=None)
    back = HandoffMsg.decode(handoff.encode(), 1 << 20)
    assert back.sampling == sampling and back.sampling.stop_token_ids == (4, 5)
    start = StartInfo("r", "q", 2, include_stop_str_in_output=True)
    assert DetokMsg.decode(DetokMsg(starts=[start]).encode(), 1 << 20).starts == [start]


@pytest.mark.parametrize("bad", [["a"], "45", 7, [1.5]])
def test_malformed_stop_token_ids_in_an_internal_message_are_refused(bad: Any) -> None:
    body = msgpack.unpackb(PrefillMsg("r", "q", [1], SamplingParams()).encode())
    body["sampling"]["stop_token_ids"] = bad
    with pytest.raises(ProtocolError, match="malformed prefill"):
        PrefillMsg.decode(msgpack.packb(body), 1 << 20)
