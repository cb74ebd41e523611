"""What both schedulers share: a priority waiting queue, a running set, removal by id."""

from __future__ import annotations

from shared.runtime.block_manager import BlockManager
from shared.runtime.sequence import Sequence, SequenceStatus
from shared.scheduling.waiting_queue import Ranking, WaitingQueue


class SchedulerBase:
    def __init__(self, block_manager: BlockManager, ranking: Ranking | None = None) -> None:
        """``ranking``: the waiting queue's order (default: the request's priority); an engine
        passes its :class:`~shared.scheduling.priority.Prioritizer` (aging, boosts)."""
        self.block_manager = block_manager
        self.waiting = WaitingQueue(ranking)
        self.running: dict[str, Sequence] = {}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.running or request_id in self.waiting

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def free(self, seq: Sequence) -> None:
        """The request is over (or its KV went to a transport): its blocks go back."""
        self.running.pop(seq.request_id, None)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is; returns it, or None if it is not here."""
        seq = self.waiting.remove(request_id)
        if seq is not None:
            seq.status = SequenceStatus.FINISHED
            return seq
        seq = self.running.get(request_id)
        if seq is not None:
            self.free(seq)
        return seq
