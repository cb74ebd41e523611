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

Priority preemption with a full batch (``priority_gap`` > 0): when the batch is full by count,
a waiting sequence that outranks the lowest-ranked running one by at least ``priority_gap``
levels takes its slot (and, when blocks are short too, the blocks of further victims strictly
below it). A sequence admitted (or resumed) here fewer than ``min_steps`` steps ago is never a
priority victim — the churn bound: what was just loaded runs a while before it can be swapped
again, and two sequences of equal priority never trade places (the gap is at least one level,
and of equal priorities the older one ranks higher: aging).

Admission on projected resident KV (``lookahead_tokens`` > 0): a sequence is admitted only if
the free blocks hold it plus the blocks the running batch (loading sequences included: in-flight
handoffs and prefetches hold blocks already) and it will append within the next
``lookahead_tokens`` tokens, each capped by its ``max_tokens``. Without it a burst admitted
into the last free blocks crosses its block boundaries together and is preempted a few steps
later (sglang#30033's lockstep). A lone sequence is admitted if it fits at all.
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
        priority_gap: float = 0.0,
        min_steps: int = 0,
        lookahead_tokens: int = 0,
    ) -> None:
        super().__init__(block_manager, ranking)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stop = stop
        self.swap_out = swap_out
        self.priority_gap = priority_gap  # <= 0: no preemption for a slot
        self.min_steps = min_steps
        self.lookahead_tokens = lookahead_tokens
        self.num_preemptions = 0  # by recompute
        self.num_swaps = 0  # preemptions by swap
        # Preemptions (swap or recompute) by cause, running totals: "priority_slot" (a waiting
        # sequence outranked a running one by the gap, the batch full by count), "priority_kv"
        # (a higher-ranked waiting sequence needed blocks), "kv_full" (the running batch itself
        # outgrew the cache).
        self.preemptions_by_cause: dict[str, int] = {}
        self.num_steps = 0
        self._admitted_at: dict[str, int] = {}  # request id -> the step it (re)joined the batch
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
        while (seq := self.waiting.peek()) is not None:
            if len(self.running) >= self.max_num_seqs and not self._preempt_for_slot(seq):
                break
            if not self._fits(seq) and not self._preempt_for(seq):
                break
            self.waiting.pop()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running[seq.request_id] = seq
            self._admitted_at[seq.request_id] = self.num_steps
            admitted.append(seq)
        return admitted

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """``child``: another choice of ``parent``'s prompt (parallel sampling), as long as it.
        With a seat in the batch and blocks for its own part, it runs from the next schedule on
        the parent's computed blocks (``BlockManager.fork``; the returned block copies are the
        caller's to make before the forward). Otherwise it waits like a preempted sequence, and
        recomputes what prefix hits do not give it."""
        if len(self.running) >= self.max_num_seqs or not self.block_manager.can_fork(parent):
            child.status = SequenceStatus.PREEMPTED
            self.waiting.push(child, front=True)
            return []
        copies = self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.running[child.request_id] = child
        self._admitted_at[child.request_id] = self.num_steps
        return copies

    def free(self, seq: Sequence) -> None:
        self._admitted_at.pop(seq.request_id, None)
        super().free(seq)

    # --- projected resident KV ------------------------------------------------------------------
    def _growth(self, seq: Sequence, held: int | None = None) -> int:
        """Blocks ``seq`` will add to the ``held`` ones within the lookahead."""
        if self.lookahead_tokens <= 0:
            return 0
        bm = self.block_manager
        end = min(
            seq.num_tokens + self.lookahead_tokens, seq.num_prompt_tokens + seq.sampling.max_tokens
        )
        held = bm.blocks_for(seq.num_tokens) if held is None else held
        return max(0, bm.blocks_for(end) - held)

    def _reserved(self) -> int:
        """Blocks the running batch will take within the lookahead."""
        return sum(self._growth(s, len(s.block_table)) for s in self.running.values())

    def _fits(self, seq: Sequence) -> bool:
        bm = self.block_manager
        if not bm.can_allocate(seq):
            return False
        if not self.running:  # alone it runs if it fits at all
            return True
        need = bm.blocks_for(seq.num_tokens) + self._growth(seq)
        return bm.num_free_blocks - self._reserved() >= need

    def _preempt_for_slot(self, seq: Sequence) -> bool:
        """The batch is full by count: preempt the lowest-ranked running sequence if ``seq``
        outranks it by the gap and the blocks it frees (with further victims strictly below
        ``seq``, if need be) make room for ``seq``."""
        if self.priority_gap <= 0:
            return False
        rank = self.waiting.ranking.rank(seq)
        order = victim_order(self._candidates(rank - self.priority_gap + 1e-9, guarded=True))
        if not order:
            return False
        first = order[0]
        bm = self.block_manager
        need = bm.blocks_for(seq.num_tokens) + self._growth(seq)
        free = bm.num_free_blocks - self._reserved() + first.freeable_blocks
        rest = [c for c in self._candidates(rank, guarded=True) if c.request_id != first.request_id]
        if choose_victims(rest, need, free, rank) is None:
            return False  # even every victim would not make room: keep the batch
        self._preempt(self.running[first.request_id], "priority_slot")
        return True

    def _preempt_for(self, seq: Sequence) -> bool:
        """Preempt running sequences of strictly lower effective priority until ``seq`` fits —
        but only if preempting all of the chosen ones makes room (never throw away KV for
        nothing)."""
        bm = self.block_manager
        rank = self.waiting.ranking.rank
        below = rank(seq)
        need = bm.blocks_for(seq.num_tokens) + self._growth(seq)
        free = bm.num_free_blocks - self._reserved()
        victims = choose_victims(self._candidates(below, guarded=True), need, free, below)
        if victims is None:
            return False
        for rid in victims:
            if self._fits(seq):
                break
            self._preempt(self.running[rid], "priority_kv")
        return self._fits(seq)

    def _candidates(self, below: float | None = None, guarded: bool = False) -> list[Candidate]:
        """The running batch as preemption sees it (only ranks below ``below``, if given;
        ``guarded``: not those admitted within ``min_steps``); ``running`` is in start order
        (admission appends, preemption removes)."""
        bm, rank = self.block_manager, self.waiting.ranking.rank
        since = self.num_steps - self.min_steps
        out = []
        for started, s in enumerate(self.running.values()):
            rid, r = s.request_id, rank(s)
            if rid in self.loading or (below is not None and r >= below):
                continue
            if guarded and self._admitted_at.get(rid, since) > since:
                continue
            # Blocks only the victim references come back (shared ones may not), and with
            # them the growth the projection reserved for it.
            freeable = bm.num_freeable_blocks(s) + self._growth(s, len(s.block_table))
            out.append(Candidate(rid, r, started, freeable))
        return out

    # --- one step -------------------------------------------------------------------------------
    def schedule(self) -> DecodeStep:
        self.num_steps += 1
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
                self._preempt(victim, "kv_full")
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

    def _preempt(self, seq: Sequence, cause: str) -> None:
        del self.running[seq.request_id]
        self._admitted_at.pop(seq.request_id, None)
        self.preemptions_by_cause[cause] = self.preemptions_by_cause.get(cause, 0) + 1
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
