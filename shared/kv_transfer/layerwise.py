"""Layer-by-layer KV handoff: decode pulls each layer as soon as prefill has written it.

The whole-request handoff publishes its descriptor after the prompt's last forward, so decode's
copy starts when prefill ends and the first decode step waits for all of it. Layer-wise, prefill
*announces* a prompt before its first forward (the descriptor goes out at once, with the blocks
of the prompt's final window pinned and no first token yet) and then publishes, in a *progress
record* in its registered memory, how far each forward has written: after each layer, the
tokens of the chunk being computed and how many layers hold them. Decode reads the record and
pulls, per layer, the positions that are ready (``Progress.ready``) while prefill computes the
later layers and chunks; after the last layer it reads the first token from the record, and the
sequence joins its next decode step. Transports that read the sender's memory remotely
(``mooncake``) implement it; see docs/engine.md ("Layer-wise handoff") for why ``pool`` does not.

A record is three int64 words, each written by one aligned store (so a remote read sees each
word whole): the send id it belongs to (a reader checks it: records are reused round-robin),
the progress word ``tokens_before << 36 | tokens_upto << 12 | layers`` (positions
``[0, tokens_before)`` are written in every layer, ``[0, tokens_upto)`` in the first ``layers``),
and the state word ``first_token << 8 | state``. Prefill stores a new chunk's progress word with
``layers`` 0 before its forward, then one word per layer; the state word last.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from shared.kv_transfer.connector import KVLoad

RUNNING, READY, FINISHED, FAILED = 0, 1, 2, 3  # READY: all layers and the first token are in
NUM_RECORDS = 1024  # records in a sender's table (each handoff in flight holds one)
RECORD_WORDS = 3
_TOKEN_BITS, _LAYER_BITS = 24, 12


@dataclass(frozen=True)
class Progress:
    tokens_before: int
    tokens_upto: int
    layers: int

    def word(self) -> int:
        if not (self.tokens_upto < 1 << _TOKEN_BITS and self.layers < 1 << _LAYER_BITS):
            raise ValueError(f"{self} does not fit a progress word")
        return (
            self.tokens_before << (_TOKEN_BITS + _LAYER_BITS)
            | self.tokens_upto << _LAYER_BITS
            | self.layers
        )

    @classmethod
    def of(cls, word: int) -> Progress:
        mask = (1 << _TOKEN_BITS) - 1
        return cls(
            word >> (_TOKEN_BITS + _LAYER_BITS) & mask,
            word >> _LAYER_BITS & mask,
            word & ((1 << _LAYER_BITS) - 1),
        )

    def ready(self, layer: int) -> int:
        """Positions ``[0, ready)`` of ``layer`` are written."""
        return self.tokens_upto if self.layers > layer else self.tokens_before


def state_word(state: int, first_token: int = 0) -> int:
    return first_token << 8 | state


class ProgressTable:
    """The sender's records: a ``[NUM_RECORDS, 3]`` int64 view of memory its receivers read."""

    def __init__(self, words: np.ndarray) -> None:
        self.records = words.reshape(NUM_RECORDS, RECORD_WORDS)
        self._upto: dict[int, tuple[int, int]] = {}  # record -> (tokens_before, tokens_upto)

    @staticmethod
    def index(send_id: int) -> int:
        return send_id % NUM_RECORDS

    def open(self, send_id: int, tokens_before: int) -> int:
        """A record for a new announced send (positions before ``tokens_before`` are written
        already: a prefix cached before the prompt's first forward)."""
        r = self.index(send_id)
        self.records[r, 2] = state_word(RUNNING)
        self.records[r, 1] = Progress(tokens_before, tokens_before, 0).word()
        self.records[r, 0] = send_id
        self._upto[r] = (tokens_before, tokens_before)
        return r

    def chunk(self, record: int, tokens_upto: int) -> None:
        """A forward is about to write positions up to ``tokens_upto`` (no layer yet)."""
        before = self._upto[record][1]
        self._upto[record] = (before, tokens_upto)
        self.records[record, 1] = Progress(before, tokens_upto, 0).word()

    def layer(self, record: int, layers: int) -> None:
        before, upto = self._upto[record]
        self.records[record, 1] = Progress(before, upto, layers).word()

    def finish(self, record: int, state: int, first_token: int = 0) -> None:
        self.records[record, 2] = state_word(state, first_token)
        self._upto.pop(record, None)


@dataclass
class LayerwiseLoad:
    """A receiver's pull in progress (a thread of the transport's). ``done`` is set when it
    ended; then ``result`` says what landed, ``state`` the sender's (READY: ``first_token``;
    FINISHED/FAILED: the request ended at prefill), or the copy failed (``result.loaded``
    False: recompute)."""

    done: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    result: KVLoad = KVLoad(loaded=False)
    state: int = RUNNING
    first_token: int = 0
    thread: threading.Thread | None = None

    def cancel(self) -> None:
        """Stop, and return only once nothing more will be written into the blocks."""
        self.cancelled.set()
        if self.thread is not None:
            self.thread.join()
