"""``n`` > 1 through the real services, on each KV transport: every choice's stream adds up to its
done reply, each choice answered once; greedy choices equal Hugging Face's greedy output; a stop
string ends its choice alone; a cancel ends every choice and decode gives every block back."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from services.shell.common import resolve_model_dir
from services.shell.registry import port_offset
from shared.client import BatonClient
from shared.client.dedup import stream_mismatch
from shared.config import BatonConfig
from shared.observability.http_server import read_metrics
from shared.wire.messages import DoneReply, Reply, TokenReply
from tests.integration.test_pipeline import _hf_greedy

pytestmark = pytest.mark.integration


async def _choices(
    client: BatonClient, n: int, **kw: object
) -> tuple[list[DoneReply], list[Reply]]:
    replies = [r async for r in client.stream(n=n, **kw)]  # type: ignore[arg-type]
    dones = [r for r in replies if isinstance(r, DoneReply)]
    assert sorted(d.choice_index for d in dones) == list(range(n))  # type: ignore[type-var]
    return sorted(dones, key=lambda d: d.choice_index or 0), replies


async def test_greedy_choices_equal_hf(client: BatonClient) -> None:
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(BatonConfig.from_env())))
    ids = tok.encode("Once upon a time")
    dones, _ = await _choices(client, 2, prompt_token_ids=ids, max_tokens=24, stream=False)
    expected = _hf_greedy(ids, 24)
    assert [d.token_ids for d in dones] == [expected, expected]


async def test_choices_stream_once_each_and_a_stop_ends_its_own(client: BatonClient) -> None:
    kw = {"prompt": "Sample me", "max_tokens": 24, "temperature": 1.0, "seed": 11}
    dones, replies = await _choices(client, 3, ignore_eos=True, **kw)
    assert len({tuple(d.token_ids) for d in dones}) == 3
    for i, done in enumerate(dones):
        mine = [r for r in replies if isinstance(r, TokenReply) and r.choice_index == i]
        assert stream_mismatch(done, mine) is None
    stop = dones[0].text[4:7]  # somewhere in choice 0, after a few tokens
    stopped, _ = await _choices(client, 3, ignore_eos=True, stop=[stop], **kw)
    assert stopped[0].finish_reason == "stop" and stopped[0].text == dones[0].text[:4]
    for before, after in zip(dones[1:], stopped[1:], strict=True):
        assert stop in before.text or after.token_ids == before.token_ids


async def test_a_cancel_ends_every_choice_and_frees_every_block(
    client: BatonClient, metrics_port: int
) -> None:
    decode_port = metrics_port + port_offset("decode")
    seen: list[Reply] = []
    async for r in client.stream("a long one", n=3, max_tokens=1000, ignore_eos=True):
        seen.append(r)
        if len(seen) == 4:
            await client.cancel(r.request_id)
    dones = [r for r in seen if isinstance(r, DoneReply)]
    assert sorted(d.choice_index or 0 for d in dones) == [0, 1, 2]
    assert {d.finish_reason for d in dones} == {"cancelled"}
    for _ in range(50):  # the abort reaches decode a moment after the done replies
        if read_metrics(decode_port).get("baton:kv_blocks_used", -1) == 0:
            break
        await asyncio.sleep(0.1)
    assert read_metrics(decode_port)["baton:kv_blocks_used"] == 0
