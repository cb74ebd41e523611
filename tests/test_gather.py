"""Prefill's gather on waking: a burst joins one wave, a lone request waits for company only
briefly (services/shell/engine_service.py ``_gather``, ``lone_wait_s``)."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import pytest

from services.prefill.service import PrefillService
from services.shell.engine_service import LONE_WAIT_SHARE, Received, lone_wait_s
from shared.wire.messages import PrefillMsg, SamplingParams


def test_a_lone_request_waits_a_share_of_its_forward_capped_and_never_unmeasured() -> None:
    assert lone_wait_s(128, 0.0, 0.01) == 0.0  # no forward measured yet
    assert lone_wait_s(0, 1000.0, 0.01) == 0.0
    assert lone_wait_s(8, 1000.0, 0.01) == pytest.approx(LONE_WAIT_SHARE * 0.008)
    assert lone_wait_s(128, 1000.0, 0.01) == 0.01  # 16 ms of share, capped at the gap
    assert lone_wait_s(1, 1000.0, 0.01) < 0.0002  # a one-token prompt waits next to nothing


def _request(i: int, tokens: int = 128) -> Received:
    msg = PrefillMsg(f"r{i}", "q", list(range(tokens)), SamplingParams(max_tokens=1))
    return Received(msg, None)  # type: ignore[arg-type] # the gather never settles deliveries


def _prefill(tokens_per_s: float, batch_wait_s: float = 0.01) -> PrefillService:
    """The gather's state alone: no broker, no engine (the loop around it is the shell's)."""
    service = object.__new__(PrefillService)
    service.inbox = deque()
    service._wake = asyncio.Event()
    service.batch_wait_s, service.batch_wait_max_s = batch_wait_s, 0.05
    service.tokens_per_s = tokens_per_s
    return service


async def _gather_with_arrivals(
    service: PrefillService, arrivals: list[float]
) -> tuple[int, float]:
    """Runs the gather with one request in the inbox and the others arriving ``arrivals``
    seconds later; returns the requests it gathered and how long it took."""
    service.inbox.append(_request(0))

    async def arrive() -> None:
        start = time.monotonic()
        for i, at in enumerate(arrivals, 1):
            await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))
            service.inbox.append(_request(i))
            service._wake.set()

    feeder = asyncio.create_task(arrive())
    start = time.monotonic()
    await service._gather()
    took, gathered = time.monotonic() - start, len(service.inbox)
    feeder.cancel()
    return gathered, took


def test_a_burst_led_by_a_lone_request_joins_its_first_wave() -> None:
    """The tokenizer commits a burst's first request alone and the rest a commit later: the
    first waits for the second (5 ms on), then the gather runs until quiet."""
    service = _prefill(tokens_per_s=1000.0)  # a 128-token prompt: ~128 ms, a 10 ms wait
    gathered, _ = asyncio.run(_gather_with_arrivals(service, [0.005, 0.006, 0.008, 0.012]))
    assert gathered == 5


def test_a_lone_request_goes_alone_after_its_wait_and_at_once_before_any_forward() -> None:
    service = _prefill(tokens_per_s=1000.0)  # waits its 10 ms cap, not for the one at 0.2 s
    gathered, took = asyncio.run(_gather_with_arrivals(service, [0.2]))
    assert gathered == 1 and 0.008 < took < 0.15
    # No forward measured yet: no wait, where the cap (150 ms) would have shown.
    service = _prefill(tokens_per_s=0.0, batch_wait_s=0.15)
    gathered, took = asyncio.run(_gather_with_arrivals(service, [0.2]))
    assert gathered == 1 and took < 0.1
