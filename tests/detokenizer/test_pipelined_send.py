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
    """Stands in for the broker's publishing: records each attempt and confirms it when told
    (``fail``: the attempts numbered there come back unconfirmed); retries are recorded."""

    def __init__(self, fail: tuple[int, ...] = ()) -> None:
        self.batches: list[list[Any]] = []
        self.confirms: list[asyncio.Event] = []
        self.fail = fail
        self.retried: list[list[Any]] = []

    current: object = "channel-1"  # what a reconnect replaces

    async def publish_channel(self) -> object:
        return self.current

    async def publish_once(self, outs: list[Any], what: str, channel: object) -> list[Any]:
        attempt = len(self.batches)
        self.batches.append(outs)
        confirm = asyncio.Event()
        self.confirms.append(confirm)
        await confirm.wait()
        return outs if attempt in self.fail else []

    async def publish_until_confirmed(self, outs: list[Any], what: str) -> None:
        self.retried.append(outs)


def service(fail: tuple[int, ...] = ()) -> tuple[DetokenizerService, HeldConfirms]:
    config = BatonConfig(stream_interval_s=0.0)
    svc = DetokenizerService(config, resolve_model_dir(config))
    held = HeldConfirms(fail)
    broker: Any = svc.shell.broker
    broker.publish_channel = held.publish_channel
    broker.publish_once = held.publish_once
    broker.publish_until_confirmed = held.publish_until_confirmed
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


async def test_unconfirmed_replies_are_retried_in_batch_order_and_hold_back_new_batches() -> None:
    """Both batches' first attempts fail (a lost connection); the later one's failure comes
    back first. Its retry still waits for the earlier one's, and a batch made meanwhile goes
    out only after them: a later reply overtaking an earlier retry is a gap in a stream."""
    svc, held = service(fail=(0, 1))
    acked: list[str] = []
    for i in range(2):
        start = StartInfo(f"r{i}", "q", num_prompt_tokens=1, max_tokens=1)
        msg = DetokMsg(starts=[start], events=[TokenEvent(f"r{i}", 0, [65], "length")])
        await svc.on_message(Delivery(f"d{i}", msg, acked))  # type: ignore[arg-type]
        await svc._process()
        await settle()
    held.confirms[1].set()  # the later batch's failure first
    await settle()
    assert held.retried == []  # not before the earlier batch's retry
    start = StartInfo("r2", "q", num_prompt_tokens=1, max_tokens=1)
    msg = DetokMsg(starts=[start], events=[TokenEvent("r2", 0, [65], "length")])
    await svc.on_message(Delivery("d2", msg, acked))  # type: ignore[arg-type]
    await svc._process()
    await settle()
    assert len(held.batches) == 2  # the new batch waits while a batch is retrying
    held.confirms[0].set()
    await settle()
    assert held.retried == [held.batches[0], held.batches[1]]
    assert len(held.batches) == 3  # now the new one
    held.confirms[2].set()
    await settle()
    assert sorted(acked) == ["d0", "d1", "d2"]


async def test_after_a_reconnect_a_batch_waits_for_the_previous_one_on_the_old_channel() -> None:
    """Messages on one channel reach the broker in order; across a reconnect nothing orders
    them, so a batch on a new channel does not go out ahead of an unconfirmed earlier one."""
    svc, held = service()
    acked: list[str] = []

    def message(i: int) -> DetokMsg:
        start = StartInfo(f"r{i}", "q", num_prompt_tokens=1, max_tokens=1)
        return DetokMsg(starts=[start], events=[TokenEvent(f"r{i}", 0, [65], "length")])

    await svc.on_message(Delivery("d0", message(0), acked))  # type: ignore[arg-type]
    await svc._process()
    await settle()
    held.current = "channel-2"  # the connection was lost and restored
    await svc.on_message(Delivery("d1", message(1), acked))  # type: ignore[arg-type]
    await svc._process()
    await settle()
    assert len(held.batches) == 1  # waits for the batch on the old channel
    held.confirms[0].set()
    await settle()
    assert len(held.batches) == 2
    held.confirms[1].set()
    await settle()
    assert sorted(acked) == ["d0", "d1"]
