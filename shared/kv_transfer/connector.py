"""The KV connector: a sending role (prefill) and a receiving role (decode), on block ids.

After vLLM's KV connector, reduced to what a disaggregated pair needs:

- The **sender** is handed block ids of the engine's KV cache. ``send`` returns a descriptor
  (opaque to everyone but this transport) and, with it, takes over the duty to free those
  blocks: the engine frees them only when ``pop_freeable`` names the request — at once for a
  transport that copied the KV out (the spill store), on the receiver's release or a lease expiry
  for one that lets the receiver read the sender's pool in place (``pool``, ``cuda-ipc``).
- The **receiver** copies a descriptor's KV into block ids of its own cache (``load``) or drops
  it (``discard``); either may yield a :class:`KVRelease` for the shell to deliver to the sender.

Both roles see the engine's cache only through ``register_kv_cache`` (one tensor,
``[layers, 2, blocks, block_size, kv_heads, row_width]``, row_width = head_dim for a float
cache, head_dim + 4 for int8's packed rows; shared/runtime/kv_codec.py); no shell ever touches KV
tensors. A transport moves whole blocks and never converts: two caches of different dtype or
row width do not hand off.
Swap-out/in fit the same verbs: a decode engine may hold a sender role of its own. A transport
whose receiver reads the sender's memory remotely may also stream (``layerwise``;
shared/kv_transfer/layerwise.py): the sender announces a prompt before computing it and
publishes its progress layer by layer, the receiver pulls each layer as it is written.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch

from shared.wire.messages import KVDescriptor, KVRelease

# The cache dtypes a descriptor may name (the engine's float dtypes and int8's packed rows).
KV_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class KVLoad:
    """The outcome of ``load``: ``loaded`` False means the KV is gone — the engine recomputes."""

    loaded: bool
    nbytes: int = 0
    seconds: float = 0.0
    release: KVRelease | None = None


@dataclass(frozen=True)
class KVConnectorStats:
    """A connector's counters (cumulative since start, but for the gauge ``pinned_blocks``)."""

    pinned_blocks: int = 0  # sender: blocks held for receivers
    leases_expired: int = 0  # sender: pins freed by lease, not by a release
    map_failures: int = 0  # receiver: a sender's pool could not be mapped (recomputed)
    stale_loads: int = 0  # receiver: refused, the KV might no longer be the sender's (recomputed)
    fallbacks: int = 0  # handoffs that went through the spill store instead (BATON_KV_FALLBACK)


class KVConnector(ABC):
    """One transport; a process uses the role it plays (both, for a decode that swaps)."""

    name: str

    def __init__(self) -> None:
        self._kv_cache: torch.Tensor | None = None

    def allocate_kv_cache(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """The engine's KV cache, allocated where this transport can share it (zeroed), or None:
        the engine allocates its own. Called once, before ``register_kv_cache``; a transport that
        returns a tensor also requires that exact tensor to be registered (its pool)."""
        return None

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self._kv_cache = kv_cache

    def close(self) -> None:  # noqa: B027 - only transports holding OS resources need it
        """Give back what this connector holds (files, mappings); the process is stopping."""

    @property
    def kv_cache(self) -> torch.Tensor:
        if self._kv_cache is None:
            raise RuntimeError(f"{self.name}: register_kv_cache() first")
        return self._kv_cache

    def stats(self) -> KVConnectorStats:
        return KVConnectorStats()

    @property
    def release_route(self) -> str | None:
        """The id receivers address this sender's release notices to (``KVRelease.sender_id``);
        None for a transport whose sender needs none (it copied the KV out)."""
        return None

    # --- sending role ---------------------------------------------------------------------------
    @abstractmethod
    def send(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVDescriptor | None:
        """Offer the KV of the first ``num_tokens`` positions, held in exactly ``block_ids`` (the
        engine's choice: the blocks a sliding window still holds, then any full-precision
        slots of an int8 cache; the descriptor's ``first_block``/``fp_slots`` say which).

        None: the transport cannot take it now (full); the engine keeps the duty to free."""

    # --- layer-wise (layerwise.py; transports that set ``layerwise``) ---------------------------
    layerwise = False

    def announce(
        self, request_id: str, block_ids: list[int], num_tokens: int, num_computed: int
    ) -> KVDescriptor | None:
        """``send`` before the KV exists: pin ``block_ids`` (the prompt's final blocks) and
        open a progress record; positions below ``num_computed`` are written already."""
        raise NotImplementedError(f"{self.name} hands off whole requests only")

    def stream_chunk(self, request_id: str, tokens_upto: int) -> None:
        """A forward of an announced prompt starts, writing positions up to ``tokens_upto``."""
        raise NotImplementedError

    def stream_layer(self, request_id: str, layers: int) -> None:
        """The forward has written its first ``layers`` layers."""
        raise NotImplementedError

    def stream_end(self, request_id: str, state: int, first_token: int = 0) -> None:
        """No more writes: ``layerwise.READY`` with the first token, FINISHED (it ended at its
        first token) or FAILED (its forward failed, or it was cancelled)."""
        raise NotImplementedError

    def start_load(self, desc: KVDescriptor, block_ids: list[int], first_block: int) -> Any:
        """``load`` of an announced descriptor, in the background: a LayerwiseLoad."""
        raise NotImplementedError

    @abstractmethod
    def pop_freeable(self, now: float) -> list[str]:
        """Requests whose blocks the engine may free now (each named exactly once)."""

    def release(self, notice: KVRelease) -> None:  # noqa: B027 - copy transports need none
        """The receiver is done with a request's KV."""

    # --- receiving role -------------------------------------------------------------------------
    @abstractmethod
    def load(self, desc: KVDescriptor, block_ids: list[int], first_block: int) -> KVLoad:
        """Copy blocks ``first_block ..`` of the descriptor's KV into ``block_ids`` (blocks before
        ``first_block`` were prefix-cache hits here and already hold the same KV)."""

    @abstractmethod
    def discard(self, desc: KVDescriptor) -> KVRelease | None:
        """Drop a descriptor's KV unread (cancelled, expired, or a duplicate)."""

    def reclaim_orphans(self, now: float) -> int:
        """Housekeeping: free what no receiver will ever take; returns how many."""
        return 0

    def reclaimed(self) -> dict[tuple[str, str], int]:
        """KV this connector freed because nobody would (cumulative), by (kind, reason):
        ``spill_entries``/``unclaimed`` (no receiver loaded them in time), ``pool_blocks``/
        ``lease_expired`` (the receiver never released them: it died), ``pool_files``/
        ``owner_dead`` (a dead sender's pool). Exported as ``baton:kv_orphans_reclaimed_total``."""
        return {}


# --- what the pooled transports (pool, cuda-ipc) share ----------------------------------------
@dataclass
class _Pin:
    send_id: int
    blocks: np.ndarray  # distinct block ids
    deadline: float


class PinLedger:
    """The sending side of a pooled transport: which blocks are pinned for which request, until
    when, and the *pin table* receivers check (``table``: one int64 per block, in memory they map).

    A block's table entry holds a fresh epoch while it is pinned and is cleared before the request
    is named freeable — so a receiver that sees its descriptor's epochs before and after a copy
    read blocks nobody could have reused meanwhile. A block pinned by several requests (a shared
    prefix) keeps its first epoch until its last pin goes. Per-block work is vectorised: a send
    or release costs a few numpy calls whatever its length.
    """

    def __init__(self, table: np.ndarray, lease_s: float) -> None:
        self.table, self.lease_s = table, lease_s
        self._pins: dict[str, _Pin] = {}  # insertion order = deadline order (one lease length)
        self._count = np.zeros(len(table), dtype=np.int32)  # pins per block
        self._freeable: list[str] = []
        self._next_send_id = 1
        self.num_pinned_blocks = 0
        self.num_leases_expired = 0
        self.num_blocks_expired = 0  # blocks those expired leases gave back

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pins

    def pin(self, request_id: str, blocks: list[int]) -> tuple[int, list[int], float]:
        """Pin ``blocks`` for a request: (send id, their epochs, lease deadline: wall clock)."""
        if request_id in self._pins:  # see __contains__: the caller refuses such a send
            raise ValueError(f"{request_id!r} is pinned already")
        send_id, self._next_send_id = self._next_send_id, self._next_send_id + 1
        ids = np.asarray(blocks, dtype=np.int64)
        if len(set(blocks)) != len(blocks):  # a block table never repeats a block; be safe
            ids = np.unique(ids)
        fresh = ids[self._count[ids] == 0]
        self.table[fresh] = send_id
        self._count[ids] += 1
        self.num_pinned_blocks += len(fresh)
        deadline = time.time() + self.lease_s
        self._pins[request_id] = _Pin(send_id, ids, deadline)
        return send_id, self.table[blocks].tolist(), deadline

    def release(self, request_id: str, send_id: int) -> bool:
        """Unpin on the receiver's word; only the release of *this* send counts."""
        pin = self._pins.get(request_id)
        if pin is None or pin.send_id != send_id:
            return False
        self._unpin(request_id)
        return True

    def pop_freeable(self, now: float) -> list[str]:
        expired = []
        for rid, pin in self._pins.items():
            if pin.deadline > now:
                break  # later pins have later deadlines (a clock step back only delays expiry)
            expired.append(rid)
        for rid in expired:  # orphans: the receiver died or the request was dropped unreleased
            self.num_leases_expired += 1
            log.warning("kv lease expired; freeing unreleased blocks", request_id=rid)
            self.num_blocks_expired += self._unpin(rid)
        out, self._freeable = self._freeable, []
        return out

    def _unpin(self, request_id: str) -> int:
        """Returns how many blocks no pin holds any more."""
        ids = self._pins.pop(request_id).blocks
        self._count[ids] -= 1
        gone = ids[self._count[ids] == 0]
        self.table[gone] = 0  # before the engine may reuse the blocks
        self.num_pinned_blocks -= len(gone)
        self._freeable.append(request_id)
        return len(gone)


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs consecutive on both sides."""
    runs: list[list[int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, k) for s, d, k in runs]


def copy_blocks(
    dst: torch.Tensor, src: torch.Tensor, src_ids: list[int], dst_ids: list[int]
) -> None:
    """``dst[:, :, dst_ids] = src[:, :, src_ids]`` on ``[L, 2, blocks, ...]`` caches (any device).

    Few runs of consecutive ids: one strided slice copy each (one pass over the bytes); many: one
    gather and one scatter (two passes, but two kernels rather than one per run on a GPU). Ids
    must be in range (a slice would clip silently)."""
    runs = block_runs(src_ids, dst_ids)
    if len(runs) <= 4:
        for s, d, k in runs:
            dst[:, :, d : d + k].copy_(src[:, :, s : s + k])
        return
    src_index = torch.tensor(src_ids, dtype=torch.int64, device=src.device)
    dst_index = torch.tensor(dst_ids, dtype=torch.int64, device=dst.device)
    dst.index_copy_(2, dst_index, src.index_select(2, src_index).to(dst.device))


def block_rows(cache: torch.Tensor) -> np.ndarray:
    """A contiguous CPU cache ``[L, 2, blocks, ...]`` as a numpy byte view ``[L*2, blocks, B]``."""
    shape = cache.shape
    return cache.view(torch.uint8).view(shape[0] * shape[1], shape[2], -1).numpy()


def copy_block_rows(
    dst: np.ndarray, src: np.ndarray, src_ids: list[int], dst_ids: list[int]
) -> None:
    """``copy_blocks`` on ``block_rows`` views, for host memory: one numpy strided copy per run.
    Faster than torch's index_copy_ or per-block ``copy_`` on small models' KV (their per-call
    overhead dwarfs a row of a few KiB), and a single pass over the bytes."""
    for s, d, k in block_runs(src_ids, dst_ids):
        dst[:, d : d + k] = src[:, s : s + k]
