"""The broker topology every party agrees on: queue and exchange names and their arguments.

Part of the client contract (docs/contract.md): clients publish to ``baton.requests`` and
cancel on ``baton.control``. Every declarer uses the *same* arguments (a mismatch is a channel
error), so they live here once.
"""

from __future__ import annotations

import zlib
from typing import Any

from shared.wire.priority import MAX_PRIORITY

REQUESTS_QUEUE = "baton.requests"
PREFILL_QUEUE = "baton.prefill"
DECODE_QUEUE = "baton.decode"
# The work queues proper: priority queues that any worker of the stage may take from.
WORK_QUEUES = (REQUESTS_QUEUE, PREFILL_QUEUE, DECODE_QUEUE)
CONTROL_EXCHANGE = "baton.control"
DEAD_LETTER_EXCHANGE = "baton.dlx"
DEAD_LETTER_QUEUE = "baton.dead"

WORK_QUEUE_ARGS: dict[str, Any] = {
    "x-max-priority": MAX_PRIORITY + 1,
    "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
}
# The detokenizer's input is sharded by request id (``detok_queue_for``): one request's
# registration and token events always meet the same state. Each shard has a single active
# consumer (the broker fails it over to a standby replica when the active one dies). Starts and
# events go at priority 0: FIFO, so a registration is always read before that request's events.
# The detokenizer's own stream marks go at MARK_PRIORITY, so the replica that takes a shard over
# reads every mark before any start or event it replays (services/detokenizer/marks.py).
DETOK_QUEUE_PREFIX = "baton.detok."
MARK_PRIORITY = 1
DETOK_QUEUE_ARGS: dict[str, Any] = {
    "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
    "x-single-active-consumer": True,
    "x-max-priority": MARK_PRIORITY,
}
# The dead-letter queue is bounded so a flood of garbage cannot fill the broker's disk.
DEAD_QUEUE_ARGS: dict[str, Any] = {"x-max-length": 10_000, "x-message-ttl": 7 * 24 * 3600 * 1000}


def kv_release_queue(sender_id: str) -> str:
    """The queue of one KV-sending worker, where receivers publish its release notices. It lives
    as long as that worker's connection (exclusive, auto-deleted): a notice for a dead sender is
    unroutable and dropped, which is right — its pool died with it."""
    return f"baton.kv_release.{sender_id}"


def detok_queues(num_shards: int) -> tuple[str, ...]:
    return tuple(f"{DETOK_QUEUE_PREFIX}{i}" for i in range(num_shards))


def detok_queue_for(request_id: str, num_shards: int) -> str:
    """The shard of a request: a stable hash (crc32, the same in every process and language)."""
    return f"{DETOK_QUEUE_PREFIX}{zlib.crc32(request_id.encode()) % num_shards}"


def internal_queues(num_shards: int) -> tuple[str, ...]:
    """Every queue that carries work between services (all but ``baton.requests``)."""
    return (PREFILL_QUEUE, DECODE_QUEUE, *detok_queues(num_shards))


def queue_arguments(name: str) -> dict[str, Any]:
    """The declaration arguments of one of our durable queues (every declarer uses these)."""
    return DETOK_QUEUE_ARGS if name.startswith(DETOK_QUEUE_PREFIX) else WORK_QUEUE_ARGS
