"""What every service process shares: the model directory and the run loop."""

from __future__ import annotations

import asyncio
import gc
import signal
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import structlog

from shared.config import BatonConfig
from shared.models.catalog import resolve_model

log = structlog.get_logger(__name__)


def resolve_model_dir(config: BatonConfig) -> Path:
    """The model directory ``BATON_MODEL`` names (shared/models/catalog.py): the default model
    fetched, a GGUF file's config and tokenizer written, or the tiny model built, on first use."""
    return resolve_model(config.model)


class Service(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@runtime_checkable
class Finishing(Protocol):
    """A service that may end by itself (a drained one): ``wait_finished`` then returns."""

    async def wait_finished(self) -> None: ...


def freeze_startup_heap() -> None:
    """Hide everything built at start-up (torch, transformers, the model, the tokenizer, the
    broker connection) from the cyclic garbage collector: it lives as long as the process.

    Left in, every full collection walks it — hundreds of thousands of objects, a pause long
    enough to show in a priority request's first token. Collections now walk only what serving
    created."""
    gc.collect()
    gc.freeze()


async def run_until_signalled(service: Service) -> None:
    """Start, serve until SIGINT/SIGTERM or until the service finished draining, then stop
    cleanly (unacked work is redelivered)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    freeze_startup_heap()
    log.info("service ready", service=service.name)
    waits: list[asyncio.Task[Any]] = [asyncio.create_task(stop.wait())]
    if isinstance(service, Finishing):
        waits.append(asyncio.create_task(service.wait_finished()))
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    log.info("service stopping", service=service.name, drained=not stop.is_set())
    await service.stop()
    log.info("service stopped", service=service.name)
