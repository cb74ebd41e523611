"""Replies as broker messages: one message per reply, except that replies of requests whose
client asked for batches (``batch_replies``) and that share a reply queue go out together.

A benchmark client streaming 64 requests got ~19 token replies per request, each its own
message: the broker, this service and the client spent more CPU moving them than decode spent
computing them. A batch keeps every reply (the stream's granularity is unchanged) and costs one
message per reply queue per flush. Order is kept within a request (a batch lists its replies in
the order they were made) and across messages (a batch goes where its first reply was).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.shell.broker import Outgoing
from shared.wire.replies import MAX_BATCH_REPLIES, Reply, encode_reply_batch

# Well under the client library's reply bound (max_message_bytes, 1 MiB): a done reply carries
# the whole completion, so a batch is cut by bytes as well as by count.
MAX_BATCH_BYTES = 256 << 10


@dataclass
class _Batch:
    reply_to: str
    replies: list[tuple[Reply, bytes]] = field(default_factory=list)  # (reply, its encoding)
    num_bytes: int = 0


def reply_messages(
    replies: list[tuple[str, Reply]],
    batchable: set[str],
    max_batch_bytes: int = MAX_BATCH_BYTES,
    max_batch_replies: int = MAX_BATCH_REPLIES,
) -> list[Outgoing]:
    """``replies``: (reply_to, reply) in the order made; ``batchable``: request ids whose
    replies may share a message."""
    slots: list[Outgoing | _Batch] = []
    open_batches: dict[str, _Batch] = {}
    for reply_to, reply in replies:
        body = reply.encode()
        if reply.request_id not in batchable:
            slots.append(_single(reply_to, reply, body))
            continue
        batch = open_batches.get(reply_to)
        if batch is None or (
            len(batch.replies) >= max_batch_replies or batch.num_bytes + len(body) > max_batch_bytes
        ):
            batch = open_batches[reply_to] = _Batch(reply_to)
            slots.append(batch)
        batch.replies.append((reply, body))
        batch.num_bytes += len(body)
    out: list[Outgoing] = []
    for slot in slots:
        if isinstance(slot, Outgoing):
            out.append(slot)
        elif len(slot.replies) == 1:  # alone after all: a plain reply, as for any client
            out.append(_single(slot.reply_to, *slot.replies[0]))
        else:
            body = encode_reply_batch([b for _, b in slot.replies])
            out.append(Outgoing(slot.reply_to, body))
    return out


def _single(reply_to: str, reply: Reply, body: bytes) -> Outgoing:
    # Persistent: a client's reply queue is durable, so its replies survive a broker restart.
    return Outgoing(reply_to, body, correlation_id=reply.request_id)
