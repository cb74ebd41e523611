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
class _Request:
    info: StartInfo
    detok: IncrementalDetokenizer
    next_index: int = 0
    pending: dict[int, TokenEvent] = field(default_factory=dict)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    # tokens applied since the last flush, streamed as one reply per request per batch
    batch_index: int | None = None
    batch_token_ids: list[int] = field(default_factory=list)
    last_flush_at: float | None = None
    resume: StreamMark | None = None  # replayed: positions before it were streamed already
    cancel_at_resume: bool = False  # cancelled while its replay had not caught up yet
    # Asked for by the request (reply entries, logprobs.py): every output token's (aligned with
    # detok.token_ids; None: not asked), the batch's (with batch_token_ids), the prompt's.
    logprobs: list[list[Any]] | None = None
    batch_logprobs: list[list[Any]] = field(default_factory=list)
    prompt_logprobs: list[list[Any]] | None = None


@dataclass
class Output:
    replies: list[tuple[str, Reply]] = field(default_factory=list)  # (reply_to, reply)
    aborts: list[str] = field(default_factory=list)  # ended here: workers should drop them
    finished: list[tuple[StartInfo, DoneReply | ErrorReply]] = field(default_factory=list)
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
        self._resume: dict[str, tuple[float, StreamMark]] = {}  # marks waiting for their start

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

    # --- inputs ---------------------------------------------------------------------------------
    def start(self, info: StartInfo, now: float, out: Output) -> None:
        rid = info.request_id
        if rid in self._active or rid in self._finished:
            return  # duplicate registration (redelivered)
        lazy = not info.stream and not info.stop  # its text is only needed at the end
        detok = IncrementalDetokenizer(
            self._decode,
            info.stop,
            lazy=lazy,
            include_stop=info.include_stop_str_in_output,
            min_tokens=info.min_tokens,
        )
        req = _Request(info, detok)
        resume = self._resume.pop(rid, None)
        if resume is not None and resume[1].next_index > 0:
            req.resume = resume[1]
        self._active[rid] = req
        orphans = self._orphans.pop(rid, [])  # taken either way: a cancel makes them moot
        if rid in self._cancelled_early:
            sender = self._cancelled_early.pop(rid)
            if self._may_cancel(info.owner, sender):
                self._finish(req, "cancelled", now, out)
                return
            log.warning("cancel from another user ignored", request_id=rid, user_id=sender)
        for _, ev in orphans:
            self._apply(req, ev, now, out)

    def event(self, ev: TokenEvent, now: float, out: Output) -> None:
        req = self._active.get(ev.request_id)
        if req is None:
            if ev.request_id not in self._finished:
                self._orphans.setdefault(ev.request_id, []).append((now, ev))
            return
        self._apply(req, ev, now, out)

    def resume(self, mark: StreamMark, now: float) -> None:
        """A committed stream mark. Read before the request's start when it is replayed (marks
        overtake starts and events in the shard: ``marks.py``); a live request's own mark, read
        back, changes nothing."""
        rid = mark.request_id
        if rid in self._active or rid in self._finished:
            return
        kept = self._resume.get(rid)
        if kept is None or mark.next_index >= kept[1].next_index:
            self._resume[rid] = (now, mark)

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
        elif req is not None and req.resume is not None:
            req.cancel_at_resume = True  # once the replay has caught up with what was streamed
        elif req is not None:
            self._finish(req, "cancelled", now, out)
        elif request_id not in self._finished:
            # Still upstream (tokenizer queue): answer as soon as its start arrives.
            self._cancelled_early[request_id] = sender
            while len(self._cancelled_early) > self._max_finished:
                self._cancelled_early.popitem(last=False)

    def expire(self, now: float, out: Output) -> None:
        """Answer every request whose deadline passed; drop stale orphan events."""
        for req in [r for r in self._active.values() if r.info.deadline is not None]:
            deadline: float = req.info.deadline  # type: ignore[assignment]
            if req.resume is not None:  # a replay catches up first (its events are on the way)
                deadline += ORPHAN_EVENT_TTL_S
            if now >= deadline:
                self._finish(req, "timeout", now, out)
        for rid in [r for r, evs in self._orphans.items() if now - evs[0][0] > ORPHAN_EVENT_TTL_S]:
            log.warning("dropping events of an unknown request", request_id=rid)
            del self._orphans[rid]
            out.dropped.append(rid)
        # A mark whose start never came: the request was answered (its start acked with the
        # terminal reply) while the mark was still held for others.
        for rid in [r for r, (t, _) in self._resume.items() if now - t > ORPHAN_EVENT_TTL_S]:
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
            if req.batch_index is None:
                continue
            if now is None or req.last_flush_at is None or now - req.last_flush_at >= interval:
                req.last_flush_at = now
                self._flush_one(req, out)

    def has_pending_stream(self) -> bool:
        return any(r.batch_index is not None for r in self._active.values())

    # --- internals ------------------------------------------------------------------------------
    def _apply(self, req: _Request, ev: TokenEvent, now: float, out: Output) -> None:
        if ev.error_code is not None:
            self._error(req, ev.error_code, ev.error_message or "request failed", out)
            return
        if ev.scheduled_at is not None and req.scheduled_at is None:
            req.scheduled_at = ev.scheduled_at
        if ev.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = self._text.entries(ev.prompt_logprobs)
        req.pending[ev.index] = ev
        while req.info.request_id in self._active:
            nxt = _pop_covering(req.pending, req.next_index)
            if nxt is None:
                break
            skip = req.next_index - nxt.index  # positions already applied (duplicates)
            new_ids = nxt.token_ids[skip : skip + req.info.max_tokens - req.next_index]
            entries = None if nxt.logprobs is None else nxt.logprobs[skip : skip + len(new_ids)]
            # The engine's "stop" is its last token (EOS, a stop_token_ids entry): not in the
            # text unless the client asked for the stop in the output, as vLLM.
            hide = (
                nxt.finish_reason == "stop"
                and not req.info.include_stop_str_in_output
                and skip + len(new_ids) == len(nxt.token_ids)
            )
            if new_ids:
                self._add_tokens(req, new_ids, now, hide, entries)
            if req.detok.stopped:
                self._finish(req, "stop", now, out)
                out.aborts.append(req.info.request_id)
            elif nxt.finish_reason is not None:
                self._finish(req, nxt.finish_reason, now, out)
            elif req.next_index >= req.info.max_tokens:  # decode says so too; never exceed it
                self._finish(req, "length", now, out)
            elif req.cancel_at_resume and req.resume is None:
                self._finish(req, "cancelled", now, out)

    def _add_tokens(
        self,
        req: _Request,
        ids: list[int],
        now: float,
        hide_last: bool,
        entries: list[list[Any]] | None = None,
    ) -> None:
        if req.first_token_at is None:
            req.first_token_at = now
        req.last_token_at = now
        lps: list[list[Any]] | None = None
        if entries is not None:
            lps = self._text.entries(entries)
            if req.logprobs is None:
                req.logprobs = []
        if req.resume is not None:  # replayed: what was streamed before the crash, silently
            quiet = ids[: max(0, req.resume.next_index - req.next_index)]
            if quiet:
                _detok_add(req, quiet, hide_last and len(quiet) == len(ids), lps)
                req.next_index += len(quiet)
            ids = ids[len(quiet) :]
            lps = None if lps is None else lps[len(quiet) :]
            if req.next_index >= req.resume.next_index:
                req.detok.skip_streamed(req.resume.text_offset)
                req.resume = None
            if not ids:
                return
        if req.batch_index is None:
            req.batch_index = req.next_index
        req.batch_token_ids.extend(ids)
        if lps is not None:
            req.batch_logprobs.extend(lps)
        req.next_index += len(ids)
        _detok_add(req, ids, hide_last, lps)

    def _flush_one(self, req: _Request, out: Output, final: bool = False) -> None:
        offset = req.detok.num_streamed_chars
        delta = req.detok.take_delta(final=final)
        if req.info.stream and req.batch_index is not None:
            rid = req.info.request_id
            reply = TokenReply(
                rid,
                delta,
                req.batch_token_ids,
                req.batch_index,
                offset,
                logprobs=None if req.logprobs is None else req.batch_logprobs,
                # The prompt's go with the stream's start (a replay resumes after it).
                prompt_logprobs=req.prompt_logprobs if req.batch_index == 0 else None,
            )
            out.reply(req.info, reply)
        req.batch_index = None
        req.batch_token_ids = []
        req.batch_logprobs = []

    def _finish(self, req: _Request, reason: str, now: float, out: Output) -> None:
        info = req.info
        if reason == "timeout" and not req.detok.token_ids:
            self._error(req, ErrorCode.TIMEOUT.value, "deadline passed before the first token", out)
            out.aborts.append(info.request_id)
            return
        req.detok.finish()
        if req.detok.stopped and reason not in ("cancelled", "timeout"):
            reason = "stop"  # the flush completed a stop string (it ended in a split character)
        if req.resume is not None:  # ended before its replay caught up: nothing more to stream
            req.detok.skip_streamed(req.resume.text_offset)
        elif info.stream and req.batch_index is None:
            # Nothing new this batch, but text held back (a stop-string prefix, a split
            # character) is final now: stream it so the deltas add up to the done text.
            offset = req.detok.num_streamed_chars
            tail = req.detok.take_delta(final=True)
            if tail:
                lps: list[list[Any]] | None = None if req.logprobs is None else []
                reply = TokenReply(info.request_id, tail, [], req.next_index, offset, logprobs=lps)
                out.reply(info, reply)
        elif req.batch_index is not None:
            self._flush_one(req, out, final=True)
        n = len(req.detok.token_ids)
        first, last = req.first_token_at, req.last_token_at
        done = DoneReply(
            request_id=info.request_id,
            text=req.detok.text,
            token_ids=list(req.detok.token_ids),
            finish_reason=reason,
            usage={"prompt_tokens": info.num_prompt_tokens, "completion_tokens": n},
            timing={
                "queue_s": _delta(info.arrival_time, req.scheduled_at),
                "ttft_s": _delta(info.arrival_time, first),
                "tpot_s": (last - first) / (n - 1) if n > 1 and first and last else 0.0,
                "e2e_s": max(0.0, now - info.arrival_time),
            },
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_logprobs,
            stop_reason=_stop_reason(req) if reason == "stop" else None,
        )
        if reason in ("cancelled", "timeout"):
            out.aborts.append(info.request_id)
        self._close(req, done, out)

    def _error(self, req: _Request, code: str, message: str, out: Output) -> None:
        self._close(req, ErrorReply(req.info.request_id, code, message), out)

    def _close(self, req: _Request, reply: DoneReply | ErrorReply, out: Output) -> None:
        rid = req.info.request_id
        del self._active[rid]
        self._finished[rid] = None
        while len(self._finished) > self._max_finished:
            self._finished.popitem(last=False)
        out.reply(req.info, reply)
        out.finished.append((req.info, reply))


def _detok_add(req: _Request, ids: list[int], hide_last: bool, lps: list[list[Any]] | None) -> None:
    """Tokens into the text; their logprobs with them, for those it took (none once stopped)."""
    before = len(req.detok.token_ids)
    req.detok.add(ids, hide_last)
    if lps is not None and req.logprobs is not None:
        req.logprobs.extend(lps[: len(req.detok.token_ids) - before])


def _stop_reason(req: _Request) -> str | int | None:
    """vLLM's ``stop_reason`` of a ``stop``: the stop string, or the ``stop_token_ids`` entry
    the output ended with; None for EOS."""
    if req.detok.stop_string is not None:
        return req.detok.stop_string
    ids = req.detok.token_ids
    if ids and ids[-1] in req.info.stop_token_ids:
        return ids[-1]
    return None


def _pop_covering(pending: dict[int, TokenEvent], index: int) -> TokenEvent | None:
    """Remove and return an event that starts at or before ``index`` and is not stale."""
    for start in sorted(pending):
        if start > index:
            return None
        ev = pending.pop(start)
        if start + len(ev.token_ids) > index or ev.finish_reason is not None:
            return ev
    return None


def _delta(t0: float, t1: float | None) -> float:
    return max(0.0, t1 - t0) if t1 is not None else 0.0
