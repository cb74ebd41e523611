"""The one poller of a service: broker queue depths and the spill store's size.

Two kinds of reader share its readings:
- the service's scheduling policy (``on_depths``, ``on_spill``): the tokenizer and prefill read
  ``baton.prefill`` and ``baton.decode`` every ``policy_poll_interval_s``, prefill the spill
  store at most once a second (a folder scan);
- the gauges (``baton:queue_depth``, ``baton:spill_store_bytes``): every reading sets them, and
  while the metrics endpoint runs every queue and the spill store are read every
  ``METRICS_INTERVAL_S`` as well (nobody could read the gauges else).

One loop wakes for whichever reading is due next; readings due together share one passive-declare
channel. A failed reading keeps the last values (the broker reconnects meanwhile) and is retried
at its next turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TypeVar

import structlog

from services.shell.broker import Broker
from services.shell.service_metrics import ServiceMetrics
from shared.config import BatonConfig

log = structlog.get_logger(__name__)
T = TypeVar("T")

METRICS_INTERVAL_S = 2.0
SPILL_MIN_INTERVAL_S = 1.0  # a folder scan: not more often for the policy either

DepthsListener = Callable[[Mapping[str, int]], None]
SpillListener = Callable[[int], None]


class Poller:
    def __init__(self, config: BatonConfig, broker: Broker, metrics: ServiceMetrics) -> None:
        self.config = config
        self.broker = broker
        self.metrics = metrics
        self._policy_queues: tuple[str, ...] = ()
        self._on_depths: DepthsListener | None = None
        self._read_spill: Callable[[], int] | None = None
        self._on_spill: SpillListener | None = None
        self._interval: dict[str, float] = {}  # reading -> seconds between two
        self._due: dict[str, float] = {}  # reading -> when it is next due (monotonic)
        self._task: asyncio.Task[None] | None = None

    # --- what to read (before ``start``) ---------------------------------------------------------
    def on_depths(self, queues: Iterable[str], listener: DepthsListener) -> None:
        """Feed ``listener`` the depths of ``queues`` every ``policy_poll_interval_s``."""
        self._policy_queues, self._on_depths = tuple(queues), listener

    def watch_spill(self, read: Callable[[], int]) -> None:
        """The spill store's size, from ``read`` (run off the event loop): to the gauge."""
        self._read_spill = read

    def on_spill(self, listener: SpillListener) -> None:
        """Feed ``listener`` the spill store's size too (if ``watch_spill`` gave a store)."""
        self._on_spill = listener

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """A first reading before the service consumes (its policy never decides blind), then
        the loop. Nothing to read: no loop."""
        policy_s, served = self.config.policy_poll_interval_s, bool(self.config.metrics_port)
        wanted = {
            "policy_depths": (self._on_depths is not None, policy_s),
            "all_depths": (served, METRICS_INTERVAL_S),
            "spill": (  # one reading: the policy's turn is the more frequent one
                self._read_spill is not None and (self._on_spill is not None or served),
                max(SPILL_MIN_INTERVAL_S, policy_s) if self._on_spill else METRICS_INTERVAL_S,
            ),
        }
        self._interval = {name: every for name, (on, every) in wanted.items() if on}
        self._due = dict.fromkeys(self._interval, time.monotonic())
        if self._due:
            await self.poll(first=True)
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(max(0.0, min(self._due.values()) - time.monotonic()))
            await self.poll()

    # --- one turn -------------------------------------------------------------------------------
    async def poll(self, first: bool = False) -> None:
        """Take every reading that is due. Each is rescheduled first, so a failure never spins,
        and fails alone (logged): e.g. the broker reconnecting; its next turn may work."""
        failed = log.warning if first else log.debug
        now = time.monotonic()
        due = {name for name, at in self._due.items() if at <= now}
        for name in due:
            self._due[name] = now + self._interval[name]
        if due & {"policy_depths", "all_depths"}:
            # Every queue when the gauges want them; that reading serves the policy too.
            names = None if "all_depths" in due else self._policy_queues
            depths = self.broker.queue_depths(names)  # awaited by _take, which logs a failure
            await _take(
                "queue depth", depths, failed, self.metrics.set_queue_depths, self._on_depths
            )
        if "spill" in due and self._read_spill is not None:
            size = asyncio.to_thread(self._read_spill)
            await _take(
                "spill store", size, failed, self.metrics.set_spill_store_bytes, self._on_spill
            )


async def _take(
    what: str,
    reading: Awaitable[T],
    failed: Callable[..., object],
    *readers: Callable[[T], None] | None,
) -> None:
    """Await one reading and hand it to each of ``readers`` (the gauge, then the policy's
    listener if any); a failure is logged and leaves the last values in place."""
    try:
        value = await reading
    except Exception as exc:
        failed(f"{what} poll failed", error=str(exc))
        return
    for reader in readers:
        if reader is not None:
            reader(value)
