"""Logprobs through the whole system (gateway, four services, RabbitMQ), driven by the official
openai client, against Hugging Face's ``log_softmax`` on the same weights (fp32) within 1e-4:
completions and chat, streamed and not; a completion's echoed prompt, and the exact request
lm-evaluation-harness's ``local-completions`` sends for a log-likelihood (``echo``,
``max_tokens`` 0 or 1, ``logprobs`` 1)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.shell.common import resolve_model_dir
from tests.gateway.conftest import Live
from tests.runtime.helpers import torch_threads

pytestmark = pytest.mark.integration

MODEL = "tiny-random"
PROMPT_IDS = [11, 12, 13, 14, 15, 16, 17]
CHAT = [{"role": "user", "content": "Hello there"}]
AS_IDS = {"return_tokens_as_token_ids": True, "ignore_eos": True}
TOL = 1e-4


@pytest.fixture(scope="module")
def hf(live: Live) -> Iterator[Any]:
    path = resolve_model_dir(live.gateway.config)
    with torch_threads(1):
        yield AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def rows(hf: Any, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` log-probabilities: row ``p`` scores the token at ``p + 1``."""
    with torch.inference_mode(), torch_threads(1):
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def ids_of(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.split(":")[1]) for t in tokens]


def check_scores(hf: Any, prompt: list[int], out: list[int], logprobs: list[float]) -> None:
    lp = rows(hf, prompt + out)
    want = [lp[len(prompt) + i - 1, t].item() for i, t in enumerate(out)]
    assert max(abs(a - b) for a, b in zip(logprobs, want, strict=True)) < TOL


async def test_completion_logprobs_equal_hf_streamed_and_not(live: Live, hf: Any) -> None:
    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    args: dict[str, Any] = dict(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0, logprobs=3, extra_body=AS_IDS
    )
    out = await client.completions.create(**args)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    tokens = ids_of(lp.tokens)
    assert len(tokens) == 6 == out.usage.completion_tokens
    check_scores(hf, PROMPT_IDS, tokens, lp.token_logprobs)
    table = rows(hf, PROMPT_IDS + tokens)
    for i, top in enumerate(lp.top_logprobs):
        row = table[len(PROMPT_IDS) + i - 1]
        want = {f"token_id:{t}": v for t, v in zip(*map(list, row.topk(3)[::-1]), strict=True)}
        assert set(top) == set(want)  # greedy: the chosen token is the most likely one
        assert all(abs(top[k] - want[k]) < TOL for k in want)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]

    chunks = [c async for c in await client.completions.create(stream=True, **args)]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


async def test_chat_logprobs_equal_hf_streamed_and_not(live: Live, hf: Any) -> None:
    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    args: dict[str, Any] = dict(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
        extra_body=AS_IDS,
    )  # fmt: skip
    out = await client.chat.completions.create(**args)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    async with httpx.AsyncClient(base_url=live.url) as http:
        prompt = (await http.post("/tokenize", json={"messages": CHAT})).json()["tokens"]
    tokens = ids_of([c.token for c in content])
    check_scores(hf, prompt, tokens, [c.logprob for c in content])
    for c in content:
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token  # greedy

    chunks = [c async for c in await client.chat.completions.create(stream=True, **args)]
    streamed = [
        item for c in chunks if c.choices and c.choices[0].logprobs
        for item in c.choices[0].logprobs.content or []
    ]  # fmt: skip
    assert [(s.token, s.logprob) for s in streamed] == [(c.token, c.logprob) for c in content]


@pytest.mark.parametrize("max_tokens", [0, 1])
async def test_echo_scores_the_prompt_as_lm_eval_asks(live: Live, hf: Any, max_tokens: int) -> None:
    """lm-evaluation-harness's local-completions log-likelihood request, as it sends it, and
    as its ``parse_logprobs`` reads the answer (token_logprobs[ctxlen:-1] summed)."""
    body = {
        "model": MODEL, "prompt": [PROMPT_IDS], "temperature": 0, "max_tokens": max_tokens,
        "logprobs": 1, "seed": 1234, "echo": True,
    }  # fmt: skip
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
        r = await http.post("/v1/completions", json=body)
        detok = await http.post("/detokenize", json={"tokens": PROMPT_IDS})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    n = len(PROMPT_IDS) + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    table = rows(hf, PROMPT_IDS)
    want = [table[p - 1, PROMPT_IDS[p]].item() for p in range(1, len(PROMPT_IDS))]
    got = lp["token_logprobs"][1 : len(PROMPT_IDS)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL
    for top, value in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:], strict=True):
        assert value in top.values() and len(top) <= 2  # the chosen one and the best one
    assert choice["text"].startswith(detok.json()["prompt"])
    if max_tokens == 0:
        assert choice["text"] == detok.json()["prompt"]  # the prompt alone
    ctxlen = 3  # lm-eval's continuation: the prompt's tokens after the context
    assert sum(lp["token_logprobs"][ctxlen : len(PROMPT_IDS)]) == pytest.approx(
        sum(want[ctxlen - 1 :]), abs=5 * TOL
    )


async def test_prompt_logprobs_in_vllms_shape(live: Live, hf: Any) -> None:
    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    out = await client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": 1},
    )  # fmt: skip
    scored = out.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert out.choices[0].logprobs is None and scored[0] is None
    table = rows(hf, PROMPT_IDS)
    for p in range(1, len(PROMPT_IDS)):
        own = scored[p][str(PROMPT_IDS[p])]
        assert abs(own["logprob"] - table[p - 1, PROMPT_IDS[p]].item()) < TOL
        assert own["rank"] == int((table[p - 1] >= table[p - 1, PROMPT_IDS[p]]).sum())
        best = int(table[p - 1].argmax())
        assert scored[p][str(best)]["rank"] == 1
