"""The detokenizer's pipelined sends: a batch is published while earlier confirms are pending,
and acks follow batch order, so no input is acked before every reply made from it is confirmed.

The broker's publish is replaced by one whose confirms this test releases (the service's own
code decides what to publish, when to ack and what to hold); deliveries record their acks. The
end-to-end crash tests (tests/fault) run the same code against the real broker.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.detokenizer.service import MAX_SENDS_IN_FLIGHT, DetokenizerService
from services.shell.common import resolve_model_dir
from shared.config import BatonConfig
from shared.wire.messages import DetokMsg, StartInfo, TokenEvent


class Delivery:
    """What the service reads from an incoming message, and its ack."""

    def __init__(self, name: str, msg: DetokMsg, acked: list[str]) -> None:
        self.name, self.body, self._acked = name, msg.encode(), acked
        self.delivery_tag = name

    async def ack(self) -> None:
        self._acked.append(self.name)


class HeldConfirms:
    """Stands in for ``publish_until_confirmed``: records each batch and confirms it when told."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.confirms: list[asyncio.Event] = []

    async def __call__(self, outs: list[Any], what: str) -> None:
        self.batches.append(outs)
        confirm = asyncio.Event()
        self.confirms.append(confirm)
        await confirm.wait()


def service() -> tuple[DetokenizerService, HeldConfirms]:
    config = BatonConfig(stream_interval_s=0.0)
    svc = DetokenizerService(config, resolve_model_dir(config))
    held = HeldConfirms()
    svc.shell.broker.publish_until_confirmed = held  # type: ignore[method-assign]
    return svc, held


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.mark.parametrize("first_confirmed", [0, 1])
async def test_a_batch_is_published_before_the_previous_is_confirmed_and_acks_wait(
    first_confirmed: int,
) -> None:
    svc, held = service()
    acked: list[str] = []
    start = StartInfo("r", "reply-q", num_prompt_tokens=3, max_tokens=2)
    first = DetokMsg(starts=[start], events=[TokenEvent("r", 0, [65])])
    last = DetokMsg(events=[TokenEvent("r", 1, [66], finish_reason="length")])

    await svc.on_message(Delivery("d1", first, acked))  # type: ignore[arg-type]
    await svc._process()
    await settle()
    await svc.on_message(Delivery("d2", last, acked))  # type: ignore[arg-type]
    await svc._process()  # does not wait for the first batch's confirm
    await settle()
    assert len(held.batches) == 2  # both published; neither confirmed
    assert acked == []

    # One batch confirmed, either one: nothing may be acked yet. The first batch's input
    # carries r, whose terminal reply is in the second batch; the second waits for the first.
    held.confirms[first_confirmed].set()
    await settle()
    assert acked == []

    held.confirms[1 - first_confirmed].set()
    await settle()
    assert sorted(acked) == ["d1", "d2"]  # r is answered and every reply confirmed
    assert len(svc.ledger) == 0


async def test_the_window_of_unconfirmed_batches_is_bounded() -> None:
    svc, held = service()
    acked: list[str] = []
    for i in range(MAX_SENDS_IN_FLIGHT + 1):
        start = StartInfo(f"r{i}", "q", num_prompt_tokens=1, max_tokens=1)
        msg = DetokMsg(starts=[start], events=[TokenEvent(f"r{i}", 0, [65], "length")])
        await svc.on_message(Delivery(f"d{i}", msg, acked))  # type: ignore[arg-type]
        processing = asyncio.create_task(svc._process())
        await settle()
        if i < MAX_SENDS_IN_FLIGHT:
            assert processing.done()
    assert not processing.done()  # the window is full: it waits for the oldest confirm
    held.confirms[0].set()
    await settle()
    assert processing.done()
    for confirm in held.confirms:
        confirm.set()
    await settle()
    assert sorted(acked) == [f"d{i}" for i in range(MAX_SENDS_IN_FLIGHT + 1)]
