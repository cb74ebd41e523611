"""Admission: queue depth decides whether new work is taken at all.

The tokenizer refuses new requests with ``overloaded`` while the prefill backlog (ready messages
on ``baton.prefill``, as last polled) is at its limit: a client told at once can retry elsewhere
or later, instead of waiting in a queue that cannot drain in time. Requests already accepted are
never dropped by this policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shared.broker import PREFILL_QUEUE


@dataclass
class AdmissionPolicy:
    max_prefill_backlog: int
    prefill_backlog: int = 0  # as last polled

    def observe(self, depths: Mapping[str, int]) -> None:
        self.prefill_backlog = depths.get(PREFILL_QUEUE, self.prefill_backlog)

    def admit(self) -> bool:
        return self.prefill_backlog < self.max_prefill_backlog

    def reason(self) -> str:
        return (
            f"prefill backlog of {self.prefill_backlog} requests is at the limit "
            f"({self.max_prefill_backlog}); retry later"
        )
