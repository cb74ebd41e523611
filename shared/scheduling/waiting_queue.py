"""A priority queue of waiting sequences: highest rank first, then first come first served.

The rank comes from a :class:`Ranking`: by default the request's priority; in an engine its
:class:`~shared.scheduling.priority.Prioritizer` (priority + aging + boosts), whose ranks keep
their order as time passes and change only when its ``epoch`` does — the queue then re-keys
every live entry once (O(n)), before the next push or pick.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Protocol

from shared.runtime.sequence import Sequence


class Ranking(Protocol):
    @property
    def epoch(self) -> int:
        """Changes whenever ``rank`` may order sequences differently than before."""

    def rank(self, seq: Sequence) -> float:
        """Higher is served first."""


class ByPriority:
    """The static ranking: the request's own priority, never re-keyed."""

    epoch = 0

    def rank(self, seq: Sequence) -> float:
        return float(seq.priority)


class WaitingQueue:
    def __init__(self, ranking: Ranking | None = None) -> None:
        self.ranking: Ranking = ranking if ranking is not None else ByPriority()
        self._epoch = self.ranking.epoch  # the epoch the heap's keys were computed in
        self._heap: list[tuple[float, int, Sequence]] = []
        self._order = itertools.count()
        # request_id -> the order key of its live heap entry; other entries are stale (removed).
        self._ids: dict[str, int] = {}
        self._seqs: dict[str, Sequence] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def push(self, seq: Sequence, front: bool = False) -> None:
        """``front``: ahead of the sequences of equal rank (preempted work resumes first)."""
        self._sync()
        order = -next(self._order) if front else next(self._order)
        heapq.heappush(self._heap, (-self.ranking.rank(seq), order, seq))
        self._ids[seq.request_id] = order
        self._seqs[seq.request_id] = seq

    def peek(self) -> Sequence | None:
        self._sync()
        self._drop_removed()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Sequence:
        self._sync()
        self._drop_removed()
        seq = heapq.heappop(self._heap)[2]
        del self._ids[seq.request_id]
        del self._seqs[seq.request_id]
        return seq

    def remove(self, request_id: str) -> Sequence | None:
        """Lazy removal: the heap entry is skipped when it reaches the top."""
        self._ids.pop(request_id, None)
        return self._seqs.pop(request_id, None)

    def max_priority(self) -> int | None:
        """The (client) priority of the sequence that would be picked next."""
        seq = self.peek()
        return None if seq is None else seq.priority

    def _sync(self) -> None:
        """Re-key every live entry if the ranking changed since the heap was built."""
        epoch = self.ranking.epoch
        if epoch == self._epoch:
            return
        self._epoch = epoch
        self._heap = [
            (-self.ranking.rank(seq), order, seq)
            for _, order, seq in self._heap
            if self._ids.get(seq.request_id) == order
        ]
        heapq.heapify(self._heap)

    def _drop_removed(self) -> None:
        while self._heap:
            _, order, seq = self._heap[0]
            if self._ids.get(seq.request_id) == order:
                return
            heapq.heappop(self._heap)
