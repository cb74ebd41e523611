"""The gateway's Prometheus metrics, on the same registry as the full :class:`Metrics` set.

Like every Baton service, the gateway exports the whole set (the per-request latencies and
outcomes stay at zero here: the detokenizer owns them, and counting them twice would double
every dashboard's sums) plus what only an HTTP front has:

- ``baton:http_requests_total{route, status}``: responses by route template and status code.
  A client that went away before its response ended counts as status ``499`` (nginx's "client
  closed request"), whatever status line it may already have been sent.
- ``baton:http_request_duration_seconds{route}``: arrival to the last byte handed to the server.
- ``baton:gateway_overhead_seconds``: what the gateway adds to a request's time to first
  byte: from arrival to the publish on ``baton.requests``, plus from Baton's first reply
  arriving to its bytes being handed to the server. Waiting for Baton is not in it.
- ``baton:http_client_disconnects_total{route}``: requests cancelled because the client left.
- ``baton:http_requests_in_flight``: requests between arrival and their last byte.

Route labels are a closed set (the served paths, else ``other``), never the raw path.
"""

from __future__ import annotations

from shared.observability.metrics import REQUEST_LATENCY_BUCKETS, Metrics

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
    def __init__(self) -> None:
        super().__init__()
        self.service_info.info({"service": "gateway"})
        self.http_requests = self.counter(
            "http_requests_total",
            "HTTP responses by route and status code (499: the client went away first).",
            ("route", "status"),
        )
        self.http_request_duration = self.histogram(
            "http_request_duration_seconds",
            "Arrival to the last byte of the response, by route.",
            REQUEST_LATENCY_BUCKETS,
            ("route",),
        )
        self.gateway_overhead = self.histogram(
            "gateway_overhead_seconds",
            "Time the gateway adds to time to first byte (parsing and publishing, and turning "
            "Baton's first reply into bytes), waiting for Baton excluded.",
            OVERHEAD_BUCKETS,
        )
        self.client_disconnects = self.counter(
            "http_client_disconnects_total",
            "Requests cancelled because the HTTP client disconnected before the end.",
            ("route",),
        )
        self.requests_in_flight = self.gauge(
            "http_requests_in_flight", "HTTP requests received and not yet fully answered."
        )
