"""What every service shell shares: model directory, expiring id sets, the run loop."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

import structlog

from shared.config import DEFAULT_MODEL_DIR, BatonConfig

log = structlog.get_logger(__name__)


def resolve_model_dir(config: BatonConfig) -> Path:
    """``BATON_MODEL`` if set, else the built-in tiny model (built on first use, atomically)."""
    if config.model:
        path = Path(config.model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"BATON_MODEL={config.model!r} is not a local HF model dir")
        return path
    from shared.tiny_model import ensure_tiny_model

    return ensure_tiny_model(DEFAULT_MODEL_DIR, preset="tiny", arch="llama")


class ExpiringIdSet:
    """Request ids remembered for ``ttl_s`` (cancelled / aborted ids); bounded in size."""

    def __init__(self, ttl_s: float = 600.0, max_size: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_size = max_size
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = time.monotonic()
        self._ids.move_to_end(request_id)
        self._trim()

    def __contains__(self, request_id: str) -> bool:
        self._trim()
        return request_id in self._ids

    def _trim(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._ids and (
            len(self._ids) > self.max_size or next(iter(self._ids.values())) < cutoff
        ):
            self._ids.popitem(last=False)


class Service(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def run_until_signalled(service: Service) -> None:
    """Start, serve until SIGINT/SIGTERM, then stop cleanly (unacked work is redelivered)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    log.info("service ready", service=service.name)
    await stop.wait()
    log.info("service stopping", service=service.name)
    await service.stop()
    log.info("service stopped", service=service.name)
