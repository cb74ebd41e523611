"""Prefetch on resume: a swapped-out sequence's KV is read from the spill store and copied into
its blocks on a background thread while the engine's current step runs.

Without it the copy runs synchronously at the start of the step that admits the sequence, so
that whole batch waits for it (the resume stall: ``loadtest/engine/resume_stall.py``, figures in
docs/scheduling.md). With it the step runs without the resumed sequence, which joins the batch
at the next step, its KV already in place. The load's file read, dtype conversion and
``index_copy_`` release the GIL, so on a CPU they overlap the forward (on a GPU the copy is
ordered on the device's stream; the read still overlaps).

Invariants: the sequence holds its blocks (allocated at admission) and sits in the scheduler's
``loading`` set (never scheduled, never preempted) until :meth:`KVPrefetch.take` hands its
result back; the blocks are written by this thread only and read by nobody meanwhile. Dropping
a sequence waits for its load to end before the blocks are freed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kernels.cpu import omp_team
from shared.kv_transfer.connector import KVLoad
from shared.wire.messages import KVDescriptor

# One thread: loads are memory-bound copies; two at once would only share the bandwidth (and
# the cores with the forward they are meant to hide behind).
NUM_THREADS = 1


class KVPrefetch:
    """The loads in flight, by request id."""

    def __init__(self) -> None:
        # Its copies run on the thread itself: the step thread owns the process's one OpenMP team.
        self._pool = ThreadPoolExecutor(NUM_THREADS, "kv-prefetch", initializer=omp_team.serial)
        self._loads: dict[str, tuple[Future[KVLoad], KVDescriptor]] = {}
        self.num_started = 0  # running totals, for metrics
        self.num_hits = 0  # landed before the step that needed them: no wait

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._loads

    def __len__(self) -> int:
        return len(self._loads)

    def start(self, request_id: str, desc: KVDescriptor, load: Callable[[], KVLoad]) -> None:
        self._loads[request_id] = (self._pool.submit(load), desc)
        self.num_started += 1

    def take(self, wait: bool) -> list[tuple[str, KVDescriptor, KVLoad | BaseException]]:
        """The loads that ended (``wait``: the first one in flight too, however long it takes —
        the engine has nothing else to run); a failed load comes back as its exception."""
        ready = {rid for rid, (fut, _) in self._loads.items() if fut.done()}
        self.num_hits += len(ready)
        if wait and self._loads and not ready:
            next(iter(self._loads.values()))[0].exception()
        done = []
        for rid, (fut, desc) in list(self._loads.items()):
            if not fut.done():
                continue
            del self._loads[rid]
            exc = fut.exception()
            done.append((rid, desc, fut.result() if exc is None else exc))
        return done

    def cancel(self, request_id: str) -> KVDescriptor | None:
        """Forget a load (its sequence is dropped) once it has stopped writing; its descriptor,
        for the caller to discard whatever is left of the entry."""
        entry = self._loads.pop(request_id, None)
        if entry is None:
            return None
        entry[0].exception()  # wait: the blocks are about to be freed
        return entry[1]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
