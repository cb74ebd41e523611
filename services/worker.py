"""What the prefill and decode shells share: intake of work messages, control, failure replies.

Intake happens on the event loop; the engine loop drains it between steps, so scheduler state is
only ever touched from the loop thread (the forward runs in a worker thread and reads sequences
that nothing else mutates meanwhile).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import structlog
from aio_pika.abc import AbstractIncomingMessage

from services.common import ExpiringIdSet
from shared.broker import DETOK_QUEUE, Broker, Outgoing
from shared.protocol import ControlMsg, DetokMsg, TokenEvent, unpack
from shared.protocol_errors import ErrorCode, ProtocolError

log = structlog.get_logger(__name__)


@dataclass
class Intake:
    """A decoded work message and the delivery to ack once its outcome is confirmed."""

    msg: Any
    delivery: AbstractIncomingMessage


class WorkerShell:
    """Intake queue, control subscription and the engine-loop wake-up of a worker service."""

    def __init__(self, broker: Broker, max_message_bytes: int) -> None:
        self.broker = broker
        self.max_message_bytes = max_message_bytes
        self.incoming: deque[Intake] = deque()
        self.aborted = ExpiringIdSet()
        self.pending_aborts: deque[str] = deque()
        self.wake = asyncio.Event()
        self.draining = False
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Publish-and-ack in the background so the next step can start meanwhile."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain_publishes(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def on_control(self, message: AbstractIncomingMessage) -> None:
        try:
            ctl = ControlMsg.decode(message.body, self.max_message_bytes)
        except ProtocolError as exc:
            log.warning("bad control message ignored", reason=exc.message)
            return
        if ctl.type == "drain":
            self.draining = True
        elif ctl.request_id is not None:
            self.aborted.add(ctl.request_id)
            self.pending_aborts.append(ctl.request_id)
        self.wake.set()

    async def fail_unparseable(self, delivery: AbstractIncomingMessage, exc: ProtocolError) -> None:
        """An internal message we cannot read (version skew, corruption). Answer the request if
        its id is recoverable, so the client still gets its one terminal reply; dead-letter it."""
        request_id = _peek_request_id(delivery.body, self.max_message_bytes)
        log.error("unreadable work message", request_id=request_id, reason=exc.message)
        if request_id is not None:
            await self.publish_events([error_event(request_id, ErrorCode.INTERNAL, exc.message)])
        await delivery.reject(requeue=False)

    async def publish_events(self, events: list[TokenEvent]) -> None:
        msg = DetokMsg(events=events, sent_at=time.time())
        await self.broker.publish(Outgoing(DETOK_QUEUE, msg.encode()))

    async def wait_for_work(self, timeout_s: float | None = None) -> None:
        try:
            await asyncio.wait_for(self.wake.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        self.wake.clear()


def error_event(request_id: str, code: ErrorCode, message: str) -> TokenEvent:
    return TokenEvent(request_id, 0, [], error_code=code.value, error_message=message)


def _peek_request_id(body: bytes, max_bytes: int) -> str | None:
    try:
        d = unpack(body, max_bytes)
    except ProtocolError:
        return None
    rid = d.get("request_id") if isinstance(d, dict) else None
    return rid if isinstance(rid, str) else None


async def requeue(item: Intake) -> None:
    """Give a delivery back to the broker after a failed publish."""
    try:
        await item.delivery.nack(requeue=True)
    except Exception:  # channel gone: the broker redelivers unacked messages by itself
        log.warning("could not requeue; broker will redeliver", request_id=item.msg.request_id)
