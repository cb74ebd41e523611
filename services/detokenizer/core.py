"""The detokenizer's synchronous core: request states, ordering, the one terminal reply.

It knows every accepted request (the tokenizer registers each one with a :class:`StartInfo`
before passing it on), so it alone decides when a request is over and answers exactly once:
- token events are applied in position order; duplicates (a redelivered step, a replayed
  request) are dropped by position, and gaps wait in a small per-request buffer;
- a stop string, a cancel or a passed deadline ends a request here, and the workers are told to
  drop it (``aborts``);
- finished ids are remembered (bounded) so late events and duplicate starts are ignored.

Every output is a function of the inputs' order, never of timing except for where stream
batches are cut: replayed from the same inputs after a crash (see ``ledger.py``), a fresh core
rebuilds the same text at the same positions and text offsets. A replayed request resumes its
stream after the last position that was committed (its stream mark, ``marks.py``): positions
before it are applied silently, so a client sees each position once.

A request with ``n`` > 1 (parallel sampling) is ``n`` streams, one per choice: each has its own
positions, text and ``done`` reply (with its ``choice_index``); the request is over, and its
inputs released, when every choice is done — or at its one ``error`` reply, which ends the
choices not done yet. Such a request's marks cover all its choices at once (the newest mark
message is the whole state), and a choice whose ``done`` reply was committed is marked ``done``:
a replay finishes it silently.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from services.detokenizer.incremental import Decode, IncrementalDetokenizer
from services.detokenizer.logprobs import DecodeToken, LogprobText
from shared.wire.errors import ErrorCode
from shared.wire.messages import (
    DoneReply,
    ErrorReply,
    Reply,
    StartInfo,
    StreamMark,
    TokenEvent,
    TokenReply,
)

log = structlog.get_logger(__name__)

# Events for a request whose start has not arrived (redelivery can reorder) wait this long.
ORPHAN_EVENT_TTL_S = 60.0
# (the request's owner, the cancel's sender) -> honour it? (services/shell/control_auth.py)
CancelRule = Callable[[str | None, str | None], bool]


@dataclass
class _Choice:
    """One stream of a request: its only one, or choice ``index`` of an n > 1 request."""

    index: int
    detok: IncrementalDetokenizer
    next_index: int = 0
    pending: dict[int, TokenEvent] = field(default_factory=dict)
    first_token_at: float | None = None
    last_token_at: float | None = None
    # tokens applied since the last flush, streamed as one reply per request per batch
    batch_index: int | None = None
    batch_token_ids: list[int] = field(default_factory=list)
    last_flush_at: float | None = None
    resume: StreamMark | None = None  # replayed: positions before it were streamed already
    cancel_at_resume: bool = False  # cancelled while its replay had not caught up yet
    done: bool = False  # its done reply is made
    answered: bool = False  # replayed: its done reply was committed before (a done mark)
    mark: StreamMark | None = None  # n > 1: where its committed replies end
    # Asked for by the request (reply entries, logprobs.py): every output token's (aligned with
    # detok.token_ids; None: not asked) and the batch's (with batch_token_ids).
    logprobs: list[list[Any]] | None = None
    batch_logprobs: list[list[Any]] = field(default_factory=list)


@dataclass
class _Request:
    info: StartInfo
    choices: list[_Choice]
    scheduled_at: float | None = None
    prompt_logprobs: list[list[Any]] | None = None  # asked for: they go with choice 0's start

    @property
    def parallel(self) -> bool:
        return len(self.choices) > 1


@dataclass
class Output:
    replies: list[tuple[str, Reply]] = field(default_factory=list)  # (reply_to, reply)
    aborts: list[str] = field(default_factory=list)  # ended here: workers should drop them
    # One choice of an n > 1 request ended here (a stop string): workers drop that choice.
    choice_aborts: list[tuple[str, int]] = field(default_factory=list)
    # Every terminal reply made (n > 1: a done per choice), for metrics.
    finished: list[tuple[StartInfo, DoneReply | ErrorReply]] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)  # requests wholly answered
    marks: list[StreamMark] = field(default_factory=list)  # n > 1 requests' (all choices)
    dropped: list[str] = field(default_factory=list)  # events of unknown requests given up
    # requests whose replies may share a message with others on the same queue (batch_replies)
    batchable: set[str] = field(default_factory=set)

    def reply(self, info: StartInfo, reply: Reply) -> None:
        self.replies.append((info.reply_to, reply))
        if info.batch_replies:
            self.batchable.add(info.request_id)


class DetokenizerCore:
    def __init__(
        self,
        decode: Decode,
        max_finished: int = 200_000,
        stream_interval_s: float = 0.0,
        max_stream_replies_per_s: float = 0.0,
        may_cancel: CancelRule = lambda owner, sender: True,
        decode_token: DecodeToken | None = None,
    ) -> None:
        """``decode_token``: one token's text for logprobs (special tokens included); default
        ``decode([token])``."""
        self._decode = decode
        self._text = LogprobText(decode_token or (lambda t: decode([t])))
        self._may_cancel = may_cancel
        # Streamed tokens of a request are coalesced into one reply per interval (the first
        # token and the terminal reply are never held back): the broker's message rate, not
        # the model, is the limit on small machines. 0 = one reply per batch.
        self.stream_interval_s = stream_interval_s
        # The budget of token replies per second over all streams: with many streams the
        # interval stretches to num_streams / budget, so that under load the broker and the
        # clients spend their CPU on work, not on ever smaller deltas. 0 = no budget.
        self.max_stream_replies_per_s = max_stream_replies_per_s
        self._active: dict[str, _Request] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._max_finished = max_finished
        # cancels of requests not registered yet: request id -> the sender
        self._cancelled_early: OrderedDict[str, str | None] = OrderedDict()
        self._orphans: dict[str, list[tuple[float, TokenEvent]]] = {}
        # Marks waiting for their start: request id -> choice index -> (when, mark).
        self._resume: dict[str, dict[int, tuple[float, StreamMark]]] = {}
        self._marked: set[str] = set()  # n > 1 requests whose choices' marks moved this batch

    @property
    def num_active(self) -> int:
        return len(self._active)

    def is_live(self, request_id: str) -> bool:
        """Not answered yet, and known here (registered, or events or a mark waiting for the
        start)."""
        return (
            request_id in self._active or request_id in self._orphans or request_id in self._resume
        )

    def reset(self) -> None:
        """Forget every unanswered request (their inputs will be redelivered and replayed,
        here or on another replica); what was answered stays answered."""
        self._active.clear()
        self._orphans.clear()
        self._resume.clear()
        self._cancelled_early.clear()
        self._marked.clear()

    # --- inputs ---------------------------------------------------------------------------------
    def start(self, info: StartInfo, now: float, out: Output) -> None:
        rid = info.request_id
        if rid in self._active or rid in self._finished:
            return  # duplicate registration (redelivered)
        lazy = not info.stream and not info.stop  # its text is only needed at the end
        choices = []
        marks = self._resume.pop(rid, {})
        for index in range(max(1, info.n)):
            detok = IncrementalDetokenizer(
                self._decode,
                info.stop,
                lazy=lazy,
                include_stop=info.include_stop_str_in_output,
            )
            choice = _Choice(index, detok)
            resume = marks.get(index)
            if resume is not None and resume[1].next_index > 0:
                choice.resume = choice.mark = resume[1]
                choice.answered = resume[1].done
            choices.append(choice)
        req = _Request(info, choices)
        self._active[rid] = req
        orphans = self._orphans.pop(rid, [])  # taken either way: a cancel makes them moot
        if rid in self._cancelled_early:
            sender = self._cancelled_early.pop(rid)
            if self._may_cancel(info.owner, sender):
                self._cancel(req, now, out)
                return
            log.warning("cancel from another user ignored", request_id=rid, user_id=sender)
        for _, ev in orphans:
            if rid not in self._active:
                break
            self._event(req, ev, now, out)

    def event(self, ev: TokenEvent, now: float, out: Output) -> None:
        req = self._active.get(ev.request_id)
        if req is None:
            if ev.request_id not in self._finished:
                self._orphans.setdefault(ev.request_id, []).append((now, ev))
            return
        self._event(req, ev, now, out)

    def resume(self, mark: StreamMark, now: float) -> None:
        """A committed stream mark. Read before the request's start when it is replayed (marks
        overtake starts and events in the shard: ``marks.py``); a live request's own mark, read
        back, changes nothing."""
        rid = mark.request_id
        if rid in self._active or rid in self._finished:
            return
        kept = self._resume.setdefault(rid, {})
        old = kept.get(mark.choice_index)
        if old is None or mark.next_index >= old[1].next_index:
            kept[mark.choice_index] = (now, mark)

    def fail(self, request_id: str, message: str, out: Output) -> None:
        """Processing this request raised: answer it ``internal`` (and forget its orphans)."""
        req = self._active.get(request_id)
        if req is not None:
            self._error(req, ErrorCode.INTERNAL.value, message, out)
        elif self._orphans.pop(request_id, None) is not None:
            out.dropped.append(request_id)

    def cancel(self, request_id: str, now: float, out: Output, sender: str | None = None) -> None:
        """A client's cancel from broker user ``sender``: honoured if the request's owner
        may be cancelled by it (``may_cancel``)."""
        req = self._active.get(request_id)
        if req is not None and not self._may_cancel(req.info.owner, sender):
            log.warning("cancel from another user ignored", request_id=request_id, user_id=sender)
        elif req is not None:
            self._cancel(req, now, out)
        elif request_id not in self._finished:
            # Still upstream (tokenizer queue): answer as soon as its start arrives.
            self._cancelled_early[request_id] = sender
            while len(self._cancelled_early) > self._max_finished:
                self._cancelled_early.popitem(last=False)

    def expire(self, now: float, out: Output) -> None:
        """Answer every request whose deadline passed; drop stale orphan events."""
        for req in [r for r in self._active.values() if r.info.deadline is not None]:
            deadline: float = req.info.deadline  # type: ignore[assignment]
            if any(c.resume is not None for c in req.choices):
                deadline += ORPHAN_EVENT_TTL_S  # a replay catches up first (events on the way)
            if now >= deadline:
                self._timeout(req, now, out)
        for rid in [r for r, evs in self._orphans.items() if now - evs[0][0] > ORPHAN_EVENT_TTL_S]:
            log.warning("dropping events of an unknown request", request_id=rid)
            del self._orphans[rid]
            out.dropped.append(rid)
        # A mark whose start never came: the request was answered (its start acked with the
        # terminal reply) while the mark was still held for others.
        for rid in [
            r for r, marks in self._resume.items() if now - _oldest(marks) > ORPHAN_EVENT_TTL_S
        ]:
            del self._resume[rid]
            out.dropped.append(rid)

    @property
    def effective_stream_interval_s(self) -> float:
        if self.max_stream_replies_per_s <= 0:
            return self.stream_interval_s
        num_streaming = sum(r.info.stream for r in self._active.values())
        return max(self.stream_interval_s, num_streaming / self.max_stream_replies_per_s)

    def flush(self, out: Output, now: float | None = None) -> None:
        """End of a batch: a token reply per streaming request that got tokens (and, given
        ``now``, whose stream interval has passed)."""
        interval = self.effective_stream_interval_s
        for req in self._active.values():
            for c in req.choices:
                if c.batch_index is None:
                    continue
                if now is None or c.last_flush_at is None or now - c.last_flush_at >= interval:
                    c.last_flush_at = now
                    self._flush_one(req, c, out)
        for rid in self._marked:  # n > 1: every choice's mark, so the newest is the whole state
            marked = self._active.get(rid)
            if marked is not None:
                out.marks += [c.mark for c in marked.choices if c.mark is not None]
        self._marked.clear()

    def has_pending_stream(self) -> bool:
        return any(c.batch_index is not None for r in self._active.values() for c in r.choices)

    # --- internals ------------------------------------------------------------------------------
    def _event(self, req: _Request, ev: TokenEvent, now: float, out: Output) -> None:
        if ev.error_code is not None:
            self._error(req, ev.error_code, ev.error_message or "request failed", out)
            return
        if not 0 <= ev.choice_index < len(req.choices):
            raise ValueError(f"choice {ev.choice_index} of a request with n={len(req.choices)}")
        if ev.scheduled_at is not None and req.scheduled_at is None:
            req.scheduled_at = ev.scheduled_at
        if ev.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = self._text.entries(ev.prompt_logprobs)
        self._apply(req, req.choices[ev.choice_index], ev, now, out)

    def _apply(self, req: _Request, c: _Choice, ev: TokenEvent, now: float, out: Output) -> None:
        c.pending[ev.index] = ev
        while not c.done and req.info.request_id in self._active:
            nxt = _pop_covering(c.pending, c.next_index)
            if nxt is None:
                break
            skip = c.next_index - nxt.index  # positions already applied (duplicates)
            new_ids = nxt.token_ids[skip : skip + req.info.max_tokens - c.next_index]
            entries = None if nxt.logprobs is None else nxt.logprobs[skip : skip + len(new_ids)]
            # The engine's "stop" is its last token (EOS, a stop_token_ids entry): not in the
            # text unless the client asked for the stop in the output, as vLLM.
            hide = (
                nxt.finish_reason == "stop"
                and not req.info.include_stop_str_in_output
                and skip + len(new_ids) == len(nxt.token_ids)
            )
            if new_ids:
                self._add_tokens(c, new_ids, now, hide, entries)
            if c.detok.stopped:
                self._finish(req, c, "stop", now, out)
                if req.parallel:
                    out.choice_aborts.append((req.info.request_id, c.index))
                else:
                    out.aborts.append(req.info.request_id)
            elif nxt.finish_reason is not None:
                self._finish(req, c, nxt.finish_reason, now, out)
            elif c.next_index >= req.info.max_tokens:  # decode says so too; never exceed it
                self._finish(req, c, "length", now, out)
            elif c.cancel_at_resume and c.resume is None:
                self._finish(req, c, "cancelled", now, out)
        if req.parallel and c.done:
            c.pending.clear()

    def _add_tokens(
        self,
        c: _Choice,
        ids: list[int],
        now: float,
        hide_last: bool,
        entries: list[list[Any]] | None = None,
    ) -> None:
        if c.first_token_at is None:
            c.first_token_at = now
        c.last_token_at = now
        lps: list[list[Any]] | None = None
        if entries is not None:
            lps = self._text.entries(entries)
            if c.logprobs is None:
                c.logprobs = []
        if c.resume is not None:  # replayed: what was streamed before the crash, silently
            quiet = ids[: max(0, c.resume.next_index - c.next_index)]
            if quiet:
                _detok_add(c, quiet, hide_last and len(quiet) == len(ids), lps)
                c.next_index += len(quiet)
            ids = ids[len(quiet) :]
            lps = None if lps is None else lps[len(quiet) :]
            if c.next_index >= c.resume.next_index:
                c.detok.skip_streamed(c.resume.text_offset)
                c.resume = None
            if not ids:
                return
        if c.batch_index is None:
            c.batch_index = c.next_index
        c.batch_token_ids.extend(ids)
        if lps is not None:
            c.batch_logprobs.extend(lps)
        c.next_index += len(ids)
        _detok_add(c, ids, hide_last, lps)

    def _flush_one(self, req: _Request, c: _Choice, out: Output, final: bool = False) -> None:
        offset = c.detok.num_streamed_chars
        delta = c.detok.take_delta(final=final)
        if req.info.stream and c.batch_index is not None:
            reply = TokenReply(
                req.info.request_id,
                delta,
                c.batch_token_ids,
                c.batch_index,
                offset,
                logprobs=None if c.logprobs is None else c.batch_logprobs,
                # The prompt's go with choice 0's start (a replay resumes after it).
                prompt_logprobs=(
                    req.prompt_logprobs if c.batch_index == 0 and c.index == 0 else None
                ),
                choice_index=c.index if req.parallel else None,
            )
            self._token_reply(req, c, reply, out)
        c.batch_index = None
        c.batch_token_ids = []
        c.batch_logprobs = []

    def _token_reply(self, req: _Request, c: _Choice, reply: TokenReply, out: Output) -> None:
        out.reply(req.info, reply)
        if req.parallel:
            end = reply.index + len(reply.token_ids)
            offset = (reply.text_offset or 0) + len(reply.text)
            c.mark = StreamMark(req.info.request_id, end, offset, c.index)
            self._marked.add(req.info.request_id)

    def _cancel(self, req: _Request, now: float, out: Output) -> None:
        """Every choice not done ends ``cancelled`` (a replayed one once it caught up)."""
        for c in req.choices:
            if c.done:
                continue
            if c.resume is not None:
                c.cancel_at_resume = True  # once the replay has caught up with what was streamed
            else:
                self._finish(req, c, "cancelled", now, out)

    def _timeout(self, req: _Request, now: float, out: Output) -> None:
        """Past the deadline: every choice not done ends ``timeout``; with no token at all, the
        request gets the ``timeout`` error instead."""
        if not any(c.detok.token_ids for c in req.choices):
            self._error(req, ErrorCode.TIMEOUT.value, "deadline passed before the first token", out)
            _abort(req.info.request_id, out)
            return
        for c in req.choices:
            if not c.done:
                self._finish(req, c, "timeout", now, out)

    def _finish(self, req: _Request, c: _Choice, reason: str, now: float, out: Output) -> None:
        info = req.info
        c.done = True
        if c.answered:  # replayed: its done reply went out before; nothing of it again
            self._close_if_done(req, None, out)
            return
        c.detok.finish()
        if c.detok.stopped and reason not in ("cancelled", "timeout"):
            reason = "stop"  # the flush completed a stop string (it ended in a split character)
        index = c.index if req.parallel else None
        if c.resume is not None:  # ended before its replay caught up: nothing more to stream
            c.detok.skip_streamed(c.resume.text_offset)
        elif info.stream and c.batch_index is None:
            # Nothing new this batch, but text held back (a stop-string prefix, a split
            # character) is final now: stream it so the deltas add up to the done text.
            offset = c.detok.num_streamed_chars
            tail = c.detok.take_delta(final=True)
            if tail:
                lps: list[list[Any]] | None = None if c.logprobs is None else []
                reply = TokenReply(
                    info.request_id,
                    tail,
                    [],
                    c.next_index,
                    offset,
                    logprobs=lps,
                    choice_index=index,
                )
                self._token_reply(req, c, reply, out)
        elif c.batch_index is not None:
            self._flush_one(req, c, out, final=True)
        n = len(c.detok.token_ids)
        first, last = c.first_token_at, c.last_token_at
        done = DoneReply(
            request_id=info.request_id,
            text=c.detok.text,
            token_ids=list(c.detok.token_ids),
            finish_reason=reason,
            usage={"prompt_tokens": info.num_prompt_tokens, "completion_tokens": n},
            timing={
                "queue_s": _delta(info.arrival_time, req.scheduled_at),
                "ttft_s": _delta(info.arrival_time, first),
                "tpot_s": (last - first) / (n - 1) if n > 1 and first and last else 0.0,
                "e2e_s": max(0.0, now - info.arrival_time),
            },
            logprobs=c.logprobs,
            prompt_logprobs=req.prompt_logprobs if c.index == 0 else None,
            stop_reason=_stop_reason(req, c) if reason == "stop" else None,
            choice_index=index,
        )
        if reason in ("cancelled", "timeout"):
            _abort(info.request_id, out)
        out.reply(info, done)
        out.finished.append((info, done))
        if req.parallel:  # committed with its mark: a replay does not answer it again
            c.mark = StreamMark(info.request_id, c.next_index, len(done.text), c.index, True)
            self._marked.add(info.request_id)
        self._close_if_done(req, None, out)

    def _error(self, req: _Request, code: str, message: str, out: Output) -> None:
        reply = ErrorReply(req.info.request_id, code, message)
        out.reply(req.info, reply)
        out.finished.append((req.info, reply))
        if req.parallel:  # its other choices may run elsewhere: they stop too
            _abort(req.info.request_id, out)
        self._close_if_done(req, reply, out)

    def _close_if_done(self, req: _Request, error: ErrorReply | None, out: Output) -> None:
        """Forget the request once it is wholly answered (every choice done, or an error)."""
        if error is None and not all(c.done for c in req.choices):
            return
        rid = req.info.request_id
        del self._active[rid]
        self._marked.discard(rid)
        self._finished[rid] = None
        while len(self._finished) > self._max_finished:
            self._finished.popitem(last=False)
        out.closed.append(rid)


def _pop_covering(pending: dict[int, TokenEvent], index: int) -> TokenEvent | None:
    """Remove and return an event that starts at or before ``index`` and is not stale."""
    for start in sorted(pending):
        if start > index:
            return None
        ev = pending.pop(start)
        if start + len(ev.token_ids) > index or ev.finish_reason is not None:
            return ev
    return None


def _abort(request_id: str, out: Output) -> None:
    """Workers drop the request (once per batch: every choice of it goes)."""
    if request_id not in out.aborts:
        out.aborts.append(request_id)


def _detok_add(c: _Choice, ids: list[int], hide_last: bool, lps: list[list[Any]] | None) -> None:
    """Tokens into the text; their logprobs with them, for those it took (none once stopped)."""
    before = len(c.detok.token_ids)
    c.detok.add(ids, hide_last)
    if lps is not None and c.logprobs is not None:
        c.logprobs.extend(lps[: len(c.detok.token_ids) - before])


def _stop_reason(req: _Request, c: _Choice) -> str | int | None:
    """vLLM's ``stop_reason`` of a ``stop``: the stop string, or the ``stop_token_ids`` entry
    the output ended with; None for EOS."""
    if c.detok.stop_string is not None:
        return c.detok.stop_string
    ids = c.detok.token_ids
    if ids and ids[-1] in req.info.stop_token_ids:
        return ids[-1]
    return None


def _oldest(marks: dict[int, tuple[float, StreamMark]]) -> float:
    return min(t for t, _ in marks.values())


def _delta(t0: float, t1: float | None) -> float:
    return max(0.0, t1 - t0) if t1 is not None else 0.0
