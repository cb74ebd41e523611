"""One OpenMP team per engine process: helper threads keep torch on themselves, and the model
loads on a thread that ends.

libgomp keeps a team (a pool of worker threads) for every thread that has ever opened a parallel
region, and a team lives as long as its thread. Once a process holds more such threads than it
has CPUs, libgomp stops spinning at its barriers (a hundred spins, not ``GOMP_SPINCOUNT``'s) and an
idle worker sleeps on a futex at the end of every region. A decode step opens hundreds of regions
(each projection, each attention call, each elementwise op), so every one of them then waits for
a worker to wake: one ``index_copy_`` of a KV load on a helper thread left a second team behind,
and from then on the decode step of 64 sequences ran at 60 ms where it takes 42 (docs/perf-log.md,
"A second OpenMP team slows every step").

So the engine's step thread owns the process's one team. A helper thread that calls torch (or a
C kernel: they size their regions by torch's count) calls :func:`serial` first, and its ops run on
the thread itself, opening no region; the model loads (a parallel job, before any step) in
:func:`in_passing_thread`, whose team ends with it (shared/engine/build.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def serial() -> None:
    """Run this thread's torch calls on the thread itself: no OpenMP team of its own. (A new
    thread takes the count last set anywhere in the process: the step thread's.)"""
    import torch

    torch.set_num_threads(1)


def in_passing_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own with the calling thread's torch thread count; that
    thread, and any OpenMP team it opened, has ended when this returns. ``fn``'s exception is
    raised here."""
    import torch

    threads = torch.get_num_threads()
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        torch.set_num_threads(threads)
        try:
            outcome.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="load")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
