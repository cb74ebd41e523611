"""Decode scheduling: continuous batching over the paged cache, with preemption by swap or by
recompute.

Every step, all running sequences that are ready (KV computed up to their last token) decode one
token. Sequences that joined without KV (the transport was full, an entry was lost to a crash, or
they were preempted) first recompute their KV inside this engine, chunked by the token budget.

Preemption swaps the victim out when the engine can (``swap_out``: its computed KV is copied to the
spill store and the request leaves this engine, to resume on whichever decode worker has room,
with no recompute); otherwise it frees the victim's blocks and re-queues it ahead of its equals,
to recompute its KV here. Victims are chosen by
:func:`~shared.scheduling.priority.choose_victims`: lowest effective priority first, then the most
recently started (it has the least sunk work). A waiting sequence of higher effective priority
than some running one may preempt it when blocks are short. Effective priorities are compared
through the waiting queue's ranking (aging included: a sequence that has aged past a newcomer's
priority is not preempted for it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shared.limits import StopRule
from shared.runtime.block_manager import BlockManager
from shared.runtime.sequence import Sequence, SequenceStatus
from shared.scheduling.base import SchedulerBase
from shared.scheduling.prefill_scheduler import PrefillBatch
from shared.scheduling.priority import Candidate, choose_victims, victim_order
from shared.scheduling.waiting_queue import Ranking


@dataclass
class DecodeStep:
    decode: list[Sequence] = field(default_factory=list)
    recompute: PrefillBatch = field(default_factory=PrefillBatch)

    def __bool__(self) -> bool:
        return bool(self.decode) or bool(self.recompute.seqs)


@dataclass(frozen=True)
class Finished:
    seq: Sequence
    reason: str  # "stop" | "length"


# Copies a sequence's computed KV out of its blocks (before they are freed) and takes the
# request off this engine's hands; False: it could not (the store is full): recompute instead.
SwapOut = Callable[[Sequence], bool]


class DecodeScheduler(SchedulerBase):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        stop: StopRule,
        ranking: Ranking | None = None,
        swap_out: SwapOut | None = None,
    ) -> None:
        super().__init__(block_manager, ranking)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stop = stop
        self.swap_out = swap_out
        self.num_preemptions = 0  # by recompute
        self.num_swaps = 0  # preemptions by swap
        # Running sequences whose KV a transport is still writing (a layer-wise handoff): not
        # scheduled, never preempted, until the engine takes them out.
        self.loading: set[str] = set()

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (the engine checked that it fits the cache: ``Limits``)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq)

    # --- admission ------------------------------------------------------------------------------
    def admit(self) -> list[Sequence]:
        """Move waiting sequences into the running batch while blocks allow.

        Returned sequences hold blocks for all their tokens; the caller loads their KV from the
        transport (then sets ``num_computed_tokens``) or leaves them to recompute."""
        admitted = []
        while len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek()
            if seq is None:
                break
            if not self.block_manager.can_allocate(seq) and not self._preempt_for(seq):
                break
            self.waiting.pop()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running[seq.request_id] = seq
            admitted.append(seq)
        return admitted

    def _preempt_for(self, seq: Sequence) -> bool:
        """Preempt running sequences of strictly lower effective priority until ``seq`` fits —
        but only if preempting all of the chosen ones makes room (never throw away KV for
        nothing)."""
        bm = self.block_manager
        rank = self.waiting.ranking.rank
        below = rank(seq)
        victims = choose_victims(
            self._candidates(below), bm.blocks_for(seq.num_tokens), bm.num_free_blocks, below
        )
        if victims is None:
            return False
        for rid in victims:
            if bm.can_allocate(seq):
                break
            self._preempt(self.running[rid])
        return bm.can_allocate(seq)

    def _candidates(self, below: float | None = None) -> list[Candidate]:
        """The running batch as preemption sees it (only ranks below ``below``, if given);
        ``running`` is in start order (admission appends, preemption removes)."""
        bm, rank = self.block_manager, self.waiting.ranking.rank
        out = []
        for started, s in enumerate(self.running.values()):
            r = rank(s)
            if s.request_id not in self.loading and (below is None or r < below):
                # Blocks only the victim references come back; shared ones may not.
                out.append(Candidate(s.request_id, r, started, bm.num_freeable_blocks(s)))
        return out

    # --- one step -------------------------------------------------------------------------------
    def schedule(self) -> DecodeStep:
        step = DecodeStep()
        budget = self.max_num_batched_tokens
        for seq in list(self.running.values()):
            if seq.request_id not in self.running or seq.request_id in self.loading:
                continue  # preempted by an earlier iteration of this loop, or still loading
            pending = seq.num_tokens - 1 - seq.num_computed_tokens
            if pending > 0:
                if budget > 0:
                    n = min(pending, budget)
                    step.recompute.seqs.append(seq)
                    step.recompute.num_new_tokens.append(n)
                    budget -= n
                continue
            while not self.block_manager.can_append_slot(seq):
                victim = self._victim()
                assert victim is not None
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.request_id in self.running:
                self.block_manager.append_slot(seq)
                step.decode.append(seq)
        # A victim may have been scheduled before it was chosen: drop it from this step.
        step.decode = [s for s in step.decode if s.request_id in self.running]
        keep = [i for i, s in enumerate(step.recompute.seqs) if s.request_id in self.running]
        step.recompute = PrefillBatch(
            [step.recompute.seqs[i] for i in keep], [step.recompute.num_new_tokens[i] for i in keep]
        )
        return step

    def update(self, step: DecodeStep, tokens: list[int]) -> list[Finished]:
        for seq, n in zip(step.recompute.seqs, step.recompute.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            self.block_manager.cache_computed_blocks(seq)
        finished = []
        for seq, token in zip(step.decode, tokens, strict=True):
            seq.num_computed_tokens = seq.num_tokens
            seq.append_token(token)
            self.block_manager.cache_computed_blocks(seq)
            reason = self.stop(token, seq.num_tokens, seq.num_output_tokens, seq.sampling)
            if reason is not None:
                self.free(seq)
                finished.append(Finished(seq, reason))
        return finished

    def _victim(self) -> Sequence | None:
        """The first victim when the running batch itself outgrew the cache (it may be the very
        sequence that needs the block)."""
        order = victim_order(self._candidates())
        return self.running[order[0].request_id] if order else None

    def _preempt(self, seq: Sequence) -> None:
        del self.running[seq.request_id]
        # The copy comes first: the blocks hold the KV until they are freed.
        swapped = seq.num_computed_tokens > 0 and self.swap_out is not None and self.swap_out(seq)
        self.block_manager.free(seq)
        if swapped:
            seq.status = SequenceStatus.SWAPPED
            self.num_swaps += 1
            return
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.push(seq, front=True)
