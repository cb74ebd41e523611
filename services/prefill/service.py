"""Prefill service: batch prompts up to a token budget, sample the first token, hand off the KV.

Per completed prompt, in this order: the first token goes to the detokenizer, then the handoff
(KV descriptor) to decode; the input is acked only after both are confirmed. A request that
finishes at its first token (EOS, ``max_tokens`` 1) is not handed off at all.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog
from aio_pika.abc import AbstractIncomingMessage

from services.worker import Intake, WorkerShell, error_event, requeue
from shared.broker import DECODE_QUEUE, PREFILL_QUEUE, Broker, Outgoing
from shared.config import BatonConfig
from shared.engine.block_manager import BlockManager
from shared.engine.model_runner import ModelRunner
from shared.engine.sequence import SamplingParams, Sequence
from shared.kv_transport import KVTransport
from shared.metrics_glue import ServiceMetrics
from shared.protocol import HandoffMsg, KVDescriptor, PrefillMsg, TokenEvent
from shared.protocol_errors import ErrorCode, ProtocolError
from shared.scheduling import PrefillBatch, PrefillScheduler

log = structlog.get_logger(__name__)


@dataclass
class _Done:
    seq: Sequence
    token: int
    finish_reason: str | None  # set when the request ends at its first token (no handoff)
    kv: KVDescriptor | None
    send_s: float = 0.0


class PrefillService:
    name = "prefill"

    def __init__(self, config: BatonConfig, runner: ModelRunner, transport: KVTransport) -> None:
        self.config = config
        self.runner = runner
        self.transport = transport
        self.block_manager = BlockManager(
            runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = PrefillScheduler(
            self.block_manager, config.max_num_batched_tokens, config.prefill_max_num_seqs
        )
        self.eos_token_ids = frozenset(runner.model_config.eos_token_ids)
        self.broker = Broker(config, prefetch_count=2 * config.prefill_max_num_seqs)
        self.shell = WorkerShell(self.broker, config.max_message_bytes)
        self.work: dict[str, Intake] = {}  # request_id -> its message, until acked
        self.metrics = ServiceMetrics(config, self.name, broker=self.broker)
        self._loop_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.broker.connect()
        await self.broker.subscribe_control(self.shell.on_control)
        await self.metrics.start(ready=lambda: self._loop_task is not None)
        self._loop_task = asyncio.create_task(self._engine_loop())
        await self.broker.consume(PREFILL_QUEUE, self.on_message)

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        await self.shell.drain_publishes()
        await self.broker.close()
        await self.metrics.stop()

    async def on_message(self, delivery: AbstractIncomingMessage) -> None:
        try:
            msg = PrefillMsg.decode(delivery.body, self.config.max_message_bytes)
        except ProtocolError as exc:
            await self.shell.fail_unparseable(delivery, exc)
            return
        self.shell.incoming.append(Intake(msg, delivery))
        self.shell.wake.set()

    # --- engine loop (the only place scheduler state changes) -----------------------------------
    async def _engine_loop(self) -> None:
        while True:
            try:
                await self._admit_incoming()
                self._apply_aborts()
                if not self.scheduler.has_work():
                    await self.shell.wait_for_work(timeout_s=1.0)
                    continue
                if self.scheduler.num_running == 0 and self.config.prefill_batch_wait_s > 0:
                    # Just woke with fresh work: give its neighbours a moment to arrive too.
                    await asyncio.sleep(self.config.prefill_batch_wait_s)
                    await self._admit_incoming()
                batch = self.scheduler.schedule()
                if not batch:
                    await self.shell.wait_for_work(timeout_s=0.01)
                    continue
                await self._run_batch(batch)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("prefill engine loop error")
                await asyncio.sleep(0.1)

    async def _admit_incoming(self) -> None:
        now = time.time()
        while self.shell.incoming:
            item = self.shell.incoming.popleft()
            msg: PrefillMsg = item.msg
            rid = msg.request_id
            if rid in self.work:  # a redelivered duplicate of a request already here
                await item.delivery.ack()
                continue
            if rid in self.shell.aborted or (msg.deadline is not None and now >= msg.deadline):
                await item.delivery.ack()  # the detokenizer answers cancels and timeouts
                continue
            s = msg.sampling
            seq = Sequence(
                rid,
                msg.prompt_token_ids,
                SamplingParams(s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens, s.ignore_eos),
                priority=msg.priority,
                arrival_time=msg.arrival_time,
                block_size=self.config.block_size,
            )
            if not self.scheduler.fits_ever(seq):
                event = error_event(rid, ErrorCode.PROMPT_TOO_LONG, "prompt exceeds the KV cache")
                await self.shell.publish_events([event])
                await item.delivery.ack()
                continue
            self.work[rid] = item
            self.scheduler.add(seq)

    def _apply_aborts(self) -> None:
        while self.shell.pending_aborts:
            rid = self.shell.pending_aborts.popleft()
            if self.scheduler.abort(rid) is not None:
                item = self.work.pop(rid)
                self.shell.spawn(item.delivery.ack())

    async def _run_batch(self, batch: PrefillBatch) -> None:
        started = time.time()
        done = await asyncio.to_thread(self._forward_and_send, batch)
        finished = self.scheduler.update(batch, [d.token if d else None for d in done])
        self.metrics.on_prefill_batch(
            batch, self.scheduler.num_waiting, self.block_manager, time.time() - started
        )
        results = [d for d in done if d is not None]
        for seq in finished:
            self.scheduler.free(seq)  # the KV went to the transport: blocks are reusable
        if results:
            items = [self.work.pop(d.seq.request_id) for d in results]
            self.shell.spawn(self._publish(results, items, started))

    def _forward_and_send(self, batch: PrefillBatch) -> list[_Done | None]:
        """Worker thread: the forward, then each completed prompt's KV into the transport."""
        tokens = self.runner.prefill(batch.seqs, batch.num_new_tokens)
        out: list[_Done | None] = []
        for seq, token in zip(batch.seqs, tokens, strict=True):
            if token is None:
                out.append(None)
                continue
            desc, send_s = None, 0.0
            reason = self._finish_reason(seq, token)
            if reason is None:
                t0 = time.perf_counter()
                num_blocks = self.block_manager.blocks_for(seq.num_tokens)
                kv = self.runner.read_blocks(seq.block_table[:num_blocks])
                desc = self.transport.send(seq.request_id, kv, seq.num_tokens)
                send_s = time.perf_counter() - t0
            out.append(_Done(seq, token, reason, desc, send_s))
        return out

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Does the request end at its first token? (``seq`` holds the prompt only here.)"""
        if token in self.eos_token_ids and not seq.sampling.ignore_eos:
            return "stop"
        if seq.sampling.max_tokens <= 1 or seq.num_tokens + 1 >= self.config.max_model_len:
            return "length"
        return None

    async def _publish(self, results: list[_Done], items: list[Intake], started: float) -> None:
        events, handoffs = [], []
        for d, item in zip(results, items, strict=True):
            seq, msg = d.seq, item.msg
            events.append(
                TokenEvent(seq.request_id, 0, [d.token], d.finish_reason, scheduled_at=started)
            )
            if d.finish_reason is None:
                handoff = HandoffMsg(
                    request_id=seq.request_id,
                    prompt_token_ids=msg.prompt_token_ids,
                    output_token_ids=[d.token],
                    sampling=msg.sampling,
                    kv=d.kv,
                    priority=msg.priority,
                    arrival_time=msg.arrival_time,
                    deadline=msg.deadline,
                )
                handoffs.append(Outgoing(DECODE_QUEUE, handoff.encode(), priority=msg.priority))
        try:
            await self.shell.publish_events(events)
            await self.broker.publish_many(handoffs)
        except Exception:
            log.exception("publishing prefill results failed; requeueing the inputs")
            for item in items:
                await requeue(item)
            return
        for item in items:
            await item.delivery.ack()
        for d in results:
            if d.kv is not None:
                self.metrics.on_handoff(d.kv.transport, d.kv.nbytes, d.send_s)
