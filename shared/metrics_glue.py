"""Service-side metric updates: turns scheduler/engine state into :class:`~shared.metrics.Metrics`.

Each service owns one :class:`ServiceMetrics`; the HTTP endpoint (``/metrics``, ``/health``,
``/ready``) runs only when ``BATON_METRICS_PORT`` is set, but the metrics are always updated
(a few counter increments per step; no allocation on the hot path beyond that).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from shared.config import BatonConfig
from shared.http_server import start_metrics_server
from shared.metrics import Metrics

if TYPE_CHECKING:
    from shared.broker import Broker
    from shared.engine.block_manager import BlockManager
    from shared.protocol import DoneReply, ErrorReply, StartInfo
    from shared.scheduling import DecodeScheduler, DecodeStep, PrefillBatch

log = structlog.get_logger(__name__)

QUEUE_POLL_INTERVAL_S = 2.0


class ServiceMetrics:
    def __init__(self, config: BatonConfig, service: str, broker: Broker | None = None) -> None:
        self.config = config
        self.service = service
        self.broker = broker
        self.metrics = Metrics()
        self.metrics.service_info.info({"service": service, "device": config.device})
        self._server: asyncio.AbstractServer | None = None
        self._poller: asyncio.Task[None] | None = None
        self._last_prefix = (0, 0)
        self._last_preemptions = 0
        self._step_weight_bytes = 0
        self._kv_bytes_per_token = 0

    async def start(self, ready: Callable[[], bool]) -> None:
        if not self.config.metrics_port:
            return
        self._server = await start_metrics_server(self.config.metrics_port, self.metrics, ready)
        if self.broker is not None:
            self._poller = asyncio.create_task(self._poll_queues())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _poll_queues(self) -> None:
        assert self.broker is not None
        while True:
            try:
                self.metrics.set_queue_depths(await self.broker.queue_depths())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the broker reconnects; a missed poll is harmless
                log.debug("queue depth poll failed", error=str(exc))
            await asyncio.sleep(QUEUE_POLL_INTERVAL_S)

    # --- tokenizer ------------------------------------------------------------------------------
    def on_accepted(self, num_prompt_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        self.metrics.request_prompt_tokens.observe(num_prompt_tokens)

    def on_error(self, code: str) -> None:
        self.metrics.request_errors.labels(code=code).inc()

    # --- prefill --------------------------------------------------------------------------------
    def on_prefill_batch(
        self, batch: PrefillBatch, waiting: int, block_manager: BlockManager, seconds: float
    ) -> None:
        m = self.metrics
        m.batch_size.observe(len(batch))
        m.batch_token_utilization.observe(batch.num_tokens / self.config.max_num_batched_tokens)
        m.forward_seconds.observe(seconds)
        m.num_requests_running.set(len(batch))
        m.num_requests_waiting.set(waiting)
        self._kv(block_manager)

    def on_handoff(self, transport: str, nbytes: int, seconds: float) -> None:
        self.metrics.handoff_bytes.labels(transport=transport).inc(nbytes)
        self.metrics.handoff_seconds.labels(transport=transport).observe(seconds)

    # --- decode ---------------------------------------------------------------------------------
    def set_decode_costs(self, weight_bytes: int, kv_bytes_per_token: int) -> None:
        """What one decode step must read besides the KV of its batch (for the bandwidth gauge)."""
        self._step_weight_bytes = weight_bytes
        self._kv_bytes_per_token = kv_bytes_per_token

    def on_decode_step(
        self,
        step: DecodeStep,
        scheduler: DecodeScheduler,
        block_manager: BlockManager,
        seconds: float,
    ) -> None:
        m = self.metrics
        n = len(step.decode)
        m.batch_size.observe(n + len(step.recompute.seqs))
        m.batch_token_utilization.observe(n / self.config.max_num_seqs)
        m.forward_seconds.observe(seconds)
        m.generation_tokens.inc(n)
        m.num_requests_running.set(scheduler.num_running)
        m.num_requests_waiting.set(scheduler.num_waiting)
        new = scheduler.num_preemptions - self._last_preemptions
        if new:
            m.num_preemptions.labels(mode="recompute").inc(new)
            self._last_preemptions = scheduler.num_preemptions
        if n and seconds > 0 and self._step_weight_bytes:
            kv_tokens = sum(s.num_tokens for s in step.decode)
            read = self._step_weight_bytes + kv_tokens * self._kv_bytes_per_token
            m.memory_bandwidth_bytes_per_second.set(read / seconds)
        self._kv(block_manager)

    # --- detokenizer ----------------------------------------------------------------------------
    def on_request_finished(self, info: StartInfo, reply: DoneReply | ErrorReply) -> None:
        m = self.metrics
        if reply.type == "error":
            m.request_errors.labels(code=reply.code).inc()  # type: ignore[union-attr]
            return
        done: Any = reply
        timing, n = done.timing, len(done.token_ids)
        m.request_success.labels(finish_reason=done.finish_reason).inc()
        m.e2e_request_latency.observe(timing["e2e_s"])
        m.request_generation_tokens.observe(n)
        if n:
            m.time_to_first_token.observe(timing["ttft_s"])
            m.request_queue_time.observe(timing["queue_s"])
        if n > 1:
            m.time_per_output_token.observe(timing["tpot_s"])

    # --- shared ---------------------------------------------------------------------------------
    def _kv(self, block_manager: BlockManager) -> None:
        self.metrics.set_kv_blocks(block_manager.num_used_blocks, block_manager.num_free_blocks)
        queries, hits = block_manager.num_prefix_queries_tokens, block_manager.num_prefix_hit_tokens
        last_q, last_h = self._last_prefix
        if queries > last_q:
            self.metrics.prefix_cache_queries.inc(queries - last_q)
            self.metrics.prefix_cache_hits.inc(hits - last_h)
            self._last_prefix = (queries, hits)
