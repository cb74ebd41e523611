"""The scheduling policy: one object per service, fed numbers, answering with decisions.

No I/O and no clock: a service polls the broker and its engine, feeds the numbers in, and applies
the answers (docs/scheduling.md). Every input and every decision is also a Prometheus metric
(``services/shell/service_metrics.py``).

Inputs
- broker depths: ready messages on ``baton.prefill`` and ``baton.decode`` (passive declares,
  polled every ``policy_poll_interval_s``);
- the worker's load after each step (:class:`~shared.engine.outputs.EngineLoad`): waiting and
  running sequences, free and used KV blocks;
- the spill store's size (prefill, shm transport);
- the worker's steps: forward time, tokens computed per sequence, and how long a step's inputs
  stay held after it (its outputs confirmed, then the inputs acked).

Decisions
- admission (tokenizer): ``overloaded`` while either backlog is at its limit;
- the default deadline by length (tokenizer), shortened by the client's ``timeout_s``;
- prefetch: how many messages each consumer may hold unacked. Work a worker cannot start soon
  stays in the broker, where priority orders it and any replica can take it;
- prefill intake: slowed, then paused, as decode's backlog or the spill store fills;
- effective priority and preemption victims: :mod:`shared.scheduling.priority`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from shared.config import BatonConfig
from shared.engine.load import EngineLoad
from shared.wire.queues import DECODE_QUEUE, PREFILL_QUEUE

# Prefill intake: from SLOW_FROM of the pressure limit the window shrinks linearly to one message;
# at the limit (1.0) prefill starts nothing new until the pressure is below RESUME_BELOW.
SLOW_FROM = 0.5
RESUME_BELOW = 0.9
# Prefill holds what its next forwards take while the slots of a finished batch come back (its
# outputs confirmed by the broker, then its inputs acked: tens of milliseconds under load, when
# the broker confirms persistent messages in batches): ceil(release time / forward time) batches
# beyond the one in the forward, at least one, at most this many. Fewer starve the engine (it
# waits for its own acks); more only add work ahead of a higher-priority request.
MAX_BATCHES_AHEAD = 16
# The weight of a new step in the exponential means of those times and of the tokens a forward
# computes per sequence.
STEP_MEAN_WEIGHT = 0.1


@dataclass(frozen=True)
class Admission:
    admit: bool
    reason: str | None = None  # why not (the ``overloaded`` reply's message)


class DeadlineSource(enum.Enum):
    DEFAULT = "default"  # base + per prompt token + per output token
    CLIENT = "client"  # the client's timeout_s, shorter than the default
    NONE = "none"  # no default (base 0) and no timeout_s


@dataclass(frozen=True)
class Deadline:
    at: float | None  # wall clock; None = no deadline
    seconds: float | None  # after arrival
    source: DeadlineSource


class Intake(enum.Enum):
    OPEN = "open"  # the whole window
    SLOWED = "slowed"  # a window shrunk by pressure
    PAUSED = "paused"  # no new prompt starts until the pressure eases


@dataclass(frozen=True)
class PrefillIntake:
    state: Intake
    prefetch: int
    pressure: float  # max of decode backlog / its limit and spill bytes / its limit (1 = full)


class SchedulingPolicy:
    def __init__(self, config: BatonConfig) -> None:
        self.config = config
        # Inputs as last observed; None = never observed (no decision rests on a guess).
        self.prefill_backlog: int | None = None
        self.decode_backlog: int | None = None
        self.spill_bytes: int | None = None
        # Tokens a forward computes per sequence: the prompt less its prefix-cache hits (what
        # decides how many prompts one forward takes).
        self.mean_tokens_per_seq: float | None = None
        self.forward_s: float | None = None  # mean forward time of this worker's steps
        self.release_s: float | None = None  # mean time from a step's end to its inputs' acks
        self._paused = False  # prefill intake (hysteresis between 1.0 and RESUME_BELOW)

    # --- inputs ---------------------------------------------------------------------------------
    def observe_depths(self, depths: Mapping[str, int]) -> None:
        """Broker depths as polled; a queue missing from ``depths`` keeps its last reading."""
        self.prefill_backlog = depths.get(PREFILL_QUEUE, self.prefill_backlog)
        self.decode_backlog = depths.get(DECODE_QUEUE, self.decode_backlog)
        self._update_pause()

    def observe_spill(self, used_bytes: int) -> None:
        self.spill_bytes = used_bytes
        self._update_pause()

    def _update_pause(self) -> None:
        """Prefill's pause has hysteresis: on at pressure 1.0, off below RESUME_BELOW (a
        pressure hovering at the limit does not flap intake at every poll)."""
        self._paused = self.prefill_pressure() >= (RESUME_BELOW if self._paused else 1.0)

    def observe_step(self, forward_s: float, num_seqs: int, num_scheduled_tokens: int) -> None:
        """A forward ran over ``num_seqs`` sequences and ``num_scheduled_tokens`` tokens."""
        self.forward_s = _mean(self.forward_s, forward_s, STEP_MEAN_WEIGHT)
        if num_seqs > 0:
            per_seq = num_scheduled_tokens / num_seqs
            self.mean_tokens_per_seq = _mean(self.mean_tokens_per_seq, per_seq, STEP_MEAN_WEIGHT)

    def observe_release(self, seconds: float) -> None:
        """A step's outputs were confirmed and its inputs acked ``seconds`` after it ended."""
        self.release_s = _mean(self.release_s, seconds, STEP_MEAN_WEIGHT)

    # --- tokenizer ------------------------------------------------------------------------------
    def admission(self) -> Admission:
        """Refuse new work while either stage's broker backlog is at its limit: a client told at
        once can retry elsewhere or later, instead of waiting in a queue that cannot drain in
        time. Accepted requests are never dropped by this."""
        c = self.config
        for stage, depth, limit in (
            ("prefill", self.prefill_backlog, c.max_prefill_backlog),
            ("decode", self.decode_backlog, c.max_decode_backlog),
        ):
            if depth is not None and depth >= limit:
                return Admission(
                    False,
                    f"{stage} backlog of {depth} requests is at the limit ({limit}); retry later",
                )
        return Admission(True)

    def default_timeout_s(self, num_prompt_tokens: int, max_tokens: int) -> float | None:
        """base + per prompt token + per output token; None when the base is 0 (no default)."""
        c = self.config
        if c.default_timeout_base_s <= 0:
            return None
        return (
            c.default_timeout_base_s
            + c.default_timeout_per_prompt_token_s * num_prompt_tokens
            + c.default_timeout_per_output_token_s * max_tokens
        )

    def deadline(
        self, arrival: float, timeout_s: float | None, num_prompt_tokens: int, max_tokens: int
    ) -> Deadline:
        """The wall-clock deadline: the default by length, capped by the client's ``timeout_s``
        (a client may shorten it, never extend it)."""
        default = self.default_timeout_s(num_prompt_tokens, max_tokens)
        if timeout_s is not None and (default is None or timeout_s < default):
            return Deadline(arrival + timeout_s, timeout_s, DeadlineSource.CLIENT)
        if default is not None:
            return Deadline(arrival + default, default, DeadlineSource.DEFAULT)
        return Deadline(None, None, DeadlineSource.NONE)

    def tokenizer_prefetch(self) -> int:
        return max(1, self.config.tokenizer_prefetch)

    # --- prefill --------------------------------------------------------------------------------
    def prefill_pressure(self) -> float:
        """How full what prefill feeds is: decode's backlog and the spill store, each against
        its limit (1.0 = at it); 0 when neither is known or limited."""
        c = self.config
        parts = [0.0]
        if self.decode_backlog is not None and c.prefill_pause_decode_backlog > 0:
            parts.append(self.decode_backlog / c.prefill_pause_decode_backlog)
        spill_limit = c.prefill_pause_spill_fraction * c.spill_max_bytes
        if self.spill_bytes is not None and spill_limit > 0:
            parts.append(self.spill_bytes / spill_limit)
        return max(parts)

    def prefill_batch_capacity(self, load: EngineLoad) -> int:
        """Prompts one forward takes, at the mean tokens it computes per prompt: the token
        budget, the sequence cap and the KV blocks free (a prompt that cannot get blocks waits
        anyway) all bound it."""
        c = self.config
        if self.mean_tokens_per_seq is None:
            return c.prefill_max_num_seqs
        mean = max(1.0, self.mean_tokens_per_seq)
        # Rounded, not floored: a mean a hair above a divisor does not cost a whole prompt.
        by_budget = round(c.max_num_batched_tokens / mean)
        by_blocks = round(load.num_free_blocks / max(1.0, mean / c.block_size))
        return max(1, min(c.prefill_max_num_seqs, by_budget, by_blocks))

    def prefill_batches_ahead(self) -> int:
        """Batches to hold beyond the one in the forward (see MAX_BATCHES_AHEAD)."""
        if self.release_s is None or not self.forward_s:
            return 1
        return max(1, min(MAX_BATCHES_AHEAD, math.ceil(self.release_s / self.forward_s)))

    def prefill_intake(self, load: EngineLoad) -> PrefillIntake:
        """The prefill consumer's window, and whether new prompts may start."""
        pressure = self.prefill_pressure()
        if self._paused:
            return PrefillIntake(Intake.PAUSED, 1, pressure)
        window = min(
            prefill_window_cap(self.config),
            prefill_window(self.prefill_batch_capacity(load), self.prefill_batches_ahead()),
        )
        if pressure <= SLOW_FROM:
            return PrefillIntake(Intake.OPEN, window, pressure)
        shrunk = round(window * (1.0 - pressure) / (1.0 - SLOW_FROM))
        return PrefillIntake(Intake.SLOWED, max(1, min(window, shrunk)), pressure)

    # --- decode ---------------------------------------------------------------------------------
    def decode_prefetch(self, load: EngineLoad) -> int:
        """Decode holds its running batch, what waits in it, its free batch slots and
        ``decode_prefetch_headroom`` more (the broker's highest-priority handoffs, ready to
        preempt). A handoff stays unacked while its sequence runs, so this is the number of
        unacked messages allowed: the broker delivers only as slots free up.

        No free slots while sequences already wait (blocks or slots short) or while the free KV
        blocks would not hold one more sequence of the running batch's mean size."""
        c = self.config
        running, waiting = load.num_running, load.num_waiting
        slots = max(0, c.max_num_seqs - running - waiting)
        mean_blocks = load.num_used_blocks / running if running else 0.0
        if waiting > 0 or load.num_free_blocks < mean_blocks:
            slots = 0
        room = max(0, c.decode_prefetch_headroom - waiting)
        return max(1, running + waiting + slots + room)


def prefill_window(batch_capacity: int, batches_ahead: int) -> int:
    """The batch in the forward and ``batches_ahead`` more."""
    return batch_capacity * (1 + batches_ahead)


def prefill_window_cap(config: BatonConfig) -> int:
    """The largest window prefill ever asks for (the per-consumer prefetch it starts with): two
    batches of the shortest prompts."""
    return 2 * config.prefill_max_num_seqs


def _mean(current: float | None, value: float, weight: float) -> float:
    return float(value) if current is None else current + weight * (value - current)
