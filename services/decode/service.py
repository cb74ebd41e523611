"""Decode service: continuous batching over the paged cache, one detok message per step.

A handoff stays unacked while its sequence runs: if this worker dies, the broker redelivers it
to another, which recomputes the KV (the transport entry was consumed) and replays the request;
sampling is a function of (seed, position), so the replay emits the same tokens and the
detokenizer drops the positions it already has.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import structlog

from services.worker import EngineService, Intake, requeue, sampling_params
from shared.broker import DECODE_QUEUE
from shared.config import BatonConfig
from shared.engine.model_runner import ModelRunner
from shared.engine.sequence import Sequence
from shared.kv_transport import KVTransport
from shared.protocol import HandoffMsg, TokenEvent
from shared.protocol_errors import ErrorCode
from shared.scheduling import DecodeScheduler, DecodeStep

log = structlog.get_logger(__name__)


class DecodeService(EngineService):
    name = "decode"
    queue = DECODE_QUEUE
    message_type = HandoffMsg
    scheduler: DecodeScheduler

    def __init__(self, config: BatonConfig, runner: ModelRunner, transport: KVTransport) -> None:
        super().__init__(
            config, runner, transport, prefetch=config.max_num_seqs + config.decode_max_waiting
        )
        self.scheduler = DecodeScheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            runner.model_config.eos_token_ids,
            config.max_model_len,
        )
        self.metrics.set_decode_costs(
            weight_bytes=sum(p.numel() * p.element_size() for p in runner.model.parameters()),
            kv_bytes_per_token=runner.block_bytes // config.block_size,
        )

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return [self._reclaim_orphans()]

    async def _reclaim_orphans(self) -> None:
        """Spill-store entries nobody loaded in time belonged to requests that died upstream."""
        interval = max(1.0, self.config.spill_orphan_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                await asyncio.to_thread(self.transport.reclaim_orphans)
            except Exception:
                log.exception("reclaiming orphan KV entries failed")

    async def step(self) -> None:
        await self._admit_incoming()
        self._apply_aborts(time.time())
        if not self.scheduler.has_work():
            await self.shell.wait_for_work(timeout_s=1.0)
            return
        admitted = self.scheduler.admit()
        if admitted:
            await asyncio.to_thread(self._load_kv, admitted)
        step = self.scheduler.schedule()
        if not step:
            await self.shell.wait_for_work(timeout_s=0.01)
            return
        await self._run_step(step)

    async def _admit_incoming(self) -> None:
        now = time.time()
        while self.shell.incoming:
            item = self.shell.incoming.popleft()
            msg: HandoffMsg = item.msg
            rid = msg.request_id
            if self.is_stale(rid, msg.deadline, now):
                # A duplicate's entry may be the one its running original still needs: keep it
                # (an unloaded entry is reclaimed as an orphan).
                if msg.kv is not None and rid not in self.work:
                    self.transport.discard(msg.kv)
                await item.delivery.ack()
                continue
            seq = Sequence(
                rid,
                msg.prompt_token_ids + msg.output_token_ids,
                sampling_params(msg.sampling),
                priority=msg.priority,
                num_prompt_tokens=len(msg.prompt_token_ids),
                arrival_time=msg.arrival_time,
                block_size=self.config.block_size,
            )
            if not self.scheduler.add(seq):
                await self.refuse(item, ErrorCode.PROMPT_TOO_LONG, "sequence exceeds the KV cache")
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
        try:
            tokens = await asyncio.to_thread(self._forward, step)
        except Exception as exc:
            log.exception("decode step failed")
            rids = [s.request_id for s in (*step.decode, *step.recompute.seqs)]
            await self.fail_requests(rids, f"decode failed: {type(exc).__name__}")
            return
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
