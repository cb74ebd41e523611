"""Request ids remembered for a while (cancelled or aborted ones), bounded in size."""

from __future__ import annotations

import time
from collections import OrderedDict


class ExpiringIdSet:
    def __init__(self, ttl_s: float = 600.0, max_size: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_size = max_size
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = time.monotonic()
        self._ids.move_to_end(request_id)
        self._trim()

    def __contains__(self, request_id: str) -> bool:
        self._trim()
        return request_id in self._ids

    def _trim(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._ids and (
            len(self._ids) > self.max_size or next(iter(self._ids.values())) < cutoff
        ):
            self._ids.popitem(last=False)
