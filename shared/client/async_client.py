"""Async client for Baton's request queue (the contract: docs/contract.md), on aio-pika.

One robust connection, one confirming channel and ONE durable reply queue per client; a single
consumer routes replies by ``correlation_id`` to per-request asyncio queues, so any number of
requests stream concurrently. Direct reply-to is not used: it is at-most-once and unfit for
streams.

Decisions:
- Requests are published persistent, ``mandatory`` and confirmed: a return means nothing is bound
  to ``baton.requests`` (Baton not running on this vhost) and raises :class:`BatonUnavailable`
  instead of the message vanishing. The client never declares ``baton.requests`` (the services
  own its arguments; a mismatched declare is a channel error).
- The reply queue outlives a connection and a broker restart: durable, not exclusive, with an
  unguessable name, deleted by the broker once unused for ``REPLY_QUEUE_EXPIRES_S`` (the
  services publish replies persistent). After a reconnect the robust connection consumes it again
  and the requests in flight go on; only if the connection is not back within
  ``RECONNECT_GRACE_S`` do they fail with :class:`BatonConnectionLost`.
- Replies are at least once (a republished reply, a detokenizer replaying after a crash): token
  replies are cut to what is new by position and text offset (``dedup.py``), and a terminal
  reply after the first is dropped, so a caller sees each position once and one terminal reply.
  With ``n`` > 1 the same holds per choice (``choice_index``): a stream ends after one ``done``
  per choice, or at the request's ``error``.
- Every wait is bounded (``wait_s``, else the client's ``default_wait_s``). A stream abandoned
  before its terminal reply (timeout, ``break``, task cancelled) publishes a best-effort cancel so
  the server stops generating for nobody.
- Each reply is timestamped on arrival (``time.perf_counter``) in the consumer callback, not when
  the caller gets round to reading it, so TTFT/ITL are the client's true view.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import aio_pika
import structlog
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)

from shared.client.connection import connect_robust, url_username
from shared.client.dedup import StreamDeduplicator
from shared.config import DEFAULT_AMQP_URL, BatonConfig
from shared.wire.messages import (
    ControlMsg,
    DoneReply,
    ErrorReply,
    ProtocolError,
    Reply,
    RequestMsg,
    SamplingParams,
    TokenReply,
    decode_replies,
)
from shared.wire.queues import CONTROL_EXCHANGE, REQUESTS_QUEUE
from shared.wire.sampling import DEFAULT_MAX_TOKENS

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "BatonClient",
    "BatonUnavailable",
    "BatonConnectionLost",
    "TimedReply",
    "Completion",
    "Terminal",
    "RequestOptions",
    "default_amqp_url",
]

log = structlog.get_logger(__name__)

Terminal = DoneReply | ErrorReply
DEFAULT_WAIT_S = 600.0
REPLY_QUEUE_EXPIRES_S = 300.0
RECONNECT_GRACE_S = 30.0
# Replies are acked together, one ``multiple`` ack for those received within this window: a
# stream of replies costs the client and the broker one ack frame per window, not per reply.
# (No prefetch limit on the reply queue, so a later ack never holds deliveries back.)
ACK_WINDOW_S = 0.005


def default_amqp_url() -> str:
    return os.environ.get("BATON_AMQP_URL") or DEFAULT_AMQP_URL


def default_max_reply_bytes() -> int:
    raw = os.environ.get("BATON_MAX_MESSAGE_BYTES")
    return int(raw) if raw else BatonConfig.max_message_bytes


class BatonUnavailable(ConnectionError):
    """Nothing is bound to ``baton.requests``: Baton is not running on this broker/vhost."""


class BatonConnectionLost(ConnectionError):
    """The broker connection dropped while a request was in flight; its replies are lost."""


class RequestOptions(TypedDict, total=False):
    """Keyword arguments of :meth:`BatonClient.stream_timed` (and stream/generate/complete)."""

    messages: Sequence[dict[str, str]] | None
    prompt_token_ids: Sequence[int] | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: Sequence[str] | None
    ignore_eos: bool
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    stop_token_ids: Sequence[int] | None
    include_stop_str_in_output: bool
    logprobs: int | None
    prompt_logprobs: int | None
    n: int
    priority: int | None
    timeout_s: float | None
    request_id: str | None
    stream: bool
    wait_s: float | None


@dataclass(frozen=True)
class TimedReply:
    reply: Reply
    received_at: float  # time.perf_counter() when the consumer received it
    elapsed_s: float  # seconds since the request was published


@dataclass
class Completion:
    """A request's replies folded together, with client-side latencies (seconds)."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    terminal: Terminal | None = None
    ttft_s: float | None = None  # first token reply; None without one (non-streamed)
    e2e_s: float | None = None  # terminal reply
    itl_s: list[float] = field(default_factory=list)  # gaps between successive token replies
    _last_token_s: float | None = field(default=None, repr=False)

    def add(self, t: TimedReply) -> None:
        r = t.reply
        if isinstance(r, TokenReply):
            self.text += r.text
            self.token_ids.extend(r.token_ids)
            if self._last_token_s is None:
                self.ttft_s = t.elapsed_s
            else:
                self.itl_s.append(t.elapsed_s - self._last_token_s)
            self._last_token_s = t.elapsed_s
            return
        self.terminal = r
        self.e2e_s = t.elapsed_s
        if isinstance(r, DoneReply):  # the done reply is authoritative for the full output
            self.text, self.token_ids = r.text, list(r.token_ids)

    @property
    def ok(self) -> bool:
        return isinstance(self.terminal, DoneReply)

    @property
    def finish_reason(self) -> str | None:
        return self.terminal.finish_reason if isinstance(self.terminal, DoneReply) else None

    @property
    def error(self) -> ErrorReply | None:
        return self.terminal if isinstance(self.terminal, ErrorReply) else None

    @property
    def num_output_tokens(self) -> int:
        if isinstance(self.terminal, DoneReply):
            return int(self.terminal.usage.get("completion_tokens", len(self.token_ids)))
        return len(self.token_ids)

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (n - 1): time per output token after the first."""
        n = self.num_output_tokens
        if self.ttft_s is None or self.e2e_s is None or n < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)


@dataclass
class _Pending:
    queue: asyncio.Queue[TimedReply | BaseException]
    sent_at: float = 0.0
    n: int = 1  # choices: a done reply each
    streams: dict[int, StreamDeduplicator] = field(default_factory=dict)  # by choice
    done: set[int] = field(default_factory=set)  # choices whose done reply arrived
    answered: bool = False  # every done reply (or the error) arrived; later ones are duplicates


class BatonClient:
    """Use ``async with await BatonClient.connect() as client:`` (or call :meth:`close`)."""

    def __init__(
        self,
        connection: AbstractRobustConnection,
        channel: AbstractChannel,
        reply_queue: AbstractQueue,
        control: AbstractExchange,
        default_wait_s: float,
    ) -> None:
        self._connection = connection
        self._channel = channel
        self._reply_queue = reply_queue
        self._control = control
        self.default_wait_s = default_wait_s
        self._pending: dict[str, _Pending] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._lost_timer: asyncio.TimerHandle | None = None
        self._unacked: AbstractIncomingMessage | None = None  # the latest reply not acked yet
        # Anyone who may publish to the default exchange reaches a reply queue whose name they
        # know: a reply is bounded like every other message (BATON_MAX_MESSAGE_BYTES).
        self.max_reply_bytes = default_max_reply_bytes()
        self._consumer_tag: str | None = None
        # Stamped on requests and cancels (RabbitMQ checks it is the connection's user): with
        # per-role users a request is cancelled only by the user that published it.
        self.user_id: str | None = None

    @classmethod
    async def connect(
        cls, url: str | None = None, *, default_wait_s: float = DEFAULT_WAIT_S
    ) -> BatonClient:
        url = url or default_amqp_url()
        try:
            connection = await connect_robust(  # every address of a cluster in turn
                url, client_properties={"connection_name": "baton-client"}
            )
        except (ConnectionError, OSError, aio_pika.exceptions.AMQPConnectionError) as exc:
            raise BatonUnavailable(f"cannot reach RabbitMQ at {_safe(url)}: {exc}") from exc
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        reply_queue = await channel.declare_queue(
            f"baton.reply.{uuid.uuid4().hex}",
            durable=True,
            arguments={"x-expires": int(REPLY_QUEUE_EXPIRES_S * 1000)},
        )
        # Same declaration as services/shell/broker.py (durable fanout), so this is idempotent.
        control = await channel.declare_exchange(
            CONTROL_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
        )
        client = cls(connection, channel, reply_queue, control, default_wait_s)
        client.user_id = url_username(url)
        # Replies are acked once routed (together, per ACK_WINDOW_S): a reply the broker sent
        # while the connection was dying comes again after the reconnect (and is dropped as a
        # duplicate) instead of being lost.
        client._consumer_tag = await reply_queue.consume(client._on_reply, no_ack=False)
        connection.close_callbacks.add(client._on_connection_lost)
        connection.reconnect_callbacks.add(client._on_reconnected)
        return client

    async def __aenter__(self) -> BatonClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._connection.close_callbacks.discard(self._on_connection_lost)
        self._connection.reconnect_callbacks.discard(self._on_reconnected)
        if self._lost_timer is not None:
            self._lost_timer.cancel()
        with contextlib.suppress(Exception):  # gone already: the broker expires it anyway
            if self._consumer_tag is not None:  # ours first: the broker would cancel it loudly
                await self._reply_queue.cancel(self._consumer_tag)
            await self._reply_queue.delete(if_unused=False, if_empty=False)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._connection.close()

    @property
    def reply_queue_name(self) -> str:
        return self._reply_queue.name

    # --- requests ---------------------------------------------------------------------------

    async def stream_timed(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict[str, str]] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        ignore_eos: bool = False,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        include_stop_str_in_output: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        n: int = 1,
        priority: int | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
        stream: bool = True,
        wait_s: float | None = None,
    ) -> AsyncGenerator[TimedReply, None]:
        """Token replies, then exactly one terminal (done/error) reply, each with its timing.
        The sampling arguments are the contract's request fields (docs/contract.md). With
        ``n`` > 1: each choice's token replies and one done reply per choice (``choice_index``),
        in the order they come; an error reply ends them all.

        Raises ``asyncio.TimeoutError`` if the terminal reply has not arrived within ``wait_s``."""
        chat = None if messages is None else tuple((m["role"], m["content"]) for m in messages)
        msg = RequestMsg(
            request_id=request_id or uuid.uuid4().hex,
            sampling=SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                ignore_eos=ignore_eos,
                min_p=min_p,
                repetition_penalty=repetition_penalty,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                min_tokens=min_tokens,
                stop_token_ids=tuple(stop_token_ids or ()),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                n=n,
            ),
            prompt=prompt,
            messages=chat,
            prompt_token_ids=None if prompt_token_ids is None else tuple(prompt_token_ids),
            stop=tuple(stop or ()),
            stream=stream,
            priority=priority or 0,
            timeout_s=timeout_s,
            # The reply queue is this client's alone: several requests' replies may come in one
            # message (fewer broker messages when many requests stream at once).
            batch_replies=True,
            include_stop_str_in_output=include_stop_str_in_output,
        )
        pending = await self._send(msg.encode(), msg.request_id, True, priority, n)
        async with aclosing(self._replies(msg.request_id, pending, wait_s)) as replies:
            async for t in replies:
                yield t

    async def stream(
        self, prompt: str | None = None, **kwargs: Unpack[RequestOptions]
    ) -> AsyncGenerator[Reply, None]:
        """Like :meth:`stream_timed` (same arguments), without the timestamps."""
        async with aclosing(self.stream_timed(prompt, **kwargs)) as replies:
            async for t in replies:
                yield t.reply

    async def generate(
        self, prompt: str | None = None, **kwargs: Unpack[RequestOptions]
    ) -> Terminal:
        """The terminal reply only (``stream=False`` unless given). An error reply is returned,
        not raised: inspect ``.type`` / use :class:`Completion`. One choice (``n`` > 1:
        :meth:`generate_choices`)."""
        _one_choice(kwargs)
        kwargs.setdefault("stream", False)
        async with aclosing(self.stream_timed(prompt, **kwargs)) as replies:
            async for t in replies:
                if not isinstance(t.reply, TokenReply):
                    return t.reply
        raise AssertionError("unreachable: the reply iterator ends on a terminal reply")

    async def generate_choices(
        self, prompt: str | None = None, **kwargs: Unpack[RequestOptions]
    ) -> list[Terminal]:
        """The done reply of each of the request's ``n`` choices, by ``choice_index``
        (``stream=False`` unless given); ``[error]`` if the request failed."""
        kwargs.setdefault("stream", False)
        n = kwargs.get("n", 1)
        dones: dict[int, Terminal] = {}
        async with aclosing(self.stream_timed(prompt, **kwargs)) as replies:
            async for t in replies:
                if isinstance(t.reply, ErrorReply):
                    return [t.reply]
                if isinstance(t.reply, DoneReply):
                    dones[t.reply.choice_index or 0] = t.reply
        return [dones[i] for i in range(n)]

    async def complete(
        self, prompt: str | None = None, **kwargs: Unpack[RequestOptions]
    ) -> Completion:
        """Stream a request and fold it into a :class:`Completion` (client-side TTFT/ITL/TPOT).
        One choice."""
        _one_choice(kwargs)
        completion: Completion | None = None
        async for t in self.stream_timed(prompt, **kwargs):
            if completion is None:
                completion = Completion(t.reply.request_id)
            completion.add(t)
        assert completion is not None
        return completion

    async def cancel(self, request_id: str) -> None:
        await self._control.publish(
            aio_pika.Message(ControlMsg("cancel", request_id).encode(), user_id=self.user_id),
            routing_key="",
        )

    # --- raw access (tests) -----------------------------------------------------------------

    async def send_raw(
        self,
        body: bytes,
        *,
        request_id: str,
        reply_to: bool = True,
        priority: int | None = None,
        wait_s: float | None = None,
    ) -> asyncio.Task[Terminal]:
        """Publish ``body`` as-is (``correlation_id=request_id``; no ``reply_to`` when False).

        Returns a task resolving to the terminal reply (TimeoutError after ``wait_s``)."""
        await self._send(body, request_id, reply_to, priority)
        return asyncio.create_task(self.wait_terminal(request_id, wait_s))

    async def wait_terminal(self, request_id: str, timeout: float | None = None) -> Terminal:
        """Skip token replies of a request already sent; return its terminal reply."""
        pending = self._pending.get(request_id)
        if pending is None:
            raise KeyError(f"no request {request_id!r} in flight on this client")
        async with aclosing(self._replies(request_id, pending, timeout)) as replies:
            async for t in replies:
                if not isinstance(t.reply, TokenReply):
                    return t.reply
        raise AssertionError("unreachable: the reply iterator ends on a terminal reply")

    # --- internals --------------------------------------------------------------------------

    async def _send(
        self, body: bytes, request_id: str, reply_to: bool, priority: int | None, n: int = 1
    ) -> _Pending:
        if request_id in self._pending:
            raise ValueError(f"request_id {request_id!r} is already in flight on this client")
        pending = _Pending(asyncio.Queue(), n=n)
        self._pending[request_id] = pending  # before publishing: a reply can beat the confirm
        message = aio_pika.Message(
            body,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            correlation_id=request_id,
            reply_to=self._reply_queue.name if reply_to else None,
            priority=priority,
            content_type="application/msgpack",
            user_id=self.user_id,
        )
        pending.sent_at = time.perf_counter()
        try:
            await self._channel.default_exchange.publish(
                message, routing_key=REQUESTS_QUEUE, mandatory=True
            )
        except aio_pika.exceptions.PublishError:
            self._pending.pop(request_id, None)
            raise BatonUnavailable(
                f"no queue {REQUESTS_QUEUE!r} on {_safe(str(self._connection))}: "
                "is Baton running? (start it with `python -m services up`)"
            ) from None
        except BaseException:
            self._pending.pop(request_id, None)
            raise
        return pending

    async def _replies(
        self, request_id: str, pending: _Pending, wait_s: float | None
    ) -> AsyncGenerator[TimedReply, None]:
        loop = asyncio.get_running_loop()
        budget = self.default_wait_s if wait_s is None else wait_s
        deadline = loop.time() + budget
        finished = False
        num_done = 0
        try:
            while True:
                remaining = deadline - loop.time()
                try:
                    if remaining <= 0:
                        raise asyncio.TimeoutError
                    item = await asyncio.wait_for(pending.queue.get(), remaining)
                except asyncio.TimeoutError:
                    raise asyncio.TimeoutError(
                        f"no terminal reply for {request_id!r} within {budget}s"
                    ) from None
                if isinstance(item, BaseException):
                    finished = True  # the connection is gone; a cancel could not be sent
                    raise item
                num_done += isinstance(item.reply, DoneReply)
                finished = isinstance(item.reply, ErrorReply) or num_done >= pending.n
                yield item
                if finished:
                    return
        finally:
            self._pending.pop(request_id, None)
            if not finished:
                self._cancel_in_background(request_id)

    def _cancel_in_background(self, request_id: str) -> None:
        async def cancel() -> None:
            try:
                await self.cancel(request_id)
            except Exception as exc:  # best effort: the server's own timeout still applies
                log.warning("cancel not sent", request_id=request_id, error=str(exc))

        task = asyncio.get_running_loop().create_task(cancel())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        received_at = time.perf_counter()
        if self._unacked is None:
            asyncio.get_running_loop().call_later(ACK_WINDOW_S, self._ack_received)
        self._unacked = message
        rid = message.correlation_id  # unset on a batch: each reply in it names its request
        try:
            replies = decode_replies(message.body, self.max_reply_bytes)
        except ProtocolError as exc:
            pending = self._pending.get(rid) if rid else None
            if pending is not None:
                pending.queue.put_nowait(exc)
            else:
                log.warning("unreadable reply dropped", correlation_id=rid, error=exc.message)
            return
        for reply in replies:
            # A lone reply is routed by its correlation_id, which is the request's even when
            # the body could only name another (an unreadable request's error reply).
            self._route(rid if rid and len(replies) == 1 else reply.request_id, reply, received_at)

    def _route(self, rid: str, reply: Reply, received_at: float) -> None:
        pending = self._pending.get(rid)
        if pending is None:
            log.debug("reply for no request in flight dropped", request_id=rid)
            return
        if pending.answered:
            log.debug("duplicate reply after the terminal one dropped", request_id=rid)
            return
        index = 0 if isinstance(reply, ErrorReply) else reply.choice_index or 0
        if isinstance(reply, TokenReply):
            if index in pending.done:
                return
            stream = pending.streams.get(index)
            if stream is None:
                stream = pending.streams[index] = StreamDeduplicator()
            fresh = stream.accept(reply)  # a replayed stream: keep only what is new
            if fresh is None:
                return
            reply = fresh
        elif isinstance(reply, DoneReply):
            if index in pending.done:
                log.debug("duplicate done reply dropped", request_id=rid, choice_index=index)
                return
            pending.done.add(index)
            pending.answered = len(pending.done) >= pending.n
        else:
            pending.answered = True
        pending.queue.put_nowait(TimedReply(reply, received_at, received_at - pending.sent_at))

    def _ack_received(self) -> None:
        """Ack every reply received so far (the latest, ``multiple``). A channel that died
        meanwhile fails the ack: the broker redelivers those replies, and they are dropped as
        duplicates."""
        message, self._unacked = self._unacked, None
        if message is None:
            return

        async def ack() -> None:
            with contextlib.suppress(Exception):
                await message.ack(multiple=True)

        task = asyncio.get_running_loop().create_task(ack())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_connection_lost(self, _conn: object, exc: BaseException | None = None) -> None:
        log.warning("broker connection lost", in_flight=len(self._pending), error=str(exc))
        if self._lost_timer is None:
            loop = asyncio.get_running_loop()
            self._lost_timer = loop.call_later(RECONNECT_GRACE_S, self._fail_in_flight, exc)

    def _on_reconnected(self, _conn: object) -> None:
        log.info("broker connection restored", in_flight=len(self._pending))
        if self._lost_timer is not None:
            self._lost_timer.cancel()
            self._lost_timer = None

    def _fail_in_flight(self, exc: BaseException | None) -> None:
        self._lost_timer = None
        if not self._pending:
            return
        lost = BatonConnectionLost(f"broker connection lost for {RECONNECT_GRACE_S}s: {exc}")
        for pending in self._pending.values():
            pending.queue.put_nowait(lost)


def _one_choice(kwargs: RequestOptions) -> None:
    if kwargs.get("n", 1) != 1:
        raise ValueError("n > 1 has one done reply per choice: use generate_choices or stream")


def _safe(urls: str) -> str:
    """The URL(s) without their password, for error messages."""
    return ",".join(_safe_one(url) for url in urls.split(","))


def _safe_one(url: str) -> str:
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    return f"{scheme}://{creds.split(':', 1)[0]}:******@{host}"
