"""Wire protocol: msgpack round trips of every message, version refusal, size limits, replies."""

from __future__ import annotations

import struct
from dataclasses import FrozenInstanceError, asdict
from typing import Any

import msgpack
import pytest

from shared.config import BatonConfig
from shared.wire.messages import (
    SCHEMA_VERSION,
    ControlMsg,
    DetokMsg,
    DoneReply,
    ErrorCode,
    ErrorReply,
    HandoffMsg,
    KVDescriptor,
    KVRelease,
    KVReleaseMsg,
    PrefillMsg,
    ProtocolError,
    RequestMsg,
    SamplingParams,
    StartInfo,
    TokenEvent,
    TokenReply,
    decode_reply,
    pack,
    unpack,
)
from shared.wire.validation import parse_request

LIMIT = 1 << 20
SAMPLING = SamplingParams(
    max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=123, ignore_eos=True
)
KV = KVDescriptor(
    "shm", 1, 33, 4096, {"key": "req-1-abc", "shape": [2, 2, 3, 16, 1, 8], "dtype": "bfloat16"}
)


def raw(msg: Any) -> dict[str, Any]:
    return msgpack.unpackb(msg.encode(), raw=False)


def repack(msg: Any, **changes: Any) -> bytes:
    d = raw(msg)
    d.update(changes)
    return msgpack.packb(d)


# --- internal messages ------------------------------------------------------------------------


INTERNAL = [
    PrefillMsg(
        request_id="r1",
        reply_to="amq.gen-xyz",
        prompt_token_ids=[5, 6, 7],
        sampling=SAMPLING,
        stop=["\n\n", "END"],
        stream=False,
        priority=7,
        arrival_time=1700000000.25,
        deadline=1700000010.5,
    ),
    PrefillMsg("r2", "q", [1], SamplingParams()),
    HandoffMsg("r3", [1, 2, 3], [9], SAMPLING, KV, priority=3, arrival_time=1.5, deadline=None),
    HandoffMsg("r4", [1, 2, 3], [9], SamplingParams(), None),
    DetokMsg(
        starts=[
            StartInfo("r5", "q5", 12, ["x"], False, 1.0, 2.0, 99),
            StartInfo("r6", "q6", 1),
        ],
        events=[
            TokenEvent("r5", 0, [1, 2], scheduled_at=3.5),
            TokenEvent("r5", 2, [], finish_reason="length"),
            TokenEvent("r6", 0, [], error_code="internal", error_message="boom"),
        ],
        sent_at=42.0,
    ),
    DetokMsg(),
]


@pytest.mark.parametrize("msg", INTERNAL, ids=lambda m: type(m).__name__)
def test_internal_round_trip(msg: Any) -> None:
    body = msg.encode()
    assert isinstance(body, bytes)
    d = msgpack.unpackb(body, raw=False)
    assert d["v"] == SCHEMA_VERSION and d["kind"] == msg.KIND
    back = type(msg).decode(body, LIMIT)
    assert back == msg
    # nested dataclasses come back as dataclasses, not maps
    if isinstance(msg, (PrefillMsg, HandoffMsg)):
        assert isinstance(back.sampling, SamplingParams)
    if isinstance(msg, HandoffMsg) and msg.kv is not None:
        assert isinstance(back.kv, KVDescriptor)
    if isinstance(msg, DetokMsg):
        assert all(isinstance(s, StartInfo) for s in back.starts)
        assert all(isinstance(e, TokenEvent) for e in back.events)


@pytest.mark.parametrize("v", [None, 0, SCHEMA_VERSION - 1, SCHEMA_VERSION + 1, "1", 1.5, True])
def test_internal_refuses_unknown_schema_version(v: Any) -> None:
    msg = INTERNAL[1]
    d = raw(msg)
    if v is None:
        del d["v"]
    else:
        d["v"] = v
    with pytest.raises(ProtocolError) as err:
        PrefillMsg.decode(msgpack.packb(d), LIMIT)
    assert err.value.code is ErrorCode.INTERNAL
    assert "version" in err.value.message


def test_internal_refuses_other_kind() -> None:
    body = INTERNAL[2].encode()  # a handoff
    with pytest.raises(ProtocolError) as err:
        PrefillMsg.decode(body, LIMIT)
    assert err.value.code is ErrorCode.INTERNAL and "prefill" in err.value.message


@pytest.mark.parametrize(
    "body",
    [
        repack(INTERNAL[1], bogus=1),  # unknown field
        repack(INTERNAL[1], sampling=None),
        repack(INTERNAL[1], sampling=[1, 2]),
        repack(INTERNAL[1], sampling={"max_tokens": 1, "nope": 2}),
        msgpack.packb({"v": SCHEMA_VERSION, "kind": "prefill", "request_id": "r"}),
        msgpack.packb({"v": SCHEMA_VERSION, "kind": "prefill", 5: 1}),
    ],
)
def test_malformed_prefill_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError) as err:
        PrefillMsg.decode(body, LIMIT)
    assert err.value.code is ErrorCode.INTERNAL


@pytest.mark.parametrize("kv", [[1, 2], {"transport": "shm"}, "key"])
def test_malformed_handoff_descriptor(kv: Any) -> None:
    with pytest.raises(ProtocolError):
        HandoffMsg.decode(repack(INTERNAL[3], kv=kv), LIMIT)


@pytest.mark.parametrize(
    "changes",
    [{"starts": 5}, {"starts": [None]}, {"events": [{"request_id": "r"}]}, {"events": ["x"]}],
)
def test_malformed_detok(changes: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        DetokMsg.decode(repack(DetokMsg(), **changes), LIMIT)


@pytest.mark.parametrize("cls", [PrefillMsg, HandoffMsg, DetokMsg])
@pytest.mark.parametrize("body", [pack({"a": 1}) + b"", msgpack.packb([1, 2]), b"\xc1", b""])
def test_internal_decode_of_garbage(cls: Any, body: bytes) -> None:
    with pytest.raises(ProtocolError):
        cls.decode(body, LIMIT)


# --- unpack: size limits before parsing -------------------------------------------------------


def test_unpack_round_trip() -> None:
    obj = {"a": [1, 2, {"b": "c"}], "d": b"\x00\x01", "e": None, "f": 1.5}
    assert unpack(pack(obj), LIMIT) == obj


def test_unpack_refuses_body_over_max_bytes_unread() -> None:
    body = pack({"prompt": "x" * 200})
    assert unpack(body, len(body)) == {"prompt": "x" * 200}  # exactly at the limit is fine
    with pytest.raises(ProtocolError) as err:
        unpack(body, len(body) - 1)
    assert err.value.code is ErrorCode.INVALID_REQUEST
    assert str(len(body)) in err.value.message
    # not even parsed: garbage over the limit gets the size message, not a parse error
    with pytest.raises(ProtocolError, match="exceeds"):
        unpack(b"\xc1" * 100, 10)


@pytest.mark.parametrize(
    "body",
    [
        b"\xdd" + struct.pack(">I", 2**31),  # array32 claiming 2^31 elements
        b"\xdf" + struct.pack(">I", 2**31),  # map32 claiming 2^31 pairs
        b"\xdb" + struct.pack(">I", 2**31),  # str32 claiming 2 GiB
        b"\xc6" + struct.pack(">I", 2**31),  # bin32 claiming 2 GiB
        b"\xdd" + struct.pack(">I", 1000),  # array32 within limits but truncated
        b"\x91\xdb" + struct.pack(">I", 5000) + b"x" * 10,  # nested str over max_bytes
        pack({"x": msgpack.ExtType(1, b"ab")}),  # ext types are never accepted
        b"\xc1",  # never-used byte
        b"",
        pack({"a": 1}) + b"\x00",  # trailing data
    ],
)
def test_unpack_hostile_bodies(body: bytes) -> None:
    with pytest.raises(ProtocolError) as err:
        unpack(body, 4096)
    assert err.value.code is ErrorCode.INVALID_REQUEST
    assert err.value.message


def test_unpack_string_bounded_by_max_bytes_not_by_container_cap() -> None:
    s = "y" * 3000
    assert unpack(pack({"s": s}), 4096) == {"s": s}


# --- client request encoding ------------------------------------------------------------------


def test_request_encode_matches_contract() -> None:
    msg = RequestMsg(
        request_id="abc",
        sampling=SAMPLING,
        messages=(("system", "be brief"), ("user", "hi")),
        stop=("\n",),
        stream=False,
        priority=4,
        timeout_s=2.5,
    )
    d = unpack(msg.encode(), LIMIT)
    assert d == {
        "request_id": "abc",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 123,
        "ignore_eos": True,
        "stop": ["\n"],
        "stream": False,
        "priority": 4,
        "timeout_s": 2.5,
    }
    assert "prompt" not in d and "prompt_token_ids" not in d


@pytest.mark.parametrize(
    "kwargs, field",
    [({"prompt": "hello"}, "prompt"), ({"prompt_token_ids": (1, 2, 3)}, "prompt_token_ids")],
)
def test_request_encode_carries_exactly_one_prompt_field(kwargs: dict, field: str) -> None:
    d = unpack(RequestMsg("r", SamplingParams(), **kwargs).encode(), LIMIT)
    present = [k for k in ("prompt", "messages", "prompt_token_ids") if k in d]
    assert present == [field]
    assert d[field] == (list(kwargs[field]) if field == "prompt_token_ids" else kwargs[field])


def test_request_and_sampling_are_frozen() -> None:
    with pytest.raises(FrozenInstanceError):
        SAMPLING.max_tokens = 3  # type: ignore[misc]
    assert SamplingParams.from_dict(SAMPLING.to_dict()) == SAMPLING


# --- control messages -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "msg",
    [ControlMsg("cancel", "r1"), ControlMsg("abort", "r2"), ControlMsg("drain")],
)
def test_control_round_trip(msg: ControlMsg) -> None:
    body = msg.encode()
    if msg.request_id is None:
        assert "request_id" not in unpack(body, LIMIT)
    assert ControlMsg.decode(body, LIMIT) == msg


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"type": "explode", "request_id": "r"}, "unknown control type"),
        ({"request_id": "r"}, "unknown control type"),
        ({"type": ["cancel"], "request_id": "r"}, "unknown control type"),
        ({"type": {"a": 1}}, "unknown control type"),
        ({"type": "cancel"}, "cancel needs a string request_id"),
        ({"type": "cancel", "request_id": 5}, "cancel needs a string request_id"),
        ({"type": "abort", "request_id": None}, "abort needs a string request_id"),
    ],
)
def test_control_validation(body: dict, fragment: str) -> None:
    with pytest.raises(ProtocolError) as err:
        ControlMsg.decode(pack(body), LIMIT)
    assert err.value.code is ErrorCode.INVALID_REQUEST
    assert fragment in err.value.message


@pytest.mark.parametrize("body", [msgpack.packb(["cancel", "r"]), b"\xc1", pack({"t": 1}) * 3])
def test_control_garbage(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        ControlMsg.decode(body, LIMIT)


def test_control_size_limit() -> None:
    body = ControlMsg("cancel", "r" * 100).encode()
    with pytest.raises(ProtocolError, match="exceeds"):
        ControlMsg.decode(body, 50)


def test_drain_ignores_a_non_string_request_id() -> None:
    msg = ControlMsg.decode(pack({"type": "drain", "request_id": 5}), LIMIT)
    assert msg == ControlMsg("drain") and msg.request_id is None


# --- replies ----------------------------------------------------------------------------------


REPLIES: list[Any] = [
    TokenReply("r", "hé", [1, 2], 3, 7),
    DoneReply(
        "r",
        "full text",
        [1, 2, 3],
        "length",
        {"prompt_tokens": 5, "completion_tokens": 3},
        {"queue_s": 0.1, "ttft_s": 0.2, "tpot_s": 0.01, "e2e_s": 0.5},
    ),
    ErrorReply("r", "prompt_too_long", "prompt has 9000 tokens, the limit is 1536"),
]


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: r.type)
def test_reply_round_trip(reply: Any) -> None:
    d = unpack(reply.encode(), LIMIT)
    assert d["type"] == reply.type and d["request_id"] == "r"
    assert decode_reply(reply.encode(), LIMIT) == reply


def test_reply_shapes_match_contract() -> None:
    token, done, error = (unpack(r.encode(), LIMIT) for r in REPLIES)
    # The contract's fields, plus ``text_offset``: an addition old clients may ignore.
    assert set(token) == {"type", "request_id", "text", "token_ids", "index", "text_offset"}
    bare = unpack(TokenReply("r", "x", [1], 0).encode(), LIMIT)
    assert set(bare) == {"type", "request_id", "text", "token_ids", "index"}
    assert set(done) == {
        "type",
        "request_id",
        "text",
        "token_ids",
        "finish_reason",
        "usage",
        "timing",
    }
    assert set(done["usage"]) == {"prompt_tokens", "completion_tokens"}
    assert set(done["timing"]) == {"queue_s", "ttft_s", "tpot_s", "e2e_s"}
    assert set(error) == {"type", "request_id", "code", "message"}


@pytest.mark.parametrize(
    "body",
    [
        pack({"type": "bogus", "request_id": "r"}),
        pack({"request_id": "r"}),
        pack({"type": ["done"], "request_id": "r"}),  # unhashable type field
        pack({"type": "token", "request_id": "r"}),  # missing fields
        pack({"type": "error", "request_id": "r", "code": "x", "message": "m", "extra": 1}),
        msgpack.packb({"type": "done", 1: 2}),  # a non-string key
        msgpack.packb([1, 2]),
        b"\xc1",
    ],
)
def test_decode_reply_refuses_malformed(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_reply(body, LIMIT)


def test_decode_reply_size_limit() -> None:
    body = REPLIES[0].encode()
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_reply(body, max_bytes=len(body) - 1)


def test_protocol_error_carries_code_and_message() -> None:
    err = ProtocolError(ErrorCode.OVERLOADED, "queue full")
    assert err.code is ErrorCode.OVERLOADED and err.message == "queue full"
    assert str(err) == "queue full"
    assert ErrorCode.OVERLOADED == "overloaded"  # str enum: encodes as the contract string
    assert {c.value for c in ErrorCode} == {
        "invalid_request",
        "prompt_too_long",
        "overloaded",
        "timeout",
        "internal",
    }


def test_kv_release_round_trip_and_malformed() -> None:
    msg = KVReleaseMsg(releases=[KVRelease("pool", "w1", "r1", {"generation": "g", "send_id": 3})])
    assert KVReleaseMsg.decode(msg.encode(), LIMIT) == msg
    for bad in (["x"], [{"transport": "pool"}], [{**asdict(msg.releases[0]), "payload": 5}]):
        with pytest.raises(ProtocolError):
            KVReleaseMsg.decode(repack(msg, releases=bad), LIMIT)


def test_batch_replies_is_sent_only_when_asked_and_parsed_as_a_boolean() -> None:
    plain = unpack(RequestMsg("r", SamplingParams(), prompt="hi").encode(), LIMIT)
    assert "batch_replies" not in plain  # the contract's request, unchanged for old servers
    asked = RequestMsg("r", SamplingParams(), prompt="hi", batch_replies=True)
    body = asked.encode()
    assert unpack(body, LIMIT)["batch_replies"] is True
    assert parse_request(body, BatonConfig()).batch_replies is True
    plain_body = pack({"request_id": "r", "prompt": "hi"})
    assert parse_request(plain_body, BatonConfig()).batch_replies is False
    with pytest.raises(ProtocolError, match="batch_replies must be a boolean"):
        parse_request(pack({"request_id": "r", "prompt": "hi", "batch_replies": 1}), BatonConfig())
