"""Dropping duplicate replies: what makes at-least-once reply delivery exactly-once for a client.

Replies are published at least once: a confirm lost in a reconnect is republished, and a
detokenizer that crashed is replaced by one that replays the request from its start. Every
``token`` reply says where it lies — output positions ``index``.. and ``text_offset``, the
characters of the completion before its text — so a client keeps only what extends what it
already has. Terminal replies after the first are dropped by the caller (the request is over).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from shared.wire.messages import DoneReply, Reply, TokenReply


class StreamDeduplicator:
    """One request's stream: the positions and characters received so far."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self.num_chars = 0
        self.num_duplicates = 0

    def accept(self, reply: TokenReply) -> TokenReply | None:
        """The part of ``reply`` not received yet (None: all of it was)."""
        if reply.text_offset is None:  # a server without offsets never replays
            self.num_tokens = max(self.num_tokens, reply.index + len(reply.token_ids))
            return reply
        skip_ids = max(0, self.num_tokens - reply.index)
        skip_chars = max(0, self.num_chars - reply.text_offset)
        ids, text = reply.token_ids[skip_ids:], reply.text[skip_chars:]
        self.num_tokens = max(self.num_tokens, reply.index + len(reply.token_ids))
        self.num_chars = max(self.num_chars, reply.text_offset + len(reply.text))
        if not ids and not text and (skip_ids or skip_chars):
            self.num_duplicates += 1
            return None
        if not skip_ids and not skip_chars:
            return reply
        return dataclasses.replace(
            reply,
            token_ids=ids,
            text=text,
            index=reply.index + skip_ids,
            text_offset=reply.text_offset + skip_chars,
            logprobs=None if reply.logprobs is None else reply.logprobs[skip_ids:],
            prompt_logprobs=None if skip_ids else reply.prompt_logprobs,
        )


def stream_mismatch(done: DoneReply, replies: Iterable[Reply]) -> str | None:
    """How a request's token replies — every copy, replays included — fail to match its done
    reply, or None: each agrees with it at its positions and text offset, and the stream cut to
    what is new (as :class:`StreamDeduplicator` does) is the done reply exactly, with no gap."""
    stream, ids, text = StreamDeduplicator(), list[int](), ""
    for r in replies:
        if not isinstance(r, TokenReply):
            continue
        if r.text_offset is None:
            return f"no text_offset: {r}"
        if r.token_ids != done.token_ids[r.index : r.index + len(r.token_ids)]:
            return f"tokens differ from the done reply's: {r}"
        if r.text != done.text[r.text_offset : r.text_offset + len(r.text)]:
            return f"text differs from the done reply's: {r}"
        fresh = stream.accept(r)
        if fresh is not None:
            if fresh.index != len(ids) or fresh.text_offset != len(text):
                return f"a gap before {r}"
            ids += fresh.token_ids
            text += fresh.text
    if ids != done.token_ids or text != done.text:
        return "the stream is not the done reply"
    return None
