"""The gateway over the real system (four services, RabbitMQ), driven by the official openai client.

Requests are short (a few greedy tokens on the tiny model) so the whole module stays within a few
seconds once the system is up.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from services.shell.registry import port_offset
from shared.client import BatonClient
from shared.observability.http_server import read_metrics
from shared.wire.messages import DoneReply
from tests.gateway.conftest import API_KEY, Live

pytestmark = pytest.mark.integration

MODEL = "tiny-random"  # BATON_MODEL of the suite (tests/conftest.py)
PROMPT_IDS = [11, 12, 13, 14, 15]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


def _openai(url: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def test_completion_equals_the_queue_and_the_stream_adds_up(live: Live) -> None:
    client = _openai(live.url)
    out = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, **GREEDY)
    text = out.choices[0].text
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        5, 8, 13,
    )  # fmt: skip
    async with await BatonClient.connect(live.system.amqp_url) as direct:
        same = await direct.generate(
            prompt_token_ids=PROMPT_IDS, max_tokens=8, ignore_eos=True, wait_s=60
        )
    assert isinstance(same, DoneReply) and same.text == text  # the gateway adds nothing

    stream = await client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, stream=True, stream_options={"include_usage": True},
        **GREEDY,
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == out.usage


async def test_chat_streamed_and_not_agree(live: Live) -> None:
    client = _openai(live.url)
    out = await client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    message = out.choices[0].message
    assert out.object == "chat.completion" and message.role == "assistant"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 5  # the template's
    stream = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **GREEDY)
    chunks = [c async for c in stream]
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_models_health_metrics(live: Live) -> None:
    models = await _openai(live.url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with httpx.AsyncClient(base_url=live.url) as http:
        assert (await http.get("/health")).status_code == 200
        text = (await http.get("/metrics")).text
    assert 'baton:http_requests_total{route="/v1/models",status="200"}' in text


async def test_the_gateway_metrics_show_the_latencies_it_served(live: Live) -> None:
    """10 requests (5 streamed, 5 not), each one observation of time to first token and e2e
    and 7 gaps between tokens, labelled with the served model, in the gateway's own /metrics."""
    series = {
        "ttft": "baton:time_to_first_token_seconds",
        "itl": "baton:inter_token_latency_seconds",
        "tpot": "baton:time_per_output_token_seconds",
        "request_tpot": "baton:request_time_per_output_token_seconds",
        "e2e": "baton:e2e_request_latency_seconds",
        "max_tokens": "baton:request_params_max_tokens",
        "n": "baton:request_params_n",
    }

    async def scrape() -> dict[str, tuple[float, float]]:
        async with httpx.AsyncClient(base_url=live.url) as http:
            text = (await http.get("/metrics")).text
        got = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.labels.get("model_name") == MODEL and s.name.endswith(("_sum", "_count")):
                    got[s.name] = s.value
        return {k: (got[f"{v}_count"], got[f"{v}_sum"]) for k, v in series.items()}

    before = await scrape()
    client = _openai(live.url)

    async def one(stream: bool) -> None:
        out = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, stream=stream,
                                              **GREEDY)  # fmt: skip
        if stream:
            assert [c async for c in out]

    await asyncio.gather(*(one(stream=i % 2 == 0) for i in range(10)))
    after = await scrape()
    moved = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in series}
    for key in ("ttft", "request_tpot", "e2e"):
        assert moved[key][0] == 10 and moved[key][1] > 0, (key, moved[key])
    for key in ("itl", "tpot"):
        assert moved[key][0] == 10 * 7 and moved[key][1] > 0, (key, moved[key])
    assert moved["max_tokens"] == (10, 80) and moved["n"] == (10, 10)
    # a request's gaps add up to its first-to-last time, whose mean is its time per token
    assert moved["itl"][1] == pytest.approx(7 * moved["request_tpot"][1], rel=1e-6)


async def test_errors_from_baton(live: Live) -> None:
    client = _openai(live.url)
    with pytest.raises(openai.BadRequestError) as bad:  # the tokenizer's range check
        await client.completions.create(model=MODEL, prompt="x", top_p=1.5)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "top_p"  # type: ignore[index]
    too_long = [1] * (live.gateway.config.max_prompt_tokens + 1)
    with pytest.raises(openai.BadRequestError) as long:
        await client.completions.create(model=MODEL, prompt=too_long, max_tokens=1)
    assert long.value.code == "context_length_exceeded"
    with pytest.raises(openai.APIStatusError) as late:
        await client.completions.create(
            model=MODEL, prompt="x", max_tokens=64, extra_body={"timeout_s": 0.001}
        )
    assert late.value.status_code == 504 and late.value.code == "timeout"
    for extra in ({"n": 2, "best_of": 3}, {"logprobs": 21}):  # logprobs: the tokenizer's 0..20
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=MODEL, prompt="x", **extra)  # type: ignore[arg-type]


async def test_overloaded_is_503_with_retry_after(live: Live) -> None:
    with pytest.raises(openai.APIStatusError) as full:
        await _openai(live.overloaded_url).completions.create(model=MODEL, prompt="x")
    assert full.value.status_code == 503 and full.value.code == "overloaded"
    assert full.value.response.headers["retry-after"] == "1"


async def test_api_key(live: Live) -> None:
    with pytest.raises(openai.AuthenticationError):
        await _openai(live.keyed_url, "wrong").completions.create(model=MODEL, prompt="x")
    out = await _openai(live.keyed_url, API_KEY).completions.create(
        model=MODEL, prompt="x", max_tokens=2, temperature=0
    )
    assert out.usage.completion_tokens >= 1


async def test_client_disconnect_cancels_in_baton(live: Live) -> None:
    detok_port = live.metrics_port + port_offset("detokenizer")
    key = "baton:request_success_total{finished_reason=cancelled}"
    before = read_metrics(detok_port).get(key, 0.0)
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 2000, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    with capture_logs() as logs:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                rid = r.headers["x-request-id"]
                async for _ in r.aiter_bytes():
                    break  # the first tokens, then hang up
        for _ in range(100):  # the detokenizer answers the cancel with a "cancelled" done
            if read_metrics(detok_port).get(key, 0.0) > before:
                break
            await asyncio.sleep(0.1)
    assert read_metrics(detok_port).get(key, 0.0) >= before + 1
    assert any(
        e["event"] == "request cancelled by client disconnect" and e.get("request_id") == rid
        for e in logs
    )


async def test_n_choices_share_one_prefill(live: Live) -> None:
    """n = 4 with a seed: four distinct completions, the same again for the same seed, from one
    prefill (the prefill service's batch_size histogram counts the sequences it computed); greedy
    n = 2 gives the n = 1 completion twice, streamed with each choice's index."""
    prefill_port = live.metrics_port + port_offset("prefill")
    computed = "baton:batch_size_sum"
    client = _openai(live.url)
    sampled = {"temperature": 1.0, "max_tokens": 16, "seed": 1234, "n": 4,
               "extra_body": {"ignore_eos": True}}  # fmt: skip
    before = read_metrics(prefill_port).get(computed, 0.0)
    out = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, **sampled)
    assert read_metrics(prefill_port).get(computed, 0.0) == before + 1  # one prefill, four choices
    texts = [c.text for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and len(set(texts)) == 4
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 4 * 16)  # prompt once
    again = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, **sampled)
    assert [c.text for c in again.choices] == texts

    one = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, **GREEDY)
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, n=2, stream=True, **GREEDY
    )
    streamed = ["", ""]
    async for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [one.choices[0].text] * 2
