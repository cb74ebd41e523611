"""Replies as messages (services/detokenizer/batching.py): batches only for requests that asked,
per reply queue, in order, within bounds; and the batch format (shared/wire/replies.py)."""

from __future__ import annotations

import msgpack
import pytest

from services.detokenizer.batching import reply_messages
from shared.wire.errors import ProtocolError
from shared.wire.messages import DoneReply, ErrorReply, Reply, TokenReply
from shared.wire.replies import decode_replies, decode_reply, encode_reply_batch

LIMIT = 1 << 20


def tok(rid: str, index: int, text: str = "x") -> TokenReply:
    return TokenReply(rid, text, [index + 5], index, text_offset=index)


def done(rid: str) -> DoneReply:
    return DoneReply(rid, "xyz", [5, 6, 7], "length", {"prompt_tokens": 3}, {"e2e_s": 0.1})


def unpacked(msgs) -> list[tuple[str, str | None, list[Reply]]]:  # type: ignore[no-untyped-def]
    return [(m.routing_key, m.correlation_id, decode_replies(m.body, LIMIT)) for m in msgs]


def test_without_the_flag_every_reply_is_its_own_message() -> None:
    replies: list[tuple[str, Reply]] = [("q", tok("a", 0)), ("q", tok("b", 0)), ("q", done("a"))]
    msgs = reply_messages(replies, batchable=set())
    assert [(m.routing_key, m.correlation_id) for m in msgs] == [("q", "a"), ("q", "b"), ("q", "a")]
    assert [decode_reply(m.body, LIMIT) for m in msgs] == [r for _, r in replies]


def test_replies_sharing_a_queue_go_together_in_order() -> None:
    replies: list[tuple[str, Reply]] = [
        ("q1", tok("a", 0)),
        ("q2", tok("c", 0)),  # another client: its own message
        ("q1", tok("b", 0)),
        ("q3", tok("d", 0)),  # did not ask: alone, with its correlation_id
        ("q1", tok("a", 1)),
        ("q1", done("a")),
    ]
    msgs = unpacked(reply_messages(replies, batchable={"a", "b", "c"}))
    assert msgs == [
        ("q1", None, [tok("a", 0), tok("b", 0), tok("a", 1), done("a")]),
        ("q2", "c", [tok("c", 0)]),  # a batch of one is a plain reply
        ("q3", "d", [tok("d", 0)]),
    ]


def test_batches_are_cut_by_count_and_by_bytes() -> None:
    replies: list[tuple[str, Reply]] = [("q", tok(f"r{i}", 0)) for i in range(7)]
    ids = {f"r{i}" for i in range(7)}
    by_count = unpacked(reply_messages(replies, ids, max_batch_replies=3))
    assert [len(rs) for _, _, rs in by_count] == [3, 3, 1]
    assert [r for _, _, rs in by_count for r in rs] == [r for _, r in replies]
    size = len(replies[0][1].encode())
    by_bytes = unpacked(
        reply_messages(replies, {f"r{i}" for i in range(7)}, max_batch_bytes=2 * size)
    )
    assert [len(rs) for _, _, rs in by_bytes] == [2, 2, 2, 1]


def test_batch_format_round_trips() -> None:
    replies: list[Reply] = [
        tok("a", 0),
        TokenReply("b", "", [], 3),
        done("a"),
        ErrorReply("c", "internal", "m"),
    ]
    body = encode_reply_batch([r.encode() for r in replies])
    assert msgpack.unpackb(body)["type"] == "batch"
    assert decode_replies(body, LIMIT) == replies
    assert "text_offset" not in msgpack.unpackb(body)["replies"][1]  # absent, as when alone
    assert decode_replies(replies[2].encode(), LIMIT) == [replies[2]]
    with pytest.raises(ValueError):
        encode_reply_batch([replies[0].encode()])


@pytest.mark.parametrize(
    "body",
    [
        {"type": "batch"},
        {"type": "batch", "replies": []},
        {"type": "batch", "replies": "no"},
        {"type": "batch", "replies": [1, 2]},
        {"type": "batch", "replies": [{"type": "nope", "request_id": "a"}]},
        {"type": "batch", "replies": [{"type": "token", "request_id": "a"}]},
        {"type": "batch", "replies": [{"type": "error", "request_id": "a"}] * 1025},
    ],
)
def test_malformed_batches_are_refused(body: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ProtocolError):
        decode_replies(msgpack.packb(body), LIMIT)
