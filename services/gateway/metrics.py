"""The gateway's Prometheus metrics, on the same registry as the full :class:`Metrics` set.

Like every Baton service, the gateway exports the whole set. It owns the per-request latencies
of vLLM's front end, observed on the replies of each request it serves (:meth:`timed`), and adds
what only an HTTP front has (``baton:http_*``, ``baton:gateway_overhead_seconds``; without
``model_name``: they are the HTTP server's). What each series measures: docs/gateway.md,
"Metrics"; which service owns which: docs/deploy.md, "Metrics".

Route labels are a closed set (the served paths, else ``other``), never the raw path.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from shared.client import TimedReply
from shared.observability.collectors import observe_many
from shared.observability.metrics import REQUEST_LATENCY_BUCKETS, Metrics
from shared.wire.messages import DoneReply, TokenReply

ROUTES = frozenset(
    ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
     "/version", "/health", "/metrics")
)  # fmt: skip
# 50 µs to 100 ms: the gateway's share is meant to sit well under 2 ms.
OVERHEAD_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005,
    0.01, 0.025, 0.05, 0.1,
)  # fmt: skip


def route_label(path: str) -> str:
    return path if path in ROUTES else "other"


class GatewayMetrics(Metrics):
    def __init__(self, model_name: str) -> None:
        super().__init__(model_name)
        self.service_info.info({"service": "gateway"})
        self.http_requests = self.counter(
            "http_requests_total",
            "HTTP responses by route and status code (499: the client went away first).",
            ("route", "status"),
            per_model=False,
        )
        self.http_request_duration = self.histogram(
            "http_request_duration_seconds",
            "Arrival to the last byte of the response, by route.",
            REQUEST_LATENCY_BUCKETS,
            ("route",),
            per_model=False,
        )
        self.gateway_overhead = self.histogram(
            "gateway_overhead_seconds",
            "Time the gateway adds to time to first byte (parsing and publishing, and turning "
            "Baton's first reply into bytes), waiting for Baton excluded.",
            OVERHEAD_BUCKETS,
            per_model=False,
        )
        self.client_disconnects = self.counter(
            "http_client_disconnects_total",
            "Requests cancelled because the HTTP client disconnected before the end.",
            ("route",),
            per_model=False,
        )
        self.requests_in_flight = self.gauge(
            "http_requests_in_flight",
            "HTTP requests received and not yet fully answered.",
            per_model=False,
        )

    async def timed(
        self,
        replies: AsyncGenerator[TimedReply, None],
        t0: float | None,
        max_tokens: int | None,
        n: int = 1,
    ) -> AsyncGenerator[TimedReply, None]:
        """``replies`` (one request's, from ``BatonClient.stream_timed``) passed through as they
        come, each observed. ``t0``: ``perf_counter()`` at the HTTP arrival (None: from the
        publish). Closing this closes ``replies``, as closing them directly would."""
        # One set of observations per choice (an n > 1 request's choices count as vLLM's child
        # requests do: each its own TTFT, gaps and end).
        latencies: dict[int, RequestLatencies] = {}
        async with aclosing(replies):
            async for t in replies:
                index = getattr(t.reply, "choice_index", None) or 0
                if index not in latencies:
                    # The request's parameters are observed once, with choice 0.
                    params = (max_tokens, n) if index == 0 else None
                    latencies[index] = RequestLatencies(self, t0, params)
                latencies[index].add(t)
                yield t


class RequestLatencies:
    """One request's latency observations, from its replies in the order they arrive."""

    def __init__(
        self, metrics: GatewayMetrics, t0: float | None, params: tuple[int | None, int] | None
    ) -> None:
        """``params``: the request's ``max_tokens`` and ``n``, to observe at its end (None: a
        choice other than the first, which does not count the request again)."""
        self.metrics = metrics
        self.t0 = t0
        self.params = params
        self.num_tokens = 0  # received so far
        self.first_at: float | None = None
        self.last_at = 0.0

    def add(self, t: TimedReply) -> None:
        reply = t.reply
        if self.t0 is None:
            self.t0 = t.received_at - t.elapsed_s  # the publish
        if isinstance(reply, TokenReply):
            # index + length, not the length alone: a re-sent reply adds nothing
            self._tokens(reply.index + len(reply.token_ids) - self.num_tokens, t.received_at)
        elif isinstance(reply, DoneReply):
            self._done(reply, t)

    def _tokens(self, new: int, at: float) -> None:
        if new <= 0:
            return
        m = self.metrics
        if self.first_at is None:
            assert self.t0 is not None
            self.first_at = at
            m.time_to_first_token.observe(at - self.t0)
            gap, gaps = 0.0, new - 1
        else:
            gap, gaps = (at - self.last_at) / new, new
        self._gaps(gap, gaps)
        self.last_at = at
        self.num_tokens += new

    def _gaps(self, gap: float, count: int) -> None:
        observe_many(self.metrics.inter_token_latency, gap, count)
        observe_many(self.metrics.time_per_output_token, gap, count)

    def _done(self, done: DoneReply, t: TimedReply) -> None:
        m, n = self.metrics, len(done.token_ids)
        assert self.t0 is not None
        if self.first_at is None and n:  # no token reply: Baton's own timing of the tokens
            published_at = t.received_at - t.elapsed_s
            ttft_s, tpot_s = done.timing.get("ttft_s") or 0.0, done.timing.get("tpot_s") or 0.0
            m.time_to_first_token.observe(published_at - self.t0 + ttft_s)
            self._gaps(tpot_s, n - 1)
            self.num_tokens = n
        else:  # tokens not streamed before the done (none, normally) arrived with it
            self._tokens(n - self.num_tokens, t.received_at)
            tpot_s = (self.last_at - self.first_at) / (n - 1) if self.first_at and n > 1 else 0.0
        if n > 1:
            m.request_time_per_output_token.observe(tpot_s)
        m.e2e_request_latency.observe(t.received_at - self.t0)
        if self.params is not None:
            max_tokens, n_choices = self.params
            if max_tokens is not None:
                m.request_params_max_tokens.observe(max_tokens)
            m.request_params_n.observe(n_choices)
