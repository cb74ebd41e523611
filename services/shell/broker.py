"""RabbitMQ plumbing shared by the service shells: topology, confirmed publishes, consumers.

Invariants every service keeps:
- Work queues are durable and dead-letter to ``baton.dlx``: classic priority queues
  (``x-max-priority``), or quorum queues with a delivery limit (``BATON_QUEUE_TYPE``). Every
  service declares them with the *same* arguments (a mismatch is a channel error).
- Work messages are persistent; the channel runs with publisher confirms, and ``publish``
  returns only once the broker confirmed. A consumer acks its input only after everything it
  produced from that input is confirmed, so a crash anywhere redelivers instead of losing work.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import aio_pika
import aiormq.abc
import structlog
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)
from aiormq.abc import FieldValue

from shared.client.connection import connect, connect_robust, url_username
from shared.config import BatonConfig
from shared.wire.queues import (
    CONTROL_EXCHANGE,
    DEAD_LETTER_EXCHANGE,
    WORK_QUEUES,
    dead_letter_queues,
    detok_queues,
    queue_arguments,
)

log = structlog.get_logger(__name__)

Handler = Callable[[AbstractIncomingMessage], Awaitable[None]]
# What publishing raises for a message that can never be sent (a routing key or property over
# AMQP's 255 bytes, a wrong type): retrying it would block everything queued behind it.
UNPUBLISHABLE = (TypeError, ValueError)


@dataclass(frozen=True)
class Outgoing:
    """One message to publish; ``routing_key`` is a queue name (default exchange)."""

    routing_key: str
    body: bytes
    priority: int | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    persistent: bool = True
    headers: dict[str, FieldValue] | None = None


async def declare_topology(channel: AbstractChannel, config: BatonConfig) -> AbstractExchange:
    dlx = await channel.declare_exchange(
        DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
    )
    for name in dead_letter_queues(config):
        args = queue_arguments(name, config)
        await (await channel.declare_queue(name, durable=True, arguments=args)).bind(dlx)
    for name in (*WORK_QUEUES, *detok_queues(config.detok_shards)):
        await channel.declare_queue(name, durable=True, arguments=queue_arguments(name, config))
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
        # The robust channel restores its queues (re-declare, re-consume) after a reconnect or a
        # server-side consumer cancel (a deleted queue) from a WeakSet: hold them here.
        self._queues: list[AbstractQueue] = []
        # Stamped on every message (the broker refuses a user_id that is not the connection's),
        # so consumers can tell which service published it (BatonConfig.trusted_publishers).
        self.user = url_username(config.amqp_url)

    async def connect(self, attempts: int = 30, delay_s: float = 1.0) -> None:
        for attempt in range(1, attempts + 1):
            try:
                # Every address of BATON_AMQP_URL in turn (a cluster; shared/client/connection.py).
                self._connection = await connect_robust(self.config.amqp_url)
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
        self._control = await declare_topology(self._pub, self.config)

    async def supports_channel_prefetch(self) -> bool:
        """Whether the broker takes a channel-wide prefetch (basic.qos with global=true), tried
        once on a connection of its own (a refusal may close the connection it comes on).

        Why it is needed: RabbitMQ applies an ordinary (per-consumer) prefetch only to consumers
        started after it, so it cannot follow a worker's free slots; the channel-wide one
        applies at once to every consumer of the channel. RabbitMQ deprecated it (allowed up to
        4.2, refused by default from 4.3 unless ``deprecated_features.permit.global_qos``);
        where it is refused, a service keeps the per-consumer prefetch it started with.

        Never with quorum work queues: RabbitMQ closes the *connection* of a channel with a
        channel-wide prefetch that consumes from one (NOT_IMPLEMENTED)."""
        if self.config.queue_type == "quorum":
            return False
        try:
            connection = await connect(self.config.amqp_url)
        except Exception as exc:
            log.warning("channel prefetch probe could not connect", error=str(exc))
            return False
        try:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=1, global_=True)
            return True
        except Exception as exc:
            log.warning("broker refuses a channel-wide prefetch; it stays fixed", error=str(exc))
            return False
        finally:
            with contextlib.suppress(Exception):
                await connection.close()

    async def set_prefetch(self, prefetch_count: int) -> None:
        """The consume channel's channel-wide prefetch (see :meth:`supports_channel_prefetch`):
        at most ``prefetch_count`` unacked deliveries on it, applied at once; the robust channel
        re-applies the latest value after a reconnect. Send it only when the value changes."""
        assert self._sub is not None, "connect() first"
        if prefetch_count < 1:  # 0 would mean "no limit" to the broker
            raise ValueError(f"prefetch must be at least 1, got {prefetch_count}")
        await self._sub.set_qos(prefetch_count=prefetch_count, global_=True)

    def on_intake_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever the consume channel closes (a reconnect, a channel error):
        the broker has requeued everything delivered on it and not acked."""
        assert self._sub is not None, "connect() first"
        self._sub.close_callbacks.add(lambda *_: callback())

    @property
    def pub(self) -> AbstractChannel:
        assert self._pub is not None, "connect() first"
        return self._pub

    async def publish_channel(self) -> aiormq.abc.AbstractChannel:
        """The channel publishes go out on now (after any reconnect: a new one). Messages on one
        channel reach the broker in order; across a reconnect, nothing orders them."""
        return await self.pub.get_underlay_channel()

    def message(self, out: Outgoing) -> aio_pika.Message:
        """``out`` as a message stamped with this connection's user."""
        return aio_pika.Message(
            out.body,
            delivery_mode=(
                aio_pika.DeliveryMode.PERSISTENT
                if out.persistent
                else aio_pika.DeliveryMode.NOT_PERSISTENT
            ),
            priority=out.priority,
            correlation_id=out.correlation_id,
            reply_to=out.reply_to,
            headers=out.headers,
            user_id=self.user,
        )

    async def consume_channel(self) -> aiormq.abc.AbstractChannel:
        """The channel deliveries come on now (after any reconnect: a new one); a transactional
        shell publishes and settles on it (``services/shell/tx_outbox.py``)."""
        assert self._sub is not None, "connect() first"
        return await self._sub.get_underlay_channel()

    async def publish(
        self, out: Outgoing, channel: aiormq.abc.AbstractChannel | None = None
    ) -> None:
        """Publish and wait for the broker's confirm (raises if it nacks); on ``channel`` if
        given (fails if that channel is gone), else on the current one."""
        msg = self.message(out)
        if channel is None:
            await self.pub.default_exchange.publish(msg, routing_key=out.routing_key)
        else:
            await channel.basic_publish(
                msg.body, exchange="", routing_key=out.routing_key, properties=msg.properties
            )

    async def publish_many(self, outs: Iterable[Outgoing]) -> None:
        """Publish several messages, confirms awaited together (one round trip, not N)."""
        await asyncio.gather(*(self.publish(o) for o in outs))

    async def publish_once(
        self, outs: list[Outgoing], what: str, channel: aiormq.abc.AbstractChannel | None = None
    ) -> list[Outgoing]:
        """One attempt (on ``channel`` if given), confirms awaited together; returns the messages
        that were not confirmed (a message that can never be published is logged and dropped)."""
        results = await asyncio.gather(
            *(self.publish(o, channel) for o in outs), return_exceptions=True
        )
        failed = []
        for o, r in zip(outs, results, strict=True):
            if isinstance(r, UNPUBLISHABLE):  # it would fail the same way forever
                log.error(f"{what}: a message cannot be published; dropped", error=str(r))
            elif isinstance(r, Exception):
                failed.append(o)
        return failed

    async def publish_until_confirmed(self, outs: list[Outgoing], what: str) -> None:
        """Publish, retrying only the messages that were not confirmed, until all are.

        For outputs that cannot be regenerated from a redelivery (the detokenizer's replies).
        A message whose confirm was lost with the connection may arrive twice: at-least-once."""
        pending = outs
        for attempt in itertools.count(1):
            pending = await self.publish_once(pending, what)
            if not pending:
                return
            log.warning(f"publishing {what} failed; retrying", attempt=attempt, count=len(pending))
            await asyncio.sleep(min(0.1 * attempt, 2.0))

    async def publish_control(self, body: bytes) -> None:
        assert self._control is not None, "connect() first"
        # Stamped: services honour an ``abort`` only from a trusted publisher (control_auth.py).
        await self._control.publish(aio_pika.Message(body, user_id=self.user), routing_key="")

    async def consume(self, queue_name: str, handler: Handler) -> tuple[AbstractQueue, str]:
        """Start consuming a work queue (manual acks); returns the queue and the consumer tag."""
        assert self._sub is not None, "connect() first"
        args = queue_arguments(queue_name, self.config)
        queue = await self._sub.declare_queue(queue_name, durable=True, arguments=args)
        tag = await queue.consume(handler, no_ack=False)
        self._queues.append(queue)
        return queue, tag

    async def consume_private(self, queue_name: str, handler: Handler) -> AbstractQueue:
        """A named queue of this connection alone (exclusive, auto-deleted), auto-acked: for
        best-effort notices addressed to this worker (KV releases)."""
        assert self._sub is not None, "connect() first"
        queue = await self._sub.declare_queue(queue_name, exclusive=True, auto_delete=True)
        await queue.consume(handler, no_ack=True)
        self._queues.append(queue)
        return queue

    async def subscribe_control(self, handler: Handler) -> AbstractQueue:
        """Every service instance gets its own exclusive queue on the control fanout."""
        assert self._sub is not None and self._control is not None, "connect() first"
        queue = await self._sub.declare_queue("", exclusive=True, auto_delete=True)
        await queue.bind(self._control)
        await queue.consume(handler, no_ack=True)
        self._queues.append(queue)
        return queue

    async def queue_depths(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """Ready-message counts (default: every work queue and detokenizer shard), via passive
        declares on a short-lived channel."""
        if names is None:
            names = (*WORK_QUEUES, *detok_queues(self.config.detok_shards))
        return {name: ready for name, (ready, _) in (await self._queue_states(names)).items()}

    async def unattended(self, names: Iterable[str]) -> list[str]:
        """Of ``names``, the queues that hold ready messages and have no consumer at all."""
        states = await self._queue_states(names)
        return [name for name, (ready, consumers) in states.items() if ready and not consumers]

    async def _queue_states(self, names: Iterable[str]) -> dict[str, tuple[int, int]]:
        """(ready messages, consumers) per queue, via passive declares on a short-lived channel."""
        assert self._connection is not None, "connect() first"
        states: dict[str, tuple[int, int]] = {}
        channel = await self._connection.channel()
        try:
            for name in names:
                result = (await channel.declare_queue(name, passive=True)).declaration_result
                states[name] = (result.message_count or 0, result.consumer_count or 0)
        finally:
            await channel.close()
        return states

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
