"""Logprobs on the wire: the request fields (validated, 0..20), absent from every message of a
request that does not ask, carried by internal events and replies when it does; the budget a
reply's logprobs may take (an output is clamped to it, a prompt refused)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from shared.config import BatonConfig
from shared.limits import Limits
from shared.wire.errors import ProtocolError
from shared.wire.messages import (
    DetokMsg,
    DoneReply,
    PrefillMsg,
    SamplingParams,
    StartInfo,
    TokenEvent,
    TokenReply,
    decode_reply,
)
from shared.wire.validation import MAX_LOGPROBS, parse_request

CONFIG = BatonConfig(max_tokens_limit=100)
ENTRY = [7, -0.25, 1, [7, 3], [-0.25, -1.5]]
REPLY_ENTRY = [7, "hi", -0.25, 1, [[7, "hi", -0.25], [3, "yo", -1.5]]]


def parse(**fields: Any) -> Any:
    body = {"request_id": "r1", "prompt": "hello", "max_tokens": 10, **fields}
    return parse_request(msgpack.packb(body), CONFIG)


def test_fields_parse_and_travel_in_the_sampling_map() -> None:
    s = parse(logprobs=MAX_LOGPROBS, prompt_logprobs=0).sampling
    assert (s.logprobs, s.prompt_logprobs) == (20, 0)
    assert parse(logprobs=None).sampling.logprobs is None
    back = PrefillMsg.decode(PrefillMsg("r", "q", [1], s).encode(), 1 << 20)
    assert back.sampling == s


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [("logprobs", 21, "logprobs must be in [0, 20]"), ("logprobs", -1, "must be in"),
     ("logprobs", True, "must be an integer"), ("prompt_logprobs", 2.0, "must be an integer"),
     ("prompt_logprobs", 99, "prompt_logprobs must be in [0, 20]")],
)  # fmt: skip
def test_refusals_name_the_field(field: str, value: Any, fragment: str) -> None:
    with pytest.raises(ProtocolError) as err:
        parse(**{field: value})
    assert fragment in err.value.message


def test_absent_unless_asked() -> None:
    sampling = msgpack.unpackb(PrefillMsg("r", "q", [1], SamplingParams()).encode())["sampling"]
    assert not {"logprobs", "prompt_logprobs"} & set(sampling)
    detok = msgpack.unpackb(
        DetokMsg(starts=[StartInfo("r", "q", 2)], events=[TokenEvent("r", 0, [1])]).encode()
    )
    assert not {"min_tokens", "stop_token_ids"} & set(detok["starts"][0])
    assert not {"logprobs", "prompt_logprobs"} & set(detok["events"][0])
    done = msgpack.unpackb(DoneReply("r", "x", [1], "stop", {}, {}).encode())
    assert not {"logprobs", "prompt_logprobs", "stop_reason"} & set(done)


def test_events_and_replies_carry_them() -> None:
    start = StartInfo("r", "q", 2, stop_token_ids=[9])
    event = TokenEvent("r", 0, [7], logprobs=[ENTRY], prompt_logprobs=[[5, None, None, [], []]])
    back = DetokMsg.decode(DetokMsg(starts=[start], events=[event]).encode(), 1 << 20)
    assert back.starts == [start] and back.events == [event]
    token = TokenReply("r", "hi", [7], 0, 0, logprobs=[REPLY_ENTRY], prompt_logprobs=[])
    assert decode_reply(token.encode(), 1 << 20) == token
    done = DoneReply("r", "hi", [7], "stop", {}, {}, logprobs=[REPLY_ENTRY], stop_reason="END")
    assert decode_reply(done.encode(), 1 << 20) == done


def test_malformed_entries_in_an_internal_message_are_refused() -> None:
    body = msgpack.unpackb(DetokMsg(events=[TokenEvent("r", 0, [7], logprobs=[ENTRY])]).encode())
    body["events"][0]["logprobs"] = [5]
    with pytest.raises(ProtocolError, match="malformed detok"):
        DetokMsg.decode(msgpack.packb(body), 1 << 20)


def test_the_reply_budget_clamps_an_output_and_refuses_a_prompt() -> None:
    limits = Limits.build(BatonConfig(max_message_bytes=64 << 10), 4096)
    assert limits.max_logprob_bytes == 48 << 10
    plain = SamplingParams(max_tokens=2000)
    assert limits.clamp(plain, 10) is plain  # not asked: only the model's length
    top20 = limits.clamp(SamplingParams(max_tokens=2000, logprobs=20), 10)
    assert top20.max_tokens == (48 << 10) // (32 + 20 * 28)
    chosen = limits.clamp(SamplingParams(max_tokens=2000, logprobs=0), 10)
    assert chosen.max_tokens == 1536  # (48 KiB) // 32
    # a scored prompt takes its share first
    both = SamplingParams(max_tokens=2000, logprobs=0, prompt_logprobs=0)
    assert limits.clamp(both, 1001).max_tokens == 1536 - 1000
    limits.check_prompt_logprobs(both, 1536)
    with pytest.raises(ProtocolError, match="prompt_logprobs=0 over 1538 prompt tokens"):
        limits.check_prompt_logprobs(both, 1538)
