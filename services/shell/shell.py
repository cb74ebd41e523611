"""The one service shell, composed into every service: broker, control, intake, publishing, drain.

What it owns, so that a service module only translates between wire messages and its core:
- the broker connection and topology (:class:`~services.shell.broker.Broker`);
- the control subscription (``baton.control``): ``cancel``/``abort`` go to the service's
  callback with the sender's user_id, ``drain`` is handled here (below); who may send what is
  ``control_auth.py``'s rule;
- consumers with prefetch; each delivery is counted (``redelivered_messages_total`` when the
  broker's redelivered flag is set) and tracked while its handler runs;
- publishing with confirms, and ordered background publishes that ack their inputs only once
  confirmed (:meth:`publish_then_ack`); or, for a ``transactional`` shell (the services that
  answer clients), outputs and acks committed together (:meth:`commit`, ``tx_outbox.py``);
- the metrics, ``/health`` and ``/ready`` endpoint (:class:`ServiceMetrics`), and the one poller
  of queue depths and the spill store (:class:`~services.shell.polling.Poller`: a service
  subscribes its policy before ``start``).

Drain: on a ``drain`` control message a drainable service stops consuming (its consumers are
cancelled; a delivery that still arrives is requeued), gives back what it received but has not
started (``on_drain``), reports not-ready, finishes the work it holds, logs ``drained`` and ends
(``wait_finished`` returns; the process exits 0). A service that must keep answering work already
accepted (the detokenizer) is not drainable and ignores the message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

import structlog
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

from services.shell.broker import Broker, Handler, Outgoing
from services.shell.control_auth import ControlAuth
from services.shell.polling import Poller
from services.shell.service_metrics import ServiceMetrics
from services.shell.tx_outbox import TxOutbox
from shared.config import BatonConfig
from shared.wire.errors import ProtocolError
from shared.wire.messages import ControlMsg, DetokMsg, TokenEvent, unpack
from shared.wire.queues import POISON_QUEUE, REQUESTS_QUEUE, detok_queue_for

log = structlog.get_logger(__name__)

# A cancel or abort, and the broker user that sent it (its AMQP user_id; None if it set none).
ControlHandler = Callable[[ControlMsg, str | None], None]
# Answers the request of a message that is about to be dead-lettered as poison; True if it
# settled the message itself (a transactional shell's answer and reject commit together).
PoisonHandler = Callable[[AbstractIncomingMessage, int], Awaitable[bool | None]]
# How many deliveries of a message ended without it being finished (see _count_redelivery).
FAILURES_HEADER = "x-baton-failures"
DRAIN_POLL_S = 0.05
STOP_PUBLISH_TIMEOUT_S = 10.0


class ServiceShell:
    def __init__(
        self, config: BatonConfig, name: str, prefetch: int, *, transactional: bool = False
    ) -> None:
        """``transactional``: every delivery is settled in a transaction with the outputs made
        from it (:meth:`commit`); for the services whose outputs reach clients."""
        self.config = config
        self.name = name
        self.broker = Broker(config, prefetch_count=prefetch)
        self.outbox = TxOutbox(self.broker) if transactional else None
        self.auth = ControlAuth(config)
        self.metrics = ServiceMetrics(config, name)
        self.poller = Poller(config, self.broker, self.metrics)
        self.draining = False
        self._consumers: list[tuple[AbstractQueue, str]] = []
        self._handling = 0  # deliveries whose handler is still running
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_publish: asyncio.Task[None] | None = None
        self._on_control: ControlHandler | None = None
        self._drainable = True
        self._on_drain: Callable[[], Awaitable[None]] | None = None
        self._idle: Callable[[], bool] = lambda: True
        self._drain_task: asyncio.Task[None] | None = None
        self._finished = asyncio.Event()
        self._trusted = {u.strip() for u in config.trusted_publishers.split(",") if u.strip()}

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(
        self,
        *,
        on_control: ControlHandler | None = None,
        drainable: bool = True,
        on_drain: Callable[[], Awaitable[None]] | None = None,
        idle: Callable[[], bool] | None = None,
    ) -> None:
        """Connect, subscribe to control, serve metrics, take the first polled readings.
        ``idle``: the service holds no work (drain ends when it is true, no handler runs and
        every background publish is done)."""
        self._on_control, self._drainable, self._on_drain = on_control, drainable, on_drain
        if idle is not None:
            self._idle = idle
        await self.broker.connect()
        await self.broker.subscribe_control(self._control)
        await self.metrics.start(ready=self.ready)
        await self.poller.start()

    def ready(self) -> bool:
        return bool(self._consumers) and not self.draining

    async def wait_finished(self) -> None:
        """Returns once the service has drained (it never does otherwise)."""
        await self._finished.wait()

    async def stop(self) -> None:
        await self.poller.stop()
        if self._drain_task is not None:
            self._drain_task.cancel()
        if self.outbox is not None:
            self.outbox.close()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=STOP_PUBLISH_TIMEOUT_S)
            for task in pending:  # the broker is gone: the inputs stay unacked and are redelivered
                task.cancel()
        await self.broker.close()
        await self.metrics.stop()

    # --- intake ---------------------------------------------------------------------------------
    async def consume(
        self, queue: str, handler: Handler, *, on_poison: PoisonHandler | None = None
    ) -> None:
        """Consume ``queue``. With ``on_poison`` and classic work queues, redeliveries are
        counted (see :meth:`_count_redelivery`) and a message whose deliveries failed
        ``max_delivery_failures`` times is given to ``on_poison`` (to answer its request) and
        dead-lettered to ``baton.dead``. Quorum work queues count them in the broker, which
        dead-letters such a message itself; the tokenizer answers it from ``baton.poison``
        (``services/tokenizer/poison.py``)."""

        async def on_delivery(delivery: AbstractIncomingMessage) -> None:
            if checked and delivery.user_id not in self._trusted:
                log.error(
                    "work from an untrusted publisher dead-lettered",
                    queue=queue,
                    user_id=delivery.user_id,
                    correlation_id=delivery.correlation_id,
                )
                await self.dispose(delivery, requeue=False)
                return
            if delivery.redelivered:
                self.metrics.on_redelivered(queue)
                if counted is not None and not self.draining:
                    await self._count_redelivery(queue, delivery, counted)
                    return
            if self.draining:  # in flight when the consumer was cancelled: give it back
                await self.dispose(delivery, requeue=True)
                return
            self._handling += 1
            try:
                await handler(delivery)
            finally:
                self._handling -= 1

        # Clients write only baton.requests; every other queue carries work between services
        # but baton.poison, which holds clients' dead requests too (its consumer checks).
        checked = bool(self._trusted) and queue not in (REQUESTS_QUEUE, POISON_QUEUE)
        # A republished copy would restart a quorum queue's own count (x-delivery-limit).
        counted = on_poison if self.config.queue_type == "classic" else None
        if not self.draining:  # a drain that came during start-up: never begin
            self._consumers.append(await self.broker.consume(queue, on_delivery))

    async def _count_redelivery(
        self, queue: str, delivery: AbstractIncomingMessage, on_poison: PoisonHandler
    ) -> None:
        """A redelivered message: a worker took it and did not finish it (crashed, lost its
        channel). The count must outlive the worker, so it travels in the message: the message
        is republished with the count in a header, then acked, and runs again as the copy. At
        ``max_delivery_failures`` it is poison: answered and dead-lettered, never run again.

        Classic work queues only (``BATON_QUEUE_TYPE``): quorum queues count deliveries
        themselves (``x-delivery-limit``), but have no priorities on RabbitMQ 3.x (two levels
        from 4.0), and the classic ones keep the contract's ten. A worker killed several times
        in a row also counts against the messages it held: the limit allows that.
        """
        recorded = (delivery.headers or {}).get(FAILURES_HEADER)
        failures = (recorded if type(recorded) is int and recorded >= 0 else 0) + 1
        if failures >= self.config.max_delivery_failures:
            log.error(
                "poison message dead-lettered",
                queue=queue,
                failures=failures,
                correlation_id=delivery.correlation_id,
            )
            self.metrics.on_poison(queue)
            if not await on_poison(delivery, failures):
                await self.dispose(delivery, requeue=False)
            return
        copy = Outgoing(
            queue,
            delivery.body,
            priority=delivery.priority,
            correlation_id=delivery.correlation_id,
            reply_to=delivery.reply_to,
            headers={FAILURES_HEADER: failures},
        )
        if self.outbox is not None:  # the copy and the original's ack, together or not at all
            with contextlib.suppress(Exception):  # not counted: the original comes again
                await self.outbox.commit([copy], acks=[delivery])
            return
        try:
            await self.broker.publish(copy)
        except Exception as exc:  # not counted this time; the original stays unacked
            log.warning("redelivery count not recorded", queue=queue, error=str(exc))
            await requeue(delivery)
            return
        await ack(delivery)

    async def _control(self, message: AbstractIncomingMessage) -> None:
        try:
            ctl = ControlMsg.decode(message.body, self.config.max_message_bytes)
        except ProtocolError as exc:
            log.warning("bad control message ignored", reason=exc.message)
            return
        sender = message.user_id
        if ctl.type == "abort" and not self.auth.may_abort(sender):
            log.warning("abort from an untrusted user ignored", user_id=sender)
        elif ctl.type != "drain":
            if self._on_control is not None:
                self._on_control(ctl, sender)
        elif not self.auth.may_drain(sender):
            log.warning("drain from a user that is not an operator ignored", user_id=sender)
        elif not self._drainable:
            log.info("drain ignored: this service answers all work already accepted")
        elif not self.draining:
            self.draining = True
            self._drain_task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        log.info("draining: intake stopped, finishing held work", service=self.name)
        for queue, tag in self._consumers:
            try:
                await queue.cancel(tag)
            except Exception as exc:  # the channel is gone: nothing is delivered on it anyway
                log.warning("cancelling a consumer failed", error=str(exc))
        if self._on_drain is not None:
            await self._on_drain()
        while self._handling or self._tasks or not self._idle():
            await asyncio.sleep(DRAIN_POLL_S)
        log.info("drained", service=self.name)
        self._finished.set()

    # --- publishing -----------------------------------------------------------------------------
    async def commit(
        self,
        outs: list[Outgoing],
        *,
        acks: Iterable[AbstractIncomingMessage] = (),
        rejects: Iterable[AbstractIncomingMessage] = (),
    ) -> None:
        """Publish ``outs`` and ack/dead-letter the deliveries in one transaction (a
        ``transactional`` shell); raises if it did not commit — the deliveries come again."""
        assert self.outbox is not None, "a transactional shell commits"
        await self.outbox.commit(outs, acks=acks, rejects=rejects)

    async def dispose(self, delivery: AbstractIncomingMessage, *, requeue: bool) -> None:
        """Dead-letter (or requeue) a delivery; a failure is harmless (its channel is gone, and
        the broker requeues it)."""
        with contextlib.suppress(Exception):
            if self.outbox is not None:
                await self.outbox.commit(
                    rejects=[] if requeue else [delivery], requeues=[delivery] if requeue else []
                )
            elif requeue:
                await delivery.nack(requeue=True)
            else:
                await delivery.reject(requeue=False)

    async def publish(self, out: Outgoing) -> None:
        await self.broker.publish(out)

    async def publish_control(self, body: bytes) -> None:
        await self.broker.publish_control(body)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run in the background; ``stop`` and drain wait for it."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def publish_then_ack(
        self, outs: list[Outgoing], acks: Iterable[AbstractIncomingMessage], what: str
    ) -> asyncio.Task[None]:
        """Publish in the background until confirmed, then ack ``acks``. Batches ack in the order
        they were handed in: an input is never acked before earlier outputs are confirmed.
        Returns the task (done once ``acks`` are acked)."""
        previous = self._last_publish
        task = asyncio.create_task(self._publish_then_ack(outs, list(acks), what, previous))
        self._last_publish = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _publish_then_ack(
        self,
        outs: list[Outgoing],
        acks: list[AbstractIncomingMessage],
        what: str,
        previous: asyncio.Task[None] | None,
    ) -> None:
        # Outputs that were already computed are retried rather than regenerated; a duplicate
        # (a confirm lost with the connection) is dropped downstream by request id and position.
        await self.broker.publish_until_confirmed(outs, what)
        if previous is not None:
            await asyncio.wait([previous])
        for delivery in acks:
            await ack(delivery)


def detok_events(events: list[TokenEvent], sent_at: float, num_shards: int) -> list[Outgoing]:
    """The events of a step or batch to the detokenizer: one message per shard that has any,
    and one of its own for each event carrying a prompt's logprobs (each is bounded by the
    tokenizer, shared/limits.py; several together in one message would not be). A request's
    events keep their order: one publisher, one queue."""
    by_shard: dict[str, list[TokenEvent]] = {}
    alone: list[Outgoing] = []
    for ev in events:
        queue = detok_queue_for(ev.request_id, num_shards)
        if ev.prompt_logprobs is not None:
            alone.append(Outgoing(queue, DetokMsg(events=[ev], sent_at=sent_at).encode()))
        else:
            by_shard.setdefault(queue, []).append(ev)
    return alone + [
        Outgoing(queue, DetokMsg(events=evs, sent_at=sent_at).encode())
        for queue, evs in by_shard.items()
    ]


def peek_request_id(body: bytes, max_bytes: int) -> str | None:
    """The ``request_id`` of a work message's body, or None where it has none that reads."""
    try:
        d = unpack(body, max_bytes)
    except ProtocolError:
        return None
    rid = d.get("request_id") if isinstance(d, dict) else None
    return rid if isinstance(rid, str) else None


async def ack(delivery: AbstractIncomingMessage) -> None:
    try:
        await delivery.ack()
    except Exception:  # its channel died: redelivered, then dropped as a duplicate
        log.debug("ack failed; the broker redelivers", delivery_tag=delivery.delivery_tag)


async def requeue(delivery: AbstractIncomingMessage) -> None:
    with contextlib.suppress(Exception):  # channel gone: the broker requeues it by itself
        await delivery.nack(requeue=True)
