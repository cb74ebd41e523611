"""End to end through the real broker: streaming, parity with HF, many requests at once."""

from __future__ import annotations

import asyncio
import random
import uuid

import aio_pika
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.shell.common import resolve_model_dir
from shared.client import BatonClient
from shared.config import BatonConfig
from shared.wire.messages import (
    DoneReply,
    RequestMsg,
    SamplingParams,
    TokenReply,
    decode_replies,
)
from shared.wire.queues import REQUESTS_QUEUE
from tests.runtime.helpers import greedy, hf_greedy

pytestmark = pytest.mark.integration


async def test_stream_adds_up_to_done(client: BatonClient) -> None:
    replies = [r async for r in client.stream("The quick brown fox", max_tokens=24)]
    *tokens, done = replies
    assert isinstance(done, DoneReply) and done.finish_reason == "length"
    assert all(isinstance(t, TokenReply) for t in tokens)
    ids = [i for t in tokens for i in t.token_ids]
    assert ids == done.token_ids and len(ids) == 24
    # positions are contiguous from 0, and the deltas concatenate to the final text
    expected = 0
    for t in tokens:
        assert t.index == expected
        expected += len(t.token_ids)
    assert "".join(t.text for t in tokens) == done.text
    assert done.usage["completion_tokens"] == 24 and done.usage["prompt_tokens"] > 0
    assert done.timing["ttft_s"] > 0 and done.timing["e2e_s"] >= done.timing["ttft_s"]


def _hf_greedy(prompt_ids: list[int], max_new: int) -> list[int]:
    model_dir = resolve_model_dir(BatonConfig.from_env())
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    return hf_greedy(model, prompt_ids, greedy(max_new))


async def test_greedy_equals_hf_end_to_end(client: BatonClient) -> None:
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(BatonConfig.from_env())))
    for prompt in ["Once upon a time", "héllo wörld — 你好 🙂 and more text " * 6]:
        ids = tok.encode(prompt)
        reply = await client.generate(prompt_token_ids=ids, max_tokens=40)
        assert isinstance(reply, DoneReply)
        assert reply.token_ids == _hf_greedy(ids, 40)
        text = await client.generate(prompt, max_tokens=40)
        assert isinstance(text, DoneReply) and text.token_ids == reply.token_ids


async def test_same_seed_same_sample(client: BatonClient) -> None:
    kw = dict(max_tokens=32, temperature=0.9, top_p=0.95, top_k=50)
    a = await client.generate("Sample me", seed=7, **kw)
    b = await client.generate("Sample me", seed=7, **kw)
    c = await client.generate("Sample me", seed=8, **kw)
    assert isinstance(a, DoneReply) and isinstance(b, DoneReply) and isinstance(c, DoneReply)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize("batch_replies", [False, True])
async def test_64_requests_at_once_each_get_exactly_one_terminal(
    system, batch_replies: bool
) -> None:  # type: ignore[no-untyped-def]
    """Publish 64 mixed requests at once on a raw channel and count every reply that comes.
    Without ``batch_replies`` every message is one reply with its correlation_id (the contract);
    with it, replies of several requests also come batched in one message."""
    rng = random.Random(0)
    connection = await aio_pika.connect_robust(system.amqp_url)
    num_batches = 0
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.declare_queue("", exclusive=True)
        replies: dict[str, list] = {}
        all_done = asyncio.Event()
        ids: list[str] = []

        async def on_reply(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal num_batches
            got = decode_replies(message.body, BatonConfig().max_message_bytes)
            if message.correlation_id is None:
                assert batch_replies and len(got) >= 2
                num_batches += 1
            else:
                assert [r.request_id for r in got] == [message.correlation_id]
            for reply in got:
                replies.setdefault(reply.request_id, []).append(reply)
            terminal = sum(1 for rs in replies.values() for r in rs if r.type != "token")
            if terminal >= len(ids):
                all_done.set()

        await queue.consume(on_reply, no_ack=True)
        expected_tokens: dict[str, int] = {}
        await _publish_all(channel, queue.name, rng, ids, expected_tokens, batch_replies)
        await asyncio.wait_for(all_done.wait(), 120)
        await asyncio.sleep(1.5)  # anything extra (a duplicate terminal) would arrive by now

    assert (num_batches > 0) == batch_replies
    for rid in ids:
        rs = replies[rid]
        terminal = [r for r in rs if r.type != "token"]
        assert len(terminal) == 1, (rid, terminal)
        done = terminal[0]
        assert done.type == "done", done
        assert done.finish_reason == "length"
        assert len(done.token_ids) == expected_tokens[rid]
        streamed = [i for r in rs if r.type == "token" for i in r.token_ids]
        assert streamed in ([], done.token_ids)


async def _publish_all(
    channel,
    reply_to: str,
    rng: random.Random,
    ids: list[str],  # type: ignore[no-untyped-def]
    expected: dict[str, int],
    batch_replies: bool = False,
) -> None:
    msgs = []
    for i in range(64):
        rid = f"many-{i}-{uuid.uuid4().hex[:6]}"
        max_tokens = rng.randint(1, 48)
        kind = i % 3
        msgs.append(
            RequestMsg(
                request_id=rid,
                sampling=SamplingParams(
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    temperature=0.7 if i % 4 == 0 else 0.0,
                    seed=i,
                ),
                prompt="word " * rng.randint(1, 200) if kind == 0 else None,
                messages=(("user", "hello " * rng.randint(1, 40)),) if kind == 1 else None,
                prompt_token_ids=tuple(rng.randrange(3, 500) for _ in range(rng.randint(1, 300)))
                if kind == 2
                else None,
                stream=i % 5 != 0,
                priority=rng.randint(0, 9),
                batch_replies=batch_replies,
            )
        )
        ids.append(rid)
        expected[rid] = max_tokens
    await asyncio.gather(
        *(
            channel.default_exchange.publish(
                aio_pika.Message(
                    m.encode(),
                    correlation_id=m.request_id,
                    reply_to=reply_to,
                    priority=m.priority,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=REQUESTS_QUEUE,
            )
            for m in msgs
        )
    )
