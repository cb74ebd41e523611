"""RabbitMQ plumbing shared by the service shells: topology, confirmed publishes, consumers.

Invariants every service keeps:
- Work queues are durable, priority queues (``x-max-priority``) that dead-letter to ``baton.dlx``.
  Every service declares them with the *same* arguments (a mismatch is a channel error).
- Work messages are persistent; the channel runs with publisher confirms, and ``publish``
  returns only once the broker confirmed. A consumer acks its input only after everything it
  produced from that input is confirmed, so a crash anywhere redelivers instead of losing work.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aio_pika
import structlog
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)

from shared.config import BatonConfig

log = structlog.get_logger(__name__)

REQUESTS_QUEUE = "baton.requests"
PREFILL_QUEUE = "baton.prefill"
DECODE_QUEUE = "baton.decode"
DETOK_QUEUE = "baton.detok"
WORK_QUEUES = (REQUESTS_QUEUE, PREFILL_QUEUE, DECODE_QUEUE, DETOK_QUEUE)
CONTROL_EXCHANGE = "baton.control"
DEAD_LETTER_EXCHANGE = "baton.dlx"
DEAD_LETTER_QUEUE = "baton.dead"
MAX_PRIORITY = 9

WORK_QUEUE_ARGS: dict[str, Any] = {
    "x-max-priority": MAX_PRIORITY + 1,
    "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
}
# The dead-letter queue is bounded so a flood of garbage cannot fill the broker's disk.
DEAD_QUEUE_ARGS: dict[str, Any] = {"x-max-length": 10_000, "x-message-ttl": 7 * 24 * 3600 * 1000}

Handler = Callable[[AbstractIncomingMessage], Awaitable[None]]


@dataclass(frozen=True)
class Outgoing:
    """One message to publish; ``routing_key`` is a queue name (default exchange)."""

    routing_key: str
    body: bytes
    priority: int | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    persistent: bool = True


async def declare_topology(channel: AbstractChannel) -> AbstractExchange:
    dlx = await channel.declare_exchange(
        DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
    )
    dead = await channel.declare_queue(DEAD_LETTER_QUEUE, durable=True, arguments=DEAD_QUEUE_ARGS)
    await dead.bind(dlx)
    for name in WORK_QUEUES:
        await channel.declare_queue(name, durable=True, arguments=WORK_QUEUE_ARGS)
    return await channel.declare_exchange(
        CONTROL_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
    )


class Broker:
    """One robust connection with a confirming publish channel and a consume channel."""

    def __init__(self, config: BatonConfig, prefetch_count: int) -> None:
        self.config = config
        self.prefetch_count = prefetch_count
        self._connection: AbstractRobustConnection | None = None
        self._pub: AbstractChannel | None = None
        self._sub: AbstractChannel | None = None
        self._control: AbstractExchange | None = None

    async def connect(self, attempts: int = 30, delay_s: float = 1.0) -> None:
        for attempt in range(1, attempts + 1):
            try:
                self._connection = await aio_pika.connect_robust(self.config.amqp_url)
                break
            except (ConnectionError, OSError, aio_pika.exceptions.AMQPConnectionError) as exc:
                if attempt == attempts:
                    raise
                log.warning("broker not reachable yet", attempt=attempt, error=str(exc))
                await asyncio.sleep(delay_s)
        assert self._connection is not None
        self._pub = await self._connection.channel(publisher_confirms=True)
        self._sub = await self._connection.channel(publisher_confirms=False)
        await self._sub.set_qos(prefetch_count=self.prefetch_count)
        self._control = await declare_topology(self._pub)

    @property
    def pub(self) -> AbstractChannel:
        assert self._pub is not None, "connect() first"
        return self._pub

    async def publish(self, out: Outgoing) -> None:
        """Publish and wait for the broker's confirm (raises if it nacks)."""
        msg = aio_pika.Message(
            out.body,
            delivery_mode=(
                aio_pika.DeliveryMode.PERSISTENT
                if out.persistent
                else aio_pika.DeliveryMode.NOT_PERSISTENT
            ),
            priority=out.priority,
            correlation_id=out.correlation_id,
            reply_to=out.reply_to,
        )
        await self.pub.default_exchange.publish(msg, routing_key=out.routing_key)

    async def publish_many(self, outs: Iterable[Outgoing]) -> None:
        """Publish several messages, confirms awaited together (one round trip, not N)."""
        await asyncio.gather(*(self.publish(o) for o in outs))

    async def publish_until_confirmed(self, outs: list[Outgoing], what: str) -> None:
        """Publish, retrying only the messages that were not confirmed, until all are.

        For outputs that cannot be regenerated from a redelivery (the detokenizer's replies).
        A message whose confirm was lost with the connection may arrive twice: at-least-once."""
        pending = outs
        for attempt in itertools.count(1):
            results = await asyncio.gather(
                *(self.publish(o) for o in pending), return_exceptions=True
            )
            failed = [o for o, r in zip(pending, results, strict=True) if isinstance(r, Exception)]
            if not failed:
                return
            log.warning(f"publishing {what} failed; retrying", attempt=attempt, count=len(failed))
            pending = failed
            await asyncio.sleep(min(0.1 * attempt, 2.0))

    async def publish_control(self, body: bytes) -> None:
        assert self._control is not None, "connect() first"
        await self._control.publish(aio_pika.Message(body), routing_key="")

    async def consume(self, queue_name: str, handler: Handler) -> AbstractQueue:
        assert self._sub is not None, "connect() first"
        queue = await self._sub.declare_queue(queue_name, durable=True, arguments=WORK_QUEUE_ARGS)
        await queue.consume(handler, no_ack=False)
        return queue

    async def subscribe_control(self, handler: Handler) -> AbstractQueue:
        """Every service instance gets its own exclusive queue on the control fanout."""
        assert self._sub is not None and self._control is not None, "connect() first"
        queue = await self._sub.declare_queue("", exclusive=True, auto_delete=True)
        await queue.bind(self._control)
        await queue.consume(handler, no_ack=True)
        return queue

    async def queue_depths(self, names: Iterable[str] = WORK_QUEUES) -> dict[str, int]:
        """Ready-message counts, via passive declares on a short-lived channel."""
        assert self._connection is not None, "connect() first"
        depths: dict[str, int] = {}
        channel = await self._connection.channel()
        try:
            for name in names:
                q = await channel.declare_queue(name, passive=True)
                depths[name] = q.declaration_result.message_count or 0
        finally:
            await channel.close()
        return depths

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
