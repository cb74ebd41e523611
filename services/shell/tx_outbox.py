"""Outputs and the settling of their inputs, committed together: AMQP transactions.

A service that answers clients (the tokenizer's errors, the detokenizer's replies) must never
answer twice. With publisher confirms the order is publish, confirm, ack — and a process killed
between the confirm and the ack has its input redelivered and answered again. Here a unit of
work is one transaction on the channel its inputs came on (``tx.select``): the publishes, the
acks and the rejects of an :meth:`TxOutbox.commit` are applied by the broker at ``tx.commit``,
all of them or — the process or its channel gone before the commit — none; the inputs then come
again and are handled as if for the first time. Why transactions and what they cost against
confirms: docs/reliability.md ("Exactly once").

Group commit: one committer takes every item waiting, publishes and settles them all, commits
once, and only then the next group (the client library serialises publishes behind a pending
commit on a channel anyway). An item is bound to the channel of its inputs: if that channel was
replaced (a reconnect), the broker has requeued its inputs and the item fails with
:class:`StaleChannel` without sending anything. A commit that fails or times out closes its
channel: whatever it applied is consistent (a transaction is all or nothing), and everything not
settled is redelivered.

Not covered: RabbitMQ applies a transaction that spans several queues atomically against a
client's death, not against the broker's own crash in the middle of a commit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiormq.abc
import structlog
from aio_pika.abc import AbstractIncomingMessage
from aio_pika.exceptions import ChannelInvalidStateError

from services.shell.broker import Broker, Outgoing

log = structlog.get_logger(__name__)

COMMIT_TIMEOUT_S = 30.0


class StaleChannel(Exception):
    """The channel an item's inputs came on is gone: the broker requeued them."""


def _future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


@dataclass
class _Item:
    outs: list[Outgoing]
    acks: list[AbstractIncomingMessage]
    rejects: list[AbstractIncomingMessage]  # dead-lettered
    requeues: list[AbstractIncomingMessage]
    channel: aiormq.abc.AbstractChannel | None  # None: whatever channel is current
    done: asyncio.Future[None] = field(default_factory=_future)


class TxOutbox:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._pending: list[_Item] = []
        self._committer: asyncio.Task[None] | None = None
        self._selected: aiormq.abc.AbstractChannel | None = None  # tx.select was sent on it
        self.num_commits = 0

    async def commit(
        self,
        outs: Iterable[Outgoing] = (),
        *,
        acks: Iterable[AbstractIncomingMessage] = (),
        rejects: Iterable[AbstractIncomingMessage] = (),
        requeues: Iterable[AbstractIncomingMessage] = (),
        channel: aiormq.abc.AbstractChannel | None = None,
    ) -> None:
        """Publish ``outs`` and settle the deliveries in one transaction; returns once it is
        committed. ``channel``: the consume channel the work derives from when it settles no
        delivery (default: that of the deliveries). Raises :class:`StaleChannel` or the
        commit's error; nothing of the item is then known to be applied."""
        item = _Item(list(outs), list(acks), list(rejects), list(requeues), channel)
        for delivery in (*item.acks, *item.rejects, *item.requeues):
            came_on = channel_of(delivery)
            if came_on is None:
                raise StaleChannel("its inputs' channel is gone")
            if item.channel is None:
                item.channel = came_on
            elif came_on is not item.channel:
                raise ValueError("one transaction settles deliveries of one channel")
        self._pending.append(item)
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._run())
        await asyncio.shield(item.done)

    def close(self) -> None:
        """Stopping: nothing more is committed; what waits fails (its inputs come again)."""
        if self._committer is not None:
            self._committer.cancel()
        _fail(self._pending, StaleChannel("the service is stopping"))
        self._pending = []

    async def _run(self) -> None:
        while self._pending:
            group, self._pending = self._pending, []
            try:
                channel = await self.broker.consume_channel()
            except Exception as exc:
                _fail(group, exc)
                continue
            live = []
            for item in group:
                if item.channel is None or item.channel is channel:
                    live.append(item)
                else:
                    _fail([item], StaleChannel("its inputs' channel is gone"))
            if not live:
                continue
            try:
                await self._commit(channel, live)
            except Exception as exc:
                log.warning("transaction failed; its inputs come again", error=repr(exc))
                _fail(live, exc)
                await _abandon(channel)
                continue
            self.num_commits += 1
            for item in live:
                if not item.done.done():
                    item.done.set_result(None)

    async def _commit(self, channel: aiormq.abc.AbstractChannel, group: list[_Item]) -> None:
        if self._selected is not channel:
            await channel.tx_select()
            self._selected = channel
        for item in group:
            for out in item.outs:
                msg = self.broker.message(out)
                await channel.basic_publish(
                    msg.body, exchange="", routing_key=out.routing_key, properties=msg.properties
                )
            for delivery in item.acks:
                await delivery.ack()
            for delivery in item.rejects:
                await delivery.reject(requeue=False)
            for delivery in item.requeues:
                await delivery.nack(requeue=True)
        await channel.tx_commit(timeout=COMMIT_TIMEOUT_S)


def channel_of(delivery: AbstractIncomingMessage) -> aiormq.abc.AbstractChannel | None:
    """The channel a delivery came on, or None once it is closed (the broker requeued it)."""
    try:
        return delivery.channel
    except ChannelInvalidStateError:
        return None


def _fail(items: list[_Item], exc: BaseException) -> None:
    for item in items:
        if not item.done.done():
            item.done.set_exception(exc)
            item.done.exception()  # retrieved: a caller that gave up waiting is not an error


async def _abandon(channel: aiormq.abc.AbstractChannel) -> None:
    """Close a channel whose transaction is in doubt: the broker requeues what it had not
    settled, and the robust channel opens a new one (the service replays from its inputs)."""
    with contextlib.suppress(Exception):
        if not channel.is_closed:
            await channel.close()
