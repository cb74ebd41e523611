"""Tokenizer service: validate, tokenize, register with the detokenizer, pass on to prefill.

Bad input never goes further than here: it is answered with an ``error`` reply at once. A body
without ``reply_to`` cannot be answered and is dead-lettered with a log line.
"""

from __future__ import annotations

import asyncio
import random
import time

import structlog
from aio_pika.abc import AbstractIncomingMessage

from services.tokenizer.core import PromptEncoder
from shared.broker import DETOK_QUEUE, PREFILL_QUEUE, REQUESTS_QUEUE, Broker, Outgoing
from shared.config import BatonConfig
from shared.metrics_glue import ServiceMetrics
from shared.policy import AdmissionPolicy
from shared.protocol import DetokMsg, ErrorReply, PrefillMsg, RequestMsg, StartInfo
from shared.protocol_errors import ErrorCode, ProtocolError
from shared.validation import parse_request

log = structlog.get_logger(__name__)

BACKLOG_POLL_INTERVAL_S = 0.25


class TokenizerService:
    name = "tokenizer"

    def __init__(self, config: BatonConfig, encoder: PromptEncoder) -> None:
        self.config = config
        self.encoder = encoder
        self.broker = Broker(config, prefetch_count=64)
        self.metrics = ServiceMetrics(config, self.name)
        self.admission = AdmissionPolicy(config.max_prefill_backlog)
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.broker.connect()
        await self.metrics.start(ready=lambda: True)
        self._poller = asyncio.create_task(self._poll_backlog())
        await self.broker.consume(REQUESTS_QUEUE, self.on_request)

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await self.broker.close()
        await self.metrics.stop()

    async def _poll_backlog(self) -> None:
        while True:
            try:
                self.admission.observe(await self.broker.queue_depths([PREFILL_QUEUE]))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the broker reconnects; keep the last reading
                log.debug("backlog poll failed", error=str(exc))
            await asyncio.sleep(BACKLOG_POLL_INTERVAL_S)

    async def on_request(self, message: AbstractIncomingMessage) -> None:
        arrival = time.time()
        if not message.reply_to:
            log.warning(
                "request without reply_to dead-lettered",
                correlation_id=message.correlation_id,
                nbytes=len(message.body),
            )
            await message.reject(requeue=False)
            return
        request_id = message.correlation_id or ""
        try:
            req = parse_request(message.body, self.config)
            request_id = req.request_id
            token_ids = self.encoder.encode(req)
        except ProtocolError as exc:
            await self._reply_error(message, request_id, exc.code, exc.message)
            return
        except Exception:  # a tokenizer bug must not kill the consumer or lose the request
            log.exception("tokenization failed", request_id=request_id)
            await self._reply_error(message, request_id, ErrorCode.INTERNAL, "tokenization failed")
            return
        if not self.admission.admit():
            await self._reply_error(
                message, request_id, ErrorCode.OVERLOADED, self.admission.reason()
            )
            return
        await self._forward(message, req, token_ids, arrival)

    async def _forward(
        self,
        message: AbstractIncomingMessage,
        req: RequestMsg,
        token_ids: list[int],
        arrival: float,
    ) -> None:
        assert message.reply_to is not None
        priority = req.priority if req.priority else (message.priority or 0)
        sampling = req.sampling
        if sampling.temperature > 0 and sampling.seed is None:
            # Fix the seed now so a replayed request (crash, preemption) samples the same tokens.
            sampling = type(sampling)(**{**sampling.to_dict(), "seed": random.getrandbits(63)})
        deadline = arrival + req.timeout_s if req.timeout_s is not None else None
        start = StartInfo(
            request_id=req.request_id,
            reply_to=message.reply_to,
            num_prompt_tokens=len(token_ids),
            stop=list(req.stop),
            stream=req.stream,
            arrival_time=arrival,
            deadline=deadline,
            max_tokens=sampling.max_tokens,
        )
        work = PrefillMsg(
            request_id=req.request_id,
            reply_to=message.reply_to,
            prompt_token_ids=token_ids,
            sampling=sampling,
            stop=list(req.stop),
            stream=req.stream,
            priority=priority,
            arrival_time=arrival,
            deadline=deadline,
        )
        # Registration first: the detokenizer must know the request before any token can exist.
        await self.broker.publish(Outgoing(DETOK_QUEUE, DetokMsg(starts=[start]).encode()))
        await self.broker.publish(Outgoing(PREFILL_QUEUE, work.encode(), priority=priority))
        await message.ack()
        self.metrics.on_accepted(len(token_ids))
        log.debug("request accepted", request_id=req.request_id, prompt_tokens=len(token_ids))

    async def _reply_error(
        self, message: AbstractIncomingMessage, request_id: str, code: ErrorCode, text: str
    ) -> None:
        log.info("request rejected", request_id=request_id, code=code.value, reason=text)
        assert message.reply_to is not None
        reply = ErrorReply(request_id=request_id, code=code.value, message=text)
        await self.broker.publish(
            Outgoing(
                message.reply_to,
                reply.encode(),
                correlation_id=message.correlation_id or request_id or None,
                persistent=False,
            )
        )
        await message.ack()
        self.metrics.on_error(code.value)
