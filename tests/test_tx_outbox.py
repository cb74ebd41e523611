"""The transactional outbox (services/shell/tx_outbox.py) on the real broker: outputs and the
acks of their inputs commit together or not at all, concurrent commits share a transaction, and
work whose inputs' channel is gone sends nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import aio_pika
import pytest

from services.launcher import fresh_vhost
from services.shell.broker import Broker, Outgoing
from services.shell.tx_outbox import StaleChannel, TxOutbox
from shared.config import BatonConfig
from shared.wire.queues import queue_arguments

pytestmark = pytest.mark.integration

INPUT, OUTPUT = "test.tx.in", "test.tx.out"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with fresh_vhost(prefix="baton-test-tx") as u:
        yield u


@pytest.fixture
async def broker(url: str) -> AsyncIterator[Broker]:
    b = Broker(BatonConfig(amqp_url=url), prefetch_count=100)
    await b.connect()
    yield b
    await b.close()


async def depth(url: str, queue: str) -> int:
    conn = await aio_pika.connect(url)
    async with conn:
        declared = await (await conn.channel()).declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


async def inputs(url: str, broker: Broker, n: int) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """``n`` messages published to INPUT and delivered to ``broker``'s consume channel."""
    conn = await aio_pika.connect(url)
    async with conn:
        channel = await conn.channel()
        for q in (INPUT, OUTPUT):  # as the shell declares them
            await (
                await channel.declare_queue(
                    q, durable=True, arguments=queue_arguments(q, BatonConfig())
                )
            ).purge()
        for i in range(n):
            await channel.default_exchange.publish(aio_pika.Message(b"%d" % i), routing_key=INPUT)
    got: list[aio_pika.abc.AbstractIncomingMessage] = []

    async def keep(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        got.append(message)

    queue, tag = await broker.consume(INPUT, keep)
    while len(got) < n:
        await asyncio.sleep(0.01)
    await queue.cancel(tag)
    return got


async def test_outputs_and_acks_commit_together_and_concurrent_ones_share_a_commit(
    url: str, broker: Broker
) -> None:
    outbox = TxOutbox(broker)
    delivered = await inputs(url, broker, 8)
    await asyncio.gather(*(outbox.commit([Outgoing(OUTPUT, d.body)], acks=[d]) for d in delivered))
    assert outbox.num_commits < 8  # grouped while a commit was pending
    assert await depth(url, OUTPUT) == 8 and await depth(url, INPUT) == 0


async def test_nothing_commits_once_the_inputs_channel_is_gone(url: str, broker: Broker) -> None:
    outbox = TxOutbox(broker)
    delivered = await inputs(url, broker, 2)
    await outbox.commit([Outgoing(OUTPUT, b"first")], acks=[delivered[0]])
    old = delivered[1].channel
    await old.close()  # as a crash of the channel: the broker requeues what it held
    for _ in range(100):  # the robust channel opens a new one
        if (await broker.consume_channel()) is not old:
            break
        await asyncio.sleep(0.05)
    with pytest.raises(StaleChannel):
        await outbox.commit([Outgoing(OUTPUT, b"second")], acks=[delivered[1]])
    await asyncio.sleep(0.2)
    assert await depth(url, OUTPUT) == 1  # only the committed one
    assert await depth(url, INPUT) == 1  # the other input is back, to be done again
