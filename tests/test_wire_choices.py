"""The contract's parallel sampling (``n``): validated against ``BATON_MAX_N``, ``choice_index`` on
the replies of requests with n > 1 only, and the internal messages' choice fields absent when
unused, so the messages of n = 1 requests are what they were."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from shared.config import BatonConfig
from shared.wire.errors import ProtocolError
from shared.wire.messages import (
    ControlMsg,
    DetokMsg,
    DoneReply,
    HandoffMsg,
    RequestMsg,
    SamplingParams,
    StartInfo,
    StreamMark,
    TokenEvent,
    TokenReply,
    decode_reply,
    unpack,
)
from shared.wire.validation import parse_request

CONFIG = BatonConfig(max_n=4)
BOUND = 1 << 20


def parse(**fields: Any) -> RequestMsg:
    return parse_request(msgpack.packb({"request_id": "r", "prompt": "hi", **fields}), CONFIG)


def handoff(**kw: Any) -> HandoffMsg:
    return HandoffMsg("r", [1, 2, 3], [], SamplingParams(n=3), None, **kw)


def test_n_is_validated_and_travels_in_the_sampling_params() -> None:
    assert parse().sampling.n == 1 and parse(n=None).sampling.n == 1
    msg = parse(n=4)
    assert msg.sampling.n == 4 and parse_request(msg.encode(), CONFIG) == msg
    for bad in (0, 5, True, 2.0, "2"):
        with pytest.raises(ProtocolError, match="^n must be"):
            parse(n=bad)
    assert "n" not in SamplingParams().to_dict() and SamplingParams(n=2).to_dict()["n"] == 2


def test_replies_carry_choice_index_only_for_n_above_1() -> None:
    usage, timing = {"prompt_tokens": 1, "completion_tokens": 1}, {"e2e_s": 0.0}
    one = DoneReply("r", "a", [1], "length", usage, timing)
    assert "choice_index" not in unpack(one.encode(), BOUND)
    for reply in (
        DoneReply("r", "a", [1], "length", usage, timing, choice_index=0),
        TokenReply("r", "a", [1], 0, 0, choice_index=2),
    ):
        assert decode_reply(reply.encode(), BOUND) == reply
    assert "choice_index" not in unpack(TokenReply("r", "a", [1], 0, 0).encode(), BOUND)


def test_internal_choice_fields_are_absent_when_unused() -> None:
    assert (
        "n" not in StartInfo("r", "q", 3).to_dict() and StartInfo("r", "q", 3, n=2).to_dict()["n"]
    )
    plain = DetokMsg(events=[TokenEvent("r", 0, [1])], marks=[StreamMark("r", 1, 1)])
    d = unpack(plain.encode(), BOUND)
    assert "choice_index" not in d["events"][0] and set(d["marks"][0]) == {
        "request_id", "next_index", "text_offset",
    }  # fmt: skip
    msg = DetokMsg(events=[TokenEvent("r", 0, [1], choice_index=2)],
                   marks=[StreamMark("r", 1, 1, 2, True)])  # fmt: skip
    assert DetokMsg.decode(msg.encode(), BOUND) == msg
    single = HandoffMsg("r", [1], [2], SamplingParams(), None)
    assert not {"choice_index", "choices"} & set(unpack(single.encode(), BOUND))
    for msg in (handoff(choices=[[0, 7], [2, 9]]), handoff(choice_index=0)):
        assert HandoffMsg.decode(msg.encode(), BOUND) == msg


@pytest.mark.parametrize(
    "kw", [{"choices": [[3, 7]]}, {"choices": [[0]]}, {"choices": [[0, 7, 1]]}, {"choice_index": 3}]
)
def test_a_handoff_naming_a_choice_beyond_n_is_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError, match="malformed handoff"):
        HandoffMsg.decode(handoff(**kw).encode(), BOUND)


def test_an_abort_may_name_one_choice() -> None:
    msg = ControlMsg("abort", "r", 2)
    assert ControlMsg.decode(msg.encode(), BOUND) == msg
    assert ControlMsg.decode(ControlMsg("abort", "r").encode(), BOUND).choice_index is None
    with pytest.raises(ProtocolError):
        ControlMsg.decode(
            msgpack.packb({"type": "cancel", "request_id": "r", "choice_index": 1}), BOUND
        )
