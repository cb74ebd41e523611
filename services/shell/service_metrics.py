"""Service-side metric updates: turns engine step facts and service events into Prometheus metrics.

Each service owns one :class:`ServiceMetrics` (the service shell creates it). Engine services
feed it what their engine reports as data — :class:`~shared.engine.outputs.EngineInfo` once, then
each :class:`~shared.engine.outputs.StepOutput` (its ``StepStats``, ``EngineLoad``, transfers and
connector counters); it never sees a scheduler, a block manager or a connector. The HTTP endpoint
(``/metrics``, ``/health``, ``/ready``) runs only when ``BATON_METRICS_PORT`` is set; the polled
figures (queue depths, the spill store's size) come from the service's one poller
(``services/shell/polling.py``).

Adding a metric: declare it in ``shared/observability/metrics.py`` and set it here, from a field
of the data above (an engine figure: a field of ``StepStats`` or ``EngineLoad`` first).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from shared.config import BatonConfig
from shared.engine.outputs import KVConnectorStats
from shared.models.catalog import served_model_id
from shared.observability.http_server import start_metrics_server
from shared.observability.metrics import Metrics

if TYPE_CHECKING:
    from shared.engine.load import EngineLoad
    from shared.engine.outputs import EngineInfo, KVTransferStat, StepOutput, StepStats
    from shared.flow_control.policy import PrefillIntake
    from shared.scheduling.priority import PriorityState
    from shared.wire.messages import DoneReply, ErrorReply, StartInfo


class ServiceMetrics:
    def __init__(self, config: BatonConfig, service: str) -> None:
        self.config = config
        self.service = service
        self.metrics = Metrics(served_model_id(config))
        self.metrics.service_info.info({"service": service, "device": config.device})
        self._server: asyncio.AbstractServer | None = None
        self._last_prefix = (0, 0)
        self._last_preemptions = 0
        self._last_swaps = (0, 0)  # (out, in)
        self._last_by_cause: dict[str, int] = {}
        self._last_prefetch_hits = 0
        self._last_connector = KVConnectorStats()
        self._last_reclaimed: dict[tuple[str, str], int] = {}
        self._last_staged_blocks = 0  # EngineLoad.num_staged_blocks is cumulative
        self._step_weight_bytes = 0
        self._kv_bytes_per_token = 0

    async def start(self, ready: Callable[[], bool]) -> None:
        if self.config.metrics_port:
            self._server = await start_metrics_server(self.config.metrics_port, self.metrics, ready)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def watch_device(self, device: str) -> None:
        """Export ``baton:gpu_memory_*`` for a CUDA device (a process that holds a model there)."""
        self.metrics.watch_device(device)

    # --- polled (services/shell/polling.py) -----------------------------------------------------
    def set_queue_depths(self, depths: Mapping[str, int]) -> None:
        self.metrics.set_queue_depths(depths)

    def set_spill_store_bytes(self, used: int) -> None:
        self.metrics.spill_store_bytes.set(used)

    # --- every consumer -------------------------------------------------------------------------
    def on_redelivered(self, queue: str) -> None:
        self.metrics.redelivered_messages.labels(queue=queue).inc()

    def on_poison(self, queue: str) -> None:
        self.metrics.poison_messages.labels(queue=queue).inc()

    # --- detokenizer ----------------------------------------------------------------------------
    def on_slo_judged(self, priority: int, met: bool) -> None:
        """A terminal reply judged against the objectives (services/detokenizer/goodput.py)."""
        self.metrics.request_slo_judged.labels(priority=str(priority)).inc()
        if met:
            self.metrics.request_goodput.labels(priority=str(priority)).inc()

    def set_detok_held(self, held_messages: int, active_requests: int) -> None:
        self.metrics.detok_held_messages.set(held_messages)
        self.metrics.detok_active_requests.set(active_requests)

    # --- tokenizer ------------------------------------------------------------------------------
    def on_accepted(self, num_prompt_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        self.metrics.request_prompt_tokens.observe(num_prompt_tokens)

    def on_error(self, code: str) -> None:
        self.metrics.request_errors.labels(code=code).inc()

    # --- scheduling policy ----------------------------------------------------------------------
    def on_admission(self, admit: bool) -> None:
        self.metrics.admission_decisions.labels(
            decision="admitted" if admit else "overloaded"
        ).inc()

    def on_deadline(self, source: str, seconds: float | None) -> None:
        """``source``: default | client | none (``seconds`` None)."""
        self.metrics.request_deadlines.labels(source=source).inc()
        if seconds is not None:
            self.metrics.request_deadline_seconds.observe(seconds)

    def on_prefetch(self, prefetch: int, changed: bool) -> None:
        self.metrics.consumer_prefetch.set(prefetch)
        if changed:
            self.metrics.prefetch_updates.inc()

    def on_policy_times(self, release_s: float | None, batches_ahead: int | None) -> None:
        if release_s is not None:
            self.metrics.release_seconds.set(release_s)
        if batches_ahead is not None:
            self.metrics.prefill_batches_ahead.set(batches_ahead)

    def on_intake(self, intake: PrefillIntake) -> None:
        m = self.metrics
        m.prefill_intake_pressure.set(intake.pressure)
        for state in type(intake.state):  # every state of the Intake enum
            m.prefill_intake_state.labels(state=state.value).set(int(state is intake.state))

    def on_published(self, queue: str, priority: int, wire: int, reason: str) -> None:
        """A work message published with AMQP priority ``wire`` (client priority ``priority``);
        ``reason`` names what raised it, if it was raised."""
        self.metrics.published_priority.labels(queue=queue, priority=str(wire)).inc()
        if wire > priority:
            self.metrics.priority_boosts.labels(reason=reason).inc()

    def on_priorities(self, state: PriorityState) -> None:
        m = self.metrics
        m.priority_aging_horizon.set(state.horizon_s or 0.0)
        m.priority_median_wait.set(state.median_wait_s or 0.0)
        m.short_prompt_boost_active.set(int(state.boosting))

    # --- prefill and decode ---------------------------------------------------------------------
    def set_engine(self, info: EngineInfo) -> None:
        """What a step must read besides the KV of its batch (for the decode bandwidth gauge)."""
        self._step_weight_bytes = info.weight_bytes
        self._kv_bytes_per_token = info.kv_bytes_per_token

    def on_engine_step(self, out: StepOutput) -> None:
        """Everything one engine step reports, forward or not."""
        if out.stats is not None:
            self.on_step(out.stats)
        self.on_load(out.load)
        for stat in out.transfers:
            self.on_transfer(stat)
        self.on_connector(out.kv)
        self.on_kv_reclaimed(out.kv_reclaimed)

    def on_step(self, stats: StepStats) -> None:
        """One forward of a prefill or decode engine."""
        m = self.metrics
        m.batch_size.observe(stats.num_seqs)
        m.iteration_tokens.observe(stats.num_scheduled_tokens)
        if self.service == "decode":  # a decode step's budget is its sequence cap
            m.batch_token_utilization.observe(stats.num_seqs / self.config.max_num_seqs)
        else:
            budget = self.config.max_num_batched_tokens
            m.batch_token_utilization.observe(stats.num_scheduled_tokens / budget)
        m.forward_seconds.observe(stats.forward_s)
        # The cores the step used (the shared budget's count, or a pinned engine's fixed one).
        m.engine_threads.set(stats.num_threads)
        m.forward_thread_seconds.inc(stats.forward_s * stats.num_threads)
        m.generation_tokens.inc(stats.num_generated_tokens)
        last_q, last_h = self._last_prefix
        if stats.prefix_queries_total > last_q:
            m.prefix_cache_queries.inc(stats.prefix_queries_total - last_q)
            m.prefix_cache_hits.inc(stats.prefix_hits_total - last_h)
            self._last_prefix = (stats.prefix_queries_total, stats.prefix_hits_total)
        if stats.preemptions_total > self._last_preemptions:
            m.num_preemptions.labels(mode="recompute").inc(
                stats.preemptions_total - self._last_preemptions
            )
            self._last_preemptions = stats.preemptions_total
        if stats.swaps_out_total > self._last_swaps[0]:
            m.num_preemptions.labels(mode="swap").inc(stats.swaps_out_total - self._last_swaps[0])
        if stats.swaps_in_total > self._last_swaps[1]:
            m.num_swap_ins.inc(stats.swaps_in_total - self._last_swaps[1])
        self._last_swaps = (stats.swaps_out_total, stats.swaps_in_total)
        for cause, total in stats.preemptions_by_cause.items():
            if total > self._last_by_cause.get(cause, 0):
                by_cause = m.num_preemptions_by_cause.labels(cause=cause)
                by_cause.inc(total - self._last_by_cause.get(cause, 0))
                self._last_by_cause[cause] = total
        if stats.prefetch_hits_total > self._last_prefetch_hits:
            m.kv_prefetch_hits.inc(stats.prefetch_hits_total - self._last_prefetch_hits)
            self._last_prefetch_hits = stats.prefetch_hits_total
        if stats.num_context_tokens and stats.forward_s > 0 and self._step_weight_bytes:
            read = self._step_weight_bytes + stats.num_context_tokens * self._kv_bytes_per_token
            m.memory_bandwidth_bytes_per_second.set(read / stats.forward_s)

    def on_load(self, load: EngineLoad) -> None:
        """The engine's requests and KV blocks after each step, forward or not."""
        self.metrics.num_requests_running.set(load.num_running)
        self.metrics.num_requests_waiting.set(load.num_waiting)
        self.metrics.set_kv_blocks(load.num_used_blocks, load.num_free_blocks)
        self.metrics.kv_host_blocks_used.set(load.num_host_blocks_used)
        self.metrics.kv_host_staged_blocks.inc(load.num_staged_blocks - self._last_staged_blocks)
        self._last_staged_blocks = load.num_staged_blocks
        self.on_priorities(load.priority)

    def on_connector(self, stats: KVConnectorStats) -> None:
        """The KV connector's counters, read after each step (cumulative: add what is new)."""
        m, last = self.metrics, self._last_connector
        m.kv_blocks_pinned.set(stats.pinned_blocks)
        for counter, new, old in (
            (m.kv_leases_expired, stats.leases_expired, last.leases_expired),
            (m.kv_map_failures, stats.map_failures, last.map_failures),
            (m.kv_stale_loads, stats.stale_loads, last.stale_loads),
            (m.kv_handoff_fallbacks, stats.fallbacks, last.fallbacks),
        ):
            if new > old:
                counter.inc(new - old)
        self._last_connector = stats

    def on_kv_reclaimed(self, reclaimed: dict[tuple[str, str], int]) -> None:
        """The engine's orphaned-KV counts (cumulative, by (kind, reason)): add what is new."""
        for (kind, reason), total in reclaimed.items():
            new = total - self._last_reclaimed.get((kind, reason), 0)
            if new > 0:
                self.metrics.kv_orphans_reclaimed.labels(kind=kind, reason=reason).inc(new)
        self._last_reclaimed = dict(reclaimed)

    def on_transfer(self, stat: KVTransferStat) -> None:
        self.metrics.handoff_bytes.labels(transport=stat.transport).inc(stat.nbytes)
        self.metrics.handoff_seconds.labels(transport=stat.transport).observe(stat.seconds)

    # --- detokenizer ----------------------------------------------------------------------------
    def on_request_finished(self, info: StartInfo, reply: DoneReply | ErrorReply) -> None:
        """The pipeline's view of a request (every client's, from arrival on baton.requests):
        its outcome, and its latencies from the ``done`` reply's timing."""
        m = self.metrics
        if reply.type == "error":
            m.request_errors.labels(code=reply.code).inc()  # type: ignore[union-attr]
            return
        done: Any = reply
        timing, n = done.timing, len(done.token_ids)
        m.request_success.labels(finished_reason=done.finish_reason).inc()
        m.pipeline_e2e_request_latency.observe(timing["e2e_s"])
        m.request_generation_tokens.observe(n)
        if not n:
            return
        queue_s, ttft_s, tpot_s = timing["queue_s"], timing["ttft_s"], timing["tpot_s"]
        prefill_s, decode_s = max(0.0, ttft_s - queue_s), tpot_s * (n - 1)
        m.pipeline_time_to_first_token.observe(ttft_s)
        m.request_queue_time.observe(queue_s)
        m.request_prefill_time.observe(prefill_s)
        m.request_decode_time.observe(decode_s)
        m.request_inference_time.observe(prefill_s + decode_s)
        if n > 1:
            m.pipeline_request_time_per_output_token.observe(tpot_s)
