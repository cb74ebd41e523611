"""Prefill scheduling: batch waiting prompts up to a token budget, chunk the long ones.

Each step's budget (``max_num_batched_tokens``) goes, in this order, to:
1. *whole prompts*, in the waiting queue's order (effective priority: priority, aging, the
   short-prompt boost), as long as each fits whole. A prompt too long to fit whole (it will be
   chunked) may be *overtaken* by the whole prompts behind it, for up to half the budget: that is
   what chunking is for — a short request's first token does not wait for a 1.5k-token prompt
   (vLLM v0's ``max_long_partial_prefills`` rule; ``docs/scheduling.md``, "Mixed workload").
2. prompts already partly computed (chunked), which also hold at least half the budget whenever
   they can use it: they hold blocks, and finishing them frees those soonest;
3. the next waiting prompts in order, the last one chunked to what is left.
Nothing waits forever: an overtaken prompt starts with at least half of a step, and a prompt that
does not fit in the free blocks stops admission (smaller ones behind it never overtake it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.runtime.block_manager import BlockManager
from shared.runtime.sequence import Sequence, SequenceStatus
from shared.scheduling.base import SchedulerBase
from shared.scheduling.waiting_queue import Ranking

# How many too-long prompts step 1 looks past for whole ones behind them (bounds its cost).
MAX_PASSED_OVER = 32


@dataclass
class PrefillBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)


def remaining(seq: Sequence) -> int:
    """Prompt tokens not computed yet."""
    return seq.num_tokens - seq.num_computed_tokens


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
        half = self.max_num_batched_tokens // 2
        continuing = list(self.running.values())
        reserved = min(sum(remaining(s) for s in continuing), half)  # step 2's share
        whole = self._admit_whole(self.max_num_batched_tokens - reserved, half)
        batch = PrefillBatch()
        budget = self.max_num_batched_tokens - sum(n for _, n in whole)
        for seq in continuing[: self.max_num_seqs - len(whole)]:
            if budget == 0:
                break
            batch.add(seq, min(remaining(seq), budget))
            budget -= batch.num_new_tokens[-1]
        for seq, n in whole:
            batch.add(seq, n)
        while budget > 0 and len(batch) < self.max_num_seqs:
            head = self.waiting.peek()
            if head is None or not self.block_manager.can_allocate(head):
                break  # strict priority order: a big prompt is not overtaken forever
            seq = self._start(self.waiting.pop())
            batch.add(seq, min(remaining(seq), budget))
            budget -= batch.num_new_tokens[-1]
        return batch

    def _admit_whole(self, free: int, max_overtaking: int) -> list[tuple[Sequence, int]]:
        """Step 1: waiting prompts that fit whole into ``free`` tokens, in order; a prompt that
        does not (it will be chunked) is passed over while the prompts passing it total at most
        ``max_overtaking`` tokens. The passed-over keep their places in the queue."""
        whole: list[tuple[Sequence, int]] = []
        passed: list[Sequence] = []
        overtaking = 0
        seats = self.max_num_seqs - len(self.running)
        while len(whole) < seats and len(passed) < MAX_PASSED_OVER:
            head = self.waiting.peek()
            if head is None or not self.block_manager.can_allocate(head):
                break  # out of blocks: strict order, nothing overtakes
            n = remaining(head)  # before a prefix hit: at most what it will cost
            if n > free:
                passed.append(self.waiting.pop())
                continue
            if passed and overtaking + n > max_overtaking:
                break
            seq = self._start(self.waiting.pop())
            whole.append((seq, remaining(seq)))
            free -= whole[-1][1]
            overtaking += whole[-1][1] if passed else 0
        for seq in reversed(passed):
            self.waiting.push(seq, front=True)
        return whole

    def _start(self, seq: Sequence) -> Sequence:
        self.block_manager.allocate(seq)  # may find a cached prefix
        seq.status = SequenceStatus.RUNNING
        self.running[seq.request_id] = seq
        return seq

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
