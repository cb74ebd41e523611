"""parse_request: every rule of the client contract, with the field named in the message."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from shared.config import BatonConfig
from shared.wire.errors import ErrorCode, ProtocolError
from shared.wire.messages import RequestMsg, SamplingParams
from shared.wire.validation import parse_request, parse_request_map

CONFIG = BatonConfig(
    max_message_bytes=4096,
    max_prompt_tokens=8,
    max_tokens_limit=100,
    max_stop_strings=3,
    max_stop_chars=5,
)
NAN, INF = float("nan"), float("inf")
_DROP = object()  # a field left out of the body


def parse(**fields: Any) -> RequestMsg:
    body: dict[str, Any] = {"request_id": "r1", "prompt": "hello"}
    body.update(fields)
    body = {k: v for k, v in body.items() if v is not _DROP}
    return parse_request(msgpack.packb(body), CONFIG)


def refused(code: ErrorCode = ErrorCode.INVALID_REQUEST, **fields: Any) -> str:
    with pytest.raises(ProtocolError) as err:
        parse(**fields)
    assert err.value.code is code, err.value.message
    return err.value.message


def test_defaults() -> None:
    msg = parse()
    assert msg == RequestMsg(request_id="r1", sampling=SamplingParams(), prompt="hello")
    assert msg.sampling == SamplingParams()
    assert msg.stop == () and msg.stream is True and msg.priority == 0 and msg.timeout_s is None


def test_every_field_set() -> None:
    msg = parse(
        max_tokens=100,
        temperature=0.7,
        top_p=0.5,
        top_k=50,
        seed=2**63 - 1,
        stop=["a", "bcdef"],
        ignore_eos=True,
        stream=False,
        priority=9,
        timeout_s=3,
    )
    assert msg.sampling == SamplingParams(
        max_tokens=100, temperature=0.7, top_p=0.5, top_k=50, seed=2**63 - 1, ignore_eos=True
    )
    assert msg.stop == ("a", "bcdef") and msg.stream is False and msg.priority == 9
    assert msg.timeout_s == 3.0 and isinstance(msg.timeout_s, float)


def test_explicit_nulls_mean_defaults() -> None:
    msg = parse(
        max_tokens=None,
        temperature=None,
        top_p=None,
        top_k=None,
        seed=None,
        stop=None,
        ignore_eos=None,
        stream=None,
        priority=None,
        timeout_s=None,
    )
    assert msg == parse()


def test_unknown_keys_are_ignored() -> None:
    assert parse(echo=True, model="gpt", extra={"a": [1]}) == parse()


def test_ints_become_floats_for_float_fields() -> None:
    msg = parse(temperature=1, top_p=1)
    assert msg.sampling.temperature == 1.0 and isinstance(msg.sampling.temperature, float)
    assert isinstance(msg.sampling.top_p, float)


# --- prompt fields ----------------------------------------------------------------------------


def test_prompt_text() -> None:
    assert parse(prompt="héllo 🙂").prompt == "héllo 🙂"


def test_messages() -> None:
    msg = parse(
        prompt=_DROP,
        messages=[{"role": "system", "content": ""}, {"role": "user", "content": "hi", "x": 1}],
    )
    assert msg.messages == (("system", ""), ("user", "hi")) and msg.prompt is None


def test_prompt_token_ids() -> None:
    msg = parse(prompt=_DROP, prompt_token_ids=[0, 5, 7])
    assert msg.prompt_token_ids == (0, 5, 7) and msg.prompt is None and msg.messages is None


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"prompt": _DROP}, "none"),
        ({"prompt": None}, "none"),
        ({"messages": [{"role": "user", "content": "x"}]}, "prompt, messages"),
        ({"prompt_token_ids": [1]}, "prompt, prompt_token_ids"),
        (
            {"messages": [{"role": "u", "content": "x"}], "prompt_token_ids": [1]},
            "prompt, messages, prompt_token_ids",
        ),
    ],
)
def test_exactly_one_prompt_field(fields: dict[str, Any], named: str) -> None:
    message = refused(**fields)
    assert "exactly one of prompt, messages, prompt_token_ids" in message
    assert message.endswith(named)


def test_null_prompt_field_does_not_count_as_given() -> None:
    msg = parse(messages=None, prompt_token_ids=None)
    assert msg.prompt == "hello"


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"prompt": 5}, "prompt must be a string, got int"),
        ({"prompt": ["a"]}, "prompt must be a string, got list"),
        ({"prompt": ""}, "prompt must not be empty"),
        ({"prompt": _DROP, "messages": []}, "messages must be a non-empty list"),
        ({"prompt": _DROP, "messages": "hi"}, "messages must be a non-empty list"),
        ({"prompt": _DROP, "messages": ["hi"]}, "messages[0] must be a map"),
        (
            {"prompt": _DROP, "messages": [{"role": "u", "content": "a"}, {"content": "b"}]},
            "messages[1].role must be a non-empty string",
        ),
        ({"prompt": _DROP, "messages": [{"role": "", "content": "b"}]}, "messages[0].role"),
        ({"prompt": _DROP, "messages": [{"role": 1, "content": "b"}]}, "messages[0].role"),
        ({"prompt": _DROP, "messages": [{"role": "u"}]}, "messages[0].content must be a string"),
        (
            {"prompt": _DROP, "messages": [{"role": "u", "content": 3}]},
            "messages[0].content must be a string",
        ),
        ({"prompt": _DROP, "prompt_token_ids": []}, "prompt_token_ids must be a non-empty list"),
        ({"prompt": _DROP, "prompt_token_ids": "123"}, "prompt_token_ids must be a non-empty"),
        ({"prompt": _DROP, "prompt_token_ids": [1, 2.0]}, "prompt_token_ids must contain only"),
        ({"prompt": _DROP, "prompt_token_ids": [1, True]}, "prompt_token_ids must contain only"),
        ({"prompt": _DROP, "prompt_token_ids": [1, "2"]}, "prompt_token_ids must contain only"),
        ({"prompt": _DROP, "prompt_token_ids": [None]}, "prompt_token_ids must contain only"),
    ],
)
def test_prompt_field_types(fields: dict[str, Any], fragment: str) -> None:
    assert fragment in refused(**fields)


def test_prompt_token_ids_too_long_is_prompt_too_long() -> None:
    assert parse(prompt=_DROP, prompt_token_ids=[1] * 8).prompt_token_ids == (1,) * 8
    message = refused(ErrorCode.PROMPT_TOO_LONG, prompt=_DROP, prompt_token_ids=[1] * 9)
    assert "9 tokens" in message and "limit is 8" in message


# --- request_id -------------------------------------------------------------------------------


@pytest.mark.parametrize("rid", [_DROP, None, "", 5, ["r"]])
def test_request_id_required_non_empty_string(rid: Any) -> None:
    assert "request_id" in refused(request_id=rid)


def test_request_id_length_limit() -> None:
    assert parse(request_id="x" * 255).request_id == "x" * 255
    assert "request_id is longer than 256" in refused(request_id="x" * 257)
    # It comes back as the AMQP correlation_id, at most 255 bytes: counted in UTF-8.
    assert "longer than 255 bytes" in refused(request_id="x" * 256)
    assert "longer than 255 bytes" in refused(request_id="\u00e9" * 128)


# --- numeric fields ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("max_tokens", 0, "max_tokens must be in [1, 100], got 0"),
        ("max_tokens", 101, "max_tokens must be in [1, 100], got 101"),
        ("max_tokens", -1, "max_tokens must be in [1, 100]"),
        ("max_tokens", True, "max_tokens must be an integer, got bool"),
        ("max_tokens", 5.0, "max_tokens must be an integer, got float"),
        ("max_tokens", "5", "max_tokens must be an integer, got str"),
        ("top_k", -1, "top_k must be in [0, 1048576], got -1"),
        ("top_k", 2**20 + 1, "top_k must be in [0, 1048576]"),
        ("top_k", False, "top_k must be an integer, got bool"),
        ("top_k", 1.5, "top_k must be an integer, got float"),
        ("priority", 10, "priority must be in [0, 9], got 10"),
        ("priority", -1, "priority must be in [0, 9], got -1"),
        ("priority", 9.0, "priority must be an integer, got float"),
        ("priority", True, "priority must be an integer, got bool"),
        ("seed", -1, "seed must be in [0, 9223372036854775807], got -1"),
        ("seed", 2**63, "seed must be in [0, 9223372036854775807]"),
        ("seed", True, "seed must be an integer, got bool"),
        ("seed", 1.0, "seed must be an integer, got float"),
        ("seed", "7", "seed must be an integer, got str"),
        ("temperature", -0.1, "temperature must be in [0.0, 100.0], got -0.1"),
        ("temperature", 100.5, "temperature must be in [0.0, 100.0], got 100.5"),
        ("temperature", NAN, "temperature must be in [0.0, 100.0], got nan"),
        ("temperature", INF, "temperature must be in [0.0, 100.0], got inf"),
        ("temperature", -INF, "temperature must be in [0.0, 100.0], got -inf"),
        ("temperature", True, "temperature must be a number, got bool"),
        ("temperature", "0.5", "temperature must be a number, got str"),
        ("top_p", 0, "top_p must be in (0.0, 1.0], got 0.0"),
        ("top_p", 0.0, "top_p must be in (0.0, 1.0]"),
        ("top_p", 1.5, "top_p must be in (0.0, 1.0], got 1.5"),
        ("top_p", -0.5, "top_p must be in (0.0, 1.0]"),
        ("top_p", NAN, "top_p must be in (0.0, 1.0], got nan"),
        ("top_p", False, "top_p must be a number, got bool"),
        ("timeout_s", 0, "timeout_s must be in (0.0, 86400.0], got 0.0"),
        ("timeout_s", -1.0, "timeout_s must be in (0.0, 86400.0]"),
        ("timeout_s", 86400.5, "timeout_s must be in (0.0, 86400.0]"),
        ("timeout_s", INF, "timeout_s must be in (0.0, 86400.0], got inf"),
        ("timeout_s", NAN, "timeout_s must be in (0.0, 86400.0], got nan"),
        ("timeout_s", True, "timeout_s must be a number, got bool"),
        ("timeout_s", "5", "timeout_s must be a number, got str"),
    ],
)
def test_numeric_rules(field: str, value: Any, fragment: str) -> None:
    message = refused(**{field: value})
    assert fragment in message
    assert message.startswith(field)  # the message leads with the field a person must fix


@pytest.mark.parametrize(
    "field, value, get",
    [
        ("max_tokens", 1, lambda m: m.sampling.max_tokens),
        ("max_tokens", 100, lambda m: m.sampling.max_tokens),
        ("temperature", 0, lambda m: m.sampling.temperature),
        ("temperature", 100, lambda m: m.sampling.temperature),
        ("top_p", 1e-9, lambda m: m.sampling.top_p),
        ("top_p", 1, lambda m: m.sampling.top_p),
        ("top_k", 0, lambda m: m.sampling.top_k),
        ("top_k", 2**20, lambda m: m.sampling.top_k),
        ("seed", 0, lambda m: m.sampling.seed),
        ("priority", 0, lambda m: m.priority),
        ("priority", 9, lambda m: m.priority),
        ("timeout_s", 1e-3, lambda m: m.timeout_s),
        ("timeout_s", 86400, lambda m: m.timeout_s),
    ],
)
def test_numeric_bounds_inclusive(field: str, value: Any, get: Any) -> None:
    assert get(parse(**{field: value})) == value


@pytest.mark.parametrize("field", ["ignore_eos", "stream"])
@pytest.mark.parametrize("value", [0, 1, "true", 1.0, [True]])
def test_booleans_must_be_booleans(field: str, value: Any) -> None:
    assert f"{field} must be a boolean" in refused(**{field: value})


# --- stop -------------------------------------------------------------------------------------


def test_stop_single_string_becomes_a_tuple() -> None:
    assert parse(stop="END").stop == ("END",)


def test_stop_limits_inclusive() -> None:
    assert parse(stop=["a", "bb", "ccccc"]).stop == ("a", "bb", "ccccc")
    assert parse(stop=[]).stop == ()


@pytest.mark.parametrize(
    "stop, fragment",
    [
        (["a", "b", "c", "d"], "stop has 4 strings, the limit is 3"),
        (["abcdef"], "a stop string is longer than 5 characters"),
        ("abcdef", "a stop string is longer than 5 characters"),
        ([""], "stop must contain only non-empty strings"),
        ("", "stop must contain only non-empty strings"),
        (["a", 1], "stop must contain only non-empty strings"),
        ([None], "stop must contain only non-empty strings"),
        (5, "stop must be a list of strings"),
        ({"a": 1}, "stop must be a list of strings"),
    ],
)
def test_stop_rules(stop: Any, fragment: str) -> None:
    assert fragment in refused(stop=stop)


# --- body level -------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [[1, 2], "request", 5, None])
def test_body_must_be_a_map(body: Any) -> None:
    with pytest.raises(ProtocolError) as err:
        parse_request(msgpack.packb(body), CONFIG)
    assert err.value.code is ErrorCode.INVALID_REQUEST
    assert "request body must be a msgpack map" in err.value.message


def test_body_not_msgpack() -> None:
    with pytest.raises(ProtocolError) as err:
        parse_request(b"\xc1\xc1", CONFIG)
    assert err.value.code is ErrorCode.INVALID_REQUEST and "msgpack" in err.value.message


def test_body_over_max_message_bytes() -> None:
    with pytest.raises(ProtocolError) as err:
        parse(prompt="x" * 5000)
    assert err.value.code is ErrorCode.INVALID_REQUEST and "exceeds 4096" in err.value.message


def test_parse_request_map_accepts_a_decoded_map() -> None:
    d = {"request_id": "r1", "prompt": "hello", "priority": 3}
    assert parse_request_map(d, CONFIG) == parse(priority=3)


def test_round_trip_through_request_encode() -> None:
    msg = parse(
        prompt=_DROP,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0.3,
        top_p=0.8,
        top_k=3,
        seed=11,
        stop=["x"],
        ignore_eos=True,
        stream=False,
        priority=2,
        timeout_s=9.5,
    )
    assert parse_request(msg.encode(), CONFIG) == msg
