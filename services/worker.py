"""What the prefill and decode shells share: intake of work messages, control, failure replies.

Intake happens on the event loop; the engine loop drains it between steps, so scheduler state is
only ever touched from the loop thread (the forward runs in a worker thread and reads sequences
that nothing else mutates meanwhile).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import structlog
from aio_pika.abc import AbstractIncomingMessage

from services.common import ExpiringIdSet
from shared.broker import DETOK_QUEUE, Broker, Outgoing
from shared.config import BatonConfig
from shared.engine.block_manager import BlockManager
from shared.engine.model_runner import ModelRunner
from shared.engine.sequence import SamplingParams
from shared.kv_transport import KVTransport
from shared.metrics_glue import ServiceMetrics
from shared.protocol import (
    ControlMsg,
    DetokMsg,
    HandoffMsg,
    PrefillMsg,
    Sampling,
    TokenEvent,
    unpack,
)
from shared.protocol_errors import ErrorCode, ProtocolError
from shared.scheduling import DecodeScheduler, PrefillScheduler

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


def sampling_params(s: Sampling) -> SamplingParams:
    """The wire's sampling settings as the engine's (validated at the tokenizer)."""
    return SamplingParams(s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens, s.ignore_eos)


class EngineService(ABC):
    """The shell around one engine (prefill or decode): consume → engine loop → publish.

    Subclasses provide the work-message type, the queue, and one iteration of the engine loop;
    this class owns the broker, the intake, the block manager and the task lifecycle.
    """

    name: str
    queue: str
    message_type: type[PrefillMsg] | type[HandoffMsg]
    scheduler: PrefillScheduler | DecodeScheduler

    def __init__(
        self, config: BatonConfig, runner: ModelRunner, transport: KVTransport, prefetch: int
    ) -> None:
        self.config = config
        self.runner = runner
        self.transport = transport
        self.block_manager = BlockManager(
            runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.broker = Broker(config, prefetch_count=prefetch)
        self.shell = WorkerShell(self.broker, config.max_message_bytes)
        self.work: dict[str, Intake] = {}  # request_id -> its message, unacked until done
        self.metrics = ServiceMetrics(config, self.name, broker=self.broker)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.broker.connect()
        await self.broker.subscribe_control(self.shell.on_control)
        await self.metrics.start(ready=lambda: bool(self._tasks))
        self._tasks = [asyncio.create_task(c) for c in (self._engine_loop(), *self.background())]
        await self.broker.consume(self.queue, self.on_message)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.shell.drain_publishes()
        await self.broker.close()
        await self.metrics.stop()

    def background(self) -> list[Coroutine[Any, Any, None]]:
        """Extra periodic work of the service (none by default)."""
        return []

    async def on_message(self, delivery: AbstractIncomingMessage) -> None:
        try:
            msg = self.message_type.decode(delivery.body, self.config.max_message_bytes)
        except ProtocolError as exc:
            await self.shell.fail_unparseable(delivery, exc)
            return
        self.shell.incoming.append(Intake(msg, delivery))
        self.shell.wake.set()

    async def _engine_loop(self) -> None:
        """The only place scheduler state changes (the forward itself runs in a thread)."""
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("engine loop error", service=self.name)
                await asyncio.sleep(0.1)

    def is_stale(self, request_id: str, deadline: float | None, now: float) -> bool:
        """Work that must not start: a duplicate of a request already here (a redelivery), or
        one cancelled or past its deadline (the detokenizer answers those itself)."""
        expired = deadline is not None and now >= deadline
        return request_id in self.work or request_id in self.shell.aborted or expired

    async def refuse(self, item: Intake, code: ErrorCode, message: str) -> None:
        """Answer a request this engine can never serve, and drop its message."""
        await self.publish_events([error_event(item.msg.request_id, code, message)])
        await item.delivery.ack()

    async def fail_requests(self, request_ids: list[str], reason: str) -> None:
        """A forward failed: end its requests with an ``internal`` error rather than retrying a
        batch that may fail forever; every other request keeps being served."""
        log.error("failing requests after an engine error", count=len(request_ids), reason=reason)
        items = []
        for rid in request_ids:
            self.scheduler.abort(rid)
            item = self.work.pop(rid, None)
            if item is not None:
                items.append(item)
                if getattr(item.msg, "kv", None) is not None:
                    self.transport.discard(item.msg.kv)
        await self.publish_events(
            [error_event(rid, ErrorCode.INTERNAL, reason) for rid in request_ids]
        )
        for item in items:
            await item.delivery.ack()

    async def publish_events(self, events: list[TokenEvent]) -> None:
        await self.shell.publish_events(events)

    @abstractmethod
    async def step(self) -> None:
        """One iteration: take in new work, apply aborts, run a batch or wait for work."""
