"""Inputs held unacked until every request they carry is answered: the detokenizer's durability.

The detokenizer keeps its per-request state (text so far, stop-string holdback, timing) in
memory only. What makes that safe is this ledger: a registration or token-event message stays
unacked in the broker until every request it carries has its terminal reply committed. If the
process dies, the broker redelivers all of them — to a restarted instance, or to the standby
replica that takes over the shard — which replays them through a fresh core and so rebuilds
exactly the state that was lost (the core is deterministic in its inputs).

A stream mark (``marks.py``) is held the same way, for each request it names, until that
request is answered or a newer mark of it arrives: the newest committed mark of every live
request stays in the broker, so a replay resumes each stream where it was cut.

The cost: the detokenizer consumes without a prefetch limit (a window would stall once it held
that many messages), and the broker keeps a request's messages until it finishes.
"""

from __future__ import annotations

from collections.abc import Iterable

from aio_pika.abc import AbstractIncomingMessage


class DeliveryLedger:
    def __init__(self) -> None:
        # id(delivery) -> (delivery, the requests it is still held for)
        self._held: dict[int, tuple[AbstractIncomingMessage, set[str]]] = {}
        self._by_request: dict[str, list[int]] = {}
        self._mark_of: dict[str, int] = {}  # request -> the held delivery with its newest mark

    def __len__(self) -> int:
        return len(self._held)

    def hold(
        self,
        delivery: AbstractIncomingMessage,
        request_ids: Iterable[str],
        marks: Iterable[str] = (),
    ) -> list[AbstractIncomingMessage]:
        """Keep ``delivery`` until each of ``request_ids`` is released and each request it
        carries a mark of (``marks``) is released or marked again. Returns what may be acked
        now: ``delivery`` if it is held for nothing, older marks it supersedes."""
        key = id(delivery)
        pending = set(request_ids) | set(marks)
        if not pending:
            return [delivery]
        self._held[key] = (delivery, pending)
        for rid in pending:
            self._by_request.setdefault(rid, []).append(key)
        free = []
        for rid in marks:
            older = self._mark_of.get(rid)
            self._mark_of[rid] = key
            if older is not None and older != key:
                free += self._drop_claim(older, rid)
        return free

    def release(self, request_id: str) -> list[AbstractIncomingMessage]:
        """``request_id`` is answered (or given up): the deliveries that now carry nothing
        unfinished, to be acked."""
        self._mark_of.pop(request_id, None)
        free = []
        for key in self._by_request.pop(request_id, []):
            free += self._drop_claim(key, request_id, index=False)
        return free

    def clear(self) -> int:
        """The channel they came on is gone (the broker requeued them): forget them all."""
        n = len(self._held)
        self._held.clear()
        self._by_request.clear()
        self._mark_of.clear()
        return n

    def _drop_claim(
        self, key: int, request_id: str, index: bool = True
    ) -> list[AbstractIncomingMessage]:
        entry = self._held.get(key)
        if entry is None:
            return []
        entry[1].discard(request_id)
        if index:
            keys = self._by_request.get(request_id)
            if keys is not None and key in keys:
                keys.remove(key)
        if entry[1]:
            return []
        del self._held[key]
        return [entry[0]]
