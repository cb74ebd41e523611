"""The client contract, checked raw: a client that speaks the queue contract and nothing else,
and the verdict on what one request got (the chaos run's view: loadtest/chaos.py).

``RawWire`` is plain aio-pika — no client library, no deduplication: it publishes request maps
to ``baton.requests`` and keeps every reply in the order it came. ``judge`` counts, per request,
what the contract forbids: no terminal reply or more than one, an error, token positions
repeated, missing or out of order, text that does not continue the stream, tokens unequal to
the reference.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import aio_pika

from shared.wire.messages import DoneReply, RequestMsg, TokenReply, decode_reply
from shared.wire.queues import REQUESTS_QUEUE

MUST_BE_ZERO = (
    "no_terminal",
    "extra_terminals",
    "error_terminals",
    "repeated_positions",
    "missing_positions",
    "out_of_order",
    "text_mismatches",
    "wrong_tokens",
    "leaked_blocks",
    "leaked_spill_entries",
)


class RawWire:
    """A client of the queue contract and nothing else: plain aio-pika, its own reply queue,
    every reply kept in arrival order."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.replies: dict[str, list[Any]] = {}
        self.changed = asyncio.Event()

    async def __aenter__(self) -> RawWire:
        self._conn = await aio_pika.connect(self.url)
        self._channel = await self._conn.channel(publisher_confirms=True)
        self._queue = await self._channel.declare_queue("", exclusive=True)
        await self._queue.consume(self._on_reply, no_ack=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._conn.close()

    async def _on_reply(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        reply = decode_reply(message.body, 1 << 20)
        self.replies.setdefault(reply.request_id, []).append(reply)
        self.changed.set()

    async def send(self, msg: RequestMsg) -> None:
        self.replies.setdefault(msg.request_id, [])
        await self._channel.default_exchange.publish(
            aio_pika.Message(
                msg.encode(),
                correlation_id=msg.request_id,
                reply_to=self._queue.name,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=REQUESTS_QUEUE,
        )

    def answered(self, rid: str) -> bool:
        return any(r.type != "token" for r in self.replies.get(rid, []))

    async def wait(self, ids: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(self.answered(rid) for rid in ids) and time.monotonic() < deadline:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        await asyncio.sleep(1.0)  # a repeat would show up now


@dataclass
class Counts:
    requests: int = 0
    answered_once: int = 0  # exactly one terminal reply, a done
    no_terminal: int = 0
    extra_terminals: int = 0
    error_terminals: int = 0
    repeated_positions: int = 0
    missing_positions: int = 0
    out_of_order: int = 0  # token replies that did not start where the stream was
    text_mismatches: int = 0
    wrong_tokens: int = 0  # done tokens unequal to the undisturbed run's
    leaked_blocks: int = 0
    leaked_spill_entries: int = 0
    tokens: int = 0

    def problems(self) -> dict[str, int]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k in MUST_BE_ZERO and v}


def judge(replies: list[Any], reference: list[int] | None, counts: Counts) -> None:
    """One request's raw replies, in arrival order, into ``counts``."""
    counts.requests += 1
    terminals = [r for r in replies if r.type != "token"]
    if not terminals:
        counts.no_terminal += 1
        return
    counts.extra_terminals += len(terminals) - 1
    done = terminals[0]
    if not isinstance(done, DoneReply):
        counts.error_terminals += 1
        return
    counts.answered_once += len(terminals) == 1
    counts.tokens += len(done.token_ids)
    seen: set[int] = set()
    position, text = 0, ""
    for r in replies:
        if not isinstance(r, TokenReply):
            continue
        span = range(r.index, r.index + len(r.token_ids))
        counts.repeated_positions += len(seen.intersection(span))
        seen.update(span)
        if r.index != position or r.text_offset != len(text):
            counts.out_of_order += 1
        position = max(position, span.stop)
        text += r.text
    counts.missing_positions += len(set(range(len(done.token_ids))) - seen)
    counts.text_mismatches += text != done.text
    counts.wrong_tokens += reference is not None and done.token_ids != reference
