"""Which CPUs an engine service runs on, and how many torch threads it uses there.

On one machine prefill and decode share the cores with the broker and the light services; a long
prefill then steals decode's CPU and every stream's time per output token grows, which is what
disaggregation exists to prevent. ``BATON_PREFILL_CPUS`` / ``BATON_DECODE_CPUS`` (Linux CPU lists,
``"0-3,8"``) give each engine its own cores, the CPU analogue of separate GPUs; the light services
stay unpinned. Unset, a service may run anywhere.

``python -m services up`` runs both engines on this machine. By default they are not pinned
apart: they share every CPU and each takes, before a step, all of them while the other engine is
idle and half while both are busy (``BATON_CPU_SHARE``, shared/engine/cpu_share.py). Pinned to
halves with one thread each, a burst's prefill would run on half the cores while the other half
idled, then its decode the same (docs/perf-log.md, "CPU sharing"). With ``BATON_CPU_SHARE=0``
and neither list given, ``up`` still gives them the two halves of its CPUs
(:func:`split_engine_cpus`): left alone, the kernel's balancer may put both one-thread engines
on one core. Lists given, engines
on the same set share it and engines on disjoint sets never halve each other (the table is per
CPU set). An explicitly empty list (``BATON_DECODE_CPUS=``) keeps an engine unpinned.

``BATON_PREFILL_NICE`` / ``BATON_DECODE_NICE`` lower an engine's CPU priority where it shares
cores (default 0): niced, decode never makes a first token's hops wait for its time slice, nor
prefill (docs/scheduling.md has both sides). ``BATON_STEP_NICE`` (default 10) lowers only the
forwards' threads, of both engines alike: the light hops win, and neither engine yields to the
other.
"""

from __future__ import annotations

import os
import sys
import threading


def parse_cpu_list(spec: str) -> frozenset[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8}; ``""`` -> {} (no restriction). ValueError if malformed."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, sep, last = part.partition("-")
        try:
            lo, hi = int(first), int(last if sep else first)
        except ValueError:
            raise ValueError(f"not a CPU list: {spec!r}") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"not a CPU range: {part!r} in {spec!r}")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def split_engine_cpus(available: frozenset[int]) -> tuple[str, str] | None:
    """Prefill's and decode's CPU lists when both run here: the first half of ``available``
    and the rest (decode gets the odd one); None with fewer than two CPUs."""
    cpus = sorted(available)
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


MAX_NICE = 19


def check_nice(nice: int) -> None:
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"nice must be 0..{MAX_NICE}, not {nice}")


def yield_cpu(nice: int) -> None:
    """Lower this process's CPU priority by ``nice`` (0 leaves it). Never raised: that needs
    privileges, and the light services are the ones that must win."""
    check_nice(nice)
    if nice:
        os.nice(nice)


def yield_thread_cpu(nice: int) -> None:
    """Lower the calling thread's CPU priority by ``nice`` (Linux: a nice value is per thread,
    and the threads it starts inherit it). Elsewhere, a no-op."""
    check_nice(nice)
    if not nice or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def pin_engine(cpu_spec: str, torch_threads: int) -> int:
    """Pin this process to ``cpu_spec`` (if given) and return its torch thread count.

    ``torch_threads`` 0 means auto: every pinned CPU, or half the machine's cores unpinned (prefill
    and decode then share them; with BATON_CPU_SHARE the first step replaces the count). Must run
    before torch starts its thread pool."""
    cpus = parse_cpu_list(cpu_spec)
    if cpus:
        available = os.sched_getaffinity(0)
        if not cpus <= available:
            missing = ",".join(map(str, sorted(cpus - available)))
            raise ValueError(f"CPUs {missing} of {cpu_spec!r} are not available to this process")
        os.sched_setaffinity(0, cpus)
    if torch_threads > 0:
        return torch_threads
    return len(cpus) if cpus else max(1, (os.cpu_count() or 2) // 2)
