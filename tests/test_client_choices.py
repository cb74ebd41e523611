"""The client library with ``n`` > 1: replies are routed per (request, choice), duplicates of
any choice's tokens or done reply are dropped, and a request's stream ends after one done reply
per choice, or at its error. No broker: replies are handed to the consumer callback."""

from __future__ import annotations

import asyncio
from typing import Any

from shared.client import async_client
from shared.client.async_client import BatonClient
from shared.wire.messages import DoneReply, ErrorReply, Reply, TokenReply

USAGE = {"prompt_tokens": 3, "completion_tokens": 2}


def token(index: int, ids: list[int], text: str, offset: int, choice: int) -> TokenReply:
    return TokenReply("r", text, ids, index, offset, choice_index=choice)


def done(text: str, ids: list[int], choice: int) -> DoneReply:
    return DoneReply("r", text, ids, "length", USAGE, {}, choice_index=choice)


async def received(n: int, replies: list[Reply]) -> list[Reply]:
    """What a caller of ``stream_timed`` sees of ``replies`` (in arrival order)."""
    client: Any = BatonClient(None, None, None, None, 5.0)  # type: ignore[arg-type]
    pending = async_client._Pending(asyncio.Queue(), n=n)
    client._pending["r"] = pending
    for reply in replies:
        client._route("r", reply, 0.0)
    return [t.reply async for t in client._replies("r", pending, 1.0)]


async def test_each_choice_once_and_the_stream_ends_after_n_dones() -> None:
    a0, b0 = token(0, [5], "a", 0, 0), token(0, [7], "b", 0, 1)
    a1 = token(1, [6], "c", 1, 0)
    replayed = token(0, [7, 8], "bd", 0, 1)  # a detokenizer's replay: only "d" is new
    seen = await received(
        2,
        [a0, b0, a0, a1, replayed, done("ac", [5, 6], 0), done("ac", [5, 6], 0),
         done("bd", [7, 8], 1), token(2, [9], "x", 2, 0)],
    )  # fmt: skip
    assert [(type(r).__name__, r.choice_index) for r in seen] == [  # type: ignore[union-attr]
        ("TokenReply", 0), ("TokenReply", 1), ("TokenReply", 0), ("TokenReply", 1),
        ("DoneReply", 0), ("DoneReply", 1),
    ]  # fmt: skip
    assert isinstance(seen[3], TokenReply) and (seen[3].text, seen[3].token_ids) == ("d", [8])


async def test_an_error_ends_every_choice() -> None:
    seen = await received(
        3, [done("a", [1], 0), ErrorReply("r", "internal", "boom"), done("b", [2], 1)]
    )
    assert [type(r).__name__ for r in seen] == ["DoneReply", "ErrorReply"]
