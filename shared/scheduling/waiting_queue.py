"""A priority queue of waiting sequences: higher priority first, then first come first served."""

from __future__ import annotations

import heapq
import itertools

from shared.engine.sequence import Sequence


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Sequence]] = []
        self._order = itertools.count()
        # request_id -> the order key of its live heap entry; other entries are stale (removed).
        self._ids: dict[str, int] = {}
        self._seqs: dict[str, Sequence] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def push(self, seq: Sequence, front: bool = False) -> None:
        """``front``: ahead of its priority class (preempted work resumes first)."""
        order = -next(self._order) if front else next(self._order)
        heapq.heappush(self._heap, (-seq.priority, order, seq))
        self._ids[seq.request_id] = order
        self._seqs[seq.request_id] = seq

    def peek(self) -> Sequence | None:
        self._drop_removed()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Sequence:
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
        seq = self.peek()
        return None if seq is None else seq.priority

    def _drop_removed(self) -> None:
        while self._heap:
            _, order, seq = self._heap[0]
            if self._ids.get(seq.request_id) == order:
                return
            heapq.heappop(self._heap)
