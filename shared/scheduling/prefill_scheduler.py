"""Prefill scheduling: batch waiting prompts up to a token budget, chunk the long ones.

Sequences whose prompt is partly computed (chunked prefill) continue first: they already hold
blocks, and finishing them frees those blocks soonest. New prompts are admitted in the waiting
queue's order (effective priority: priority, aging, the short-prompt boost) while the token
budget, the sequence cap and the block manager allow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence, SequenceStatus
from shared.scheduling.base import SchedulerBase
from shared.scheduling.waiting_queue import Ranking


@dataclass
class PrefillBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class PrefillScheduler(SchedulerBase):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        ranking: Ranking | None = None,
    ):
        super().__init__(block_manager, ranking)  # running: partially prefilled (chunked) ones
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq)

    def schedule(self) -> PrefillBatch:
        batch = PrefillBatch()
        budget = self.max_num_batched_tokens
        for seq in self.running.values():
            if budget == 0 or len(batch) == self.max_num_seqs:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        while budget > 0 and len(batch) < self.max_num_seqs:
            head = self.waiting.peek()
            if head is None or not self.block_manager.can_allocate(head):
                break  # strict priority order: a big prompt is not overtaken forever
            seq = self.waiting.pop()
            self.block_manager.allocate(seq)  # may find a cached prefix
            seq.status = SequenceStatus.RUNNING
            self.running[seq.request_id] = seq
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def update(self, batch: PrefillBatch, sampled: list[int | None]) -> list[Sequence]:
        """Advance counters after the forward; returns the sequences whose prompt is done."""
        done = []
        for seq, n, token in zip(batch.seqs, batch.num_new_tokens, sampled, strict=True):
            seq.num_computed_tokens += n
            self.block_manager.cache_computed_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                assert token is not None, "a completed prompt must yield a token"
                seq.append_token(token)
                del self.running[seq.request_id]
                done.append(seq)
        return done
