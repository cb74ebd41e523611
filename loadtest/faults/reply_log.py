"""Every reply a set of requests gets, read off a raw reply queue of our own: the fault tests'
and the chaos run's view (loadtest/faults/chaos.py). The client library would drop repeats and stop
at
the first terminal reply; this log keeps them all, to check what the contract promises a raw
client: exactly one terminal reply per request, and each stream position once, in order
(``stream_gaps`` asserts it; ``judge`` counts each way it can fail, for the chaos report)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aio_pika

from shared.client.connection import connect_robust
from shared.config import BatonConfig
from shared.wire.messages import DoneReply, Reply, RequestMsg, TokenReply, decode_reply
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


class ReplyLog:
    """Requests published on a raw channel, and *every* reply they get (a client library would
    stop at the first terminal reply: this one counts them, to check there is exactly one)."""

    def __init__(self, amqp_url: str) -> None:
        self.amqp_url = amqp_url
        self.replies: dict[str, list[Reply]] = {}
        self._connection: Any = None
        self._channel: Any = None
        self._queue: Any = None
        self._changed = asyncio.Event()

    async def __aenter__(self) -> ReplyLog:
        self._connection = await connect_robust(self.amqp_url)  # a cluster: each node in turn
        self._channel = await self._connection.channel(publisher_confirms=True)
        # As the client library's: durable and not exclusive, so it outlives a broker restart.
        self._queue = await self._channel.declare_queue(
            f"baton.reply.log-{uuid.uuid4().hex}", durable=True, arguments={"x-expires": 300_000}
        )
        await self._queue.consume(self._on_reply, no_ack=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._connection.close()

    async def _on_reply(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        await message.ack()  # acked: a reply in flight when the broker restarts comes again
        reply = decode_reply(message.body, BatonConfig().max_message_bytes)
        assert message.correlation_id == reply.request_id
        got = self.replies.setdefault(reply.request_id, [])
        if message.redelivered and reply in got:  # the same message again, not a second reply
            return
        got.append(reply)
        self._changed.set()

    async def send(self, msgs: Iterable[RequestMsg]) -> list[str]:
        msgs = list(msgs)
        for m in msgs:
            self.replies.setdefault(m.request_id, [])
        await asyncio.gather(
            *(
                self._channel.default_exchange.publish(
                    aio_pika.Message(
                        m.encode(),
                        correlation_id=m.request_id,
                        reply_to=self._queue.name,
                        priority=m.priority,
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    ),
                    routing_key=REQUESTS_QUEUE,
                )
                for m in msgs
            )
        )
        return [m.request_id for m in msgs]

    def check_stream(self, request_id: str) -> DoneReply:
        """The request's one terminal reply, a ``done``; its token replies, read raw in the
        order they came (no dedup, offsets unused), cover each position once, in order, and
        add up to the done reply exactly (``stream_gaps``)."""
        terminals = self.terminals(request_id)
        assert len(terminals) == 1, (request_id, terminals)
        done = terminals[0]
        assert isinstance(done, DoneReply), done
        problem = stream_gaps(done, self.replies[request_id])
        assert problem is None, (request_id, problem)
        return done

    def num_repeated(self, request_ids: Iterable[str]) -> int:
        """Token positions received more than once (a server that replays a stream)."""
        total = 0
        for rid in request_ids:
            seen: set[int] = set()
            for r in self.replies[rid]:
                if isinstance(r, TokenReply):
                    span = set(range(r.index, r.index + len(r.token_ids)))
                    total += len(span & seen)
                    seen |= span
        return total

    def terminals(self, request_id: str) -> list[Reply]:
        return [r for r in self.replies.get(request_id, []) if r.type != "token"]

    def num_streamed(self, request_id: str) -> int:
        """Output tokens streamed so far, replays after a detokenizer crash included."""
        replies = self.replies.get(request_id, [])
        return sum(len(r.token_ids) for r in replies if isinstance(r, TokenReply))

    async def _until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Until ``done()`` holds, re-checked at each reply; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True

    async def wait(self, ids: list[str], timeout_s: float) -> None:
        """Until each request has a terminal reply; then a moment for any extra one to show."""
        if not await self._until(lambda: all(self.terminals(rid) for rid in ids), timeout_s):
            missing = [rid for rid in ids if not self.terminals(rid)]
            raise TimeoutError(f"{len(missing)} requests unanswered: {missing[:4]}")
        await asyncio.sleep(1.0)

    async def reference_tokens(
        self, msgs: Iterable[RequestMsg], timeout_s: float
    ) -> list[list[int]]:
        """Send ``msgs`` and wait for their answers: each one's tokens (``check_stream``), the
        undisturbed run that a disturbed one's answers are compared with."""
        ids = await self.send(msgs)
        await self.wait(ids, timeout_s)
        return [self.check_stream(rid).token_ids for rid in ids]

    async def until_unanswered(self, ids: list[str], at_most: int, timeout_s: float) -> None:
        """Until at most ``at_most`` of ``ids`` lack a terminal reply, or ``timeout_s`` passes."""
        await self._until(lambda: sum(not self.terminals(r) for r in ids) <= at_most, timeout_s)

    async def wait_streaming(self, ids: list[str], min_tokens: int, timeout_s: float) -> None:
        """Until some of ``ids`` has streamed ``min_tokens`` (generation is under way)."""
        deadline = time.monotonic() + timeout_s
        while max(self.num_streamed(rid) for rid in ids) < min_tokens:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request streamed {min_tokens} tokens in {timeout_s}s")
            await asyncio.sleep(0.01)


def stream_gaps(done: DoneReply, replies: list[Reply]) -> str | None:
    """Why the token replies, taken raw in arrival order, are not the done reply's stream:
    each must start at the position and text offset where the previous one ended."""
    position, offset = 0, 0
    for r in replies:
        if not isinstance(r, TokenReply):
            continue
        if r.index != position or r.text_offset not in (None, offset):
            return f"reply at {r.index}/{r.text_offset}, expected {position}/{offset}"
        if r.token_ids != done.token_ids[position : position + len(r.token_ids)]:
            return f"tokens at {position} differ from the done reply's"
        if r.text != done.text[offset : offset + len(r.text)]:
            return f"text at {offset} differs from the done reply's"
        position, offset = position + len(r.token_ids), offset + len(r.text)
    want = (len(done.token_ids), len(done.text))
    if (position, offset) != want:
        return f"stream ends at {position}/{offset}, the done reply at {want[0]}/{want[1]}"
    return None


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


class TimedReplies(ReplyLog):
    """A reply log that also notes when each request was sent, first answered and finished."""

    def __init__(self, amqp_url: str) -> None:
        super().__init__(amqp_url)
        self.sent: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}

    async def _on_reply(self, message: Any) -> None:
        now = time.monotonic()
        reply = decode_reply(message.body, BatonConfig().max_message_bytes)
        self.first.setdefault(reply.request_id, now)
        if reply.type != "token":
            self.last.setdefault(reply.request_id, now)
        await super()._on_reply(message)

    async def send(self, msgs: Any) -> list[str]:
        msgs = list(msgs)
        now = time.monotonic()
        for m in msgs:
            self.sent[m.request_id] = now
        return await super().send(msgs)

    def ttft(self, request_id: str) -> float:
        return self.first[request_id] - self.sent[request_id]

    def e2e(self, request_id: str) -> float:
        return self.last[request_id] - self.sent[request_id]

    async def one(self, msg: RequestMsg, timeout_s: float = 60.0) -> str:
        """Send ``msg`` and wait for its terminal reply."""
        [rid] = await self.send([msg])
        deadline = time.monotonic() + timeout_s
        while not self.terminals(rid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{rid} unanswered after {timeout_s} s")
            await asyncio.sleep(0.002)
        return rid
