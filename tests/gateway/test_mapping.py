"""The OpenAI ↔ Baton mapping as pure functions: request fields, errors, chunks, exposure."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from services.gateway.api_requests import parse_chat, parse_completion, served_model_id
from services.gateway.api_responses import Formatter, finish_reason
from services.gateway.errors import ApiError, from_error_reply, from_exception
from services.gateway.service import GatewayConfigError, check_exposure, is_loopback
from shared.client import BatonConnectionLost, BatonUnavailable
from shared.config import BatonConfig
from shared.limits import Limits
from shared.wire.messages import DoneReply, ErrorReply

CONFIG = BatonConfig()
LIMITS = Limits.build(CONFIG, max_position_embeddings=4096)


def test_completion_fields_map_onto_a_baton_request() -> None:
    req = parse_completion(
        {"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 5, "temperature": 0,
         "top_p": 0.9, "stop": "\n", "seed": 7, "top_k": -1, "priority": 3, "ignore_eos": True,
         "timeout_s": 2, "user": "ignored", "n": 1, "best_of": 1, "logprobs": None},
        CONFIG,
    )  # fmt: skip
    assert req.baton == {
        "prompt": "hi", "max_tokens": 5, "temperature": 0.0, "top_p": 0.9, "seed": 7,
        "timeout_s": 2.0, "top_k": 0, "ignore_eos": True, "stop": ["\n"], "priority": 3,
    }  # fmt: skip
    assert (req.chat, req.stream, req.include_usage, req.timeout_s) == (False, False, False, 2.0)


def test_openai_defaults_where_they_differ_from_batons() -> None:
    completion = parse_completion({"prompt": "hi"}, CONFIG)
    assert completion.baton["max_tokens"] == 16 and completion.baton["temperature"] == 1.0
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, CONFIG, LIMITS)
    assert chat.baton["max_tokens"] == min(CONFIG.max_model_len, CONFIG.max_tokens_limit)
    # The model's length counts too: a model of 1,024 positions runs to 1,024 at most.
    short = Limits.build(CONFIG, max_position_embeddings=1024)
    assert (
        parse_chat({"messages": [{"role": "user", "content": "hi"}]}, CONFIG, short).baton[
            "max_tokens"
        ]
        == 1024
    )
    both = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    assert parse_chat({**both, "max_completion_tokens": 9}, CONFIG, LIMITS).baton["max_tokens"] == 9
    assert parse_chat(both, CONFIG, LIMITS).baton["max_tokens"] == 3


@pytest.mark.parametrize(
    ("prompt", "key", "value"),
    [
        ("text", "prompt", "text"),
        ([1, 2, 3], "prompt_token_ids", [1, 2, 3]),
        (["one text"], "prompt", "one text"),
        ([[4, 5]], "prompt_token_ids", [4, 5]),
    ],
)
def test_prompt_forms(prompt: object, key: str, value: object) -> None:
    assert parse_completion({"prompt": prompt}, CONFIG).baton[key] == value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [[1], [2]]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": "x", "n": "2"}, "n"),  # its range is the tokenizer's; its type is checked
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),  # best_of only equal to n
        ({"prompt": "x", "logprobs": True}, "logprobs"),  # a count, not chat's flag
        ({"prompt": "x", "echo": 1}, "echo"),
        ({"prompt": "x", "top_logprobs": 2}, "top_logprobs"),  # chat's
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # vLLM's
        ({"prompt": "x", "suffix": "tail"}, "suffix"),
        ({"prompt": "x", "presence_penalty": "0.5"}, "presence_penalty"),  # honoured: typed
        ({"prompt": "x", "guided_json": {"type": "object"}}, "guided_json"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "temperature": True}, "temperature"),
        ({"prompt": "x", "stop": ["a", 1]}, "stop"),
        ({"prompt": "x", "priority": 10}, "priority"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "seed": 1 << 70}, "seed"),  # msgpack carries 64 bits
        ({"prompt": "x", "temperature": 10**400}, "temperature"),
        ({"prompt": [1 << 70]}, "prompt"),
        ({"prompt": "lone \ud800 surrogate"}, "prompt"),  # valid JSON, not encodable
        ({"prompt": "x", "stop": ["\udfff"]}, "stop"),
    ],
)
def test_completion_refusals_name_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_completion(body, CONFIG)
    assert (info.value.status, info.value.param) == (400, param), info.value.message


@pytest.mark.parametrize(
    ("messages", "ok"),
    [
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            True,
        ),
        ([{"role": "assistant", "content": None}, {"role": "user", "content": "q"}], True),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], False),
        ([{"content": "no role"}], False),
        ([], False),
    ],
)
def test_chat_messages(messages: list[dict[str, object]], ok: bool) -> None:
    body = {"messages": messages}
    if ok:
        out = parse_chat(body, CONFIG, LIMITS).baton["messages"]
        assert all(isinstance(m["content"], str) for m in out)
    else:
        with pytest.raises(ApiError):
            parse_chat(body, CONFIG, LIMITS)


def test_chat_refusals_name_the_field() -> None:
    base = {"messages": [{"role": "user", "content": "x"}]}
    for extra in ({"logprobs": 1}, {"top_logprobs": 2}, {"echo": True},
                  {"tools": [{"type": "function"}]},
                  {"response_format": {"type": "json_object"}}, {"best_of": 2}):  # fmt: skip
        with pytest.raises(ApiError) as info:
            parse_chat({**base, **extra}, CONFIG, LIMITS)
        assert info.value.status == 400 and info.value.param == next(iter(extra))
    assert parse_chat({**base, "logprobs": False, "top_logprobs": 0}, CONFIG, LIMITS).chat


def test_model_must_be_the_served_one() -> None:
    assert served_model_id(CONFIG) == "smollm2-135m-instruct"
    assert served_model_id(BatonConfig(model="/models/Qwen3-0.6B/")) == "Qwen3-0.6B"
    named = BatonConfig(model="/models/Qwen3-0.6B/", served_model_name="qwen")
    assert served_model_id(named) == "qwen"
    assert parse_completion({"model": "qwen", "prompt": "x"}, named).baton["prompt"] == "x"
    with pytest.raises(ApiError) as info:
        parse_completion({"model": "gpt-4", "prompt": "x"}, CONFIG)
    assert (info.value.status, info.value.code) == (404, "model_not_found")


@pytest.mark.parametrize(
    ("code", "status", "err_code", "retry_after"),
    [
        ("invalid_request", 400, "invalid_request", None),
        ("prompt_too_long", 400, "context_length_exceeded", None),
        ("overloaded", 503, "overloaded", "1"),
        ("timeout", 504, "timeout", None),
        ("internal", 500, "internal", None),
        ("something_new", 500, "something_new", None),
    ],
)
def test_error_replies_map_to_statuses(
    code: str, status: int, err_code: str, retry_after: str | None
) -> None:
    err = from_error_reply(ErrorReply("r", code, "why"))
    assert (err.status, err.code, err.headers.get("Retry-After")) == (status, err_code, retry_after)
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_invalid_reply_names_the_field_when_it_can() -> None:
    assert from_error_reply(
        ErrorReply("r", "invalid_request", "top_p must be in (0, 1]")
    ).param == ("top_p")
    assert from_error_reply(ErrorReply("r", "invalid_request", "messages[0].role bad")).param == (
        "messages"
    )
    assert from_error_reply(ErrorReply("r", "invalid_request", "body is bad")).param is None


def test_client_exceptions_map_to_statuses() -> None:
    timeout = from_exception(asyncio.TimeoutError("slow"))
    assert timeout is not None and timeout.status == 504
    for exc in (BatonUnavailable("down"), BatonConnectionLost("gone")):
        err = from_exception(exc)
        assert err is not None and err.status == 503 and "Retry-After" in err.headers
    assert from_exception(KeyError("bug")) is None


def test_finish_reasons() -> None:
    assert [finish_reason(r) for r in ("stop", "length", "timeout", "cancelled")] == [
        "stop", "length", "length", "abort",
    ]  # fmt: skip


def _events(raw: bytes) -> list[Any]:
    assert raw.endswith(b"\n\n")
    return [
        e[len("data: ") :] if e == "data: [DONE]" else json.loads(e[len("data: ") :])
        for e in raw.decode().split("\n\n")
        if e
    ]


def test_chunks_follow_openai_format() -> None:
    done = DoneReply("r", "ab", [1, 2], "stop", {"prompt_tokens": 4, "completion_tokens": 2}, {})
    chat = Formatter("chatcmpl-1", "m", chat=True, include_usage=True)
    role, delta = _events(chat.chunk(role=True))[0], _events(chat.chunk("ab"))[0]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert delta["object"] == "chat.completion.chunk" and delta["usage"] is None
    end, usage, last = _events(chat.finish(done))
    assert end["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop", "stop_reason": None}
    ]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
    }  # fmt: skip
    assert last == "[DONE]"
    text = Formatter("cmpl-1", "m", chat=False)
    (only,) = _events(text.chunk("x"))
    assert only["object"] == "text_completion" and "usage" not in only
    choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": None}
    assert only["choices"] == [choice]
    assert len(_events(text.finish(done))) == 2  # finish, [DONE]: no usage unless asked


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.9", "::1", "localhost"])
def test_loopback_needs_no_key(host: str) -> None:
    assert is_loopback(host)
    check_exposure(BatonConfig(gateway_host=host))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gateway.example"])
def test_public_bind_needs_a_key_or_an_explicit_opt_out(host: str) -> None:
    with pytest.raises(GatewayConfigError, match="BATON_API_KEY"):
        check_exposure(BatonConfig(gateway_host=host))
    check_exposure(BatonConfig(gateway_host=host, api_key="k"))
    check_exposure(BatonConfig(gateway_host=host, gateway_allow_no_auth=True))


def test_the_key_stays_out_of_the_config_repr() -> None:
    assert "s3cr3t" not in repr(BatonConfig(api_key="s3cr3t"))
    assert BatonConfig.from_env({"BATON_API_KEY": "s3cr3t"}).api_key == "s3cr3t"


def test_n_choices_and_best_of_equal_to_it() -> None:
    req = parse_completion({"prompt": "x", "n": 3, "best_of": 3}, CONFIG)
    assert req.baton["n"] == 3 and req.n == 3
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 2}, CONFIG, LIMITS)
    assert chat.n == 2 and "n" not in parse_completion({"prompt": "x", "n": 1}, CONFIG).baton


def test_n_choices_in_a_response_and_its_chunks() -> None:
    usage = {"prompt_tokens": 4, "completion_tokens": 2}
    dones = [DoneReply("r", t, [1] * len(t), "length", usage, {}, choice_index=i)
             for i, t in enumerate(["ab", "cd", "ef"])]  # fmt: skip
    chat = Formatter("chatcmpl-1", "m", chat=True, include_usage=True)
    out = chat.completion(dones)
    assert [(c["index"], c["message"]["content"]) for c in out["choices"]] == [
        (0, "ab"), (1, "cd"), (2, "ef"),
    ]  # fmt: skip
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    (delta,) = _events(chat.chunk("cd", index=1))
    assert delta["choices"][0]["index"] == 1 and delta["choices"][0]["delta"] == {"content": "cd"}
    (end,) = _events(chat.finish_choice(dones[2], 2))
    assert end["choices"][0] == {
        "index": 2,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    usage_event, last = _events(chat.close(dones))
    assert usage_event["usage"]["completion_tokens"] == 6 and last == "[DONE]"
