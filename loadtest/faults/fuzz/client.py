"""Client cases against a live Baton: publish with bounded concurrency, collect every reply,
check each case (``checks``), and after each batch check the dead-letter queue and that a
known-good request is still served.

Replies are collected on raw aio-pika, not ``shared.client``: the client library deduplicates
and stops at the first terminal reply, and this must see exactly what the services sent.
A case with no correlation id gets a reply queue of its own: an unparseable body without one is
answered with no way to tell which case it was.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection

from loadtest.faults.fuzz.cases import Case
from loadtest.faults.fuzz.checks import check_case, outcome
from shared.wire.errors import ProtocolError
from shared.wire.messages import unpack
from shared.wire.queues import DEAD_LETTER_QUEUE, PREFILL_QUEUE, REQUESTS_QUEUE

NO_REPLY_TO_LOG = "request without reply_to dead-lettered"
DEAD_WAIT_S = 15.0
GRACE_S = 0.5  # after a batch: time for a reply that should not come (a second terminal)


@dataclass
class Report:
    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)


@dataclass
class _Track:
    case: Case
    replies: list[tuple[str | None, dict[str, Any]]] = field(default_factory=list)
    terminal: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, correlation_id: str | None, reply: dict[str, Any]) -> None:
        self.replies.append((correlation_id, reply))
        if reply.get("type") in ("done", "error"):
            self.terminal.set()


class ClientFuzzer:
    def __init__(
        self,
        url: str,
        *,
        concurrency: int = 32,
        timeout_s: float = 60.0,
        read_log: Callable[[], str] | None = None,
    ) -> None:
        self.url = url
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.read_log = read_log
        self.report = Report()
        self._tracks: dict[str, _Track] = {}
        self._by_key: dict[str, _Track] = {}
        self._dead_expected = 0
        self._dead_base = 0
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._reply_queue = ""

    async def __aenter__(self) -> ClientFuzzer:
        self._connection = await aio_pika.connect_robust(self.url)
        self._channel = await self._connection.channel(publisher_confirms=True)
        queue = await self._channel.declare_queue("", exclusive=True, auto_delete=True)
        await queue.consume(self._on_reply, no_ack=True)
        self._reply_queue = queue.name
        self._dead_base = await dead_count(self._channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._connection is not None:
            await self._connection.close()

    @property
    def connection(self) -> AbstractRobustConnection:
        assert self._connection is not None, "use as an async context manager"
        return self._connection

    @property
    def channel(self) -> AbstractChannel:
        assert self._channel is not None, "use as an async context manager"
        return self._channel

    async def run_batch(self, cases: list[Case], canary: Case) -> bool:
        """Run ``cases``, judge them, then the canary; False if the canary was not served."""
        gate = asyncio.Semaphore(self.concurrency)
        batch = [self._track(c) for c in cases]
        await asyncio.gather(*(self._run(t, gate) for t in batch))
        await asyncio.sleep(GRACE_S)
        for track in batch:
            self._judge(track)
        await self._check_dead([t.case for t in batch if t.case.reply == "none"])
        return await self.check_canary(canary)

    async def check_canary(self, canary: Case) -> bool:
        """The known-good request: exactly 4 tokens, ``length``. True if it was served."""
        track = self._track(canary)
        await self._run(track, asyncio.Semaphore(1))
        await asyncio.sleep(GRACE_S)
        problems = check_case(canary, track.replies) if track.terminal.is_set() else []
        if not track.terminal.is_set():
            problems = [f"no terminal reply within {self.timeout_s:.0f}s"]
        elif outcome(track.replies[-1][1]) != "done/length":
            problems.append(f"canary not served: {track.replies[-1][1]!r:.300}")
        for p in problems:
            self.report.violations.append(f"canary {canary.case_id}: {p}")
        return not problems

    def _track(self, case: Case) -> _Track:
        track = _Track(case)
        self._tracks[case.case_id] = track
        for key in {case.correlation_id, case.request_id} - {None}:
            self._by_key[key] = track  # type: ignore[index]
        return track

    async def _run(self, track: _Track, gate: asyncio.Semaphore) -> None:
        case = track.case
        async with gate:
            reply_to: str | None = self._reply_queue
            if case.reply == "none":
                reply_to = None
            elif case.reply == "internal":  # its replies are dead-lettered there, unread
                reply_to = PREFILL_QUEUE
            elif case.correlation_id is None:
                reply_to = await self._solo_queue(track)
            message = aio_pika.Message(
                case.body,
                correlation_id=case.correlation_id,
                reply_to=reply_to,
                priority=case.header_priority,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            try:
                await self.channel.default_exchange.publish(message, routing_key=REQUESTS_QUEUE)
            except Exception as exc:
                self.report.violations.append(f"{case.describe()}: publish failed: {exc!r}")
                return
            if case.reply != "own":
                return
            try:
                await asyncio.wait_for(track.terminal.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                pass  # judged as "no terminal reply"

    async def _solo_queue(self, track: _Track) -> str:
        queue = await self.channel.declare_queue("", exclusive=True, auto_delete=True)

        async def on_reply(message: AbstractIncomingMessage) -> None:
            reply = self._decode(message)
            if reply is not None:
                track.add(message.correlation_id, reply)

        await queue.consume(on_reply, no_ack=True)
        return queue.name

    def _decode(self, message: AbstractIncomingMessage) -> dict[str, Any] | None:
        try:
            reply = unpack(message.body, 64 << 20)
        except ProtocolError:
            reply = None
        if not isinstance(reply, dict):
            self.report.violations.append(f"reply is not a msgpack map: {message.body[:120]!r}")
            return None
        return reply

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        reply = self._decode(message)
        if reply is None:
            return
        corr, rid = message.correlation_id, reply.get("request_id")
        track = self._by_key.get(corr) if corr else None
        if track is None and isinstance(rid, str):
            track = self._by_key.get(rid)
        if track is None:
            self.report.violations.append(f"reply for no case (correlation_id {corr!r}): {reply}")
            return
        track.add(corr, reply)

    def _judge(self, track: _Track) -> None:
        case, report = track.case, self.report
        report.cases += 1
        if case.reply == "none":
            report.outcomes["dead-lettered (no reply_to)"] += 1
            return
        if case.reply == "internal":
            report.outcomes["unobserved (reply_to an internal queue)"] += 1
            return
        if not track.terminal.is_set():
            report.outcomes["no reply"] += 1
            report.violations.append(
                f"{case.describe()}: no terminal reply within {self.timeout_s:.0f}s"
            )
            return
        terminal = next(r for _, r in track.replies if r.get("type") in ("done", "error"))
        report.outcomes[outcome(terminal)] += 1
        for problem in check_case(case, track.replies):
            report.violations.append(f"{case.describe()}: {problem} (reply {terminal!r:.300})")

    async def _check_dead(self, unanswerable: list[Case]) -> None:
        """Requests without reply_to must reach baton.dead, each with a log line."""
        if not unanswerable:
            return
        self._dead_expected += len(unanswerable)
        want = self._dead_base + self._dead_expected
        deadline = time.monotonic() + DEAD_WAIT_S
        while (have := await dead_count(self.channel)) < want and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if have < want:
            cases = "; ".join(c.describe(80) for c in unanswerable)
            self.report.violations.append(
                f"{DEAD_LETTER_QUEUE} holds {have - self._dead_base} messages, "
                f"expected at least {self._dead_expected} (requests without reply_to: {cases})"
            )
        if self.read_log is not None:
            logged = self.read_log().count(NO_REPLY_TO_LOG)
            if logged < self._dead_expected:
                self.report.violations.append(
                    f"{logged} '{NO_REPLY_TO_LOG}' log lines for {self._dead_expected} requests"
                )


async def dead_count(channel: AbstractChannel) -> int:
    # On aiormq's channel: aio-pika's channel answers a repeated declare from its cache.
    raw = await channel.get_underlay_channel()
    declared = await raw.queue_declare(DEAD_LETTER_QUEUE, passive=True)
    return int(declared.message_count or 0)
