"""Effective priority — a request's priority plus what its wait (aging) and, at prefill under
pressure, its shortness add — and the choice of preemption victims. Pure: numbers in, numbers out.

    effective = priority + MAX_PRIORITY * waited / horizon + short_boost

``horizon`` is the wait after which a priority-0 request ranks with a fresh priority-9 one: a
multiple of the median wait of the requests this worker recently started (never below a floor).
A request that waited longer than ``horizon`` ranks ahead of every request that arrives after that
moment, so its wait is bounded by the horizon plus the time to serve what arrived before it: a
bounded multiple of the median (``tests/flow_control/test_policy_priority.py`` simulates it).

On the wire the effective priority is cut to the AMQP range 0..9 (:meth:`Prioritizer.wire_priority`,
the one place a hop's priority is made: tokenizer, prefill's handoffs, decode's swapped-out
requests); inside a worker the waiting queue orders by the uncut value, so among requests that all
aged to the top the oldest goes first.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.config import BatonConfig
from shared.wire.priority import MAX_PRIORITY, clamp_priority

if TYPE_CHECKING:
    from shared.runtime.sequence import Sequence

# The horizon follows the median of this many recent waits, recomputed every MEDIAN_EVERY of
# them; it only moves (and the waiting queue is re-keyed) when it changes by more than
# HORIZON_STEP, so a steady load keeps one ordering.
WAIT_WINDOW = 256
MEDIAN_EVERY = 16
HORIZON_STEP = 0.25
MIN_HORIZON_S = 1e-3  # a guard against a zero floor: aging never divides by zero


def aging_horizon(median_wait_s: float, multiple: float, min_s: float) -> float | None:
    """Seconds of waiting that add MAX_PRIORITY levels; None = no aging (``multiple`` 0)."""
    if multiple <= 0:
        return None
    return max(min_s, multiple * median_wait_s, MIN_HORIZON_S)


def short_prompt_boost(num_prompt_tokens: int, short_prompt_tokens: int, max_boost: float) -> float:
    """Up to ``max_boost`` levels for a short prompt, the shorter the more (shortest job first);
    nothing from ``short_prompt_tokens`` tokens on."""
    if max_boost <= 0 or short_prompt_tokens <= 0 or num_prompt_tokens >= short_prompt_tokens:
        return 0.0
    return max_boost * (1.0 - num_prompt_tokens / short_prompt_tokens)


def effective_priority(
    priority: int, waited_s: float, horizon_s: float | None, boost: float = 0.0
) -> float:
    """``priority`` + aging + ``boost``. Linear in ``waited_s`` with the same slope for every
    request (which is what lets a queue order by it without re-sorting as time passes)."""
    aging = 0.0 if horizon_s is None else MAX_PRIORITY * waited_s / horizon_s
    return priority + boost + aging


@dataclass(frozen=True)
class PriorityState:
    """A :class:`Prioritizer`'s figures, for metrics (an engine reports them in its load)."""

    horizon_s: float | None = None  # None: no aging
    median_wait_s: float | None = None  # None: too few requests started yet
    boosting: bool = False  # short prompts boosted (the prefill backlog is deep)


class Prioritizer:
    """The effective priority in one process, and the order of its worker's waiting queue (a
    :class:`~shared.scheduling.waiting_queue.Ranking`).

    ``rank(seq)`` is the effective priority at time 0 (waited = -arrival). Effective priority
    grows with time at the same rate for every request, so at any moment the order of effective
    priorities *is* the order of ranks: the queue is keyed by rank once per ``epoch``, and the
    scheduler's pick is the highest effective priority at the moment it picks. The epoch changes
    (the queue re-keys) only when the slope or a boost changes: the horizon moved by more than
    HORIZON_STEP, or the prefill backlog crossed the short-prompt threshold.

    Not thread-safe: in an engine it is touched only between steps, like the engine itself.
    """

    def __init__(self, config: BatonConfig, *, short_boost: bool) -> None:
        self.multiple = config.priority_aging_multiple
        self.min_s = config.priority_aging_min_s
        self.short_prompt_tokens = config.short_prompt_tokens
        # The boost is about prefill's backlog: decode never applies it.
        self.max_short_boost = config.short_prompt_boost if short_boost else 0.0
        self.boost_backlog = config.short_boost_backlog
        self.epoch = 0
        self.horizon_s = aging_horizon(0.0, self.multiple, self.min_s)
        self.boosting = False  # the prefill backlog is deep: short prompts get their boost
        self._waits: deque[float] = deque(maxlen=WAIT_WINDOW)
        self._unsummarized = 0
        self.median_wait_s: float | None = None

    # --- inputs ---------------------------------------------------------------------------------
    def observe_backlog(self, prefill_backlog: int | None) -> None:
        """The prefill queue's depth (None: not known yet). Boosting starts at
        ``short_boost_backlog`` and stops below half of it, so a depth hovering at the
        threshold does not re-key the queue at every poll."""
        if prefill_backlog is None or self.max_short_boost <= 0:
            return
        threshold = self.boost_backlog / 2 if self.boosting else self.boost_backlog
        boosting = prefill_backlog >= threshold
        if boosting != self.boosting:
            self.boosting = boosting
            self.epoch += 1

    def observe_wait(self, wait_s: float) -> None:
        """A request started here after waiting ``wait_s`` since its arrival."""
        self._waits.append(max(0.0, wait_s))
        self._unsummarized += 1
        if self._unsummarized < MEDIAN_EVERY:
            return
        self._unsummarized = 0
        self.median_wait_s = statistics.median(self._waits)
        horizon = aging_horizon(self.median_wait_s, self.multiple, self.min_s)
        if horizon is None or self.horizon_s is None:
            return
        if abs(horizon - self.horizon_s) > HORIZON_STEP * self.horizon_s:
            self.horizon_s = horizon
            self.epoch += 1

    # --- answers --------------------------------------------------------------------------------
    def boost(self, num_prompt_tokens: int) -> float:
        if not self.boosting:
            return 0.0
        return short_prompt_boost(num_prompt_tokens, self.short_prompt_tokens, self.max_short_boost)

    def effective(
        self, priority: int, arrival: float, num_prompt_tokens: int, now: float, boost: bool = True
    ) -> float:
        """The effective priority at ``now``; ``boost=False``: aging only (what the next stage,
        which has its own backlog, continues from)."""
        extra = self.boost(num_prompt_tokens) if boost else 0.0
        return effective_priority(priority, max(0.0, now - arrival), self.horizon_s, extra)

    def wire_priority(
        self, priority: int, arrival: float, num_prompt_tokens: int, now: float, boost: bool = True
    ) -> int:
        """The AMQP priority of the next hop: the effective priority at ``now``, cut to the
        contract's range. ``boost=False`` from an engine (the short-prompt boost answers
        prefill's backlog and stays there)."""
        return clamp_priority(self.effective(priority, arrival, num_prompt_tokens, now, boost))

    def state(self) -> PriorityState:
        return PriorityState(self.horizon_s, self.median_wait_s, self.boosting)

    def rank(self, seq: Sequence) -> float:
        """The waiting-queue key (higher first): the effective priority at time 0."""
        return effective_priority(
            seq.priority, -seq.arrival_time, self.horizon_s, self.boost(seq.num_prompt_tokens)
        )


@dataclass(frozen=True)
class Candidate:
    """A running sequence as a preemption decision sees it."""

    request_id: str
    priority: float  # effective
    started: int  # start order in this worker: higher = started more recently
    freeable_blocks: int  # KV blocks that come back if it is preempted (not shared)


def victim_order(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Who goes first: the lowest effective priority, then the most recently started (it has
    the least work sunk into it, so recomputing or swapping it costs least)."""
    return sorted(candidates, key=lambda c: (c.priority, -c.started))


def choose_victims(
    candidates: Iterable[Candidate],
    blocks_needed: int,
    free_blocks: int,
    below: float | None = None,
) -> list[str] | None:
    """The sequences to preempt so that ``blocks_needed`` blocks are free, in victim order.

    Only candidates whose effective priority is strictly below ``below`` may go (None: any — a
    running batch that outgrew the cache). ``[]``: it fits already. None: preempting every
    eligible candidate would still not make room, so none is preempted (KV is never thrown away
    for nothing)."""
    if free_blocks >= blocks_needed:
        return []
    eligible = [c for c in candidates if below is None or c.priority < below]
    chosen: list[str] = []
    for c in victim_order(eligible):
        chosen.append(c.request_id)
        free_blocks += c.freeable_blocks
        if free_blocks >= blocks_needed:
            return chosen
    return None
