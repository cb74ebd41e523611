"""What prefill and decode engines share: request bookkeeping, the verbs, failure handling.

Threading invariant: an engine is not thread-safe. Its shell calls ``add``/``abort``/``release``
only while no ``step`` runs (the step itself may run in a worker thread).
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

import structlog

from shared.config import BatonConfig
from shared.engine.expiring import ExpiringIdSet
from shared.engine.outputs import (
    AddResult,
    EngineLoad,
    NewRequest,
    RequestError,
    StepOutput,
    StepStats,
)
from shared.kv_transfer.connector import KVConnector
from shared.limits import Limits
from shared.runtime.block_manager import BlockManager
from shared.runtime.model_runner import ModelRunner
from shared.runtime.sequence import Sequence
from shared.scheduling.base import SchedulerBase
from shared.scheduling.priority import Prioritizer
from shared.wire.errors import ErrorCode
from shared.wire.messages import KVDescriptor, KVRelease

log = structlog.get_logger(__name__)
T = TypeVar("T")


class EngineCore(ABC):
    kind: str  # "prefill" | "decode"
    scheduler: SchedulerBase

    def __init__(self, config: BatonConfig, runner: ModelRunner, connector: KVConnector) -> None:
        self.config = config
        self.runner = runner
        self.connector = connector
        connector.register_kv_cache(runner.kv_cache)
        self.block_manager = BlockManager(
            runner.num_kv_blocks,
            runner.block_size,
            config.enable_prefix_caching,
            num_device_blocks=runner.tiers.num_device_blocks,
            kv_window=runner.model_config.kv_window,
            **runner.fp_slots_config(),
        )
        mc = runner.model_config
        self.limits = Limits.build(config, mc.max_position_embeddings, runner.max_seq_tokens)
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        # The waiting queue's order (effective priority: aging; prefill also boosts short
        # prompts while its backlog is deep). The subclass hands it to its scheduler.
        self.priorities = Prioritizer(config, short_boost=self.kind == "prefill")
        self.requests: dict[str, Sequence] = {}  # every request this engine owns, by id
        self._deadlines: dict[str, float] = {}
        self._aborted = ExpiringIdSet()

    # --- verbs ----------------------------------------------------------------------------------
    def add(self, req: NewRequest, now: float | None = None) -> AddResult:
        now = time.time() if now is None else now
        rid = req.request_id
        if rid in self.requests:
            return AddResult.DUPLICATE
        if rid in self._aborted or (req.deadline is not None and now >= req.deadline):
            return AddResult.STALE
        num_prompt = len(req.prompt_token_ids)
        if not self.limits.fits(num_prompt + len(req.output_token_ids)):
            return AddResult.TOO_LONG
        seq = Sequence(
            rid,
            req.prompt_token_ids + req.output_token_ids,
            self.limits.clamp(req.sampling, num_prompt),
            priority=req.priority,
            num_prompt_tokens=num_prompt,
            arrival_time=req.arrival_time,
            block_size=self.block_manager.block_size,
        )
        self.requests[rid] = seq
        if req.deadline is not None:
            self._deadlines[rid] = req.deadline
        self._admit(seq, req)
        return AddResult.ADDED

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (cancel, or the detokenizer finished it early); later
        copies of it are refused. True if it was here: the shell may ack its input now."""
        self._aborted.add(request_id)
        if request_id not in self.requests:
            return False
        self._drop(request_id)
        return True

    def observe_backlog(self, prefill_backlog: int | None) -> None:
        """The prefill queue's depth as last polled (the short-prompt boost follows it)."""
        self.priorities.observe_backlog(prefill_backlog)

    def has_work(self) -> bool:
        """Anything for ``step`` to schedule or expire."""
        return self.scheduler.has_work() or bool(self._deadlines)

    def is_drained(self) -> bool:
        """Nothing left here at all: no work, and no KV a receiver may still read."""
        return not self.has_work()

    def release(self, notice: KVRelease, now: float | None = None) -> None:
        """A receiver is done with KV this engine sent (pooled transports)."""
        self.connector.release(notice)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def step(self, now: float | None = None) -> StepOutput:
        """Expire, schedule, run one forward, update; returns what to publish."""
        out = self._step(time.time() if now is None else now)
        bm = self.block_manager
        tier = self.runner.host_tier
        out.load = EngineLoad(
            self.scheduler.num_waiting,
            self.scheduler.num_running,
            bm.num_used_blocks,
            bm.num_free_blocks,
            bm.num_host_blocks_used,
            tier.num_staged_blocks if tier is not None else 0,
        )
        return out

    @abstractmethod
    def _step(self, now: float) -> StepOutput:
        """One iteration of this engine (``step`` adds the load snapshot)."""

    # --- for subclasses -------------------------------------------------------------------------
    @abstractmethod
    def _admit(self, seq: Sequence, req: NewRequest) -> None:
        """Queue a new sequence with the scheduler (and keep what else the request carries)."""

    def _drop(self, request_id: str) -> None:
        """Forget a request and free whatever it holds."""
        self.scheduler.abort(request_id)
        del self.requests[request_id]
        self._deadlines.pop(request_id, None)

    def _started(self, seqs: list[Sequence], now: float) -> None:
        """These sequences were just scheduled: the first time, their wait ends (aging's median)."""
        for seq in seqs:
            if seq.started_at is None:
                seq.started_at = now
                self.priorities.observe_wait(now - seq.arrival_time)

    def _device_ids(
        self, block_ids: list[int], *, read: bool, write: bool
    ) -> AbstractContextManager[list[int]]:
        """Transports see the device cache only: host-tier blocks pass through staging (read:
        staged in for a send; write: copied back after a load)."""
        tier = self.runner.host_tier
        if tier is None:
            return nullcontext(block_ids)
        return tier.device_ids(block_ids, read=read, write=write)

    def _send(
        self, sender: KVConnector, seq: Sequence, announce: bool = False
    ) -> KVDescriptor | None:
        """Offer ``seq``'s computed KV to ``sender``: the blocks its window still holds (those
        before were released), the descriptor saying where they start. ``announce``: before the
        prompt is computed (a layer-wise handoff): the blocks its window will hold at the end."""
        bm = self.block_manager
        num_tokens = seq.num_tokens if announce else seq.num_computed_tokens
        first, live = bm.live_blocks(seq, num_tokens)
        if announce:
            first = max(first, bm.first_kept_block(num_tokens))
            live = seq.block_table[first : bm.blocks_for(num_tokens)]
        slots = bm.fp_slots(seq, num_tokens)  # after the blocks: an int8 cache's window
        with self._device_ids(live + slots, read=True, write=False) as block_ids:
            if announce:
                desc = sender.announce(
                    seq.request_id, block_ids, num_tokens, seq.num_computed_tokens
                )
            else:
                desc = sender.send(seq.request_id, block_ids, num_tokens)
        if desc is None or not (first or slots):
            return desc
        return dataclasses.replace(
            desc, first_block=first, fp_first_block=seq.fp_first_block, fp_slots=len(slots)
        )

    def _retire(self, request_id: str, out: StepOutput) -> None:
        """The request is done here; its blocks are already freed or handed to the connector."""
        self.requests.pop(request_id, None)
        self._deadlines.pop(request_id, None)
        out.retired.append(request_id)

    def _expire(self, now: float, out: StepOutput) -> None:
        """Requests past their deadline stop here silently: the detokenizer answers ``timeout``."""
        for rid in [r for r, d in self._deadlines.items() if now >= d]:
            self._drop(rid)
            out.retired.append(rid)

    def _forward(self, seqs: list[Sequence], out: StepOutput, fn: Callable[[], T]) -> T | None:
        """Run a forward; if it raises, end its requests with ``internal`` rather than retrying a
        batch that may fail forever — every other request keeps being served."""
        try:
            return fn()
        except Exception as exc:
            reason = f"{self.kind} failed: {type(exc).__name__}"
            log.exception("forward failed; failing its requests", count=len(seqs))
            for seq in seqs:
                if seq.request_id in self.requests:
                    self._drop(seq.request_id)
                    out.errors.append(RequestError(seq.request_id, ErrorCode.INTERNAL, reason))
                    out.retired.append(seq.request_id)
            return None

    def _stats(
        self,
        num_seqs: int,
        num_scheduled: int,
        num_generated: int,
        num_context: int,
        forward_s: float,
        preemptions_total: int = 0,
        swaps_out_total: int = 0,
        swaps_in_total: int = 0,
    ) -> StepStats:
        bm = self.block_manager
        return StepStats(
            num_seqs=num_seqs,
            num_scheduled_tokens=num_scheduled,
            num_generated_tokens=num_generated,
            num_context_tokens=num_context,
            forward_s=forward_s,
            prefix_queries_total=bm.num_prefix_queries_tokens,
            prefix_hits_total=bm.num_prefix_hit_tokens,
            preemptions_total=preemptions_total,
            swaps_out_total=swaps_out_total,
            swaps_in_total=swaps_in_total,
        )
