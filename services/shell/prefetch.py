"""A consumer's prefetch window that follows the scheduling policy's answer.

The service computes the window after each step (``want``); a new value goes to the broker only
when it differs from the one in force, one request at a time, the latest wanted value winning.
It is a channel-wide prefetch (``Broker.set_prefetch``): RabbitMQ applies a per-consumer one only
to consumers started after it. Where the broker refuses a channel-wide prefetch, the window stays
at the per-consumer value the service started with (``dynamic`` False), which is also its cap.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from services.shell.broker import Broker
from services.shell.service_metrics import ServiceMetrics

log = structlog.get_logger(__name__)


class PrefetchWindow:
    def __init__(self, broker: Broker, metrics: ServiceMetrics, initial: int) -> None:
        self.broker = broker
        self.metrics = metrics
        self.dynamic = False  # set by start(): the broker takes a channel-wide prefetch
        self.current = initial  # in force at the broker
        self.wanted = initial
        self._task: asyncio.Task[None] | None = None
        metrics.on_prefetch(initial, changed=False)

    async def start(self) -> None:
        """After the broker connected; before consuming."""
        self.dynamic = await self.broker.supports_channel_prefetch()
        if self.dynamic:
            await self.broker.set_prefetch(self.current)

    def want(self, prefetch: int) -> None:
        self.wanted = prefetch
        if self.dynamic and self._task is None and prefetch != self.current:
            self._task = asyncio.create_task(self._send())

    async def _send(self) -> None:
        try:
            while self.wanted != self.current:
                wanted = self.wanted
                await self.broker.set_prefetch(wanted)
                self.current = wanted
                self.metrics.on_prefetch(wanted, changed=True)
        except Exception as exc:  # the broker reconnects; the next step asks again
            log.warning("prefetch change failed", wanted=self.wanted, error=str(exc))
        finally:
            self._task = None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
