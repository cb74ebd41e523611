"""Decode service: continuous batching over the paged cache, one detok message per step.

A handoff stays unacked while its sequence runs: if this worker dies, the broker redelivers it
to another, which recomputes the KV (the transport entry was consumed) and replays the request;
sampling is a function of (seed, position), so the replay emits the same tokens and the
detokenizer drops the positions it already has.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from aio_pika.abc import AbstractIncomingMessage

from services.worker import Intake, WorkerShell, error_event, requeue
from shared.broker import DECODE_QUEUE, Broker
from shared.config import BatonConfig
from shared.engine.block_manager import BlockManager
from shared.engine.model_runner import ModelRunner
from shared.engine.sequence import SamplingParams, Sequence
from shared.kv_transport import KVTransport
from shared.metrics_glue import ServiceMetrics
from shared.protocol import HandoffMsg, ProtocolError, TokenEvent
from shared.protocol_errors import ErrorCode
from shared.scheduling import DecodeScheduler, DecodeStep

log = structlog.get_logger(__name__)


class DecodeService:
    name = "decode"

    def __init__(self, config: BatonConfig, runner: ModelRunner, transport: KVTransport) -> None:
        self.config = config
        self.runner = runner
        self.transport = transport
        self.block_manager = BlockManager(
            runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = DecodeScheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            runner.model_config.eos_token_ids,
            config.max_model_len,
        )
        self.broker = Broker(config, prefetch_count=config.max_num_seqs + config.decode_max_waiting)
        self.shell = WorkerShell(self.broker, config.max_message_bytes)
        self.work: dict[str, Intake] = {}  # request_id -> its handoff, unacked while it runs
        self.metrics = ServiceMetrics(config, self.name, broker=self.broker)
        self.metrics.set_decode_costs(
            weight_bytes=sum(p.numel() * p.element_size() for p in runner.model.parameters()),
            kv_bytes_per_token=runner.block_bytes // config.block_size,
        )
        self._loop_task: asyncio.Task[None] | None = None
        self._reclaim_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.broker.connect()
        await self.broker.subscribe_control(self.shell.on_control)
        await self.metrics.start(ready=lambda: self._loop_task is not None)
        self._loop_task = asyncio.create_task(self._engine_loop())
        self._reclaim_task = asyncio.create_task(self._reclaim_orphans())
        await self.broker.consume(DECODE_QUEUE, self.on_message)

    async def stop(self) -> None:
        for task in (self._loop_task, self._reclaim_task):
            if task is not None:
                task.cancel()
        await self.shell.drain_publishes()
        await self.broker.close()
        await self.metrics.stop()

    async def _reclaim_orphans(self) -> None:
        """Spill-store entries nobody loaded in time belonged to requests that died upstream."""
        interval = max(1.0, self.config.spill_orphan_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                await asyncio.to_thread(self.transport.reclaim_orphans)
            except Exception:
                log.exception("reclaiming orphan KV entries failed")

    async def on_message(self, delivery: AbstractIncomingMessage) -> None:
        try:
            msg = HandoffMsg.decode(delivery.body, self.config.max_message_bytes)
        except ProtocolError as exc:
            await self.shell.fail_unparseable(delivery, exc)
            return
        self.shell.incoming.append(Intake(msg, delivery))
        self.shell.wake.set()

    # --- engine loop ----------------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        while True:
            try:
                await self._admit_incoming()
                self._apply_aborts(time.time())
                if not self.scheduler.has_work():
                    await self.shell.wait_for_work(timeout_s=1.0)
                    continue
                admitted = self.scheduler.admit()
                if admitted:
                    await asyncio.to_thread(self._load_kv, admitted)
                step = self.scheduler.schedule()
                if not step:
                    await self.shell.wait_for_work(timeout_s=0.01)
                    continue
                await self._run_step(step)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("decode engine loop error")
                await asyncio.sleep(0.1)

    async def _admit_incoming(self) -> None:
        now = time.time()
        while self.shell.incoming:
            item = self.shell.incoming.popleft()
            msg: HandoffMsg = item.msg
            rid = msg.request_id
            expired = msg.deadline is not None and now >= msg.deadline
            if rid in self.work or rid in self.shell.aborted or expired:
                if msg.kv is not None and rid not in self.work:
                    self.transport.discard(msg.kv)
                await item.delivery.ack()
                continue
            s = msg.sampling
            seq = Sequence(
                rid,
                msg.prompt_token_ids + msg.output_token_ids,
                SamplingParams(s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens, s.ignore_eos),
                priority=msg.priority,
                num_prompt_tokens=len(msg.prompt_token_ids),
                arrival_time=msg.arrival_time,
                block_size=self.config.block_size,
            )
            if not self.scheduler.add(seq):
                event = error_event(rid, ErrorCode.PROMPT_TOO_LONG, "sequence exceeds the KV cache")
                await self.shell.publish_events([event])
                await item.delivery.ack()
                continue
            self.work[rid] = item

    def _load_kv(self, admitted: list[Sequence]) -> None:
        """Worker thread: copy each admitted sequence's KV from the transport into its blocks.

        Blocks that were prefix hits in this engine already hold the same KV and may be shared:
        only the rest is written. Without an entry (consumed by a crashed worker, transport was
        full, or a preempted sequence resuming) the scheduler recomputes the KV instead."""
        for seq in admitted:
            msg: HandoffMsg = self.work[seq.request_id].msg
            desc, msg.kv = msg.kv, None  # consumed: a preempted sequence resumes by recompute
            if desc is None:
                continue
            t0 = time.perf_counter()
            kv = self.transport.receive(desc)
            if kv is None:
                log.warning("KV entry gone, recomputing", request_id=seq.request_id)
                continue
            first = seq.num_computed_tokens // self.config.block_size
            num_blocks = kv.shape[2]
            self.runner.write_blocks(seq.block_table[first:num_blocks], kv[:, :, first:])
            seq.num_computed_tokens = desc.num_tokens
            self.metrics.on_handoff(desc.transport, desc.nbytes, time.perf_counter() - t0)

    def _apply_aborts(self, now: float) -> None:
        aborted = list(self.shell.pending_aborts)
        self.shell.pending_aborts.clear()
        for rid, item in self.work.items():
            deadline = item.msg.deadline
            if deadline is not None and now >= deadline:
                aborted.append(rid)  # the detokenizer answers the timeout itself
        for rid in aborted:
            if rid not in self.work:
                continue
            item = self.work.pop(rid)
            self.scheduler.abort(rid)
            if item.msg.kv is not None:
                self.transport.discard(item.msg.kv)
            self.shell.spawn(item.delivery.ack())

    async def _run_step(self, step: DecodeStep) -> None:
        started = time.perf_counter()
        tokens = await asyncio.to_thread(self._forward, step)
        finished = self.scheduler.update(step, tokens)
        reasons = {f.seq.request_id: f.reason for f in finished}
        events = [
            TokenEvent(s.request_id, s.num_output_tokens - 1, [t], reasons.get(s.request_id))
            for s, t in zip(step.decode, tokens, strict=True)
        ]
        done = [self.work.pop(rid) for rid in reasons]
        self.metrics.on_decode_step(
            step, self.scheduler, self.block_manager, time.perf_counter() - started
        )
        if events:
            self.shell.spawn(self._publish(events, done))

    def _forward(self, step: DecodeStep) -> list[int]:
        if step.recompute.seqs:
            self.runner.prefill(step.recompute.seqs, step.recompute.num_new_tokens)
        return self.runner.decode(step.decode)

    async def _publish(self, events: list[TokenEvent], done: list[Intake]) -> None:
        try:
            await self.shell.publish_events(events)
        except Exception:
            log.exception("publishing a decode step failed; requeueing finished handoffs")
            for item in done:
                await requeue(item)
            return
        for item in done:
            await item.delivery.ack()
