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

from services.worker import EngineService, Intake, requeue, sampling_params
from shared.broker import DECODE_QUEUE, PREFILL_QUEUE, Outgoing
from shared.config import BatonConfig
from shared.engine.model_runner import ModelRunner
from shared.engine.sequence import Sequence
from shared.kv_transport import KVTransport
from shared.protocol import HandoffMsg, KVDescriptor, PrefillMsg, TokenEvent
from shared.protocol_errors import ErrorCode
from shared.scheduling import PrefillBatch, PrefillScheduler

log = structlog.get_logger(__name__)


@dataclass
class _Done:
    seq: Sequence
    token: int
    finish_reason: str | None  # set when the request ends at its first token (no handoff)
    kv: KVDescriptor | None
    send_s: float = 0.0


class PrefillService(EngineService):
    name = "prefill"
    queue = PREFILL_QUEUE
    message_type = PrefillMsg
    scheduler: PrefillScheduler

    def __init__(self, config: BatonConfig, runner: ModelRunner, transport: KVTransport) -> None:
        super().__init__(config, runner, transport, prefetch=2 * config.prefill_max_num_seqs)
        self.scheduler = PrefillScheduler(
            self.block_manager, config.max_num_batched_tokens, config.prefill_max_num_seqs
        )
        self.eos_token_ids = frozenset(runner.model_config.eos_token_ids)

    async def step(self) -> None:
        await self._admit_incoming()
        self._apply_aborts()
        if not self.scheduler.has_work():
            await self.shell.wait_for_work(timeout_s=1.0)
            return
        if self.scheduler.num_running == 0 and self.config.prefill_batch_wait_s > 0:
            # Just woke with fresh work: give its neighbours a moment to arrive too.
            await asyncio.sleep(self.config.prefill_batch_wait_s)
            await self._admit_incoming()
        batch = self.scheduler.schedule()
        if not batch:
            await self.shell.wait_for_work(timeout_s=0.01)
            return
        await self._run_batch(batch)

    async def _admit_incoming(self) -> None:
        now = time.time()
        while self.shell.incoming:
            item = self.shell.incoming.popleft()
            msg: PrefillMsg = item.msg
            rid = msg.request_id
            if self.is_stale(rid, msg.deadline, now):
                await item.delivery.ack()
                continue
            seq = Sequence(
                rid,
                msg.prompt_token_ids,
                sampling_params(msg.sampling),
                priority=msg.priority,
                arrival_time=msg.arrival_time,
                block_size=self.config.block_size,
            )
            if not self.scheduler.fits_ever(seq):
                await self.refuse(item, ErrorCode.PROMPT_TOO_LONG, "prompt exceeds the KV cache")
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
        try:
            done = await asyncio.to_thread(self._forward_and_send, batch)
        except Exception as exc:
            log.exception("prefill batch failed")
            rids = [s.request_id for s in batch.seqs]
            await self.fail_requests(rids, f"prefill failed: {type(exc).__name__}")
            return
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
