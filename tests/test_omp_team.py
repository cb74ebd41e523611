"""One OpenMP team per engine process (kernels/cpu/omp_team.py): helper threads open none, and
a load's team ends with its thread. libgomp's workers are native threads, so they show in
/proc/self/task and not in ``threading``."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kernels.cpu import omp_team
from shared.engine.kv_prefetch import KVPrefetch
from shared.kv_transfer.connector import KVLoad
from shared.wire.messages import KVDescriptor

TASKS = Path("/proc/self/task")
pytestmark = pytest.mark.skipif(not TASKS.is_dir(), reason="Linux's /proc lists the threads")


def tasks() -> set[int]:
    return {int(t) for t in os.listdir(TASKS)}


def settled(want: Callable[[], bool]) -> bool:
    """``want()`` within a few seconds: a joined thread's OS thread (and its team's workers,
    which libgomp stops in the thread's destructor) exits just after Python's join returns."""
    deadline = time.monotonic() + 5.0
    while not want():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def parallel_work() -> None:
    """An op torch splits over its team at two threads (far above its grain)."""
    torch.ones(1 << 22).add_(1)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The step thread's count in a service: a new thread takes the count last set (ATen)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_plain_helper_thread_leaves_a_team_behind(two_threads: None) -> None:
    """What the module guards against, so the tests below could fail: a thread that runs torch
    at two threads starts a worker that lives as long as the thread."""
    seen: dict[str, set[int]] = {}
    counted, go_on = threading.Event(), threading.Event()

    def helper() -> None:
        parallel_work()
        seen["during"] = tasks()
        counted.set()
        go_on.wait()

    before = tasks()
    thread = threading.Thread(target=helper)
    thread.start()
    counted.wait()
    extra = seen["during"] - before - {thread.native_id}
    go_on.set()
    thread.join()
    assert len(extra) >= 1, "no OpenMP worker appeared: the tests below would prove nothing"


def test_a_kv_prefetch_load_opens_no_team(two_threads: None) -> None:
    prefetch = KVPrefetch()
    ids: dict[str, int] = {}

    def load() -> KVLoad:
        ids["thread"] = threading.get_native_id()
        parallel_work()
        ids["count"] = torch.get_num_threads()
        return KVLoad(True, 0, 0.0)

    before = tasks()
    desc = KVDescriptor("shm", 1, 16, 0, {})
    prefetch.start("r1", desc, load)
    ((rid, _, result),) = prefetch.take(wait=True)
    try:
        assert rid == "r1" and isinstance(result, KVLoad) and result.loaded
        assert ids["count"] == 1
        assert tasks() - before == {ids["thread"]}  # the prefetch thread, no worker beside it
    finally:
        prefetch.close()


def test_a_load_in_a_passing_thread_leaves_no_team(two_threads: None) -> None:
    before = tasks()
    counts: list[int] = []

    def build() -> str:
        parallel_work()
        counts.append(torch.get_num_threads())
        return "engine"

    assert omp_team.in_passing_thread(build) == "engine"
    assert counts == [2]  # the caller's count
    assert settled(lambda: tasks() <= before)  # the thread and its team are gone


def test_a_passing_thread_raises_in_the_caller() -> None:
    def build() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        omp_team.in_passing_thread(build)
