"""The decode engine: continuous batching over the paged cache, one token per sequence a step.

An added request carries the descriptor of its prompt's KV. When the scheduler admits it (blocks
allocated), the connector copies that KV into its blocks; without a descriptor, or if the KV is
gone (an earlier receiver consumed it before crashing, the store was full), the scheduler
recomputes the KV inside this engine.

Preemption by swap (``BATON_DECODE_PREEMPTION=swap``, the default): the victim's computed KV is
copied into the spill store by this engine's own sending role (``spill``, a spill-store connector
beside the receiving one) and the request leaves as a handoff to ``baton.decode`` — prompt,
tokens so far, the KV's descriptor, its effective priority — for whichever decode worker has
room (this one included), which loads the KV and goes on with no recompute. If the store is
full, the victim stays here and recomputes (``recompute`` mode always does). The resuming worker
loads swapped-out KV on a background thread while its current step runs (prefetch on resume,
``kv_prefetch.py``); the sequence joins the batch at the next step.

Parallel sampling (``n`` > 1): prefill's handoff brings the prompt's KV once, with each choice's
first token. Its first choice is admitted and loaded (or recomputes) as any request; once the
prompt's KV is in, it is forked into the other choices (``_fork``: vLLM v0's fork of a
SequenceGroup, one sequence per choice): the prompt's full blocks are shared (ref counts), and
each choice gets its own copy of the block holding its next position (copy-on-write,
``BlockManager.fork``). The handoff's input is retired when its last choice is done or has left
(shared/engine/inputs.py); an abort of the request drops every choice, one of a choice (a stop
string) that choice alone.
"""

from __future__ import annotations

import time
from typing import cast

import structlog

from shared.engine.engine import EngineCore
from shared.engine.inputs import choice_key
from shared.engine.kv_prefetch import KVPrefetch
from shared.engine.outputs import AddResult, KVTransferStat, NewRequest, StepOutput, TokenOutput
from shared.kv_transfer.connector import KVConnector, KVLoad
from shared.kv_transfer.layerwise import FAILED, FINISHED, LayerwiseLoad
from shared.runtime.logprobs import StepLogprobs
from shared.runtime.sequence import Sequence
from shared.scheduling import DecodeScheduler, DecodeStep
from shared.scheduling.prefill_scheduler import PrefillBatch
from shared.wire.messages import KVDescriptor, KVRelease

log = structlog.get_logger(__name__)
PULL_WAIT_S = 0.002  # an otherwise idle step waits this long for a layer-wise pull to land


class DecodeEngine(EngineCore):
    kind = "decode"
    scheduler: DecodeScheduler

    def tpot_slack(self, slo_tpot_s: float, now: float) -> float:
        """Seconds every running sequence could still wait for its next token and keep its mean
        time per output token since decode took it in within ``slo_tpot_s`` (inf with none
        running): how long this engine may yield to a prefill wave without costing a stream
        its TPOT objective."""
        slack = float("inf")
        for seq in self.scheduler.running.values():
            if seq.started_at is not None:
                tokens = seq.num_tokens - seq.num_prompt_tokens
                slack = min(slack, slo_tpot_s * tokens - (now - seq.started_at))
        return slack

    def _setup(self) -> DecodeScheduler:
        # ``spill``: where preempted sequences' KV goes (swap); None: preemption recomputes.
        self._swapped: dict[str, KVDescriptor] = {}  # swapped out this step, not yet handed on
        self.num_swaps_in = 0
        self._kv: dict[str, KVDescriptor] = {}  # not yet loaded, by request id
        # Layer-wise handoffs being pulled into admitted sequences' blocks (their transport's
        # threads write them); the scheduler leaves these sequences alone meanwhile.
        self._pulls: dict[str, tuple[LayerwiseLoad, KVDescriptor]] = {}
        self._releases: list[KVRelease] = []  # produced outside a step, sent with the next
        # n > 1: a first choice's key -> (index, first token) of the choices to fork it into
        # once the prompt's KV is in.
        self._forks: dict[str, list[tuple[int, int]]] = {}
        c = self.config
        # Swapped-out KV loaded while a step runs (kv_prefetch.py); None: in the admitting step.
        self.prefetch = KVPrefetch() if c.decode_kv_prefetch and self.spill is not None else None
        return DecodeScheduler(
            self.block_manager,
            c.max_num_seqs,
            c.max_num_batched_tokens,
            self.stop,
            ranking=self.priorities,
            swap_out=self._swap_out if self.spill is not None else None,
            priority_gap=c.decode_preempt_priority_gap,
            min_steps=c.decode_preempt_min_steps,
            lookahead_tokens=c.decode_admit_lookahead_tokens,
        )

    def add(self, req: NewRequest, now: float | None = None) -> AddResult:
        result = super().add(req, now)
        # A refused copy's KV is nobody's now. A duplicate keeps its KV only if it is the very
        # descriptor still waiting here (a redelivery): a replayed prefill's own send (its first
        # prefill died before acking) would stay pinned or spilled until lease/orphan timeout.
        if req.kv is not None and (
            result in (AddResult.STALE, AddResult.TOO_LONG)
            or (result is AddResult.DUPLICATE and self._kv.get(req.sequence_key) != req.kv)
        ):
            self._discard(req.kv)
        return result

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
        super().close()

    def abort(self, request_id: str, choice_index: int | None = None) -> list[str]:
        key = choice_key(request_id, choice_index or 0)
        if choice_index is not None and key in self._forks:
            # Its choice is over, but its prompt's KV is still to be forked into the others:
            # it is dropped at the fork (``_fork``).
            self._aborted.add(key)
            return []
        return super().abort(request_id, choice_index)

    def _admit(self, seq: Sequence, req: NewRequest) -> None:
        if req.kv is not None:
            self._kv[seq.request_id] = req.kv
        if len(req.choices) > 1:
            self._forks[seq.request_id] = req.choices[1:]
        self.scheduler.add(seq)

    def _drop(self, key: str) -> str | None:
        desc = self.prefetch.cancel(key) if self.prefetch is not None else None
        if desc is not None:  # its load has ended: the blocks may be freed
            self.scheduler.loading.discard(key)
            self._discard(desc)
        pull = self._pulls.pop(key, None)
        if pull is not None:  # stop writing into its blocks before they are freed
            pull[0].cancel()
            self.scheduler.loading.discard(key)
            if pull[0].result.release is not None:
                self._releases.append(pull[0].result.release)
        self._forks.pop(key, None)
        ended = super()._drop(key)
        desc = self._kv.pop(key, None)
        if desc is not None:
            self._discard(desc)
        return ended

    def _receiver(self, desc: KVDescriptor) -> KVConnector:
        """The connector that reads ``desc``: swapped-out KV sits in the spill store, whatever
        transport prefill hands off through."""
        if self.spill is not None and desc.transport == self.spill.name != self.connector.name:
            return self.spill
        return self.connector

    def _swap_out(self, seq: Sequence) -> bool:
        """The scheduler's ``swap_out``: copy the victim's KV to the spill store (the blocks
        are freed by the scheduler right after) and hand the request on at the end of the step."""
        assert self.spill is not None
        try:
            desc = self._send(self.spill, seq)
        except Exception:
            log.exception("swap-out failed; recomputing", request_id=seq.request_id)
            return False
        if desc is None:  # the store is full
            return False
        self.spill.pop_freeable(time.time())  # a copy: the duty to free came straight back
        self._swapped[seq.request_id] = desc
        log.info("swapped out", request_id=seq.request_id, num_tokens=desc.num_tokens)
        return True

    def _hand_on_swapped(self, now: float, out: StepOutput) -> None:
        for key, desc in self._swapped.items():
            seq = self.requests[key]
            forks = self._forks.pop(key, None)  # not forked yet: it goes with every choice
            choices = [(seq.choice_index, seq.output_token_ids[0]), *forks] if forks else None
            self._hand_off(seq, desc, now, out, choices)
            self._retire(key, out)
        self._swapped.clear()

    # --- parallel sampling: the fork ------------------------------------------------------------
    def _fork_ready(self, out: StepOutput) -> None:
        """Fork each first choice whose prompt KV is in (loaded or recomputed) into the others,
        before the step schedules it: its own next token goes to a block of its own after."""
        if not self._forks:
            return
        loading = self.scheduler.loading
        for key in list(self._forks):
            seq = self.requests[key]
            if key in self.scheduler.running and key not in loading:
                if seq.num_computed_tokens >= seq.num_tokens - 1:
                    self._fork(seq, self._forks.pop(key), out)

    def _fork(self, parent: Sequence, choices: list[tuple[int, int]], out: StepOutput) -> None:
        """One sequence per choice, each the prompt and its own first token, on the parent's
        blocks (the scheduler queues one it has no room for, to recompute)."""
        rid = parent.parent_request_id
        input_key = self.inputs.input_of(parent.request_id)
        copies: list[tuple[int, int]] = []
        for index, token in choices:
            key = choice_key(rid, index)
            if key in self._aborted:  # finished already (a stop string in its first token)
                continue
            child = Sequence(
                key,
                [*parent.prompt_token_ids, token],
                parent.sampling,
                priority=parent.priority,
                num_prompt_tokens=parent.num_prompt_tokens,
                arrival_time=parent.arrival_time,
                block_size=self.block_manager.block_size,
                parent_request_id=rid,
                choice_index=index,
            )
            child.started_at = parent.started_at
            self.requests[key] = child
            self.inputs.join(key, input_key)
            copies += self.scheduler.fork(parent, child)
        self.runner.copy_blocks(copies)
        if parent.request_id in self._aborted:  # its own choice ended before the fork
            ended = self._drop(parent.request_id)
            if ended is not None:
                out.retired.append(ended)

    def _discard(self, desc: KVDescriptor) -> None:
        # Runs inside abort/add/expiry: a descriptor this connector cannot read (another
        # transport, a bad key) must not break those verbs; orphan reclaim frees its KV.
        try:
            release = self._receiver(desc).discard(desc)
        except Exception:
            log.exception("KV discard failed", transport=desc.transport)
            return
        if release is not None:
            self._releases.append(release)

    def _step(self, now: float) -> StepOutput:
        out = StepOutput(releases=self._releases)
        self._releases = []
        self._expire(now, out)
        admitted = self.scheduler.admit()
        self._started(admitted, now)
        for seq in admitted:
            self._load(seq, out)
        self._land_pulls(out)
        self._land_prefetches(out)
        self._fork_ready(out)
        sched = self.scheduler.schedule()
        self._hand_on_swapped(now, out)  # victims of admit() and schedule()
        if not sched:
            return out
        t0 = time.perf_counter()
        seqs = [*sched.recompute.seqs, *sched.decode]
        num_recompute = len(sched.recompute.seqs)
        step = sched
        asks = any(s.sampling.logprobs is not None for s in sched.decode)
        logprobs = StepLogprobs() if asks else None
        results = self._forward(seqs, out, lambda rows: self._run(step, rows, logprobs))
        if not results:
            return out
        if len(results) < len(seqs):  # a request failed alone: the rest of the step goes on
            sched = _surviving(sched, results)
        tokens = [cast(int, results[r]) for r in sorted(results) if r >= num_recompute]
        forward_s = time.perf_counter() - t0
        reasons = {f.seq.request_id: f.reason for f in self.scheduler.update(sched, tokens)}
        for seq, token in zip(sched.decode, tokens, strict=True):
            rid = seq.request_id
            entry = logprobs.sampled.get((rid, seq.choice_index)) if logprobs else None
            out.tokens.append(
                TokenOutput(
                    seq.parent_request_id,
                    seq.num_output_tokens - 1,
                    [token],
                    reasons.get(rid),
                    choice_index=seq.choice_index,
                    logprobs=None if entry is None else [entry],
                )
            )
        for key in reasons:
            self._retire(key, out)
        out.stats = self._stats(
            len(seqs),
            sched.recompute.num_tokens + len(sched.decode),
            len(sched.decode),
            sum(s.num_tokens for s in sched.decode),
            forward_s,
            self.scheduler.num_preemptions,
            self.scheduler.num_swaps,
            self.num_swaps_in,
            dict(self.scheduler.preemptions_by_cause),
            self.prefetch.num_hits if self.prefetch is not None else 0,
        )
        return out

    def _run(
        self, sched: DecodeStep, rows: list[int], logprobs: StepLogprobs | None
    ) -> list[int | None]:
        """The step's forward over ``rows`` of [*recompute, *decode]: None for a recompute row,
        the sampled token for a decode row (and its logprobs into ``logprobs`` if it asks)."""
        recompute = sched.recompute
        num_recompute = len(recompute.seqs)
        again = [r for r in rows if r < num_recompute]
        if again:
            self.runner.prefill(
                [recompute.seqs[r] for r in again], [recompute.num_new_tokens[r] for r in again]
            )
        seqs = [sched.decode[r - num_recompute] for r in rows[len(again) :]]
        decode = self.runner.decode(seqs, logprobs)
        return [None] * len(again) + list(decode)

    def _load(self, seq: Sequence, out: StepOutput) -> None:
        """Copy an admitted sequence's KV in; blocks that were prefix hits here already hold it."""
        desc = self._kv.pop(seq.request_id, None)
        if desc is None:
            return
        bm = self.block_manager
        # Blocks before the prefix hits' end are here already; the descriptor's start where
        # its sender's window began (the blocks before hold nothing this sequence reads).
        first = max(seq.num_computed_tokens // bm.block_size, desc.first_block)
        last = bm.blocks_for(desc.num_tokens)
        slots = bm.fp_slots(seq, desc.num_tokens)  # an int8 cache's window: after the blocks
        try:
            if not 0 <= desc.first_block <= last:
                raise ValueError(f"first_block {desc.first_block} outside 0..{last}")
            if desc.fp_slots != len(slots) or (slots and desc.fp_first_block != seq.fp_first_block):
                raise ValueError(
                    f"full-precision window: {desc.fp_slots} slots from block "
                    f"{desc.fp_first_block} sent, {len(slots)} from {seq.fp_first_block} here "
                    "(BATON_KV_FP_WINDOW must match between prefill and decode)"
                )
            block_ids = seq.block_table[first:last] + slots
            receiver = self._receiver(desc)
            if desc.payload.get("layerwise") and receiver.layerwise:
                self._start_pull(seq, desc, receiver, block_ids, first - desc.first_block)
                return
            if self._prefetchable(seq, desc, receiver):
                assert self.prefetch is not None
                skip = first - desc.first_block
                self.prefetch.start(
                    seq.request_id, desc, lambda: receiver.load(desc, block_ids, skip)
                )
                self.scheduler.loading.add(seq.request_id)
                return
            with self._device_ids(block_ids, read=False, write=True) as ids:
                result = receiver.load(desc, ids, first - desc.first_block)
        except Exception:  # never wrong KV: recompute whatever was partly written
            log.exception("KV load failed; recomputing", request_id=seq.request_id)
            self._discard(desc)  # the sender may free its copy now, not at lease expiry
            return
        self._loaded(seq, desc, result, out)

    def _loaded(self, seq: Sequence, desc: KVDescriptor, result: KVLoad, out: StepOutput) -> None:
        if result.release is not None:
            out.releases.append(result.release)
        if not result.loaded:
            log.warning("KV gone; recomputing", request_id=seq.request_id)
            return
        self.block_manager.release_before(seq, desc.first_block)  # outside the window: never read
        seq.num_computed_tokens = max(seq.num_computed_tokens, desc.num_tokens)
        out.transfers.append(KVTransferStat(desc.transport, result.nbytes, result.seconds))
        if desc.num_tokens > seq.num_prompt_tokens:  # KV of generated tokens: a decode swapped it
            self.num_swaps_in += 1
            log.info("swapped in", request_id=seq.request_id, num_tokens=desc.num_tokens)

    # --- prefetch on resume (kv_prefetch.py) ----------------------------------------------------
    def _prefetchable(self, seq: Sequence, desc: KVDescriptor, receiver: KVConnector) -> bool:
        """Swapped-out KV from the spill store, into device blocks (a host tier stages blocks
        around each forward: loaded in the step, as before)."""
        return (
            self.prefetch is not None
            and self.spill is not None
            and desc.transport == self.spill.name
            and desc.num_tokens > seq.num_prompt_tokens
            and self.runner.host_tier is None
        )

    def _land_prefetches(self, out: StepOutput) -> None:
        """Resumed sequences whose KV landed join this step's batch (or recompute, if it was
        gone or failed). With nothing else to run, wait for the first one."""
        if self.prefetch is None or not len(self.prefetch):
            return
        idle = all(rid in self.scheduler.loading for rid in self.scheduler.running)
        for rid, desc, result in self.prefetch.take(wait=idle):
            self.scheduler.loading.discard(rid)
            seq = self.requests[rid]
            if isinstance(result, BaseException):
                log.error("KV prefetch failed; recomputing", request_id=rid, error=repr(result))
                self._discard(desc)
                continue
            self._loaded(seq, desc, result, out)

    # --- layer-wise handoffs (kv_transfer/layerwise.py) -----------------------------------------
    def _start_pull(
        self,
        seq: Sequence,
        desc: KVDescriptor,
        receiver: KVConnector,
        block_ids: list[int],
        skip: int,
    ) -> None:
        """Pull an announced prompt's KV as prefill writes it; the sequence waits out of the
        scheduler's batch until the last layer and its first token are in (``_land_pulls``)."""
        if self.runner.host_tier is not None:  # staged blocks: pulled whole, before the step
            with self._device_ids(block_ids, read=False, write=True) as ids:
                pull = receiver.start_load(desc, ids, skip)
                pull.done.wait()
        else:
            pull = receiver.start_load(desc, block_ids, skip)
        self._pulls[seq.request_id] = (pull, desc)
        self.scheduler.loading.add(seq.request_id)

    def _land_pulls(self, out: StepOutput) -> None:
        """Sequences whose pull ended join the batch (with the first token prefill sampled), or
        recompute, or end here (the request ended at prefill). With nothing else to run, wait a
        moment for one: the step begins as soon as the last layer lands."""
        if not self._pulls:
            return
        if all(rid in self.scheduler.loading for rid in self.scheduler.running):
            pending = next(iter(self._pulls.values()))[0]
            pending.done.wait(PULL_WAIT_S)
        for rid, (pull, desc) in list(self._pulls.items()):
            if not pull.done.is_set():
                continue
            del self._pulls[rid]
            self.scheduler.loading.discard(rid)
            if pull.result.release is not None:
                out.releases.append(pull.result.release)
            seq = self.requests[rid]
            if pull.state in (FINISHED, FAILED):  # prefill answered it (last token or error)
                ended = self._drop(rid)
                if ended is not None:
                    out.retired.append(ended)
            elif pull.result.loaded:
                self.block_manager.release_before(seq, desc.first_block)
                seq.num_computed_tokens = max(seq.num_computed_tokens, desc.num_tokens)
                seq.append_token(pull.first_token)
                out.transfers.append(
                    KVTransferStat(desc.transport, pull.result.nbytes, pull.result.seconds)
                )
            else:  # recompute: the first decode step samples the first token itself
                log.warning("layer-wise KV did not arrive; recomputing", request_id=rid)


def _surviving(sched: DecodeStep, results: dict[int, int | None]) -> DecodeStep:
    """The step without the rows that failed alone (``results``: rows that ran)."""
    recompute = sched.recompute
    n = len(recompute.seqs)
    kept = [r for r in range(n) if r in results]
    return DecodeStep(
        decode=[seq for r, seq in enumerate(sched.decode, n) if r in results],
        recompute=PrefillBatch(
            [recompute.seqs[r] for r in kept], [recompute.num_new_tokens[r] for r in kept]
        ),
    )
