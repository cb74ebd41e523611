"""Tokenizer service: validate, tokenize, register with the detokenizer, pass on to prefill.

Bad input never goes further than here: it is answered with an ``error`` reply at once. A body
without ``reply_to`` cannot be answered and is dead-lettered with a log line. Every request's
outcome — the error reply, or the registration and the work — is committed in one transaction
with the ack of the request (``services/shell/tx_outbox.py``): a crash never answers or
registers one twice. ``max_tokens`` is
clamped here, once, to what fits after the prompt and, with ``logprobs``, to what a reply's
logprobs budget holds (``Limits.clamp``); the priority is the body's
when it has the field, else the AMQP header's clamped to 0..9 (``parse_request``).

Scheduling policy (``shared/flow_control/policy.py``): ``overloaded`` while baton.prefill or
baton.decode holds its limit of requests (depths polled every ``policy_poll_interval_s``); the
deadline is the default by length (base + per prompt token + per output token), shortened by the
client's ``timeout_s``; a short prompt is published to baton.prefill with a boosted AMQP
priority while the prefill backlog is deep.

With quorum work queues (``BATON_QUEUE_TYPE``) it also answers the requests the broker set aside
as poison (``poison.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Mapping

import structlog
from aio_pika.abc import AbstractIncomingMessage

from services.shell.broker import Outgoing
from services.shell.common import resolve_model_dir
from services.shell.shell import ServiceShell
from services.tokenizer.core import PromptEncoder
from services.tokenizer.poison import PoisonAnswers
from shared.config import BatonConfig
from shared.flow_control.policy import SchedulingPolicy
from shared.limits import Limits
from shared.scheduling.priority import Prioritizer
from shared.wire.errors import ErrorCode, ProtocolError
from shared.wire.messages import (
    DetokMsg,
    ErrorReply,
    PrefillMsg,
    RequestMsg,
    StartInfo,
    TokenEvent,
)
from shared.wire.queues import DECODE_QUEUE, PREFILL_QUEUE, REQUESTS_QUEUE, detok_queue_for
from shared.wire.validation import parse_request

log = structlog.get_logger(__name__)


class TokenizerService:
    name = "tokenizer"

    def __init__(self, config: BatonConfig, encoder: PromptEncoder, limits: Limits) -> None:
        self.config = config
        self.encoder = encoder
        self.limits = limits
        # The scheduling policy: admission from both backlogs, the deadline by length, the
        # short-prompt boost of the priority published to baton.prefill.
        self.policy = SchedulingPolicy(config)
        self.priorities = Prioritizer(config, short_boost=True)
        self.shell = ServiceShell(
            config, self.name, prefetch=self.policy.tokenizer_prefetch(), transactional=True
        )
        self.shell.metrics.on_prefetch(self.policy.tokenizer_prefetch(), changed=False)
        self.shell.poller.on_depths((PREFILL_QUEUE, DECODE_QUEUE), self._observe_depths)

    async def start(self) -> None:
        # No per-request control: the detokenizer answers cancels. The shell takes the first
        # depth reading before it returns: admission never runs blind.
        await self.shell.start()
        await self.shell.consume(REQUESTS_QUEUE, self.on_request, on_poison=self._answer_poison)
        if self.config.queue_type == "quorum":  # the broker sets poison aside: answer it
            await PoisonAnswers(self.shell).start()

    async def stop(self) -> None:
        await self.shell.stop()

    async def wait_finished(self) -> None:
        await self.shell.wait_finished()

    def _observe_depths(self, depths: Mapping[str, int]) -> None:
        self.policy.observe_depths(depths)
        self.priorities.observe_backlog(self.policy.prefill_backlog)
        self.shell.metrics.on_priorities(self.priorities.state())

    async def on_request(self, message: AbstractIncomingMessage) -> None:
        arrival = time.time()
        if not message.reply_to:
            log.warning(
                "request without reply_to dead-lettered",
                correlation_id=message.correlation_id,
                nbytes=len(message.body),
            )
            await self.shell.dispose(message, requeue=False)
            return
        request_id = message.correlation_id or ""
        try:
            req = parse_request(message.body, self.config, header_priority=message.priority)
            request_id = req.request_id
            token_ids = self.encoder.encode(req)
            self.limits.check_prompt_logprobs(req.sampling, len(token_ids))
        except ProtocolError as exc:
            await self._reply_error(message, request_id, exc.code, exc.message)
            return
        except Exception:  # a tokenizer bug must not kill the consumer or lose the request
            log.exception("tokenization failed", request_id=request_id)
            await self._reply_error(message, request_id, ErrorCode.INTERNAL, "tokenization failed")
            return
        admission = self.policy.admission()
        self.shell.metrics.on_admission(admission.admit)
        if not admission.admit:
            reason = admission.reason or "overloaded"
            await self._reply_error(message, request_id, ErrorCode.OVERLOADED, reason)
            return
        await self._forward(message, message.reply_to, req, token_ids, arrival)

    async def _forward(
        self,
        message: AbstractIncomingMessage,
        reply_to: str,
        req: RequestMsg,
        token_ids: list[int],
        arrival: float,
    ) -> None:
        sampling = self.limits.clamp(req.sampling, len(token_ids))
        if sampling.temperature > 0 and sampling.seed is None:
            # Fix the seed now so a replayed request (crash, preemption) samples the same tokens.
            sampling = dataclasses.replace(sampling, seed=random.getrandbits(63))
        num_prompt = len(token_ids)
        limit = self.policy.deadline(arrival, req.timeout_s, num_prompt, sampling.max_tokens)
        self.shell.metrics.on_deadline(limit.source.value, limit.seconds)
        deadline = limit.at
        # The AMQP priority: the client's, plus the short-prompt boost while the prefill
        # backlog is deep (shortest job first under pressure). The body keeps the client's.
        wire = self.priorities.wire_priority(req.priority, arrival, num_prompt, arrival)
        start = StartInfo(
            request_id=req.request_id,
            reply_to=reply_to,
            num_prompt_tokens=len(token_ids),
            stop=list(req.stop),
            stream=req.stream,
            arrival_time=arrival,
            deadline=deadline,
            max_tokens=sampling.max_tokens,
            batch_replies=req.batch_replies,
            owner=message.user_id,
            priority=req.priority,
            include_stop_str_in_output=req.include_stop_str_in_output,
            stop_token_ids=list(sampling.stop_token_ids),
            n=sampling.n,
        )
        work = PrefillMsg(
            request_id=req.request_id,
            reply_to=reply_to,
            prompt_token_ids=token_ids,
            sampling=sampling,
            stop=list(req.stop),
            stream=req.stream,
            priority=req.priority,
            arrival_time=arrival,
            deadline=deadline,
        )
        # The registration, the work and the ack: one transaction. Registration first, so the
        # broker routes it first; a token event that still overtakes it waits in the
        # detokenizer for its registration (services/detokenizer/core.py, orphan events).
        detok = detok_queue_for(req.request_id, self.config.detok_shards)
        outs = [
            Outgoing(detok, DetokMsg(starts=[start]).encode()),
            Outgoing(PREFILL_QUEUE, work.encode(), priority=wire),
        ]
        try:
            await self.shell.commit(outs, acks=[message])
        except Exception as exc:  # not committed: the request comes again
            log.warning("request not committed", request_id=req.request_id, error=repr(exc))
            return
        self.shell.metrics.on_published(PREFILL_QUEUE, req.priority, wire, "short_prompt")
        self.shell.metrics.on_accepted(len(token_ids))
        log.debug("request accepted", request_id=req.request_id, prompt_tokens=len(token_ids))

    async def _answer_poison(self, message: AbstractIncomingMessage, failures: int) -> bool:
        """About to be dead-lettered (it crashed this service ``failures`` times): answered
        through the detokenizer, a registration and an error together, so that a request
        registered before a crash is answered once, by the one service that answers it; the
        answer and the dead-lettering commit together."""
        rid = message.correlation_id
        if not message.reply_to or not rid:
            return False  # unanswerable; dead-lettered with the log line above
        text = f"the tokenizer failed on this request {failures} times; it was set aside"
        error = TokenEvent(rid, 0, [], error_code=ErrorCode.INTERNAL.value, error_message=text)
        start = StartInfo(rid, message.reply_to, 0, owner=message.user_id)
        body = DetokMsg(starts=[start], events=[error]).encode()
        out = Outgoing(detok_queue_for(rid, self.config.detok_shards), body)
        with contextlib.suppress(Exception):  # not committed: it comes again, poison again
            await self.shell.commit([out], rejects=[message])
            self.shell.metrics.on_error(ErrorCode.INTERNAL.value)
        return True

    async def _reply_error(
        self, message: AbstractIncomingMessage, request_id: str, code: ErrorCode, text: str
    ) -> None:
        log.info("request rejected", request_id=request_id, code=code.value, reason=text)
        assert message.reply_to is not None
        reply = ErrorReply(request_id=request_id, code=code.value, message=text)
        correlation_id = message.correlation_id or request_id or None
        out = Outgoing(message.reply_to, reply.encode(), correlation_id=correlation_id)
        try:  # the reply and the ack together: never answered twice
            await self.shell.commit([out], acks=[message])
        except Exception as exc:  # not committed: the request comes again
            log.warning("error reply not committed", request_id=request_id, error=repr(exc))
            return
        self.shell.metrics.on_error(code.value)


def build(config: BatonConfig) -> TokenizerService:
    model_dir = resolve_model_dir(config)
    limits = Limits.for_model_dir(config, model_dir)
    return TokenizerService(config, PromptEncoder(model_dir, limits), limits)
