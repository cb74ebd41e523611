"""Answers for the requests that quorum work queues set aside as poison (BATON_QUEUE_TYPE=quorum).

A quorum queue counts a message's deliveries itself: one returned ``max_delivery_failures``
times (its workers crashed, lost their channel or gave it back in a drain that often) is
dead-lettered by the broker, reason ``delivery_limit``, and nobody is told. Its request must
still get its one terminal reply. ``baton.poison``, bound to ``baton.dlx`` beside ``baton.dead``,
holds a copy of every dead letter; the tokenizer consumes it and answers each that a work
queue's delivery limit set aside ``internal``, the answer and the ack in one transaction:

- from ``baton.requests``: on the message's ``reply_to``, as the tokenizer answers bad input (a
  request is registered with the detokenizer only in the transaction that acks it, so one that
  was never acked was never registered);
- from ``baton.prefill`` or ``baton.decode``: an error event to the request's detokenizer shard,
  which holds its registration, as an engine answers a message it cannot read. Such a message
  must come from a trusted publisher (``BATON_TRUSTED_PUBLISHERS``): any user reaches any queue
  through the default exchange, and only a service's dead letter may end a registered request.

Every other dead letter (rejected: unreadable, untrusted, without ``reply_to``, each answered
already where it could be) is acked here; ``baton.dead`` keeps its copy for operators.
"""

from __future__ import annotations

import time

import structlog
from aio_pika.abc import AbstractIncomingMessage

from services.shell.broker import Outgoing
from services.shell.shell import ServiceShell, detok_events, peek_request_id
from shared.wire.errors import ErrorCode
from shared.wire.messages import ErrorReply, TokenEvent
from shared.wire.queues import POISON_QUEUE, REQUESTS_QUEUE, WORK_QUEUES

log = structlog.get_logger(__name__)


def death(message: AbstractIncomingMessage) -> tuple[str, str] | None:
    """(queue, reason) of the message's latest dead-lettering (``x-death`` lists the latest
    first), or None if it has no readable one."""
    deaths = (message.headers or {}).get("x-death")
    if not isinstance(deaths, list) or not deaths or not isinstance(deaths[0], dict):
        return None
    queue, reason = (deaths[0].get(key) for key in ("queue", "reason"))
    return (queue, reason) if isinstance(queue, str) and isinstance(reason, str) else None


class PoisonAnswers:
    """The tokenizer's consumer of ``baton.poison`` (a transactional shell's)."""

    def __init__(self, shell: ServiceShell) -> None:
        self.shell = shell
        self.config = shell.config
        self._trusted = {u.strip() for u in self.config.trusted_publishers.split(",") if u.strip()}

    async def start(self) -> None:
        await self.shell.consume(POISON_QUEUE, self.on_dead_letter)

    async def on_dead_letter(self, message: AbstractIncomingMessage) -> None:
        died = death(message)
        outs = self.answer(message, died[0]) if died and died[1] == "delivery_limit" else []
        try:
            await self.shell.commit(outs, acks=[message])
        except Exception as exc:  # not committed: it comes again
            log.warning("poison answer not committed", error=repr(exc))
            return
        if outs and died is not None:
            self.shell.metrics.on_poison(died[0])
            self.shell.metrics.on_error(ErrorCode.INTERNAL.value)

    def answer(self, message: AbstractIncomingMessage, queue: str) -> list[Outgoing]:
        """The ``internal`` error that answers the request of a message ``queue`` set aside;
        nothing where there is none to answer (logged)."""
        limit = self.config.max_delivery_failures
        text = f"{queue} delivered this request {limit} times without it finishing; set aside"
        if queue == REQUESTS_QUEUE:
            rid = message.correlation_id
            if not message.reply_to or not rid:
                log.error("poison request without reply_to or correlation_id", queue=queue)
                return []
            log.error("poison message answered", queue=queue, request_id=rid, deliveries=limit)
            reply = ErrorReply(request_id=rid, code=ErrorCode.INTERNAL.value, message=text)
            return [Outgoing(message.reply_to, reply.encode(), correlation_id=rid)]
        if queue not in WORK_QUEUES:
            return []
        if self._trusted and message.user_id not in self._trusted:
            log.error("dead letter from an untrusted publisher ignored", user_id=message.user_id)
            return []
        rid = peek_request_id(message.body, self.config.max_message_bytes)
        log.error("poison message answered", queue=queue, request_id=rid, deliveries=limit)
        if rid is None:
            return []
        event = TokenEvent(rid, 0, [], error_code=ErrorCode.INTERNAL.value, error_message=text)
        return detok_events([event], time.time(), self.config.detok_shards)
