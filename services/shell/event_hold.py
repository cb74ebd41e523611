"""Decode's token events, held briefly so that several steps share one broker message.

Sent at once, every decode step would cost one ``DetokMsg`` per detokenizer shard. On a small
machine the broker's per-message cost (persistent, confirmed) and the detokenizer's are paid on
the same cores as the model, while the detokenizer itself coalesces what clients see
(``stream_interval_s``). So decode holds a step's events for
up to ``interval_s`` and sends them with a later step's, merged per request.

What is never held (the caller says ``urgent``): a step that finishes, fails, hands off or
retires anything — terminal events go out at once, and a retired input is acked only after its
outputs are confirmed, so held events always precede, in the same publish, the terminal event
of their request. Held events of a worker that dies are lost with it, exactly like the events
of a step it had not published yet: its inputs are redelivered and replayed (the detokenizer
drops positions it already has).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shared.wire.messages import TokenEvent


class EventHold:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s  # 0: every step's events go out with the step
        self._held: list[TokenEvent] = []
        self._since: float | None = None  # when the oldest held event was produced
        self._steps = 0  # offers whose events are held: one step's events need no merging

    def __bool__(self) -> bool:
        return bool(self._held)

    def offer(self, events: list[TokenEvent], now: float, urgent: bool) -> list[TokenEvent]:
        """The events to send now (held ones first, merged per request); [] while holding."""
        if events:
            if self._since is None:
                self._since = now
            self._held.extend(events)
            self._steps += 1
        if not self._held:
            return []
        assert self._since is not None
        if not urgent and now - self._since < self.interval_s:
            return []
        out = merge(self._held) if self._steps > 1 else self._held
        self._held, self._since, self._steps = [], None, 0
        return out


def merge(events: list[TokenEvent]) -> list[TokenEvent]:
    """Consecutive positions of one request (of one choice, n > 1) become one event (first
    position, all tokens, the last event's ending); events that do not continue their request's
    previous one stay apart.
    Requests keep the order of their first event. Linear: a run's tokens are gathered in one
    list and its event rebuilt once (not once per step held)."""
    heads: list[TokenEvent] = []  # each run's first event
    tails: list[TokenEvent] = []  # and its latest
    tokens: list[list[int]] = []  # every token of the run
    logprobs: list[list[Any] | None] = []  # and their logprobs, if the request asked
    last: dict[tuple[str, int], int] = {}  # (request id, choice) -> its latest run's place
    for ev in events:
        key = (ev.request_id, ev.choice_index)
        i = last.get(key)
        if i is not None and _continues(tails[i], heads[i].index + len(tokens[i]), ev):
            if tails[i] is heads[i]:  # first continuation: the head's own lists stay untouched
                tokens[i] = list(tokens[i])
                head_lps = logprobs[i]
                logprobs[i] = None if head_lps is None else list(head_lps)
            tokens[i].extend(ev.token_ids)
            if ev.logprobs is not None:
                logprobs[i].extend(ev.logprobs)  # type: ignore[union-attr]
            tails[i] = ev
            continue
        last[key] = len(heads)
        heads.append(ev)
        tails.append(ev)
        tokens.append(ev.token_ids)  # copied only if the run grows
        logprobs.append(ev.logprobs)
    return [
        head
        if tail is head
        else replace(head, token_ids=ids, finish_reason=tail.finish_reason, logprobs=lps)
        for head, tail, ids, lps in zip(heads, tails, tokens, logprobs, strict=True)
    ]


def _continues(prev: TokenEvent, end: int, ev: TokenEvent) -> bool:
    """``ev`` takes up at ``end``, where its request's run (latest event ``prev``) left off, and
    neither ends it with an error, and both carry logprobs or neither does."""
    return (
        prev.finish_reason is None
        and prev.error_code is None
        and ev.error_code is None
        and end == ev.index
        and (prev.logprobs is None) == (ev.logprobs is None)
    )
