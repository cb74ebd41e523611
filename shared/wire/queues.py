"""The broker topology every party agrees on: queue and exchange names and their arguments.

Part of the client contract (docs/contract.md): clients publish to ``baton.requests`` and
cancel on ``baton.control``. Every declarer uses the *same* arguments (a mismatch is a channel
error), so they live here once; the work queues' depend on ``BATON_QUEUE_TYPE``.
"""

from __future__ import annotations

import zlib
from typing import Any

from shared.config import BatonConfig
from shared.wire.priority import MAX_PRIORITY

REQUESTS_QUEUE = "baton.requests"
PREFILL_QUEUE = "baton.prefill"
DECODE_QUEUE = "baton.decode"
# The work queues proper: queues that any worker of the stage may take from (BATON_QUEUE_TYPE).
WORK_QUEUES = (REQUESTS_QUEUE, PREFILL_QUEUE, DECODE_QUEUE)
CONTROL_EXCHANGE = "baton.control"
DEAD_LETTER_EXCHANGE = "baton.dlx"
DEAD_LETTER_QUEUE = "baton.dead"
# Quorum work queues only: a second copy of every dead letter (bound to baton.dlx beside
# baton.dead), from which the tokenizer answers the requests the broker set aside at
# x-delivery-limit (services/tokenizer/poison.py). baton.dead keeps its copy for operators.
POISON_QUEUE = "baton.poison"
QUEUE_TYPES = ("classic", "quorum")

# Classic work queues: priority queues (the contract's ten levels); poison is counted by the
# services (services/shell/shell.py, ``_count_redelivery``).
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
# Bounded too, for the time no tokenizer consumes it.
POISON_QUEUE_ARGS: dict[str, Any] = {"x-queue-type": "quorum", "x-max-length": 10_000}


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


def work_queue_args(config: BatonConfig) -> dict[str, Any]:
    """The work queues' declaration arguments under ``config.queue_type``.

    Quorum (RabbitMQ 3.10+): replicated by Raft, and the broker counts deliveries. A message
    returned ``max_delivery_failures`` times (a worker crashed or lost its channel, or gave it
    back in a drain) is dead-lettered by the broker, reason ``delivery_limit``: the limit is the
    number of returns allowed before that. At-least-once dead-lettering (which needs
    ``reject-publish`` overflow; there is no length limit to overflow) keeps the message in its
    queue until baton.dead and baton.poison have it, so none is lost on the way. No
    ``x-max-priority``: RabbitMQ 3.x refuses it on a quorum queue (docs/reliability.md)."""
    if config.queue_type == "classic":
        return WORK_QUEUE_ARGS
    if config.queue_type != "quorum":
        raise ValueError(
            f"BATON_QUEUE_TYPE must be one of {QUEUE_TYPES}, got {config.queue_type!r}"
        )
    if config.max_delivery_failures < 1:
        raise ValueError("BATON_MAX_DELIVERY_FAILURES must be at least 1 with quorum queues")
    return {
        "x-queue-type": "quorum",
        "x-delivery-limit": config.max_delivery_failures - 1,
        "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }


def queue_arguments(name: str, config: BatonConfig) -> dict[str, Any]:
    """The declaration arguments of one of our durable queues (every declarer uses these)."""
    if name.startswith(DETOK_QUEUE_PREFIX):
        return DETOK_QUEUE_ARGS
    fixed = {DEAD_LETTER_QUEUE: DEAD_QUEUE_ARGS, POISON_QUEUE: POISON_QUEUE_ARGS}
    return fixed.get(name) or work_queue_args(config)


def dead_letter_queues(config: BatonConfig) -> tuple[str, ...]:
    """The queues bound to baton.dlx: baton.dead, and with quorum work queues baton.poison."""
    return (
        (DEAD_LETTER_QUEUE, POISON_QUEUE) if config.queue_type == "quorum" else (DEAD_LETTER_QUEUE,)
    )
