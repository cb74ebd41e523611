"""Detokenizer service: the only place replies to clients come from (besides bad input, which
the tokenizer answers at once).

Messages are handled in micro-batches: everything that arrived while the previous batch was being
answered is processed together, so a streaming request gets one ``token`` reply per batch rather
than one per decode step when the broker or this process falls behind.

Crash safety and replicas: the input is sharded by request id (``baton.detok.<n>``), and an
input message is acked only once every request it carries is answered (``ledger.py``). Each
shard has a single active consumer; every replica consumes every shard, its home shard at once
and the others one ``detok_standby_delay_s`` apart, so replicas started together split the
shards and each is the standby of the others. When a replica dies (or its channel does), the
broker hands its shards' unacked messages to the next consumer, which replays them into a fresh
state.

Exactly once: a batch's replies, its stream marks (``marks.py``) and the acks of the inputs it
finished are one AMQP transaction on the consume channel (``services/shell/tx_outbox.py``). A
crash before the commit leaves nothing of the batch; after it, the replay resumes each stream
after its mark and never meets an answered request again (its start was acked with its
terminal reply). Batches commit in order, grouped while a commit is pending; a commit that fails
closes the channel, the broker requeues every unacked input, and the state is rebuilt from them.

A ``drain`` control message is ignored here: the detokenizer alone answers every accepted
request, including those still queued upstream of a drained worker (their deadlines, cancels).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Any

import aiormq.abc
import structlog
from aio_pika.abc import AbstractIncomingMessage
from transformers import AutoTokenizer

from services.detokenizer.batching import reply_messages
from services.detokenizer.core import DetokenizerCore, Output
from services.detokenizer.goodput import Goodput
from services.detokenizer.ledger import DeliveryLedger
from services.detokenizer.marks import mark_messages, stream_marks
from services.shell.common import resolve_model_dir
from services.shell.shell import ServiceShell
from services.shell.tx_outbox import channel_of
from shared.config import BatonConfig
from shared.wire.messages import ControlMsg, DetokMsg, ProtocolError
from shared.wire.queues import detok_queues

log = structlog.get_logger(__name__)

SWEEP_INTERVAL_S = 0.05
STANDBY_POLL_S = 0.02  # while a standby shard's delay runs: is work waiting there unattended?


def make_decoder(model_dir: Path, skip_special_tokens: bool = True):  # type: ignore[no-untyped-def]
    """``decode(ids) -> text``; with special tokens for logprobs' token texts (vLLM's)."""
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    skip = skip_special_tokens
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: ~10x less overhead per call
        return lambda ids: backend.decode(list(ids), skip_special_tokens=skip)
    return lambda ids: tok.decode(list(ids), skip_special_tokens=skip)


class DetokenizerService:
    name = "detokenizer"

    def __init__(self, config: BatonConfig, model_dir: Path) -> None:
        self.config = config
        # A wide window: the ledger holds messages until their requests finish, and a window they
        # filled would stop the deliveries they wait for (see detok_max_unacked).
        self.shell = ServiceShell(
            config, self.name, prefetch=config.detok_max_unacked, transactional=True
        )
        with_special = make_decoder(model_dir, skip_special_tokens=False)
        self.core = DetokenizerCore(
            make_decoder(model_dir),
            stream_interval_s=config.stream_interval_s,
            max_stream_replies_per_s=config.max_stream_replies_per_s,
            may_cancel=self.shell.auth.may_cancel,
            decode_token=lambda token_id: with_special([token_id]),
        )
        self.ledger = DeliveryLedger()
        self.goodput = Goodput(config)
        self._inbox: deque[AbstractIncomingMessage] = deque()
        self._cancels: deque[tuple[str, str | None]] = deque()  # (request id, sender)
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._standby_task: asyncio.Task[None] | None = None
        self._sends: set[asyncio.Task[None]] = set()
        # The consume channel the state was built from: a batch commits only on it.
        self._channel: aiormq.abc.AbstractChannel | None = None

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
        """The other shards, one ``detok_standby_delay_s`` apart, so that replicas started
        together each take their home shard first; but a shard that holds work and has no
        consumer at all is taken at once: no replica is there to take it first, and a lone
        replica would leave the requests hashed to its second shard waiting out the delay."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        due = {  # shard -> when it is taken at the latest
            shards[(home + k) % len(shards)]: started + k * self.config.detok_standby_delay_s
            for k in range(1, len(shards))
        }
        while due:
            take = {shard for shard, at in due.items() if at <= loop.time()}
            try:
                take.update(await self.shell.broker.unattended(due))
            except Exception as exc:  # the delays still end it
                log.debug("standby shards not checked", error=repr(exc))
            for shard in sorted(take, key=due.__getitem__):
                del due[shard]
                await self.shell.consume(shard, self.on_message)
            if due:
                await asyncio.sleep(min(STANDBY_POLL_S, max(0.0, min(due.values()) - loop.time())))

    def _intake_lost(self) -> None:
        """The consume channel closed: the broker requeued every unacked input, for this
        process once it reconsumes or for another replica. Start over from those."""
        held = self.ledger.clear()
        self._inbox.clear()
        self.core.reset()
        self._channel = None
        log.warning("intake channel lost; state dropped for replay", held_messages=held)

    async def stop(self) -> None:
        for task in (self._loop_task, self._standby_task, *self._sends):
            if task is not None:
                task.cancel()
        await self.shell.stop()

    async def on_message(self, delivery: AbstractIncomingMessage) -> None:
        self._inbox.append(delivery)
        self._wake.set()

    def on_control(self, ctl: ControlMsg, sender: str | None) -> None:
        if ctl.type == "cancel" and ctl.request_id is not None:
            self._cancels.append((ctl.request_id, sender))
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
                self._process()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("detokenizer loop error")
                await asyncio.sleep(0.1)

    def _process(self) -> None:
        """Apply what arrived, then hand the batch's replies, marks and acks to one commit.
        Synchronous: the ledger and the core move on together, and a commit that fails resets
        both (the channel closes and everything unacked is replayed)."""
        now = time.time()
        out = Output()
        deliveries: list[tuple[AbstractIncomingMessage, set[str], set[str]]] = []
        unreadable = []
        while self._inbox:
            delivery = self._inbox.popleft()
            came_on = channel_of(delivery)
            if came_on is None:  # its channel closed: requeued, and the state is being reset
                continue
            self._channel = came_on
            try:
                msg = DetokMsg.decode(delivery.body, self.config.max_message_bytes)
            except ProtocolError as exc:
                log.error("unreadable detok message dead-lettered", reason=exc.message)
                unreadable.append(delivery)
                continue
            for mark in msg.marks:
                self._guarded(mark.request_id, out, self.core.resume, mark, now)
            for info in msg.starts:
                self._guarded(info.request_id, out, self.core.start, info, now, out)
            for ev in msg.events:
                self._guarded(ev.request_id, out, self.core.event, ev, now, out)
            ids = {info.request_id for info in msg.starts} | {ev.request_id for ev in msg.events}
            deliveries.append((delivery, ids, {m.request_id for m in msg.marks}))
        while self._cancels:
            rid, sender = self._cancels.popleft()
            self.core.cancel(rid, now, out, sender)
        self.core.expire(now, out)
        self.core.flush(out, now)
        if not (out.replies or out.aborts or out.choice_aborts or out.closed or out.dropped):
            if not (deliveries or unreadable):
                return
        live = self.core.is_live
        acks: list[AbstractIncomingMessage] = []
        for delivery, ids, marked in deliveries:
            acks += self.ledger.hold(
                delivery, {r for r in ids if live(r)}, {r for r in marked if live(r)}
            )
        for rid in out.closed + out.dropped:
            acks += self.ledger.release(rid)
        outs = reply_messages(out.replies, out.batchable)
        outs += mark_messages(stream_marks(out), self.config.detok_shards)
        if not (outs or acks or unreadable):  # inputs held for later: nothing to commit
            return
        task = asyncio.create_task(self._commit(out, outs, acks, unreadable, self._channel))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def _guarded(self, request_id: str, out: Output, apply: Any, *args: Any) -> None:
        """Apply one input; if that raises (a bug, a hostile event), its request alone ends
        with an ``internal`` error and the service goes on."""
        try:
            apply(*args)
        except Exception:
            log.exception("detokenizer failed on a request", request_id=request_id)
            self.core.fail(request_id, "the detokenizer failed on this request", out)

    async def _commit(
        self,
        out: Output,
        outs: list[Any],
        acks: list[AbstractIncomingMessage],
        rejects: list[AbstractIncomingMessage],
        channel: aiormq.abc.AbstractChannel | None,
    ) -> None:
        """One batch's transaction; once committed, what follows from it (aborts, metrics)."""
        assert self.shell.outbox is not None
        try:
            await self.shell.outbox.commit(outs, acks=acks, rejects=rejects, channel=channel)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the channel is gone: everything unacked is replayed
            log.warning("replies not committed; replaying from the inputs", error=repr(exc))
            return
        await self._abort([(rid, None) for rid in out.aborts] + list(out.choice_aborts))
        self.shell.metrics.set_detok_held(len(self.ledger), self.core.num_active)
        for info, reply in out.finished:
            self.shell.metrics.on_request_finished(info, reply)
            self.shell.metrics.on_slo_judged(info.priority, self.goodput.met(reply))
            index = getattr(reply, "choice_index", None)  # n > 1: one done per choice
            log.info(
                "request finished",
                request_id=info.request_id,
                outcome=getattr(reply, "finish_reason", None) or getattr(reply, "code", None),
                **({} if index is None else {"choice_index": index}),
            )

    async def _abort(self, aborts: list[tuple[str, int | None]]) -> None:
        """Workers drop each request (index None), or that one choice of it."""
        for rid, index in aborts:
            try:
                await self.shell.publish_control(ControlMsg("abort", rid, index).encode())
            except Exception as exc:  # workers still stop at max_tokens or the deadline
                log.warning("abort not sent", request_id=rid, error=str(exc))


def build(config: BatonConfig) -> DetokenizerService:
    return DetokenizerService(config, resolve_model_dir(config))
