"""A thread budget the engines of one deployment share: whoever has work gets the cores.

Prefill and decode on one machine take turns more than they overlap (a burst's prefill, then its
decode). Pinned to halves with one thread each, each phase would run on half the cores while the
other half idled. Instead every engine runs on the whole CPU set and, before each step, takes a
thread count from a table both see: all of its cores if no other engine of the deployment is
busy, else an equal share (``budget``). The counts follow the work between the layers of a step
(:meth:`CpuShareManager.rebalance`).

The table is a small file in /dev/shm, one per deployment (broker host, port and vhost) and CPU
set, so two stacks on one host never mix and engines pinned to disjoint sets never halve each
other; it holds one slot per engine process: its pid, whether it is busy, and a heartbeat. A slot
whose process is gone, or whose heartbeat is older than ``TTL_S`` (a hung engine), counts as idle
and is reused. Writes of one's own slot are unlocked (a stale read costs one step at the wrong
count); claiming a slot takes the file's lock.

``torch.set_num_threads`` is cheap, and it is called only when the calling thread's count
differs, in the thread that runs the step (OpenMP's thread count is a per-thread setting: the
engine service runs every step on one thread of its own).
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from shared.client.connection import split_urls
from shared.engine.thread_choice import ThreadChoice

T = TypeVar("T")
# Every model shares, however small: with decode yielding to a prefill wave and OpenMP's team
# spinning between GEMMs, a small model gains from sharing as a large one does
# (docs/perf-log.md, "CPU sharing").
SLOTS = 16
# pid, busy, heartbeat (time.time()), and how many sequences the engine serves (waiting and
# running: what a step of it stands for, :meth:`CpuShareManager.decode_yields`).
SLOT = struct.Struct("<qqdq")
# A slot's busy field: 0 idle, else which engine is busy (a reader that only asks "busy?" reads
# any nonzero value as busy).
BUSY, BUSY_PREFILL = 1, 2
TABLE_BYTES = SLOTS * SLOT.size
TTL_S = 30.0  # longer than any one step: a busy engine refreshes its heartbeat once per step
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def table_path(amqp_url: str, cpus: frozenset[int], root: Path = SHM_DIR) -> Path:
    """The table of the engines that share ``cpus`` behind the broker vhost of ``amqp_url``
    (credentials left out: each service may log in as its own user; every address of a
    cluster's, in any order)."""
    urls = sorted(
        {f"{u.hostname}:{u.port}{u.path or '/'}" for u in map(urlsplit, split_urls(amqp_url))}
    )
    where = f"{','.join(urls)}|{','.join(map(str, sorted(cpus)))}"
    return root / f"baton-cpu2-{hashlib.sha1(where.encode()).hexdigest()[:16]}"


def fair_share(cores: int, others_busy: int) -> int:
    """Threads for a busy engine with ``cores`` CPUs while ``others_busy`` others are busy."""
    return max(1, cores // (others_busy + 1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, alive
        return True
    return True


class CpuShareManager:
    """This engine process's slot in its deployment's table; ``budget`` before each step."""

    def __init__(
        self,
        path: Path,
        cores: int,
        clock: Callable[[], float] = time.time,
        prefill: bool = False,
        choose_threads: bool = False,
    ) -> None:
        """``prefill``: this engine is a prefill engine (a decode engine yields to it,
        :meth:`decode_yields`). ``choose_threads``: a busy step may leave one core of its share
        to the light services where that has been faster (shared/engine/thread_choice.py;
        decode's BATON_DECODE_THREAD_CHOICE)."""
        self.path, self.cores, self.clock = path, cores, clock
        self.choice = ThreadChoice() if choose_threads else None
        self._leave = False  # the running step leaves a core (set in the step's thread)
        self.busy_mark = BUSY_PREFILL if prefill else BUSY
        self.pid = os.getpid()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size < TABLE_BYTES:
                os.ftruncate(fd, TABLE_BYTES)
            self._map = mmap.mmap(fd, TABLE_BYTES)
            self.slot = self._claim()
            self._write(busy=False)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: the map holds a duplicate of fd
            os.close(fd)
        self.threads = 0  # the count of the last step (set in the step's thread)
        self._seqs = 0  # the sequences of the step running (set in the step's thread)

    def _claim(self) -> int:
        now = self.clock()
        for i in range(SLOTS):
            pid, _busy, beat, _seqs = SLOT.unpack_from(self._map, i * SLOT.size)
            if not self._live(pid, beat, now):  # free, or its engine gone
                return i
        raise RuntimeError(f"every slot of {self.path} is held by a live engine")

    def _live(self, pid: int, beat: float, now: float) -> bool:
        return pid != 0 and now - beat < TTL_S and _alive(pid)

    def _write(self, busy: bool, seqs: int = 0) -> None:
        mark = self.busy_mark if busy else 0
        SLOT.pack_into(self._map, self.slot * SLOT.size, self.pid, mark, self.clock(), seqs)

    def _others(self) -> list[tuple[int, int]]:
        """(busy field, sequences) of the other live, busy engines' slots."""
        now = self.clock()
        marks = []
        for i in range(SLOTS):
            if i == self.slot:
                continue
            pid, busy, beat, seqs = SLOT.unpack_from(self._map, i * SLOT.size)
            if busy and self._live(pid, beat, now):
                marks.append((busy, seqs))
        return marks

    def others_busy(self) -> int:
        return len(self._others())

    def decode_yields(
        self,
        since_step_s: float,
        yield_s: float,
        running: int,
        slack_s: Callable[[], float] = lambda: math.inf,
    ) -> bool:
        """Whether a decode engine running ``running`` sequences lets its next step wait: while
        a prefill engine of the deployment computes for more sequences than that, for at most
        ``yield_s`` since its last step (``since_step_s`` ago), and while ``slack_s()`` (the
        running streams' time to spare under the TPOT objective, asked last: it walks them) is
        positive. Waiting, it is marked idle, so prefill takes every core at its next layer.

        Why: a decode step streams every weight whatever its batch, so beside a prefill wave a
        decode of one or two sequences (a burst's lone first request) would take half the cores
        for as long as the wave ran, slowing the wave by as much. A single engine runs such
        decodes inside its prefill's forward, a token per forward; this is the same trade, with
        a bound.

        Only for a wave of more sequences than decode runs: the wait delays every running
        sequence's next token to hasten the wave's first tokens, a gain where the wave is the
        larger (a burst's first prompts decoding while the rest prefill), a loss under steady
        arrivals, where prefill's waves are one or two prompts and decode runs dozens — there
        yielding made every decode step wait out the waves, and the time per output token grew
        with the arrival rate."""
        if yield_s <= 0 or since_step_s >= yield_s:
            return False
        if not any(mark == BUSY_PREFILL and seqs > running for mark, seqs in self._others()):
            return False
        if slack_s() <= 0:
            return False
        self.idle()
        return True

    def budget(self, busy: bool, seqs: int = 0) -> int:
        """Mark this engine busy (serving ``seqs`` sequences) or idle, and alive, and return its
        thread count now."""
        self._write(busy, seqs)
        if not busy:
            return self.cores
        return fair_share(self.cores - int(self._leave), self.others_busy())

    def run_step(self, busy: bool, step: Callable[[], T], seqs: int = 0) -> T:
        """``step`` with this engine's budget as torch's thread count (set only where this
        thread's differs); call it in the thread that runs the step."""
        self._seqs = seqs
        choice = self.choice
        others = self.others_busy() if choice is not None and busy else 0
        # A choice only where the two options differ (not while another engine halves the cores).
        if (
            choice is None
            or not busy
            or fair_share(self.cores, others) == fair_share(self.cores - 1, others)
        ):
            self._leave = False
            self._follow_budget(busy)
            return step()
        leave = self._leave = choice.leave(seqs)
        before = self.threads
        self._follow_budget(busy)
        threads, started = self.threads, time.perf_counter()
        out = step()
        # The time is the option's where the team ran the whole step at the count of the step
        # before: not rebalanced meanwhile, and not the first step after a change of count
        # (shared/engine/thread_choice.py: that one is slower whichever the option).
        if self.threads == threads == before:
            choice.record(seqs, leave, time.perf_counter() - started)
        return out

    def _follow_budget(self, busy: bool) -> None:
        """torch's thread count in this thread set to the budget (only where it differs)."""
        import torch

        threads = self.budget(busy, self._seqs)
        # Compared with this thread's own count, not the last one set: the count is per thread.
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self.threads = threads

    def rebalance(self, _layers_done: int = 0) -> None:
        """Between two layers of a step (ModelRunner.between_layers), in the step's thread:
        follow the budget if another engine's work began or ended since the step did. A
        prefill wave of a real-size model lasts seconds; keeping its starting count while decode
        took its share ran three threads on two cores, and an OpenMP worker that spins before
        sleeping (services/__main__.py) then waits on a thread that has no core."""
        self._follow_budget(busy=True)

    def idle(self) -> None:
        self._write(busy=False)

    def close(self) -> None:
        """Give the slot back (a killed engine's slot expires instead). The map stays open: a
        step may still be finishing in its thread."""
        SLOT.pack_into(self._map, self.slot * SLOT.size, 0, 0, 0.0, 0)
