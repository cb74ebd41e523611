"""One completion request's life: publish, wait, answer (JSON or SSE), or cancel on disconnect.

:class:`Exchange` is the ASGI response of a /v1 completion route. It runs two tasks side by side:
the work (publish through :class:`BatonClient`, turn replies into bytes) and a watch on the
connection (ASGI ``http.disconnect``). Whichever ends first decides: if the client left, the work
is cancelled, which closes the client library's reply stream, and closing a stream before its
terminal reply is what makes the library publish ``cancel`` to ``baton.control`` (it tracks that
publish and :meth:`BatonClient.close` waits for it), so Baton stops generating for nobody.
Watching the connection, rather than waiting for a write to fail, also catches a client that
leaves while its request is still queued and nothing has been written yet.

Invariant: the status line is sent only once the first reply is in. An error Baton answers
before any token (bad field, prompt too long, overloaded, timeout) is a real HTTP error status,
never a ``200`` stream holding an error; only an error after the first token travels in-stream.

A request with ``n`` > 1 is answered once every choice's done reply is in (not streamed), or
streams every choice's chunks as they come and ends after the last choice's finish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import structlog
from starlette.types import Receive, Scope, Send

from services.gateway.api_requests import BatonRequest
from services.gateway.api_responses import SSE_HEADERS, Formatter, dumps
from services.gateway.errors import ApiError, from_error_reply, from_exception, internal
from services.gateway.metrics import GatewayMetrics, route_label
from shared.client import BatonClient, TimedReply
from shared.wire.messages import DoneReply, ErrorReply, TokenReply

log = structlog.get_logger(__name__)

# How much longer than a request's own timeout_s the gateway waits for the terminal reply. Baton
# answers a passed deadline itself; this only bounds a wait for a reply that never comes.
WAIT_MARGIN_S = 30.0
STATUS_CLIENT_GONE = 499
SCOPE_T0 = "baton.t0"  # perf_counter() at arrival, set by the metrics middleware
SCOPE_STATUS = "baton.status"  # the status to count when it differs from the one sent


async def send_json(
    send: Send, status: int, obj: Any, request_id: str | None = None,
    headers: dict[str, str] | None = None,
) -> None:  # fmt: skip
    body = dumps(obj)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if request_id:
        raw.append((b"x-request-id", request_id.encode()))
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, err: ApiError, request_id: str | None = None) -> None:
    await send_json(send, err.status, err.body(), request_id, err.headers)


class Exchange:
    def __init__(
        self,
        client: BatonClient,
        request: BatonRequest,
        request_id: str,
        metrics: GatewayMetrics,
    ) -> None:
        self.client = client
        self.request = request
        self.request_id = request_id
        self.metrics = metrics
        self.fmt = Formatter(
            request_id,
            request.model,
            request.chat,
            request.include_usage,
            request.options,
            request.echo_text or "",
        )
        self.log = log.bind(request_id=request_id)
        self._terminal_seen = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with structlog.contextvars.bound_contextvars(request_id=self.request_id):
            work = asyncio.ensure_future(self._work(scope, send))
            watch = asyncio.ensure_future(_disconnected(receive))
            try:
                await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
            finally:
                # Also on our own cancellation (server shutdown): the work is cancelled like a
                # disconnect, so its reply stream is closed and Baton told to stop.
                watch.cancel()
                left_first = not work.done()
                if left_first:
                    work.cancel()
                await asyncio.gather(work, watch, return_exceptions=True)
            # Servers of ASGI spec 2.4 and later raise OSError on a write to a closed connection
            # (uvicorn drops the write): the same departure, seen from the other side. Baton
            # failures never escape the work as exceptions; they become responses.
            failed = None if work.cancelled() else work.exception()
            if not (left_first or isinstance(failed, OSError)):
                work.result()
                return
            scope[SCOPE_STATUS] = STATUS_CLIENT_GONE
            if not self._terminal_seen:  # else the answer was whole; only its last bytes lost
                self.metrics.client_disconnects.labels(route_label(scope["path"])).inc()
                self.log.info("request cancelled by client disconnect")

    async def _work(self, scope: Scope, send: Send) -> None:
        req = self.request
        timeout = req.timeout_s
        wait_s = None if timeout is None else max(timeout, 0.0) + WAIT_MARGIN_S
        replies = self.metrics.timed(
            self.client.stream_timed(
                **req.baton, request_id=self.request_id, stream=req.stream, wait_s=wait_s
            ),
            scope.get(SCOPE_T0),
            req.baton.get("max_tokens"),
            req.n,
        )
        async with aclosing(replies):
            try:
                first = await anext(replies)
            except Exception as exc:
                await send_error(send, self._error_for(exc), self.request_id)
                return
            if isinstance(first.reply, ErrorReply):
                self._terminal_seen = True
                err = from_error_reply(first.reply)
                self.log.info("request refused", code=first.reply.code, status=err.status,
                              reason=first.reply.message)  # fmt: skip
                await send_error(send, err, self.request_id)
                self._observe_overhead(scope, first)
                return
            if req.stream:
                await self._stream(scope, send, first, replies)
            else:
                await self._complete(scope, send, first, replies)

    async def _complete(
        self, scope: Scope, send: Send, first: TimedReply, rest: AsyncGenerator[TimedReply, None]
    ) -> None:
        """One response once every choice is done (stream=False sends no token replies;
        tolerated anyway)."""
        n, dones = self.request.n, dict[int, DoneReply]()
        reply = first.reply
        while True:
            if isinstance(reply, ErrorReply):
                self._terminal_seen = True
                await send_error(send, from_error_reply(reply), self.request_id)
                return
            if isinstance(reply, DoneReply):
                dones[reply.choice_index or 0] = reply
                self.log.debug("choice done", finish_reason=reply.finish_reason,
                               choice_index=reply.choice_index or 0, **reply.usage)  # fmt: skip
                if len(dones) == n:
                    break
            try:
                reply = (await anext(rest)).reply
            except Exception as exc:  # lost broker, no reply in time: say why
                self._terminal_seen = True
                await send_error(send, self._error_for(exc), self.request_id)
                return
        self._terminal_seen = True
        response = self.fmt.completion([dones[i] for i in range(n)])
        await send_json(send, 200, response, self.request_id)
        self._observe_overhead(scope, first)

    async def _stream(
        self, scope: Scope, send: Send, first: TimedReply, rest: AsyncGenerator[TimedReply, None]
    ) -> None:
        headers = [(k.encode(), v.encode()) for k, v in SSE_HEADERS.items()]
        headers.append((b"x-request-id", self.request_id.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        n, fmt = self.request.n, self.fmt
        sent = [""] * n  # each choice's text so far
        sent_tokens = [0] * n  # and its tokens (whose logprobs went with them)
        dones: dict[int, DoneReply] = {}
        pending = [fmt.chunk(role=True, index=i) for i in range(n)] if fmt.chat else []
        options = fmt.options
        echo = options.echo  # the prompt goes first, scored with the stream's first reply's
        t: TimedReply | None = first
        while t is not None:
            reply = t.reply
            if echo and not isinstance(reply, ErrorReply):
                pending.append(self.fmt.chunk(self.fmt.echo_text, logprobs=reply.prompt_logprobs))
                echo = False
            if isinstance(reply, TokenReply):
                i = reply.choice_index or 0
                if options.echo_only:
                    pass  # the one token generated is not part of the answer
                elif reply.text or (reply.logprobs and options.logprobs is not None):
                    pending.append(fmt.chunk(reply.text, logprobs=reply.logprobs, index=i))
                    sent[i] += reply.text
                    sent_tokens[i] += len(reply.token_ids)
            elif isinstance(reply, DoneReply):
                i = reply.choice_index or 0
                dones[i] = reply
                # The token deltas add up to the done text (detokenizer invariant); should a
                # tail ever be missing, send it rather than lose it.
                tail = reply.text[len(sent[i]) :] if reply.text.startswith(sent[i]) else ""
                unsent = reply.logprobs[sent_tokens[i] :] if reply.logprobs else None
                if not options.echo_only and (tail or unsent):
                    pending.append(fmt.chunk(tail, logprobs=unsent, index=i))
                pending.append(fmt.finish_choice(reply, i))
                if len(dones) == n:
                    self._terminal_seen = True
                    pending.append(fmt.close([dones[k] for k in range(n)]))
                self.log.debug("choice done", finish_reason=reply.finish_reason,
                               choice_index=i, **reply.usage)  # fmt: skip
            else:
                self._terminal_seen = True
                pending.append(self.fmt.error(from_error_reply(reply)))
                self.log.info("request failed mid-stream", code=reply.code, reason=reply.message)
            # One write per reply: a reply's chunks (and the closing events) leave together.
            await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
            pending = []
            if t is first:
                self._observe_overhead(scope, first)
            if self._terminal_seen:
                break
            try:
                t = await anext(rest)
            except Exception as exc:  # lost broker, no reply in time: end the stream, say why
                self._terminal_seen = True
                await send({"type": "http.response.body", "body": self.fmt.error(
                    self._error_for(exc)), "more_body": True})  # fmt: skip
                t = None
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _error_for(self, exc: Exception) -> ApiError:
        err = from_exception(exc)
        if err is None:
            self.log.exception("request failed in the gateway")
            return internal()
        self.log.warning("request failed", status=err.status, error=str(exc))
        return err

    def _observe_overhead(self, scope: Scope, first: TimedReply) -> None:
        t0 = scope.get(SCOPE_T0)
        if t0 is None:
            return
        published_at = first.received_at - first.elapsed_s
        now = time.perf_counter()
        self.metrics.gateway_overhead.observe((published_at - t0) + (now - first.received_at))


async def _disconnected(receive: Receive) -> None:
    """Return when the client disconnects (the body has been read; nothing else can come)."""
    while (await receive())["type"] != "http.disconnect":
        pass
