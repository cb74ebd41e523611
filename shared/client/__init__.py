"""The client library (async, aio-pika) and the command-line client (python -m shared.client)."""

from shared.client.async_client import (
    BatonClient,
    BatonConnectionLost,
    BatonUnavailable,
    Completion,
    RequestOptions,
    Terminal,
    TimedReply,
    default_amqp_url,
)

__all__ = [
    "BatonClient",
    "BatonConnectionLost",
    "BatonUnavailable",
    "Completion",
    "RequestOptions",
    "Terminal",
    "TimedReply",
    "default_amqp_url",
]
