"""Bad input, limits, timeouts and cancels: each answered once, and the system keeps serving."""

from __future__ import annotations

import asyncio
import math
import uuid

import aio_pika
import msgpack
import pytest

from shared.client import BatonClient
from shared.wire.messages import DoneReply, ErrorReply, TokenReply
from shared.wire.queues import DEAD_LETTER_QUEUE, REQUESTS_QUEUE

pytestmark = pytest.mark.integration


def _req(**fields: object) -> bytes:
    return msgpack.packb({"request_id": "r", "prompt": "hi", **fields})


BAD_BODIES = {
    "not msgpack": b"\xc1\xc1\xc1",
    "truncated msgpack": msgpack.packb({"request_id": "r", "prompt": "hello"})[:-3],
    "not a map": msgpack.packb([1, 2, 3]),
    "a bare string": msgpack.packb("hello"),
    "missing request_id": msgpack.packb({"prompt": "hi"}),
    "empty request_id": _req(request_id=""),
    "request_id not a string": _req(request_id=42),
    "no prompt field": msgpack.packb({"request_id": "r"}),
    "prompt and token ids": _req(prompt_token_ids=[1, 2]),
    "prompt and messages": _req(messages=[{"role": "user", "content": "x"}]),
    "prompt not a string": _req(prompt=123),
    "empty prompt": _req(prompt=""),
    "messages not a list": msgpack.packb({"request_id": "r", "messages": "hi"}),
    "message without content": msgpack.packb({"request_id": "r", "messages": [{"role": "user"}]}),
    "token ids not ints": msgpack.packb({"request_id": "r", "prompt_token_ids": [1, "2"]}),
    "token id beyond vocab": msgpack.packb({"request_id": "r", "prompt_token_ids": [1, 10**6]}),
    "negative token id": msgpack.packb({"request_id": "r", "prompt_token_ids": [-1]}),
    "max_tokens a string": _req(max_tokens="10"),
    "max_tokens zero": _req(max_tokens=0),
    "max_tokens absurd": _req(max_tokens=10**9),
    "max_tokens bool": _req(max_tokens=True),
    "temperature negative": _req(temperature=-1.0),
    "temperature nan": _req(temperature=math.nan),
    "temperature inf": _req(temperature=math.inf),
    "temperature a string": _req(temperature="hot"),
    "top_p zero": _req(top_p=0.0),
    "top_p above one": _req(top_p=1.5),
    "top_k negative": _req(top_k=-1),
    "seed negative": _req(seed=-5),
    "seed a float": _req(seed=1.5),
    "stop not strings": _req(stop=[1]),
    "stop empty string": _req(stop=[""]),
    "too many stop strings": _req(stop=[f"s{i}" for i in range(100)]),
    "stream not bool": _req(stream=1),
    "priority out of range": _req(priority=11),
    "timeout negative": _req(timeout_s=-1.0),
    "body over the size limit": _req(prompt="x" * (2 << 20)),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
async def test_malformed_request_gets_invalid_request(client: BatonClient, name: str) -> None:
    rid = f"bad-{uuid.uuid4().hex[:8]}"
    reply = await (await client.send_raw(BAD_BODIES[name], request_id=rid, wait_s=30))
    assert isinstance(reply, ErrorReply), reply
    assert reply.code == "invalid_request", (name, reply)
    assert reply.request_id in (rid, "r")  # the body's id when readable, else correlation_id
    assert len(reply.message) > 5
    # ... and the next good request is served
    ok = await client.generate("still alive?", max_tokens=3)
    assert isinstance(ok, DoneReply) and len(ok.token_ids) == 3


async def test_unparseable_body_answered_with_its_correlation_id(client: BatonClient) -> None:
    rid = f"garbage-{uuid.uuid4().hex[:8]}"
    reply = await (await client.send_raw(b"\xff\x00garbage", request_id=rid, wait_s=30))
    assert isinstance(reply, ErrorReply) and reply.request_id == rid


async def test_prompt_too_long(client: BatonClient) -> None:
    ids = await client.generate(prompt_token_ids=[5] * 5000, max_tokens=2)
    assert isinstance(ids, ErrorReply) and ids.code == "prompt_too_long"
    text = await client.generate("word " * 4000, max_tokens=2)
    assert isinstance(text, ErrorReply) and text.code == "prompt_too_long"
    ok = await client.generate("short", max_tokens=2)
    assert isinstance(ok, DoneReply)


async def test_timeout_mid_generation_is_done_with_timeout(client: BatonClient) -> None:
    reply = await client.generate("go on forever", max_tokens=4000, ignore_eos=True, timeout_s=0.5)
    assert isinstance(reply, DoneReply), reply
    assert reply.finish_reason == "timeout"
    assert 0 < len(reply.token_ids) < 4000
    assert 0.4 < reply.timing["e2e_s"] < 5.0


async def test_timeout_before_first_token_is_an_error(client: BatonClient) -> None:
    reply = await client.generate("too late", max_tokens=8, timeout_s=1e-6)
    assert isinstance(reply, ErrorReply) and reply.code == "timeout"
    ok = await client.generate("next one", max_tokens=2)
    assert isinstance(ok, DoneReply)


async def test_cancel_mid_stream(client: BatonClient) -> None:
    rid = f"cancel-{uuid.uuid4().hex[:8]}"
    seen = 0
    terminal = None
    async for r in client.stream("a long story", max_tokens=4000, ignore_eos=True, request_id=rid):
        if isinstance(r, TokenReply):
            seen += len(r.token_ids)
            if seen >= 3 and seen - len(r.token_ids) < 3:
                await client.cancel(rid)
        else:
            terminal = r
    assert isinstance(terminal, DoneReply) and terminal.finish_reason == "cancelled"
    assert len(terminal.token_ids) < 4000


async def test_stop_string_cuts_exactly(client: BatonClient) -> None:
    base = await client.generate("Tell me something", max_tokens=40, ignore_eos=True)
    assert isinstance(base, DoneReply) and len(base.text) > 12
    stop = base.text[8:11]
    cut = base.text.find(stop)
    replies = [
        r
        async for r in client.stream(
            "Tell me something", max_tokens=40, ignore_eos=True, stop=[stop]
        )
    ]
    done = replies[-1]
    assert isinstance(done, DoneReply) and done.finish_reason == "stop"
    assert done.text == base.text[:cut]
    assert "".join(r.text for r in replies[:-1] if isinstance(r, TokenReply)) == done.text


async def test_request_without_reply_to_is_dead_lettered(client: BatonClient, system) -> None:  # type: ignore[no-untyped-def]
    async def dead_count(connection: aio_pika.abc.AbstractConnection) -> int:
        async with connection.channel() as ch:  # a fresh channel: declarations are cached
            dead = await ch.declare_queue(DEAD_LETTER_QUEUE, passive=True)
            return dead.declaration_result.message_count or 0

    connection = await aio_pika.connect(system.amqp_url)
    async with connection:
        before = await dead_count(connection)
        channel = await connection.channel(publisher_confirms=True)
        await channel.default_exchange.publish(
            aio_pika.Message(_req(request_id="nobody-listens")), routing_key=REQUESTS_QUEUE
        )
        after = before
        for _ in range(50):
            await asyncio.sleep(0.1)
            after = await dead_count(connection)
            if after > before:
                break
        assert after == before + 1
    ok = await client.generate("after the dead letter", max_tokens=2)
    assert isinstance(ok, DoneReply)
