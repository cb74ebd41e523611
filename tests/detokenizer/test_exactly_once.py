"""Exactly once at the raw reply queue: a detokenizer SIGKILLed while streams flow (at a
moment drawn from a seed) and replaced by a fresh one. A raw consumer — no client library, no
dedup — sees each position once, in order, and one terminal reply.

Only the detokenizer runs (a process, real broker, fresh vhost); the test plays the tokenizer
and decode by publishing their messages to the shard. The whole system under random kills of
every service is tests/fault/test_chaos.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aio_pika
import pytest
from tokenizers import Tokenizer

from services.launcher import ServiceProcesses, fresh_vhost
from services.shell.common import resolve_model_dir
from shared.config import BatonConfig
from shared.wire.messages import (
    DetokMsg,
    DoneReply,
    StartInfo,
    TokenEvent,
    TokenReply,
    decode_reply,
)
from shared.wire.queues import detok_queue_for

pytestmark = pytest.mark.integration

NUM_TOKENS = 60
STREAMS = ("a", "b", "c")
TEXT = "Once upon a time, a river town — 你好 — woke slowly, and every boat sang. " * 4


@pytest.fixture(scope="module")
def ids() -> list[int]:
    tok = Tokenizer.from_file(str(resolve_model_dir(BatonConfig.from_env()) / "tokenizer.json"))
    out: list[int] = tok.encode(TEXT, add_special_tokens=False).ids[:NUM_TOKENS]
    assert len(out) == NUM_TOKENS
    return out


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with fresh_vhost(prefix="baton-test-exactly") as u:
        yield u


class Wire:
    """The other side of the detokenizer: publishes its inputs, reads every raw reply."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.replies: list[Any] = []
        self.changed = asyncio.Event()

    async def open(self) -> None:
        self.conn = await aio_pika.connect(self.url)
        self.channel = await self.conn.channel(publisher_confirms=True)
        self.queue = await self.channel.declare_queue("", exclusive=True)
        await self.queue.consume(self._on_reply, no_ack=True)

    async def _on_reply(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        self.replies.append(decode_reply(message.body, 1 << 20))
        self.changed.set()

    async def publish(self, config: BatonConfig, msg: DetokMsg, rid: str) -> None:
        queue = detok_queue_for(rid, config.detok_shards)
        await self.channel.default_exchange.publish(
            aio_pika.Message(msg.encode(), delivery_mode=2), routing_key=queue
        )

    def streamed(self, rid: str) -> list[TokenReply]:
        return [r for r in self.replies if isinstance(r, TokenReply) and r.request_id == rid]

    async def wait(self, predicate: Any, timeout_s: float = 20.0) -> None:
        async def until() -> None:
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(until(), timeout_s)  # asyncio.timeout is 3.11+


@pytest.fixture
async def wire(url: str) -> AsyncIterator[Wire]:
    w = Wire(url)
    await w.open()
    yield w
    await w.conn.close()


async def consuming(url: str, queue: str, timeout_s: float = 60.0) -> None:
    conn = await aio_pika.connect(url)

    async def until() -> None:
        while True:
            channel = await conn.channel()  # a passive declare of a missing queue closes it
            with contextlib.suppress(aio_pika.exceptions.ChannelNotFoundEntity):
                declared = await channel.declare_queue(queue, passive=True)
                if declared.declaration_result.consumer_count:
                    return
            await asyncio.sleep(0.2)

    async with conn:
        await asyncio.wait_for(until(), timeout_s)  # asyncio.timeout is 3.11+


@pytest.mark.parametrize("seed", range(3))
async def test_a_replacement_resumes_every_stream_after_what_was_committed(
    url: str, wire: Wire, ids: list[int], seed: int
) -> None:
    env = {"BATON_DETOK_SHARDS": "1", "BATON_STREAM_INTERVAL_S": "0",
           "BATON_MAX_STREAM_REPLIES_PER_S": "0"}  # fmt: skip
    procs = ServiceProcesses(url, env=env)
    config = procs.config()
    shard = detok_queue_for("any", 1)
    rng = random.Random(seed)
    crash_after = rng.randrange(2, NUM_TOKENS - 2)
    rids = [f"{s}-{seed}" for s in STREAMS]
    procs.start("detokenizer")
    try:
        await consuming(url, shard)
        for rid in rids:
            start = StartInfo(rid, wire.queue.name, 4, max_tokens=NUM_TOKENS, stream=True)
            await wire.publish(config, DetokMsg(starts=[start]), rid)

        async def send(lo: int, hi: int) -> None:
            for i in range(lo, hi):  # one message per step, every stream in it (as decode)
                last = i == NUM_TOKENS - 1
                reason = "length" if last else None
                events = [TokenEvent(rid, i, [ids[i]], reason) for rid in rids]
                await wire.publish(config, DetokMsg(events=events), rids[0])
                await asyncio.sleep(0.01)

        await send(0, crash_after)
        await wire.wait(lambda: all(len(wire.streamed(r)) > 0 for r in rids))
        sending = asyncio.create_task(send(crash_after, NUM_TOKENS))
        await asyncio.sleep(rng.uniform(0.0, 0.3))  # mid-flow: events arriving, commits pending
        procs.kill("detokenizer")
        procs.start("detokenizer")
        await sending
        await wire.wait(lambda: sum(r.type == "done" for r in wire.replies) == len(rids), 60)
        await asyncio.sleep(1.0)  # a repeat would show up now
    finally:
        procs.stop()
    for rid in rids:
        terminals = [r for r in wire.replies if r.request_id == rid and r.type != "token"]
        assert len(terminals) == 1, terminals
        done = terminals[0]
        assert isinstance(done, DoneReply)
        assert done.token_ids == ids and done.text
        position, offset = 0, 0
        for r in wire.streamed(rid):  # raw: no dedup, each reply where the last one ended
            assert (r.index, r.text_offset) == (position, offset), (rid, r, position)
            position, offset = position + len(r.token_ids), offset + len(r.text)
        assert position == NUM_TOKENS and offset == len(done.text)
