"""Detokenizer service: the only place replies to clients come from (besides bad input, which
the tokenizer answers at once).

Messages are handled in micro-batches: everything that arrived while the previous batch was being
answered is processed together, so a streaming request gets one ``token`` reply per batch rather
than one per decode step when the broker or this process falls behind.

Crash safety and replicas: the input is sharded by request id (``baton.detok.<n>``), and an
input message is acked only once every request it carries has its terminal reply confirmed
(``ledger.py``). Each shard has a single active consumer; every replica consumes every shard,
its home shard at once and the others one ``detok_standby_delay_s`` apart, so replicas started
together split the shards and each is the standby of the others. When a replica dies (or its
channel does), the broker hands its shards' unacked messages to the next consumer, which replays
them into a fresh state.

Sending is pipelined: a batch's replies are published at once, and the next batch is processed
while their confirms are pending (up to ``MAX_SENDS_IN_FLIGHT`` batches), instead of every input
waiting out the previous batch's confirm — a persistent message's confirm waits for the broker's
disk (measured under a flood: confirm p90 15 ms, max 60 ms, and a priority-9 request's first
token waited for it behind the flood's replies). What each batch does once confirmed (acks,
ledger, metrics) still runs in batch order, so an input is acked only after every reply made
from it, and from earlier inputs, is confirmed. Publishes go out in batch order on one channel,
so replies arrive in order; a batch's unconfirmed replies (a lost connection, a broker node
killed) are retried only once every earlier batch is confirmed; a batch goes out ahead of the
previous one's confirm only on the channel that one took (a reconnect opens a new one, and
nothing orders messages across two) and while no batch is retrying, so retries keep that order
too (a later batch overtaking an earlier one's retry left a gap in a stream: the broker-restart
and broker-cluster tests). A reply the broker nacks while later ones are confirmed
is still republished after them, which a client's position-based dedup
(``shared/client/dedup.py``) drops from the stream — the terminal reply carries the whole text —
as it already did within one batch.

A ``drain`` control message is ignored here: the detokenizer alone answers every accepted
request, including those still queued upstream of a drained worker (their deadlines, cancels).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from aio_pika.abc import AbstractIncomingMessage
from transformers import AutoTokenizer

from services.detokenizer.batching import reply_messages
from services.detokenizer.core import DetokenizerCore, Output
from services.detokenizer.ledger import DeliveryLedger
from services.shell.common import resolve_model_dir
from services.shell.shell import ServiceShell, ack
from shared.config import BatonConfig
from shared.wire.messages import ControlMsg, DetokMsg, ProtocolError
from shared.wire.queues import detok_queues

log = structlog.get_logger(__name__)

SWEEP_INTERVAL_S = 0.05
MAX_SENDS_IN_FLIGHT = 8  # batches whose confirms are awaited while the next ones are processed


@dataclass
class _Batch:
    """One batch's send: its task, and the channel its first attempt went out on."""

    task: asyncio.Task[None] | None = None
    channel: object | None = None


def make_decoder(model_dir: Path):  # type: ignore[no-untyped-def]
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: ~10x less overhead per call
        return lambda ids: backend.decode(list(ids), skip_special_tokens=True)
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


class DetokenizerService:
    name = "detokenizer"

    def __init__(self, config: BatonConfig, model_dir: Path) -> None:
        self.config = config
        self.core = DetokenizerCore(
            make_decoder(model_dir),
            stream_interval_s=config.stream_interval_s,
            max_stream_replies_per_s=config.max_stream_replies_per_s,
        )
        # A wide window: the ledger holds messages until their requests finish, and a window they
        # filled would stop the deliveries those requests wait for (see detok_max_unacked).
        self.shell = ServiceShell(config, self.name, prefetch=config.detok_max_unacked)
        self.ledger = DeliveryLedger()
        self._inbox: deque[AbstractIncomingMessage] = deque()
        self._cancels: deque[str] = deque()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._standby_task: asyncio.Task[None] | None = None
        self._sends: deque[_Batch] = deque()  # in batch order
        self._retrying = 0  # batches retrying unconfirmed replies: new ones wait their turn

    async def start(self) -> None:
        # Not drainable: every accepted request is registered here and must get its one
        # terminal reply, so this service keeps answering until it is stopped.
        await self.shell.start(on_control=self.on_control, drainable=False)
        self.shell.broker.on_intake_lost(self._intake_lost)
        self._loop_task = asyncio.create_task(self._loop())
        shards = detok_queues(self.config.detok_shards)
        home = self.config.detok_home_shard
        if home is None:  # containers all run as pid 1: their host names tell them apart
            home = zlib.crc32(f"{socket.gethostname()}-{os.getpid()}".encode())
        home %= len(shards)
        await self.shell.consume(shards[home], self.on_message)
        if len(shards) > 1:
            self._standby_task = asyncio.create_task(self._consume_standby(shards, home))

    async def _consume_standby(self, shards: tuple[str, ...], home: int) -> None:
        for k in range(1, len(shards)):
            await asyncio.sleep(self.config.detok_standby_delay_s)
            await self.shell.consume(shards[(home + k) % len(shards)], self.on_message)

    def _intake_lost(self) -> None:
        """The consume channel closed: the broker requeued every unacked input, for this
        process once it reconsumes or for another replica. Start over from those."""
        held = self.ledger.clear()
        self._inbox.clear()
        self.core.reset()
        log.warning("intake channel lost; state dropped for replay", held_messages=held)

    async def stop(self) -> None:
        for task in (self._loop_task, self._standby_task, *(b.task for b in self._sends)):
            if task is not None:
                task.cancel()
        await self.shell.stop()

    async def on_message(self, delivery: AbstractIncomingMessage) -> None:
        self._inbox.append(delivery)
        self._wake.set()

    def on_control(self, ctl: ControlMsg) -> None:
        if ctl.type == "cancel" and ctl.request_id is not None:
            self._cancels.append(ctl.request_id)
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            wait_s = SWEEP_INTERVAL_S
            if self.core.has_pending_stream():
                wait_s = min(wait_s, max(self.core.effective_stream_interval_s / 2, 0.001))
            try:
                await asyncio.wait_for(self._wake.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._process()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("detokenizer loop error")
                await asyncio.sleep(0.1)

    async def _process(self) -> None:
        now = time.time()
        out = Output()
        deliveries: list[tuple[AbstractIncomingMessage, set[str]]] = []
        while self._inbox:
            delivery = self._inbox.popleft()
            try:
                msg = DetokMsg.decode(delivery.body, self.config.max_message_bytes)
            except ProtocolError as exc:
                log.error("unreadable detok message dead-lettered", reason=exc.message)
                with contextlib.suppress(Exception):  # channel gone: requeued, refused again
                    await delivery.reject(requeue=False)
                continue
            for info in msg.starts:
                self._guarded(info.request_id, out, self.core.start, info, now, out)
            for ev in msg.events:
                self._guarded(ev.request_id, out, self.core.event, ev, now, out)
            ids = {info.request_id for info in msg.starts} | {ev.request_id for ev in msg.events}
            deliveries.append((delivery, ids))
        while self._cancels:
            self.core.cancel(self._cancels.popleft(), now, out)
        self.core.expire(now, out)
        self.core.flush(out, now)
        if not (out.replies or out.aborts or out.finished or out.dropped or deliveries):
            return
        # What each input still waits for, as of this batch: a later batch may finish those
        # requests before this one is confirmed, and its settling (after this one's) acks them.
        deliveries = [(d, {rid for rid in ids if self.core.is_live(rid)}) for d, ids in deliveries]
        while self._sends and (_done(self._sends[0]) or len(self._sends) >= MAX_SENDS_IN_FLIGHT):
            await _wait(self._sends[0])  # the oldest: the window is full
            self._sends.popleft()
        previous = self._sends[-1] if self._sends else None
        batch = _Batch()
        batch.task = asyncio.create_task(self._send(out, deliveries, batch, previous))
        self._sends.append(batch)

    def _guarded(self, request_id: str, out: Output, apply: Any, *args: Any) -> None:
        """Apply one input; if that raises (a bug, a hostile event), its request alone ends
        with an ``internal`` error and the service goes on."""
        try:
            apply(*args)
        except Exception:
            log.exception("detokenizer failed on a request", request_id=request_id)
            self.core.fail(request_id, "the detokenizer failed on this request", out)

    async def _send(
        self,
        out: Output,
        deliveries: list[tuple[AbstractIncomingMessage, set[str]]],
        batch: _Batch,
        previous: _Batch | None,
    ) -> None:
        """Publish one batch's replies now; once they are confirmed and the previous batch is
        done, ack and account for it (batch order: see the module docstring)."""
        try:
            # The core has already applied these inputs: a redelivery would be deduplicated and
            # produce no replies, so the replies themselves are retried until the broker takes
            # them (the robust connection reconnects meanwhile), in batch order.
            replies = reply_messages(out.replies, out.batchable)
            broker = self.shell.broker
            channel = await broker.publish_channel()
            # Ahead of the previous batch's confirm only on the channel its first attempt took
            # (one channel keeps order) and while no batch is retrying; else after it.
            if previous is not None and not _done(previous):
                if self._retrying or previous.channel is not channel:
                    await _wait(previous)
                    channel = await broker.publish_channel()
            batch.channel = channel
            failed = await broker.publish_once(replies, "replies", channel)
            if failed:
                self._retrying += 1
            try:
                if previous is not None:
                    await _wait(previous)
                if failed:
                    log.warning("publishing replies failed; retrying in order", count=len(failed))
                    await broker.publish_until_confirmed(failed, "replies")
            finally:
                self._retrying -= bool(failed)
            await self._abort(out.aborts)
            await self._settle(out, deliveries)
        except asyncio.CancelledError:
            raise
        except Exception:  # inputs stay unacked: redelivered and replayed if this replica dies
            log.exception("detokenizer send failed")

    async def _abort(self, aborts: list[str]) -> None:
        for rid in aborts:
            try:
                await self.shell.publish_control(ControlMsg("abort", rid).encode())
            except Exception as exc:  # workers still stop at max_tokens or the deadline
                log.warning("abort not sent", request_id=rid, error=str(exc))

    async def _settle(
        self, out: Output, deliveries: list[tuple[AbstractIncomingMessage, set[str]]]
    ) -> None:
        # Only now that the replies are confirmed: the inputs of answered requests go.
        for delivery, live in deliveries:
            if not self.ledger.hold(delivery, live):
                await ack(delivery)  # nothing unanswered in it
        done = [info.request_id for info, _ in out.finished] + out.dropped
        for rid in done:
            for delivery in self.ledger.release(rid):
                await ack(delivery)  # a failed ack: redelivered, then ignored as finished
        self.shell.metrics.set_detok_held(len(self.ledger), self.core.num_active)
        for info, reply in out.finished:
            self.shell.metrics.on_request_finished(info, reply)
            log.info(
                "request finished",
                request_id=info.request_id,
                outcome=getattr(reply, "finish_reason", None) or getattr(reply, "code", None),
            )


def _done(batch: _Batch) -> bool:
    return batch.task is None or batch.task.done()


async def _wait(batch: _Batch) -> None:
    if batch.task is not None:
        await asyncio.wait([batch.task])


def build(config: BatonConfig) -> DetokenizerService:
    return DetokenizerService(config, resolve_model_dir(config))
