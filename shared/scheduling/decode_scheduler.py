"""Decode scheduling: continuous batching over the paged cache, with preemption by recompute.

Every step, all running sequences that are ready (KV computed up to their last token) decode one
token. Sequences that joined without KV (the transport was full, an entry was lost to a crash, or
they were preempted) first recompute their KV inside this engine, chunked by the token budget.

Preemption frees the victim's blocks and re-queues it in front of its priority class; the victim
is chosen lowest priority first, then latest arrival (it has the least sunk work). A waiting
sequence of higher priority than some running one may preempt it when blocks are short.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence, SequenceStatus
from shared.scheduling.base import SchedulerBase
from shared.scheduling.prefill_scheduler import PrefillBatch


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


class DecodeScheduler(SchedulerBase):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
    ) -> None:
        super().__init__(block_manager)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        # A sequence alone must always fit: it finishes ("length") before outgrowing the cache.
        self.max_seq_tokens = min(
            max_model_len, block_manager.num_blocks * block_manager.block_size
        )
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> bool:
        """Queue a sequence; False (not queued) if it could never fit in the cache."""
        if seq.num_tokens >= self.max_seq_tokens:
            return False
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq)
        return True

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
        """Preempt strictly lower-priority running sequences until ``seq`` fits — but only if
        preempting all of them would make room (never throw away KV for nothing)."""
        bm = self.block_manager
        lower = [s for s in self.running.values() if s.priority < seq.priority]
        # Blocks only a victim references come back on preemption; shared ones may not.
        freeable = sum(1 for s in lower for b in s.block_table if bm.ref_count(b) == 1)
        if bm.num_free_blocks + freeable < bm.blocks_for(seq.num_tokens):
            return False
        while not bm.can_allocate(seq):
            victim = self._victim()
            if victim is None or victim.priority >= seq.priority:
                return False
            self._preempt(victim)
        return True

    # --- one step -------------------------------------------------------------------------------
    def schedule(self) -> DecodeStep:
        step = DecodeStep()
        budget = self.max_num_batched_tokens
        for seq in list(self.running.values()):
            if seq.request_id not in self.running:
                continue  # preempted by an earlier iteration of this loop
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
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.free(seq)
                finished.append(Finished(seq, reason))
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.eos_token_ids and not seq.sampling.ignore_eos:
            return "stop"
        if (
            seq.num_output_tokens >= seq.sampling.max_tokens
            or seq.num_tokens >= self.max_seq_tokens
        ):
            return "length"
        return None

    def _victim(self) -> Sequence | None:
        if not self.running:
            return None
        return min(self.running.values(), key=lambda s: (s.priority, -s.arrival_time))

    def _preempt(self, seq: Sequence) -> None:
        del self.running[seq.request_id]
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.push(seq, front=True)
