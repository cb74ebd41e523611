"""Logprobs, echo and stop_reason in the gateway, over a scripted Baton (no broker): the fields
Baton gets, and the shapes of OpenAI's and vLLM's answers, streamed and not."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from services.gateway.api_requests import parse_chat, parse_completion
from shared.config import BatonConfig
from shared.limits import Limits
from shared.wire.messages import DoneReply, Reply, TokenReply
from tests.gateway.fakes import FakeBaton

CONFIG = BatonConfig()
LIMITS = Limits.build(CONFIG, max_position_embeddings=4096)
CHAT = [{"role": "user", "content": "hi"}]
USAGE = {"prompt_tokens": 2, "completion_tokens": 2}


def entry(token_id: int, text: str, logprob: float | None, top: int = 2) -> list[Any]:
    alternatives = [[token_id, text, logprob], [99, "zz", -7.0]][:top] if logprob else []
    return [token_id, text, logprob, 1 if logprob is not None else None, alternatives]


PROMPT = [entry(5, "ab", None), entry(6, "c", -1.5)]
OUTPUT = [entry(7, " d", -0.5), entry(8, "e", float("-inf"))]


def script(rid: str, _kw: dict[str, Any]) -> list[Reply]:
    return [
        TokenReply(rid, " d", [7], 0, 0, logprobs=OUTPUT[:1], prompt_logprobs=PROMPT),
        TokenReply(rid, "", [8], 1, 2, logprobs=OUTPUT[1:]),  # no text yet: still scored
        DoneReply(rid, " d", [7, 8], "stop", USAGE, {}, logprobs=OUTPUT, prompt_logprobs=PROMPT,
                  stop_reason="END"),
    ]  # fmt: skip


def test_fields_baton_gets() -> None:
    c = parse_completion({"prompt": "x", "logprobs": 2, "echo": True}, CONFIG)
    assert (c.baton["logprobs"], c.baton["prompt_logprobs"], c.echo_text) == (2, 2, "x")
    lm_eval = parse_completion({"prompt": [[1, 2]], "logprobs": 1, "echo": True,
                                "max_tokens": 0}, CONFIG)  # fmt: skip
    assert lm_eval.baton["max_tokens"] == 1 and lm_eval.options.echo_only
    assert lm_eval.echo_text is None  # token ids: the app decodes them
    assert parse_completion({"prompt": "x", "max_tokens": 0}, CONFIG).baton["max_tokens"] == 0
    vllm = parse_completion({"prompt": "x", "logprobs": 1, "prompt_logprobs": 4}, CONFIG)
    assert (vllm.baton["logprobs"], vllm.baton["prompt_logprobs"]) == (1, 4)
    chat = parse_chat({"messages": CHAT, "logprobs": True, "top_logprobs": 3}, CONFIG, LIMITS)
    assert chat.baton["logprobs"] == 3 and "prompt_logprobs" not in chat.baton
    plain = parse_chat({"messages": CHAT, "logprobs": False}, CONFIG, LIMITS).baton
    assert "logprobs" not in plain
    off = parse_completion({"prompt": "x", "logprobs": False, "echo": False}, CONFIG).baton
    assert "logprobs" not in off and "prompt_logprobs" not in off


async def post(url: str, body: dict[str, Any]) -> Any:
    async with httpx.AsyncClient(base_url=url) as http:
        r = await http.post(body.pop("path", "/v1/completions"), json=body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()
    return [json.loads(e[6:]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]


async def test_completion_with_echo_and_logprobs(baton: FakeBaton, offline_url: str) -> None:
    baton.script = script
    out = await post(offline_url, {"prompt": "abc", "logprobs": 1, "echo": True})
    (choice,) = out["choices"]
    assert choice["text"] == "abc d" and choice["stop_reason"] == "END"
    assert choice["logprobs"] == {
        "tokens": ["ab", "c", " d", "e"],
        "token_logprobs": [None, -1.5, -0.5, -9999.0],  # -inf as vLLM sends it
        "top_logprobs": [None, {"c": -1.5}, {" d": -0.5}, {"e": -9999.0}],
        "text_offset": [0, 2, 3, 5],
    }
    assert "prompt_logprobs" not in choice  # vLLM's field only when asked for


async def test_streamed_echo_scores_the_prompt_first(baton: FakeBaton, offline_url: str) -> None:
    baton.script = script
    chunks = await post(offline_url, {"prompt": "abc", "logprobs": 2, "echo": True,
                                      "stream": True})  # fmt: skip
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts == ["abc", " d", "", ""]
    scored = [c["choices"][0]["logprobs"] for c in chunks]
    assert scored[0]["tokens"] == ["ab", "c"] and scored[0]["token_logprobs"] == [None, -1.5]
    assert scored[1]["top_logprobs"] == [{" d": -0.5, "zz": -7.0}]
    assert [s["text_offset"] for s in scored[:3]] == [[0, 2], [3], [5]]  # it runs on
    assert scored[3] is None and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == "END"


async def test_echo_without_generation(baton: FakeBaton, offline_url: str) -> None:
    baton.script = script
    out = await post(offline_url, {"prompt": "abc", "logprobs": 0, "echo": True, "max_tokens": 0})
    assert out["choices"][0]["text"] == "abc"
    assert out["choices"][0]["logprobs"]["tokens"] == ["ab", "c"]
    (call,) = baton.calls
    assert (call["max_tokens"], call["prompt_logprobs"]) == (1, 0)
    baton.calls.clear()
    chunks = await post(offline_url, {"prompt": "abc", "echo": True, "max_tokens": 0,
                                      "stream": True})  # fmt: skip
    assert [c["choices"][0]["text"] for c in chunks] == ["abc", ""]


async def test_chat_logprobs_and_vllm_prompt_logprobs(baton: FakeBaton, offline_url: str) -> None:
    baton.script = script
    body = {"path": "/v1/chat/completions", "messages": CHAT, "logprobs": True, "top_logprobs": 1,
            "prompt_logprobs": 1, "return_tokens_as_token_ids": True}  # fmt: skip
    out = await post(offline_url, body)
    content = out["choices"][0]["logprobs"]["content"]
    assert content[0] == {
        "token": "token_id:7", "logprob": -0.5, "bytes": list(b"token_id:7"),
        "top_logprobs": [{"token": "token_id:7", "logprob": -0.5, "bytes": list(b"token_id:7")}],
    }  # fmt: skip
    assert out["prompt_logprobs"] == [
        None, {"6": {"logprob": -1.5, "rank": 1, "decoded_token": "token_id:6"}},
    ]  # fmt: skip
    assert out["choices"][0]["stop_reason"] == "END"


async def test_streamed_chat_sends_scores_of_tokens_without_text(
    baton: FakeBaton, offline_url: str
) -> None:
    baton.script = script
    body = {"path": "/v1/chat/completions", "messages": CHAT, "logprobs": True, "stream": True}
    chunks = await post(offline_url, body)
    scored = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [[i["token"] for i in s["content"]] for s in scored] == [[" d"], ["e"]]
    assert all(i["top_logprobs"] == [] for s in scored for i in s["content"])


@pytest.mark.parametrize(
    ("body", "param"),
    [({"logprobs": 1, "messages": CHAT}, "logprobs"),
     ({"top_logprobs": 1, "messages": CHAT}, "top_logprobs"),
     ({"prompt": "x", "prompt_logprobs": 0, "stream": True}, "prompt_logprobs")],
)  # fmt: skip
async def test_refusals(
    baton: FakeBaton, offline_url: str, body: dict[str, Any], param: str
) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with httpx.AsyncClient(base_url=offline_url) as http:
        r = await http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and not baton.calls
