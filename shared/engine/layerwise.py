"""Prefill's side of a layer-wise handoff (shared/kv_transfer/layerwise.py): which prompts it
announced, and what their forwards report.

A prompt is announced in the step that schedules its first chunk: its handoff (descriptor, no
first token) goes out with that step's output, and the chunk's forward runs in the next step —
after the shell has published the handoff, so decode can pull while prefill computes. Each
forward then reports, per announced prompt in it, the positions it writes and each layer as it
is stored; the prompt's end reports its first token (or that it ended there). An announced
prompt's blocks are pinned for decode from the start: if its forward fails or it is cancelled,
the state says so and its blocks wait for decode's release (or the lease) like a sent one's.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.kv_transfer.connector import KVConnector
from shared.kv_transfer.layerwise import FAILED, FINISHED, READY
from shared.runtime.sequence import Sequence
from shared.scheduling.prefill_scheduler import PrefillBatch


class PrefillStreams:
    def __init__(self, connector: KVConnector) -> None:
        self.connector = connector
        self.announced: set[str] = set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.announced

    @staticmethod
    def wanted(seq: Sequence) -> bool:
        """Announce a prompt at its first chunk, unless its first token surely ends it. Not one
        with several choices (n > 1): the progress record carries one first token."""
        p = seq.sampling
        return seq.num_computed_tokens == seq.num_cached_tokens and p.max_tokens > 1 and p.n == 1

    def add(self, request_id: str) -> None:
        self.announced.add(request_id)

    def on_layer(self, batch: PrefillBatch) -> Callable[[int], None] | None:
        """Before a forward: each announced prompt's positions; the callback reports layers."""
        mine = [s.request_id for s in batch.seqs if s.request_id in self.announced]
        if not mine:
            return None
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.request_id in self.announced:
                self.connector.stream_chunk(seq.request_id, seq.num_computed_tokens + n)

        def report(layers: int) -> None:
            for rid in mine:
                self.connector.stream_layer(rid, layers)

        return report

    def end(self, request_id: str, first_token: int, finished: bool) -> None:
        self.announced.discard(request_id)
        self.connector.stream_end(request_id, FINISHED if finished else READY, first_token)

    def fail(self, request_id: str) -> bool:
        """The announced prompt will not be computed (failed, cancelled, expired): True if it
        was announced (its blocks stay pinned until decode lets go)."""
        if request_id not in self.announced:
            return False
        self.announced.discard(request_id)
        self.connector.stream_end(request_id, FAILED)
        return True
