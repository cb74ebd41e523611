"""Stream marks: how far each stream was answered, kept in the broker beside its inputs.

A detokenizer that dies is replaced by one that replays the dead one's unacked inputs
(``ledger.py``). Without more, the replay would send every live stream again from its start. So
each batch that streams a request's tokens also commits a *mark* — the position and text offset
after its last token reply — in the same transaction as the replies
(``services/shell/tx_outbox.py``): a reply is committed exactly when its mark is. Marks go to the
request's own shard (``baton.detok.<n>``), at a priority above starts and events, and are held
there like any input (until the request is answered or a newer mark of it arrives). The replica
that takes a shard over is handed every held message at once, so it reads each request's newest
mark before the request's start and events (the broker delivers higher priorities first), and
the core applies the positions before the mark without streaming them (``core.py``,
``DetokenizerCore.resume``): the client sees each position once, in order.

A terminal reply needs no mark: it commits together with the acks of its request's start and
events, so a replay never meets that request again. With ``n`` > 1 a choice's ``done`` reply
commits while the request's inputs are still held (its other choices run): its mark says
``done``, and the replay finishes that choice without answering it again.
"""

from __future__ import annotations

from services.detokenizer.core import Output
from services.shell.broker import Outgoing
from shared.wire.messages import DetokMsg, StreamMark, TokenReply
from shared.wire.queues import MARK_PRIORITY, detok_queue_for


def stream_marks(out: Output) -> list[StreamMark]:
    """The mark after each request's last token reply of this batch (none for a request that
    finished in it); an n > 1 request's are the core's, one per choice (``Output.marks``)."""
    closed = set(out.closed)
    last: dict[str, StreamMark] = {}
    for _, reply in out.replies:
        if (
            isinstance(reply, TokenReply)
            and reply.choice_index is None
            and reply.request_id not in closed
        ):
            offset = (reply.text_offset or 0) + len(reply.text)
            end = reply.index + len(reply.token_ids)
            last[reply.request_id] = StreamMark(reply.request_id, end, offset)
    return [*last.values(), *out.marks]


def mark_messages(marks: list[StreamMark], num_shards: int) -> list[Outgoing]:
    """One message per shard, to the requests' own shards, at the marks' priority."""
    by_shard: dict[str, list[StreamMark]] = {}
    for mark in marks:
        by_shard.setdefault(detok_queue_for(mark.request_id, num_shards), []).append(mark)
    return [
        Outgoing(queue, DetokMsg(marks=shard_marks).encode(), priority=MARK_PRIORITY)
        for queue, shard_marks in by_shard.items()
    ]
