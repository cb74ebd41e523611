"""The prefetch window against the real RabbitMQ: the broker delivers only what the window allows,
a new value applies at once to the consumer already running, and a value goes to the broker only
when it changes (``services/shell/prefetch.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
from aio_pika.abc import AbstractIncomingMessage

from services.launcher import fresh_vhost
from services.shell.broker import Broker, Outgoing
from services.shell.prefetch import PrefetchWindow
from services.shell.service_metrics import ServiceMetrics
from shared.config import BatonConfig
from shared.wire.queues import DECODE_QUEUE

pytestmark = pytest.mark.integration


@pytest.fixture
def vhost() -> Iterator[str]:
    with fresh_vhost(prefix="baton-prefetch") as url:
        yield url


async def _settle(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # and nothing more arrives


async def test_window_follows_the_policy_on_a_running_consumer(vhost: str) -> None:
    config = BatonConfig.from_env(amqp_url=vhost, metrics_port=0)
    broker = Broker(config, prefetch_count=8)  # the per-consumer cap it starts with
    metrics = ServiceMetrics(config, "decode")
    await broker.connect()
    window = PrefetchWindow(broker, metrics, initial=8)
    try:
        await window.start()
        assert window.dynamic, "this broker takes a channel-wide prefetch"
        for i in range(20):
            await broker.publish(Outgoing(DECODE_QUEUE, str(i).encode()))
        held: list[AbstractIncomingMessage] = []

        async def take(message: AbstractIncomingMessage) -> None:
            held.append(message)

        window.want(2)
        await _settle(lambda: window.current == 2)
        await broker.consume(DECODE_QUEUE, take)
        await _settle(lambda: len(held) >= 2)
        assert len(held) == 2

        window.want(5)  # more room: the same consumer gets three more at once
        await _settle(lambda: len(held) >= 5)
        assert len(held) == 5

        window.want(1)  # less room: nothing new until the held ones are acked
        await _settle(lambda: window.current == 1)
        for message in held[:3]:
            await message.ack()
        await asyncio.sleep(0.3)
        assert len(held) == 5  # still 2 unacked, above the window of 1
        for message in held[3:5]:
            await message.ack()
        await _settle(lambda: len(held) >= 6)
        assert len(held) == 6

        changes = metrics.metrics.registry.get_sample_value("baton:prefetch_updates_total")
        for _ in range(10):  # the same value again: nothing sent
            window.want(1)
        await asyncio.sleep(0.1)
        assert metrics.metrics.registry.get_sample_value("baton:prefetch_updates_total") == changes
        assert changes == 3
        assert metrics.metrics.registry.get_sample_value("baton:consumer_prefetch") == 1
    finally:
        await window.stop()
        await broker.close()


async def test_a_refused_channel_prefetch_leaves_the_window_fixed(vhost: str) -> None:
    """Where the broker refuses basic.qos(global) (RabbitMQ 4.3 by default), the window stays at
    the per-consumer prefetch the service started with; nothing is sent."""
    config = BatonConfig.from_env(amqp_url=vhost, metrics_port=0)
    broker = Broker(config, prefetch_count=8)
    metrics = ServiceMetrics(config, "decode")
    await broker.connect()

    async def refuse() -> bool:
        return False

    broker.supports_channel_prefetch = refuse  # type: ignore[method-assign]
    window = PrefetchWindow(broker, metrics, initial=8)
    try:
        await window.start()
        window.want(2)
        await asyncio.sleep(0.1)
        assert not window.dynamic and window.current == 8
        assert metrics.metrics.registry.get_sample_value("baton:prefetch_updates_total") == 0
    finally:
        await window.stop()
        await broker.close()
