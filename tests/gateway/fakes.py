"""A scripted stand-in for BatonClient: the gateway's HTTP behaviour without a running Baton."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from shared.client import TimedReply
from shared.wire.messages import DoneReply, ErrorReply, Reply, TokenReply

HANG = "hang"  # in a script: wait forever at this point (a request that never finishes)
Script = Callable[[str, dict[str, Any]], list[Reply | str | BaseException]]


def tokens_then_done(*pieces: str, finish_reason: str = "length", prompt_tokens: int = 3) -> Script:
    """A stream of one token reply per piece, then the done reply with the whole text."""

    def script(rid: str, _kw: dict[str, Any]) -> list[Reply | str | BaseException]:
        replies: list[Reply | str | BaseException] = [
            TokenReply(rid, p, [100 + i], i) for i, p in enumerate(pieces)
        ]
        ids = [100 + i for i in range(len(pieces))]
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces)}
        timing = {"queue_s": 0.0, "ttft_s": 0.0, "tpot_s": 0.0, "e2e_s": 0.0}
        replies.append(DoneReply(rid, "".join(pieces), ids, finish_reason, usage, timing))
        return replies

    return script


def error(code: str, message: str = "refused") -> Script:
    return lambda rid, _kw: [ErrorReply(rid, code, message)]


class FakeBaton:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.script: Script = tokens_then_done("Hel", "lo")
        self.calls: list[dict[str, Any]] = []
        self.closed_early: list[str] = []  # streams closed before their terminal reply
        self.hanging = asyncio.Event()  # set when a script reaches HANG

    async def stream_timed(
        self, prompt: str | None = None, **kw: Any
    ) -> AsyncGenerator[TimedReply, None]:
        rid = kw["request_id"]
        self.calls.append({"prompt": prompt, **kw})
        sent = time.perf_counter()
        finished = False
        try:
            for item in self.script(rid, kw):
                if isinstance(item, BaseException):
                    raise item
                if item == HANG:
                    self.hanging.set()
                    await asyncio.Event().wait()
                assert not isinstance(item, str)
                now = time.perf_counter()
                finished = not isinstance(item, TokenReply)
                yield TimedReply(item, now, now - sent)
        finally:
            if not finished:
                self.closed_early.append(rid)
