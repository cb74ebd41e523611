"""The gateway's HTTP behaviour over a scripted Baton: real uvicorn, real openai client, no broker.

What Baton would answer is scripted (tests/gateway/fakes.py); everything between the socket and
the client library (routing, auth, body limits, JSON and SSE framing, status codes, disconnect
handling) is the real gateway.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from structlog.testing import capture_logs

from services.gateway.api_requests import parse_completion
from services.gateway.exchange import SCOPE_STATUS, Exchange
from services.gateway.metrics import GatewayMetrics
from services.gateway.service import GatewayService
from shared.client import BatonUnavailable
from shared.config import BatonConfig
from shared.wire.messages import DoneReply, TokenReply
from tests.gateway.conftest import API_KEY, OFFLINE_MAX_BODY
from tests.gateway.fakes import HANG, FakeBaton, error, tokens_then_done

CHAT = [{"role": "user", "content": "hi"}]


def _openai(url: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def test_fields_reach_baton_mapped(baton: FakeBaton, offline_url: str) -> None:
    client = _openai(offline_url)
    out = await client.chat.completions.create(
        model="smollm2-135m-instruct", messages=CHAT, max_completion_tokens=7, temperature=0.5,
        stop="\n",
        seed=3, extra_body={"top_k": 5, "priority": 2, "ignore_eos": True, "timeout_s": 9},
    )  # fmt: skip
    assert out.choices[0].message.content == "Hello" and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        3, 2, 5,
    )  # fmt: skip
    (call,) = baton.calls
    assert call["messages"] == CHAT and call["request_id"] == out.id
    assert {k: call[k] for k in ("max_tokens", "temperature", "stop", "seed", "top_k")} == {
        "max_tokens": 7, "temperature": 0.5, "stop": ["\n"], "seed": 3, "top_k": 5,
    }  # fmt: skip
    assert (call["priority"], call["ignore_eos"], call["timeout_s"], call["stream"]) == (
        2, True, 9.0, False,
    )  # fmt: skip


async def test_streamed_completion_with_usage(baton: FakeBaton, offline_url: str) -> None:
    stream = await _openai(offline_url).completions.create(
        model="smollm2-135m-instruct", prompt=[1, 2, 3], max_tokens=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert baton.calls[0]["prompt_token_ids"] == [1, 2, 3] and baton.calls[0]["stream"] is True


async def test_streamed_chat_opens_with_the_role(baton: FakeBaton, offline_url: str) -> None:
    baton.script = tokens_then_done("a", "b", "c", finish_reason="stop")
    stream = await _openai(offline_url).chat.completions.create(
        model="smollm2-135m-instruct", messages=CHAT, stream=True
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "abc"
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage is None


async def test_raw_sse_framing_ends_with_done(baton: FakeBaton, offline_url: str) -> None:
    async with httpx.AsyncClient(base_url=offline_url) as http:
        r = await http.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    assert r.headers["x-request-id"] == json.loads(events[0][6:])["id"]


@pytest.mark.parametrize(
    ("code", "status"),
    [("invalid_request", 400), ("prompt_too_long", 400), ("overloaded", 503),
     ("timeout", 504), ("internal", 500)],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
async def test_baton_errors_are_http_statuses(
    baton: FakeBaton, offline_url: str, code: str, status: int, stream: bool
) -> None:
    baton.script = error(code, "nope")
    async with httpx.AsyncClient(base_url=offline_url) as http:
        r = await http.post("/v1/completions", json={"prompt": "x", "stream": stream})
    assert r.status_code == status and r.json()["error"]["message"] == "nope"
    assert ("retry-after" in r.headers) == (code == "overloaded")


async def test_unreachable_baton_is_503_and_a_lost_reply_504(
    baton: FakeBaton, offline_url: str
) -> None:
    async with httpx.AsyncClient(base_url=offline_url) as http:
        baton.script = lambda rid, kw: [BatonUnavailable("no queue")]
        r = await http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        baton.script = lambda rid, kw: [asyncio.TimeoutError("no reply")]
        r = await http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"


async def test_error_after_the_first_token_travels_in_the_stream(
    baton: FakeBaton, offline_url: str
) -> None:
    baton.script = lambda rid, kw: [
        *tokens_then_done("a")(rid, kw)[:1],
        *error("internal")(rid, kw),
    ]
    stream = await _openai(offline_url).completions.create(
        model="smollm2-135m-instruct", prompt="x", stream=True
    )
    with pytest.raises(openai.APIError, match="refused"):
        async for _ in stream:
            pass


@pytest.mark.parametrize(
    ("body", "param"),
    [({"n": 2, "best_of": 1}, "best_of"), ({"logprobs": True}, "logprobs"),
     ({"echo": "yes"}, "echo"), ({"best_of": 2}, "best_of"), ({"prompt": ["a", "b"]}, "prompt"),
     ({"model": "gpt-4"}, "model")],
)  # fmt: skip
async def test_unsupported_requests_are_refused(
    baton: FakeBaton, offline_url: str, body: dict[str, object], param: str
) -> None:
    async with httpx.AsyncClient(base_url=offline_url) as http:
        r = await http.post("/v1/completions", json={"prompt": "x", **body})
    assert r.status_code == (404 if param == "model" else 400)
    assert r.json()["error"]["param"] == param and not baton.calls


async def test_malformed_bodies(baton: FakeBaton, offline_url: str) -> None:
    async with httpx.AsyncClient(base_url=offline_url) as http:
        r = await http.post("/v1/completions", content=b'{"prompt": "x",')
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await http.post("/v1/chat/completions", json=[1, 2])
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
        big = json.dumps({"prompt": "x" * OFFLINE_MAX_BODY}).encode()
        r = await http.post("/v1/completions", content=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        async def chunked():  # no Content-Length: the limit applies while reading
            for _ in range(OFFLINE_MAX_BODY // 8192 + 2):
                yield b" " * 8192

        r = await http.post("/v1/completions", content=chunked())
        assert r.status_code == 413
        r = await http.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = await http.get("/v1/completions")
        assert r.status_code == 405
    assert not baton.calls


async def test_bearer_auth(baton: FakeBaton, offline_keyed: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        await _openai(offline_keyed, "wrong").models.list()
    async with httpx.AsyncClient(base_url=offline_keyed) as http:
        r = await http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (await http.get("/health")).status_code == 200  # probes carry no key
        assert (await http.get("/metrics")).status_code == 200
    models = await _openai(offline_keyed, API_KEY).models.list()
    assert [m.id for m in models.data] == ["smollm2-135m-instruct"]
    assert len(baton.calls) == 0


async def test_disconnect_mid_stream_cancels_the_request(
    baton: FakeBaton, offline: GatewayService, offline_url: str
) -> None:
    baton.script = lambda rid, kw: [tokens_then_done("a")(rid, kw)[0], HANG]
    before = _count(offline, "baton:http_client_disconnects_total", route="/v1/completions")
    with capture_logs() as logs:
        body = {"prompt": "x", "stream": True}
        async with httpx.AsyncClient(base_url=offline_url) as http:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    break  # one chunk, then hang up
        await _until(lambda: bool(baton.closed_early))
    rid = baton.calls[0]["request_id"]
    assert baton.closed_early == [rid]  # closing the stream is what publishes the cancel
    assert {"event": "request cancelled by client disconnect", "request_id": rid} in [
        {k: e.get(k) for k in ("event", "request_id")} for e in logs
    ]
    after = _count(offline, "baton:http_client_disconnects_total", route="/v1/completions")
    assert after == before + 1
    assert _count(offline, "baton:http_requests_total", route="/v1/completions", status="499") >= 1


async def test_disconnect_while_queued_cancels_too(baton: FakeBaton, offline_url: str) -> None:
    baton.script = lambda rid, kw: [HANG]  # nothing written yet: only the watch can notice
    async with httpx.AsyncClient(base_url=offline_url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json={"messages": CHAT})
    await _until(lambda: bool(baton.closed_early))
    assert baton.closed_early == [baton.calls[0]["request_id"]]


def _count(service: GatewayService, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_a_write_refused_by_the_server_counts_as_a_disconnect(baton: FakeBaton) -> None:
    """ASGI servers of spec 2.4 and later raise OSError on a write to a closed connection."""
    baton.script = lambda rid, kw: [tokens_then_done("a")(rid, kw)[0], HANG]
    req = parse_completion({"prompt": "x", "stream": True}, BatonConfig())
    exchange = Exchange(baton, req, "cmpl-oserror", GatewayMetrics("m"))  # type: ignore[arg-type]
    scope: dict[str, Any] = {"type": "http", "path": "/v1/completions"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            raise OSError("connection closed")

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # this server never reports the disconnect
        raise AssertionError

    with capture_logs() as logs:
        await asyncio.wait_for(exchange(scope, receive, send), 5)  # type: ignore[arg-type]
    assert baton.closed_early == ["cmpl-oserror"] and scope[SCOPE_STATUS] == 499
    assert any(e["event"] == "request cancelled by client disconnect" for e in logs)


def _two_choices(rid: str, _kw: dict[str, Any]) -> list[Any]:
    """Choice 1's replies interleaved with choice 0's; choice 1 ends first."""

    def done(text: str, i: int) -> DoneReply:
        usage = {"prompt_tokens": 3, "completion_tokens": len(text)}
        return DoneReply(rid, text, [1] * len(text), "length", usage, {}, choice_index=i)

    return [
        TokenReply(rid, "a", [1], 0, 0, choice_index=0),
        TokenReply(rid, "x", [1], 0, 0, choice_index=1),
        TokenReply(rid, "y", [1], 1, 1, choice_index=1),
        done("xy", 1),
        TokenReply(rid, "b", [1], 1, 1, choice_index=0),
        done("abc", 0),  # its tail "c" never came as a token reply: sent with the finish
    ]


async def test_n_choices_streamed_and_not(baton: FakeBaton, offline_url: str) -> None:
    baton.script = _two_choices
    client = _openai(offline_url)
    out = await client.completions.create(model="smollm2-135m-instruct", prompt="x", n=2)
    assert [(c.index, c.text) for c in out.choices] == [(0, "abc"), (1, "xy")]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 5)
    assert baton.calls[-1]["n"] == 2
    stream = await client.chat.completions.create(
        model="smollm2-135m-instruct", messages=CHAT, n=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    texts = ["", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == ["abc", "xy"]
    finishes = [
        (ch.index, ch.finish_reason) for c in chunks for ch in c.choices if ch.finish_reason
    ]
    assert finishes == [(1, "length"), (0, "length")]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
