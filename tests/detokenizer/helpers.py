"""Helpers of the detokenizer tests (shared by the incremental and core tests)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from services.detokenizer.core import DetokenizerCore, Output
from services.detokenizer.incremental import IncrementalDetokenizer
from shared.wire.messages import DoneReply, ErrorReply, StartInfo, TokenEvent, TokenReply

Decode = Callable[[Sequence[int]], str]
MULTIBYTE = "héllo wörld — 你好 🙂"
STORY = "The river town woke slowly. END of story"
T0 = 1000.0  # arrival wall clock of every request


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed ``ids`` ``chunk`` at a time, taking a delta after each; finish; take the rest."""
    deltas = []
    for i in range(0, len(ids), chunk):
        detok.add(ids[i : i + chunk])
        deltas.append(detok.take_delta())
    detok.finish()
    deltas.append(detok.take_delta(final=True))
    return deltas


def cut_at(text: str, stop: str) -> str:
    assert stop in text
    return text[: text.find(stop)]


class Harness:
    """A core plus a record of every reply, so a test can assert exactly one terminal each."""

    def __init__(self, decode: Decode) -> None:
        self.core = DetokenizerCore(decode)
        self.replies: list[tuple[str, Any]] = []
        self.aborts: list[str] = []
        self.finished: list[tuple[StartInfo, Any]] = []

    def step(
        self,
        now: float,
        starts: Sequence[StartInfo] = (),
        events: Sequence[TokenEvent] = (),
        cancels: Sequence[str] = (),
    ) -> Output:
        """One micro-batch, in the service's order: starts, events, cancels, expire, flush."""
        out = Output()
        for info in starts:
            self.core.start(info, now, out)
        for ev in events:
            self.core.event(ev, now, out)
        for rid in cancels:
            self.core.cancel(rid, now, out)
        self.core.expire(now, out)
        self.core.flush(out)
        self.replies += out.replies
        self.aborts += out.aborts
        self.finished += out.finished
        return out

    def tokens(self, rid: str) -> list[TokenReply]:
        return [r for _, r in self.replies if isinstance(r, TokenReply) and r.request_id == rid]

    def terminal(self, rid: str) -> DoneReply | ErrorReply:
        terms = [
            r for _, r in self.replies if not isinstance(r, TokenReply) and r.request_id == rid
        ]
        assert len(terms) == 1, f"{rid}: {len(terms)} terminal replies"
        return terms[0]

    def done(self, rid: str) -> DoneReply:
        reply = self.terminal(rid)
        assert isinstance(reply, DoneReply), reply
        return reply

    def error(self, rid: str) -> ErrorReply:
        reply = self.terminal(rid)
        assert isinstance(reply, ErrorReply), reply
        return reply

    def streamed_text(self, rid: str) -> str:
        return "".join(r.text for r in self.tokens(rid))

    def assert_one_terminal_each(self) -> None:
        counts = Counter(r.request_id for _, r in self.replies if not isinstance(r, TokenReply))
        assert all(n == 1 for n in counts.values()), counts
        assert [info.request_id for info, _ in self.finished] == list(counts)


def only_tokens(out: Output) -> list[tuple[str, TokenReply]]:
    """The batch's replies, asserted to be token replies (no terminal among them)."""
    assert all(isinstance(r, TokenReply) for _, r in out.replies), out.replies
    return [(q, r) for q, r in out.replies if isinstance(r, TokenReply)]


def info(rid: str, **kw: Any) -> StartInfo:
    kw.setdefault("reply_to", f"q-{rid}")
    kw.setdefault("num_prompt_tokens", 5)
    kw.setdefault("arrival_time", T0)
    return StartInfo(request_id=rid, **kw)


def ev(rid: str, index: int, ids: list[int], finish: str | None = None, **kw: Any) -> TokenEvent:
    return TokenEvent(rid, index, list(ids), finish_reason=finish, **kw)
