"""Prometheus metrics: one :class:`Metrics` per process, on its own registry.

Names are vLLM's where vLLM has one, with the ``baton:`` prefix
(``vllm:time_to_first_token_seconds`` -> ``baton:time_to_first_token_seconds``) and vLLM's labels
(``model_name``, ``finished_reason``), so a dashboard written for vLLM works by replacing the
prefix. The table of vLLM's names, Baton's, and which service owns each is in docs/deploy.md
("Metrics"). Every service defines the full set and updates the ones it owns; the rest stay at
zero, so each series has one owner and a sum across scrape targets counts nothing twice. Each
service is its own scrape target, told apart by Prometheus' ``job``/``instance`` labels, so no
metric carries a service label.

Every series carries ``model_name`` (the served model id,
``shared.models.catalog.served_model_id``: one per process, added when the registry is read)
but those of the process itself: ``baton:service``, the device's ``baton:gpu_*`` and the
gateway's HTTP server series.

Label values are closed sets (queue names, error codes, finish reasons, transports, preemption
modes): never a request id or anything else unbounded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import Counter, Gauge, Histogram, Info, generate_latest

from shared.observability.collectors import PREFIX, CudaCollector, ModelRegistry

# Buckets span both a GPU (sub-millisecond handoffs, ~2-10 ms per output token) and the CPU
# tiny model or a loaded system (tens of ms per token, seconds to minutes end to end).
REQUEST_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 600.0,
)  # fmt: skip
# Per token / per forward: finer steps where TPOT usually lives (2-100 ms).
STEP_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
    0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
HANDOFF_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
UTILIZATION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
TOKEN_COUNT_BUCKETS = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000,
)  # fmt: skip
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, for request_params_n
# vLLM's, for iteration_tokens_total: a decode step's tokens (one per sequence) up to a prefill's.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Metrics:
    """Every Baton metric, registered on ``self.registry`` (never on the global registry).

    Attributes are plain prometheus-client objects: ``metrics.generation_tokens.inc(n)``,
    ``metrics.request_errors.labels(code="timeout").inc()``; ``model_name`` is never passed, the
    registry adds it to every series when read. Every metric is declared through
    :meth:`counter`, :meth:`gauge` or :meth:`histogram` (the ``baton:`` prefix, this registry),
    here or in a subclass that adds a front's own (the gateway's ``GatewayMetrics``).
    """

    def __init__(self, model_name: str) -> None:
        self.registry = ModelRegistry(model_name)
        histogram, gauge, counter = self.histogram, self.gauge, self.counter
        self.service_info = Info(
            PREFIX + "service",
            "Service identity and settings (constant 1).",
            registry=self.registry,
        )
        self.registry.per_process.add(PREFIX + "service")

        # --- per HTTP request, observed by the gateway as it serves it (vLLM names) -------------
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "HTTP arrival to the first token in the gateway's hands.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between two consecutive output tokens, one observation per token after the "
            "first (tokens arriving together share their gap evenly).",
            STEP_LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "The same observations as inter_token_latency_seconds (vLLM's older name for it).",
            STEP_LATENCY_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            STEP_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "HTTP arrival to the terminal reply in the gateway's hands.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens a request asked for.", TOKEN_COUNT_BUCKETS
        )
        self.request_params_n = histogram(
            "request_params_n", "The n (choices) a request asked for.", N_BUCKETS
        )

        # --- per request on baton.requests, whatever its client (detokenizer; prompt tokens:
        # tokenizer). From arrival on baton.requests, so without the gateway's share. -----------
        self.pipeline_time_to_first_token = histogram(
            "pipeline_time_to_first_token_seconds",
            "Arrival on baton.requests to the first generated token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.pipeline_request_time_per_output_token = histogram(
            "pipeline_request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            STEP_LATENCY_BUCKETS,
        )
        self.pipeline_e2e_request_latency = histogram(
            "pipeline_e2e_request_latency_seconds",
            "Arrival on baton.requests to the terminal reply.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Time a request waited before its prefill started.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "Prefill start to the first token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds",
            "First token to the last.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds",
            "Prefill start to the last token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length per request.", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_COUNT_BUCKETS
        )

        # --- outcomes and throughput -----------------------------------------------------------
        self.request_success = counter(
            "request_success_total", "Requests finished, by finish reason.", ["finished_reason"]
        )
        self.request_errors = counter(
            "request_errors_total", "Requests answered with an error, by error code.", ["code"]
        )
        self.request_goodput = counter(
            "request_goodput_total",
            "Requests finished within the objectives BATON_SLO_TTFT_S and BATON_SLO_TPOT_S, "
            "by the client's priority (services/detokenizer/goodput.py).",
            ["priority"],
        )
        self.request_slo_judged = counter(
            "request_slo_judged_total",
            "Requests judged against the objectives (every terminal reply), by priority.",
            ["priority"],
        )
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.redelivered_messages = counter(
            "redelivered_messages_total",
            "Messages received with the broker's redelivered flag (a consumer died holding them).",
            ["queue"],
        )

        self.poison_messages = counter(
            "poison_messages_total",
            "Work messages dead-lettered after max_delivery_failures failed deliveries.",
            ["queue"],
        )
        self.detok_held_messages = gauge(
            "detok_held_messages",
            "Detokenizer inputs held unacked until their requests are answered (replayed by the "
            "next consumer of the shard if this replica dies).",
        )
        self.detok_active_requests = gauge(
            "detok_active_requests", "Requests this detokenizer replica is answering."
        )

        # --- scheduler state ------------------------------------------------------------------
        self.num_requests_running = gauge("num_requests_running", "Sequences in the running batch.")
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Sequences admitted but waiting for KV blocks or a slot."
        )
        self.queue_depth = gauge(
            "queue_depth", "Ready messages in a broker queue, as last polled.", ["queue"]
        )
        self.num_preemptions = counter(
            "num_preemptions_total",
            "Sequences preempted, by mode (swap: decode copies the victim's KV to the spill "
            "store and hands it to baton.decode, any worker resumes it; recompute: decode frees "
            "the victim's KV and rebuilds it when the sequence resumes).",
            ["mode"],
        )
        self.num_swap_ins = counter(
            "num_swap_ins_total",
            "Sequences resumed here from KV another (or this) decode worker swapped out.",
        )
        self.num_preemptions_by_cause = counter(
            "num_preemptions_by_cause_total",
            "Decode preemptions (swap or recompute) by cause: priority_slot (a waiting sequence "
            "outranked a running one by BATON_DECODE_PREEMPT_PRIORITY_GAP with the batch full by "
            "count), priority_kv (a higher-ranked waiting sequence needed KV blocks), kv_full "
            "(the running batch outgrew the cache).",
            ["cause"],
        )
        self.kv_prefetch_hits = counter(
            "kv_prefetch_hits_total",
            "Swapped-out KV loaded in the background that had landed before the step needing it.",
        )

        # --- scheduling policy (shared/flow_control/policy.py; its inputs not already above:
        # queue_depth, num_requests_*, kv_blocks_free, spill_store_bytes) ---------------------
        self.admission_decisions = counter(
            "admission_decisions_total",
            "Tokenizer admission decisions: admitted, or overloaded (a backlog at its limit).",
            ["decision"],
        )
        self.request_deadlines = counter(
            "request_deadlines_total",
            "Deadlines given to accepted requests, by source: default (by length), client (its "
            "timeout_s was shorter), none (no default and no timeout_s).",
            ["source"],
        )
        self.request_deadline_seconds = histogram(
            "request_deadline_seconds",
            "Deadline given to an accepted request, in seconds after its arrival.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.consumer_prefetch = gauge(
            "consumer_prefetch",
            "Messages this service's work consumer may hold unacked (its AMQP prefetch).",
        )
        self.prefetch_updates = counter(
            "prefetch_updates_total",
            "Prefetch changes sent to the broker (basic.qos, only when the value changes).",
        )
        self.release_seconds = gauge(
            "release_seconds",
            "Mean time from a step's end until its inputs are acked (its outputs confirmed "
            "first): how long a finished batch holds its prefetch slots.",
        )
        self.prefill_batches_ahead = gauge(
            "prefill_batches_ahead",
            "Prefill: batches held beyond the one in the forward (release time / forward time).",
        )
        self.prefill_intake_pressure = gauge(
            "prefill_intake_pressure",
            "Prefill: the larger of decode backlog / its pause limit and spill-store bytes / its "
            "pause limit (from 0.5 the intake shrinks; at 1 it pauses).",
        )
        self.prefill_intake_state = gauge(
            "prefill_intake_state",
            "Prefill intake: 1 for the current state (open, slowed, paused), else 0.",
            ["state"],
        )
        self.published_priority = counter(
            "published_priority_total",
            "Work messages published, by queue and AMQP priority (the effective priority then).",
            ["queue", "priority"],
        )
        self.priority_boosts = counter(
            "priority_boosts_total",
            "Work messages published above their client priority, by reason (short_prompt: "
            "tokenizer, under a deep prefill backlog; aging: prefill, for time waited).",
            ["reason"],
        )
        self.priority_aging_horizon = gauge(
            "priority_aging_horizon_seconds",
            "Wait after which a priority-0 request ranks with a fresh priority-9 one here.",
        )
        self.priority_median_wait = gauge(
            "priority_median_wait_seconds",
            "Median wait (since arrival) of the requests this worker recently started.",
        )
        self.short_prompt_boost_active = gauge(
            "short_prompt_boost_active",
            "1 while the prefill backlog is deep enough that short prompts are boosted.",
        )

        # --- batching -------------------------------------------------------------------------
        self.batch_size = histogram(
            "batch_size",
            "Sequences per forward (prefill batch or decode step).",
            BATCH_SIZE_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens per engine step: a prefill batch's prompt tokens, a decode step's sequences.",
            ITERATION_TOKEN_BUCKETS,
        )
        self.batch_token_utilization = histogram(
            "batch_token_utilization",
            "Tokens in a forward / the token budget (max_num_batched_tokens or max_num_seqs).",
            UTILIZATION_BUCKETS,
        )
        self.forward_seconds = histogram(
            "forward_seconds", "Wall time of one model forward.", STEP_LATENCY_BUCKETS
        )
        self.engine_threads = gauge(
            "engine_threads",
            "Torch threads of this engine's last forward: its share of the cores while other "
            "engines are busy, all of them while it runs alone (BATON_CPU_SHARE).",
        )
        self.forward_thread_seconds = counter(
            "forward_thread_seconds_total",
            "Forward wall time x torch threads; over forward_seconds' sum it is the mean "
            "number of cores a forward used (BATON_CPU_SHARE).",
        )
        self.memory_bandwidth_bytes_per_second = gauge(
            "memory_bandwidth_bytes_per_second",
            "Estimated bytes read per decode step (weights + KV) / step time; divide by the "
            "device's peak for bandwidth utilization.",
        )

        # --- KV cache -------------------------------------------------------------------------
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1, vLLM's unit)."
        )
        self.kv_blocks_used = gauge("kv_blocks_used", "KV blocks referenced by a sequence.")
        self.kv_blocks_free = gauge(
            "kv_blocks_free", "KV blocks allocatable (free or cached but unreferenced)."
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits_total", "Prompt tokens found in the prefix cache."
        )
        self.kv_host_blocks_used = gauge(
            "kv_host_blocks_used",
            "KV blocks in use in the host tier (BATON_KV_HOST_CACHE_MB); counted in "
            "kv_blocks_used too.",
        )
        self.kv_host_staged_blocks = counter(
            "kv_host_staged_blocks_total",
            "Host-tier KV blocks copied into the device pool for a forward or a transport.",
        )
        self.spill_store_bytes = gauge(
            "spill_store_bytes",
            "Bytes held in the shared-memory spill store (the shm KV transport), as last polled.",
        )

        # --- prefill -> decode handoff --------------------------------------------------------
        self.handoff_bytes = counter(
            "handoff_bytes_total", "KV bytes moved between prefill and decode.", ["transport"]
        )
        self.handoff_seconds = histogram(
            "handoff_seconds",
            "Time to write (prefill) or read (decode) one request's KV through a transport.",
            HANDOFF_LATENCY_BUCKETS,
            ["transport"],
        )
        self.kv_blocks_pinned = gauge(
            "kv_blocks_pinned",
            "Sender: KV blocks pinned for receivers of a pooled transport (pool, cuda-ipc).",
        )
        self.kv_leases_expired = counter(
            "kv_leases_expired_total",
            "Sender: pinned handoffs freed by lease expiry (the receiver never released them).",
        )
        self.kv_orphans_reclaimed = counter(
            "kv_orphans_reclaimed_total",
            "KV freed because no receiver would take it, by kind (spill_entries, pool_blocks, "
            "pool_files) and reason (unclaimed, lease_expired, owner_dead); every engine "
            "that reclaims counts its own.",
            ["kind", "reason"],
        )
        self.kv_map_failures = counter(
            "kv_map_failures_total",
            "Receiver: handoffs whose sender pool could not be mapped; recomputed instead.",
        )
        self.kv_stale_loads = counter(
            "kv_stale_loads_total",
            "Receiver: handoffs refused because their KV might no longer be valid; recomputed.",
        )
        self.kv_handoff_fallbacks = counter(
            "kv_handoff_fallbacks_total",
            "Handoffs that went through the spill store because the configured transport cannot "
            "work here (only with BATON_KV_FALLBACK=spill).",
        )

    # --- the one way to declare a metric ---------------------------------------------------------
    # per_model=False: a series of the process (its HTTP server), without model_name.
    def histogram(
        self,
        name: str,
        doc: str,
        buckets: Sequence[float],
        labels: Iterable[str] = (),
        per_model: bool = True,
    ) -> Histogram:
        self._declare(name, per_model)
        return Histogram(PREFIX + name, doc, tuple(labels), registry=self.registry, buckets=buckets)

    def gauge(
        self, name: str, doc: str, labels: Iterable[str] = (), per_model: bool = True
    ) -> Gauge:
        self._declare(name, per_model)
        return Gauge(PREFIX + name, doc, tuple(labels), registry=self.registry)

    def counter(
        self, name: str, doc: str, labels: Iterable[str] = (), per_model: bool = True
    ) -> Counter:
        # prometheus-client appends _total itself; pass the name with or without it.
        name = name.removesuffix("_total")
        self._declare(name, per_model)
        return Counter(PREFIX + name, doc, tuple(labels), registry=self.registry)

    def _declare(self, name: str, per_model: bool) -> None:
        if not per_model:
            self.registry.per_process.add(PREFIX + name)

    def set_kv_blocks(self, num_used_blocks: int, num_free_blocks: int) -> None:
        """Set the three KV gauges from one reading, so they never disagree."""
        self.kv_blocks_used.set(num_used_blocks)
        self.kv_blocks_free.set(num_free_blocks)
        total = num_used_blocks + num_free_blocks
        self.kv_cache_usage_perc.set(num_used_blocks / total if total else 0.0)

    def set_queue_depths(self, depths: Mapping[str, int]) -> None:
        for queue, depth in depths.items():
            self.queue_depth.labels(queue=queue).set(depth)

    def watch_device(self, device: str) -> None:
        """Export GPU memory (and utilization, where NVML is available) for a CUDA device.

        Read at scrape time, so the numbers are current and cost nothing between scrapes.
        A CPU device exports nothing: host memory belongs to node-level exporters.
        """
        if device.startswith("cuda"):
            self.registry.register(CudaCollector(device))

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format (version 0.0.4)."""
        return generate_latest(self.registry)
