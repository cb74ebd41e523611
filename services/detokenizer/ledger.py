"""Inputs held unacked until every request they carry is answered: the detokenizer's durability.

The detokenizer keeps its per-request state (text so far, stop-string holdback, timing) in
memory only. What makes that safe is this ledger: a registration or token-event message stays
unacked in the broker until every request it carries has its terminal reply confirmed. If the
process dies, the broker redelivers all of them — to a restarted instance, or to the standby
replica that takes over the shard — which replays them through a fresh core and so rebuilds
exactly the state that was lost (the core is deterministic in its inputs). Replies it re-emits
carry the same positions and text offsets, which the client library drops as duplicates.

The cost: the detokenizer consumes without a prefetch limit (a window would stall once it held
that many messages), and the broker keeps a request's messages until it finishes.
"""

from __future__ import annotations

from collections.abc import Iterable

from aio_pika.abc import AbstractIncomingMessage


class DeliveryLedger:
    def __init__(self) -> None:
        # id(delivery) -> (delivery, the unfinished requests it carries)
        self._held: dict[int, tuple[AbstractIncomingMessage, set[str]]] = {}
        self._by_request: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, delivery: AbstractIncomingMessage, request_ids: Iterable[str]) -> bool:
        """Keep ``delivery`` until each of ``request_ids`` is released; False if there is none
        (the caller acks it now)."""
        pending = set(request_ids)
        if not pending:
            return False
        key = id(delivery)
        self._held[key] = (delivery, pending)
        for rid in pending:
            self._by_request.setdefault(rid, []).append(key)
        return True

    def release(self, request_id: str) -> list[AbstractIncomingMessage]:
        """``request_id`` is answered (or given up): the deliveries that now carry nothing
        unfinished, to be acked."""
        free = []
        for key in self._by_request.pop(request_id, []):
            entry = self._held.get(key)
            if entry is None:
                continue
            entry[1].discard(request_id)
            if not entry[1]:
                del self._held[key]
                free.append(entry[0])
        return free

    def clear(self) -> int:
        """The channel they came on is gone (the broker requeued them): forget them all."""
        n = len(self._held)
        self._held.clear()
        self._by_request.clear()
        return n
