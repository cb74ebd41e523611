"""Where an engine service's wall time goes, turn by turn of its loop (``BATON_STEP_TRACE``).

Each span of :meth:`EngineService._iterate` is one JSON line: its kind, when it began
(``time.monotonic()``, seconds) and how long it lasted, and for a step what the engine reported.
Kinds: ``idle`` (no work, waiting for some), ``gather`` (a burst's requests joining the first
batch), ``yield`` (decode waiting out a prefill wave on shared cores), ``step`` (the engine's
step in its thread, hand-off included), ``publish`` (turning a step's outputs into messages),
``busy_wait`` (work that cannot be scheduled yet). What lies between two spans is the event
loop's own time: deliveries, acks, confirms, the policy.

The trace is for finding why a decode step's time per token exceeds its forward under
arrivals, not for production: each line is written as it happens (buffered, flushed at close).
``python -m loadtest step-trace`` reads it back (loadtest/serving/step_trace.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import IO, Any

_OFF: AbstractContextManager[None] = nullcontext()


class StepTrace:
    def __init__(self, path_template: str, service: str) -> None:
        """``path_template``: "" for no trace, else a path with optional ``{service}`` and
        ``{pid}`` fields (several services of one ``up`` write files of their own)."""
        self._file: IO[str] | None = None
        if path_template:
            path = path_template.format(service=service, pid=os.getpid())
            self._file = open(path, "a", buffering=1 << 16)  # noqa: SIM115 - closed in close()

    def __bool__(self) -> bool:
        return self._file is not None

    def record(self, kind: str, start: float, end: float, **fields: Any) -> None:
        if self._file is not None:
            line = {"kind": kind, "t": round(start, 6), "dt": round(end - start, 6), **fields}
            self._file.write(json.dumps(line) + "\n")

    def span(self, kind: str, **fields: Any) -> AbstractContextManager[None]:
        """Record the enclosed time (awaits included) as one span of ``kind``; with the trace
        off, one shared no-op context (the loop runs this every turn)."""
        if self._file is None:
            return _OFF
        return self._timed(kind, fields)

    @contextlib.contextmanager
    def _timed(self, kind: str, fields: dict[str, Any]) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.record(kind, start, time.monotonic(), **fields)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
