"""What prefill and decode engines share: request bookkeeping, the verbs, failure handling.

Threading invariant: an engine is not thread-safe. Its shell calls ``add``/``abort``/``release``
only while no ``step`` runs (the step itself may run in a worker thread).

What a shell sees of an engine: the verbs, :class:`EngineInfo` (``info``) and what ``step``
returns. The runner, connectors, scheduler and prioritizer are the engine's own.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

import structlog
import torch

from shared.config import BatonConfig
from shared.engine.expiring import ExpiringIdSet
from shared.engine.inputs import InputTable, choice_key
from shared.engine.outputs import (
    AddResult,
    EngineInfo,
    EngineLoad,
    Handoff,
    NewRequest,
    RequestError,
    StepOutput,
    StepStats,
)
from shared.kv_transfer import ShmConnector
from shared.kv_transfer.connector import KVConnector
from shared.limits import StopRule
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

    def __init__(
        self,
        config: BatonConfig,
        runner: ModelRunner,
        connector: KVConnector,
        spill: KVConnector | None = None,
    ) -> None:
        """``connector``: the transport between the engines. ``spill``: a spill store beside it on
        this engine's cache (prefill: prompts holding host-tier blocks when ``connector`` maps
        the device pool in place; decode: where preempted sequences swap out), or None."""
        self.config = config
        self.runner = runner
        self.connector = connector
        self.spill = spill
        self.connectors = [connector] if spill is None else [connector, spill]
        for c in self.connectors:
            c.register_kv_cache(runner.kv_cache)
        self.block_manager = BlockManager(
            runner.num_kv_blocks,
            runner.block_size,
            config.enable_prefix_caching,
            num_device_blocks=runner.tiers.num_device_blocks,
            kv_window=runner.model_config.kv_window,
            **runner.fp_slots_config(),
        )
        mc = runner.model_config
        self.limits = runner.limits
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.stop = StopRule(self.eos_token_ids, self.limits.max_model_len)
        # The waiting queue's order (effective priority: aging; prefill also boosts short
        # prompts while its backlog is deep), and the priority each handoff leaves with.
        self.priorities = Prioritizer(config, short_boost=self.kind == "prefill")
        self.requests: dict[str, Sequence] = {}  # every sequence this engine owns, by its key
        self.inputs = InputTable()  # the inputs they came in (shared/engine/inputs.py)
        self._deadlines: dict[str, float] = {}  # by input
        self._aborted = ExpiringIdSet()
        self._reclaim_interval_s = max(1.0, config.spill_orphan_timeout_s / 4)
        self._last_reclaim = time.time()
        # The spill store the scheduling policy watches: the transport, when it is one.
        self._store = connector if isinstance(connector, ShmConnector) else None
        self.info = EngineInfo(
            kind=self.kind,
            vocab_size=mc.vocab_size,
            max_model_len=self.limits.max_model_len,
            weight_bytes=runner.model.weight_bytes(),
            kv_bytes_per_token=runner.block_bytes // runner.block_size,
            release_route=connector.release_route,
            spill_store=self._store is not None,
        )
        self.scheduler = self._setup()

    @abstractmethod
    def _setup(self) -> SchedulerBase:
        """This engine's own state, and its scheduler over ``block_manager`` ordered by
        ``priorities`` (called once, at the end of ``__init__``)."""

    # --- verbs ----------------------------------------------------------------------------------
    def add(self, req: NewRequest, now: float | None = None) -> AddResult:
        now = time.time() if now is None else now
        rid, key = req.request_id, req.input_key
        if key in self.inputs:
            return AddResult.DUPLICATE
        if (
            rid in self._aborted
            or key in self._aborted
            or (req.deadline is not None and now >= req.deadline)
        ):
            return AddResult.STALE
        token_ids = req.token_ids
        if not self.limits.fits(len(token_ids)):
            return AddResult.TOO_LONG
        seq = Sequence(  # max_tokens as the tokenizer clamped it; ``stop`` holds our own bound
            req.sequence_key,
            token_ids,
            req.sampling,
            priority=req.priority,
            num_prompt_tokens=len(req.prompt_token_ids),
            arrival_time=req.arrival_time,
            block_size=self.block_manager.block_size,
            parent_request_id=rid,
            choice_index=req.first_choice,
        )
        self.requests[seq.request_id] = seq
        self.inputs.add(key, rid, seq.request_id)
        if req.deadline is not None:
            self._deadlines[key] = req.deadline
        self._admit(seq, req)
        return AddResult.ADDED

    def abort(self, request_id: str, choice_index: int | None = None) -> list[str]:
        """Drop a request wherever it is (cancel, or the detokenizer finished it early), or only
        its choice ``choice_index`` (n > 1: the detokenizer finished that one); later copies of
        it are refused. Returns the inputs that are over with it: the shell may ack them now."""
        if choice_index is None:
            self._aborted.add(request_id)
            inputs = self.inputs.of_request(request_id)
            for key in inputs:
                self._drop_input(key)
            return inputs
        key = choice_key(request_id, choice_index)
        self._aborted.add(key)
        if key not in self.requests:
            return []
        ended = self._drop(key)
        return [] if ended is None else [ended]

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

    def spill_store_bytes(self) -> int:
        """Bytes in the spill store this engine hands off through (``info.spill_store``; 0 when
        none). A folder scan: safe beside a running ``step``, too slow to run every step."""
        return self._store.used_bytes() if self._store is not None else 0

    def close(self) -> None:
        """The process is stopping: the connectors give back what they hold (a pooled sender's
        pool file; a killed sender's is reaped by the next one to start)."""
        for c in self.connectors:
            c.close()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def kv_reclaimed(self) -> dict[tuple[str, str], int]:
        """Orphaned KV its connectors freed, cumulative, by (kind, reason)
        (``KVConnector.reclaimed``)."""
        total: dict[tuple[str, str], int] = {}
        for connector in self.connectors:
            for key, n in connector.reclaimed().items():
                total[key] = total.get(key, 0) + n
        return total

    def step(self, now: float | None = None) -> StepOutput:
        """Expire, schedule, run one forward, update; returns what to publish."""
        now = time.time() if now is None else now
        self._reclaim_orphans(now)
        out = self._step(now)
        bm = self.block_manager
        tier = self.runner.host_tier
        out.load = EngineLoad(
            self.scheduler.num_waiting,
            self.scheduler.num_running,
            bm.num_used_blocks,
            bm.num_free_blocks,
            bm.num_host_blocks_used,
            tier.num_staged_blocks if tier is not None else 0,
            self.priorities.state(),
        )
        out.kv = self.connector.stats()
        out.kv_reclaimed = self.kv_reclaimed()
        return out

    @abstractmethod
    def _step(self, now: float) -> StepOutput:
        """One iteration of this engine (``step`` adds the load snapshot)."""

    # --- for subclasses -------------------------------------------------------------------------
    @abstractmethod
    def _admit(self, seq: Sequence, req: NewRequest) -> None:
        """Queue a new sequence with the scheduler (and keep what else the request carries)."""

    def _drop(self, key: str) -> str | None:
        """Forget a sequence and free whatever it holds. Returns its input if that has no
        sequence left here (it is over)."""
        self.scheduler.abort(key)
        del self.requests[key]
        return self._leave(key)

    def _leave(self, key: str) -> str | None:
        """The sequence ``key`` is gone from here; its input if that is over now."""
        ended = self.inputs.leave(key)
        if ended is not None:
            self._deadlines.pop(ended, None)
        return ended

    def _drop_input(self, input_key: str) -> None:
        """Drop every sequence of an input (all choices of a request forked here)."""
        for key in self.inputs.sequences(input_key):
            self._drop(key)
        self._deadlines.pop(input_key, None)

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

    def _hand_off(
        self,
        seq: Sequence,
        kv: KVDescriptor | None,
        now: float,
        out: StepOutput,
        choices: list[tuple[int, int]] | None = None,
    ) -> None:
        """The request goes on to ``baton.decode`` (prefill's finished prompt, decode's swapped-out
        sequence) with its tokens so far and where its KV waits (None: recompute). Its AMQP
        priority: the effective one now, aging included; the short-prompt boost stays at prefill
        (it answers prefill's backlog, not decode's). n > 1: ``choices``, the choices its KV is
        still to be forked into; else the sequence is one choice, and travels alone."""
        priority = self.priorities.wire_priority(
            seq.priority, seq.arrival_time, seq.num_prompt_tokens, now, boost=False
        )
        rid, input_key = seq.parent_request_id, self.inputs.input_of(seq.request_id)
        if choices:
            handoff = Handoff(rid, [], kv, priority, choices=choices, input_key=input_key)
        else:
            alone = seq.choice_index if seq.sampling.n > 1 else None
            output = seq.output_token_ids
            handoff = Handoff(rid, output, kv, priority, choice_index=alone, input_key=input_key)
        out.handoffs.append(handoff)

    def _reclaim_orphans(self, now: float) -> None:
        """Every engine sweeps what no receiver will take (spill entries nobody loaded, dead
        senders' pools; a sender's expired leases free themselves in ``pop_freeable``): the KV
        a dead peer left is reclaimed whichever side survives."""
        if now - self._last_reclaim >= self._reclaim_interval_s:
            self._last_reclaim = now
            for connector in self.connectors:
                connector.reclaim_orphans(now)

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

    def _retire(self, key: str, out: StepOutput) -> None:
        """The sequence is done here; its blocks are already freed or handed to the connector.
        Its input is retired with its last sequence."""
        self.requests.pop(key, None)
        ended = self._leave(key)
        if ended is not None:
            out.retired.append(ended)

    def _expire(self, now: float, out: StepOutput) -> None:
        """Requests past their deadline stop here silently: the detokenizer answers ``timeout``."""
        for input_key in [k for k, d in self._deadlines.items() if now >= d]:
            self._drop_input(input_key)
            out.retired.append(input_key)

    def _forward(
        self, seqs: list[Sequence], out: StepOutput, run: Callable[[list[int]], list[T]]
    ) -> dict[int, T]:
        """``run(rows)``: the forward over ``seqs[rows]``, one result per row. Returns the
        results by row of every sequence that ran.

        If the batch raises, the request that causes it is found and fails alone (``isolate``):
        the others keep their results, computed in smaller forwards (a forward writes only its
        own rows' KV slots, and sampling is a function of seed and position, so a row run again
        writes and samples the same). Rows that fail even alone end with ``internal`` rather
        than being retried forever; a failure no row reproduces alone fails nobody."""
        rows = list(range(len(seqs)))
        try:
            return dict(zip(rows, run(rows), strict=True))
        except Exception as exc:
            log.exception("forward failed; isolating the request that fails", count=len(seqs))
            error = exc
        results: dict[int, T] = {}
        failed = isolate(rows, run, results) if len(rows) > 1 else [(0, error)]
        for row, cause in failed:
            seq = seqs[row]
            reason = f"{self.kind} failed: {type(cause).__name__}"
            rid = seq.parent_request_id
            log.error("the request fails its forward alone", request_id=rid)
            if seq.request_id in self.requests:  # the whole request fails: all its choices
                input_key = self.inputs.input_of(seq.request_id)
                self._drop_input(input_key)
                out.errors.append(RequestError(rid, ErrorCode.INTERNAL, reason))
                out.retired.append(input_key)
        # The failed requests' other choices ran, but are gone with them.
        return {r: v for r, v in results.items() if seqs[r].request_id in self.requests}

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
        preemptions_by_cause: dict[str, int] | None = None,
        prefetch_hits_total: int = 0,
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
            preemptions_by_cause=preemptions_by_cause or {},
            prefetch_hits_total=prefetch_hits_total,
            num_threads=torch.get_num_threads(),
        )


def isolate(
    rows: list[int], run: Callable[[list[int]], list[T]], results: dict[int, T]
) -> list[tuple[int, Exception]]:
    """``rows`` failed together (two or more): run each half, and split what fails again, until
    every row either ran (its result in ``results``) or failed alone — returned with its error.
    One bad row among n costs about 2·log2(n) extra forwards, each smaller than the batch."""
    failed: list[tuple[int, Exception]] = []
    half = len(rows) // 2
    for part in (rows[:half], rows[half:]):
        try:
            results.update(zip(part, run(part), strict=True))
        except Exception as exc:
            failed += [(part[0], exc)] if len(part) == 1 else isolate(part, run, results)
    return failed
