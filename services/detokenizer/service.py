"""Detokenizer service: the only place replies to clients come from (besides bad input, which
the tokenizer answers at once).

Messages are handled in micro-batches: everything that arrived while the previous batch was being
answered is processed together, so a streaming request gets one ``token`` reply per batch rather
than one per decode step when the broker or this process falls behind. Inputs are acked only
after every reply they produced is confirmed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from pathlib import Path

import structlog
from aio_pika.abc import AbstractIncomingMessage
from transformers import AutoTokenizer

from services.detokenizer.core import DetokenizerCore, Output
from shared.broker import DETOK_QUEUE, Broker, Outgoing
from shared.config import BatonConfig
from shared.metrics_glue import ServiceMetrics
from shared.protocol import ControlMsg, DetokMsg, ProtocolError

log = structlog.get_logger(__name__)

SWEEP_INTERVAL_S = 0.05


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
            make_decoder(model_dir), stream_interval_s=config.stream_interval_s
        )
        self.broker = Broker(config, prefetch_count=512)
        self.metrics = ServiceMetrics(config, self.name, broker=self.broker)
        self._inbox: deque[AbstractIncomingMessage] = deque()
        self._cancels: deque[str] = deque()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.broker.connect()
        await self.broker.subscribe_control(self.on_control)
        await self.metrics.start(ready=lambda: self._loop_task is not None)
        self._loop_task = asyncio.create_task(self._loop())
        await self.broker.consume(DETOK_QUEUE, self.on_message)

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        await self.broker.close()
        await self.metrics.stop()

    async def on_message(self, delivery: AbstractIncomingMessage) -> None:
        self._inbox.append(delivery)
        self._wake.set()

    async def on_control(self, message: AbstractIncomingMessage) -> None:
        try:
            ctl = ControlMsg.decode(message.body, self.config.max_message_bytes)
        except ProtocolError as exc:
            log.warning("bad control message ignored", reason=exc.message)
            return
        if ctl.type == "cancel" and ctl.request_id is not None:
            self._cancels.append(ctl.request_id)
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            wait_s = SWEEP_INTERVAL_S
            if self.core.has_pending_stream():
                wait_s = min(wait_s, max(self.config.stream_interval_s / 2, 0.001))
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
        deliveries = []
        while self._inbox:
            delivery = self._inbox.popleft()
            deliveries.append(delivery)
            try:
                msg = DetokMsg.decode(delivery.body, self.config.max_message_bytes)
            except ProtocolError as exc:
                log.error("unreadable detok message dead-lettered", reason=exc.message)
                await delivery.reject(requeue=False)
                deliveries.pop()
                continue
            for info in msg.starts:
                self.core.start(info, now, out)
            for ev in msg.events:
                self.core.event(ev, now, out)
        while self._cancels:
            self.core.cancel(self._cancels.popleft(), now, out)
        self.core.expire(now, out)
        self.core.flush(out, now)
        await self._send(out, deliveries)

    async def _send(self, out: Output, deliveries: list[AbstractIncomingMessage]) -> None:
        replies = [
            Outgoing(reply_to, reply.encode(), correlation_id=reply.request_id, persistent=False)
            for reply_to, reply in out.replies
        ]
        # The core has already applied these inputs: a redelivery would be deduplicated and
        # produce no replies, so the replies themselves are retried until the broker takes them
        # (the robust connection reconnects meanwhile). Inputs are acked only afterwards.
        await self.broker.publish_until_confirmed(replies, "replies")
        for rid in out.aborts:
            try:
                await self.broker.publish_control(ControlMsg("abort", rid).encode())
            except Exception as exc:  # workers still stop at max_tokens or the deadline
                log.warning("abort not sent", request_id=rid, error=str(exc))
        for d in deliveries:
            try:
                await d.ack()
            except Exception:  # its channel died: redelivered, then dropped as a duplicate
                log.debug("ack failed after reconnect", delivery_tag=d.delivery_tag)
        for info, reply in out.finished:
            self.metrics.on_request_finished(info, reply)
            log.info(
                "request finished",
                request_id=info.request_id,
                outcome=getattr(reply, "finish_reason", None) or getattr(reply, "code", None),
            )
