"""Pooled KV transports: the receiver maps the sender's KV pool once and copies blocks from it.

One protocol, two backings: ``pool`` (``pool.py``: the prefill cache lives in a shared-memory
file, decode maps it read-only) and ``cuda-ipc`` (``cuda_ipc.py``: the pool is a CUDA
allocation exported by handle). Nothing is serialised; a descriptor names the pool (worker id +
generation) and the request's block ids.

Invariants that keep a receiver from ever reading wrong KV:

- **Pins.** ``send`` pins the request's blocks; the sender frees them (``pop_freeable``) only
  after the receiver's release or a lease expiry. Each pooled file starts with a *pin table*
  (one int64 per block, in shared memory): a block's entry holds a fresh epoch while it is pinned
  and is cleared *before* the block goes back to the engine. A descriptor carries the epochs its
  blocks had at send; the receiver checks them before and after its copy (a seqlock: stores and
  loads are ordered on x86-64's TSO; the GPU copy is synchronised before the second check). A
  redelivered handoff whose blocks were released meanwhile is therefore refused, never misread.
- **Leases.** A receiver does not start a copy within ``lease_margin_s`` of the lease deadline
  and drops a copy that ended after it (same node, same wall clock).
- **Liveness and generations.** A sender holds an exclusive ``flock`` on its file for its life
  and names it ``<transport>-<worker>-<generation>`` (fresh random generation per start). A
  receiver reads only while that lock is held (the owner is alive); a restarted sender, or any
  connector's housekeeping, deletes files whose lock is free. So a stale handle is never read.

A refused or failed load returns ``KVLoad(loaded=False)``: the decode engine recomputes every
position from ``first_block`` on, overwriting whatever a partial copy wrote into its own blocks.
Files are 0600 in the spill folder, which must be this user's and is made 0700
(``shm.private_dir``): prefill and decode must run as the same user.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from shared.kv_transfer.connector import (
    KV_DTYPES,
    KVConnector,
    KVConnectorStats,
    KVLoad,
    PinLedger,
    block_rows,
    copy_blocks,
)
from shared.kv_transfer.shm import private_dir
from shared.wire.messages import KVDescriptor, KVRelease

log = structlog.get_logger(__name__)

PAYLOAD_VERSION = 1
_ALIGN = 1 << 21  # the KV data starts on a 2 MiB boundary (huge pages, if the kernel gives them)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # a receiver maps once: fault every page in then
_NAME_PART = re.compile(r"[A-Za-z0-9_.-]{1,128}")


@dataclass(frozen=True)
class PoolHandoff:
    """A pooled descriptor's payload, validated."""

    request_id: str
    worker_id: str
    generation: str
    send_id: int
    block_ids: list[int]
    epochs: list[int]
    shape: list[int]
    dtype: torch.dtype
    data_offset: int
    deadline: float
    raw: dict[str, Any]

    @property
    def file_name(self) -> str:
        return _file_name(str(self.raw["transport"]), self.worker_id, self.generation)


@dataclass
class PoolMapping:
    """A receiver's read-only view of one sender pool (one per worker id + generation)."""

    fd: int  # kept open: its flock tells whether the owner still lives
    mm: mmap.mmap
    pins: np.ndarray
    source: torch.Tensor
    rows: np.ndarray | None = None  # host pools: ``block_rows(source)``, made on first copy


class PooledConnector(KVConnector):
    """The pooled protocol; a backing supplies the pool (``_export``/``_open_source``/``_copy``)."""

    def __init__(
        self,
        root: str | Path,
        worker_id: str | None = None,
        lease_s: float = 30.0,
        *,
        export: bool = True,
        lease_margin_s: float = 1.0,
        max_mappings: int = 16,
    ) -> None:
        super().__init__()
        self.root = private_dir(Path(root))
        self.worker_id = _safe(worker_id or f"{socket.gethostname()}-{os.getpid()}")
        self.generation = secrets.token_hex(8)  # fresh per start: a restart is a new pool
        self.lease_s, self.lease_margin_s, self.export = lease_s, lease_margin_s, export
        self.max_mappings = max_mappings
        # sender
        self._fd = -1
        self._mm: mmap.mmap | None = None
        self._data_offset = 0
        self._ledger: PinLedger | None = None
        self._block_nbytes = 0
        # receiver
        self._rows: np.ndarray | None = None  # a host cache as block rows (the fast copy)
        self._maps: OrderedDict[tuple[str, str], PoolMapping] = OrderedDict()
        # counters (the shell exports them as metrics)
        self.num_map_failures = 0
        self.num_stale_loads = 0  # refused: lease ending, blocks re-pinned or owner gone
        self.num_pools_reaped = 0
        if export:
            self.reap_dead_pools()  # a restarted sender: earlier generations go now

    def stats(self) -> KVConnectorStats:
        return KVConnectorStats(
            pinned_blocks=self.num_pinned_blocks,
            leases_expired=self.num_leases_expired,
            map_failures=self.num_map_failures,
            stale_loads=self.num_stale_loads,
        )

    @property
    def release_route(self) -> str | None:
        return self.worker_id if self.export else None

    @property
    def num_pinned_blocks(self) -> int:
        return self._ledger.num_pinned_blocks if self._ledger else 0

    @property
    def num_leases_expired(self) -> int:
        return self._ledger.num_leases_expired if self._ledger else 0

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        super().register_kv_cache(kv_cache)
        shape = kv_cache.shape
        self._block_nbytes = shape[0] * shape[1] * shape[3:].numel() * kv_cache.element_size()
        if kv_cache.device.type == "cpu" and kv_cache.is_contiguous():
            self._rows = block_rows(kv_cache)

    # --- the pool file (sender) -----------------------------------------------------------------
    def _create_pool_file(self, num_blocks: int, data_nbytes: int) -> int:
        """Create, lock and map this generation's file; returns the data offset."""
        name = _file_name(self.name, self.worker_id, self.generation)
        offset = -(-num_blocks * 8 // _ALIGN) * _ALIGN
        size = offset + data_nbytes
        tmp = self.root / f".{name}.tmp"  # locked before it gets a name the reaper looks at
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:  # reserve now: a full /dev/shm fails here, not with SIGBUS while serving
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise RuntimeError(
                    f"{self.name}: cannot reserve {size >> 20} MiB in {self.root} ({exc}); "
                    "enlarge /dev/shm (compose: shm_size) or lower BATON_KV_CACHE_MB"
                ) from exc
            # mmap keeps a dup of the fd it maps, which would hold the lock past close():
            # map through a second open of the file, so the lock lives on ``fd`` alone.
            map_fd = os.open(tmp, os.O_RDWR)
            try:
                self._mm = mmap.mmap(map_fd, size, flags=mmap.MAP_SHARED)
            finally:
                os.close(map_fd)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self._mm.madvise(mmap.MADV_HUGEPAGE)
            os.rename(tmp, self.root / name)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        self._fd = fd
        self._ledger = PinLedger(np.frombuffer(self._mm, np.int64, count=num_blocks), self.lease_s)
        log.info("kv pool exported", transport=self.name, file=name, mib=size >> 20)
        return offset

    def _export(self) -> dict[str, Any]:
        """What a receiver needs, besides the file, to open the pool (backing-specific)."""
        return {}

    # --- sending role ---------------------------------------------------------------------------
    def send(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVDescriptor | None:
        if self._ledger is None:
            raise RuntimeError(f"{self.name}: no exported pool (receiving role only?)")
        if request_id in self._ledger:
            # Still pinned for its first send (a replay in the same generation). Freeing under the
            # same id would free the wrong send's blocks: refuse; the engine frees this copy's
            # blocks itself and decode recomputes.
            log.warning("request pinned already; sending it without KV", request_id=request_id)
            return None
        blocks = [int(b) for b in block_ids]
        send_id, epochs, deadline = self._ledger.pin(request_id, blocks)
        kv = self.kv_cache
        payload = {
            "transport": self.name,
            "request_id": request_id,
            "worker_id": self.worker_id,
            "generation": self.generation,
            "send_id": send_id,
            "block_ids": blocks,
            "epochs": epochs,
            "shape": list(kv.shape),
            "dtype": str(kv.dtype).removeprefix("torch."),
            "data_offset": self._data_offset,
            "lease_deadline": deadline,
            **self._export(),
        }
        nbytes = len(blocks) * self._block_nbytes
        return KVDescriptor(self.name, PAYLOAD_VERSION, num_tokens, nbytes, payload)

    def release(self, notice: KVRelease) -> None:
        p = notice.payload
        if self._ledger is not None and p.get("generation") == self.generation:
            self._ledger.release(notice.request_id, int(p.get("send_id", 0)))

    def pop_freeable(self, now: float) -> list[str]:
        return self._ledger.pop_freeable(now) if self._ledger else []

    # --- receiving role -------------------------------------------------------------------------
    def load(self, desc: KVDescriptor, block_ids: list[int], first_block: int) -> KVLoad:
        t0 = time.perf_counter()
        h = self._parse(desc)
        release = _release_for(h)
        n = len(h.block_ids)
        if len(block_ids) != n - first_block or not 0 <= first_block <= n:
            raise ValueError(f"{len(block_ids)} blocks for handoff blocks {first_block}..{n}")
        if n == first_block:
            return KVLoad(loaded=True, release=release)
        if time.time() >= h.deadline - self.lease_margin_s:
            return self._refuse(h, "lease ends", release)
        src_ids = h.block_ids[first_block:]
        if not self._pull(h, src_ids, block_ids, np.array(h.epochs[first_block:])):
            return KVLoad(loaded=False, release=release)
        nbytes = len(src_ids) * self._block_nbytes
        return KVLoad(True, nbytes, time.perf_counter() - t0, release)

    def _pull(
        self, h: PoolHandoff, src_ids: list[int], block_ids: list[int], epochs: np.ndarray
    ) -> bool:
        """Copy the sender's ``src_ids`` into this cache's ``block_ids`` if their pins still
        carry ``epochs`` before and after the copy (a seqlock); False: recompute (counted)."""
        m = self._mapping(h)
        if m is None:
            self.num_map_failures += 1
            log.warning("kv pool cannot be mapped; recomputing", request_id=h.request_id)
            return False
        for ids, limit in ((src_ids, m.source.shape[2]), (block_ids, self.kv_cache.shape[2])):
            if min(ids) < 0 or max(ids) >= limit:  # a slice would clip silently
                raise ValueError(f"block ids outside 0..{limit - 1}")
        idx = np.array(src_ids)
        if not (m.pins[idx] == epochs).all():
            return self._refused(h, "blocks no longer pinned")
        self._copy(m, src_ids, block_ids)
        # Seqlock close: had the sender unpinned (and so possibly reused) a block during the
        # copy, its epoch would have changed. A partial write here is recomputed by the engine.
        if not (_owner_alive(m.fd) and (m.pins[idx] == epochs).all()) or time.time() >= h.deadline:
            return self._refused(h, "pin lost during the copy")
        return True

    def discard(self, desc: KVDescriptor) -> KVRelease | None:
        try:
            return _release_for(self._parse(desc))
        except ValueError:
            log.warning("discarding a descriptor this transport cannot read", kind=desc.transport)
            return None

    def reclaim_orphans(self, now: float) -> int:
        return self.reap_dead_pools()

    def _refuse(self, h: PoolHandoff, why: str, release: KVRelease) -> KVLoad:
        self._refused(h, why)
        return KVLoad(loaded=False, release=release)

    def _refused(self, h: PoolHandoff, why: str) -> bool:
        self.num_stale_loads += 1
        log.warning("kv handoff refused; recomputing", request_id=h.request_id, why=why)
        return False

    def _mapping(self, h: PoolHandoff) -> PoolMapping | None:
        """The sender's pool, mapped once per (worker, generation); None if its owner is gone."""
        key = (h.worker_id, h.generation)
        m = self._maps.get(key)
        if m is not None:
            if _owner_alive(m.fd):
                self._maps.move_to_end(key)
                return m
            self._drop(key)
            return None
        try:
            fd = os.open(self.root / h.file_name, os.O_RDONLY)
        except OSError:
            return None
        if not _owner_alive(fd):  # died, not yet reaped: its pins will never be released
            os.close(fd)
            return None
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
            pins = np.frombuffer(mm, np.int64, count=h.shape[2])
            m = PoolMapping(fd, mm, pins, self._open_source(h, mm))
        except Exception as exc:  # a handle that cannot be opened is a recompute, not a crash
            os.close(fd)
            log.warning("kv pool unreadable", file=h.file_name, error=repr(exc))
            return None
        src, dst = m.source, self.kv_cache
        if (
            src.dtype != dst.dtype
            or src.shape[:2] != dst.shape[:2]
            or src.shape[3:] != dst.shape[3:]
        ):
            os.close(fd)  # another model or layout: never mixed (a configuration error)
            raise ValueError(f"pool {tuple(src.shape)} {src.dtype} does not fit {tuple(dst.shape)}")
        for other in [k for k in self._maps if k[0] == h.worker_id]:
            self._drop(other)  # that worker restarted: its older pool is dead
        self._maps[key] = m
        while len(self._maps) > self.max_mappings:
            self._drop(next(iter(self._maps)))
        return m

    def _drop(self, key: tuple[str, str]) -> None:
        # The mmap closes when the last tensor view of it dies; the fd goes now.
        os.close(self._maps.pop(key).fd)

    def _open_source(self, h: PoolHandoff, mm: mmap.mmap) -> torch.Tensor:
        """The sender's pool as a read-only tensor (the mapping keeps it alive)."""
        raise NotImplementedError

    def _copy(self, m: PoolMapping, src_ids: list[int], dst_ids: list[int]) -> None:
        copy_blocks(self.kv_cache, m.source, src_ids, dst_ids)

    # --- housekeeping ---------------------------------------------------------------------------
    def reap_dead_pools(self) -> int:
        """Delete this transport's pool files whose owner died (their lock is free)."""
        removed = 0
        with os.scandir(self.root) as it:
            for entry in it:
                if not entry.name.startswith(self.name + "-"):
                    continue
                try:
                    fd = os.open(entry.path, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.unlink(entry.path)  # ours now: the owner is gone
                    removed += 1
                except OSError:
                    pass  # alive (or a receiver checking it this instant)
                finally:
                    os.close(fd)
        if removed:
            log.info("removed pools of dead senders", transport=self.name, count=removed)
        self.num_pools_reaped += removed
        return removed

    def reclaimed(self) -> dict[tuple[str, str], int]:
        expired = self._ledger.num_blocks_expired if self._ledger else 0
        return {
            ("pool_blocks", "lease_expired"): expired,
            ("pool_files", "owner_dead"): self.num_pools_reaped,
        }

    def close(self) -> None:
        for key in list(self._maps):
            self._drop(key)
        if self._fd >= 0:
            (self.root / _file_name(self.name, self.worker_id, self.generation)).unlink(
                missing_ok=True
            )
            os.close(self._fd)
            self._fd = -1

    def _parse(self, desc: KVDescriptor) -> PoolHandoff:
        p = desc.payload
        if desc.transport != self.name or desc.version != PAYLOAD_VERSION:
            raise ValueError(f"not a {self.name} v{PAYLOAD_VERSION} descriptor: {desc.transport}")
        try:
            h = PoolHandoff(
                str(p["request_id"]), _safe(str(p["worker_id"])), _safe(str(p["generation"])),
                int(p["send_id"]), [int(b) for b in p["block_ids"]],
                [int(e) for e in p["epochs"]], [int(x) for x in p["shape"]],
                KV_DTYPES[str(p["dtype"])], int(p["data_offset"]), float(p["lease_deadline"]), p,
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad {self.name} payload: {exc!r}") from None
        if len(h.epochs) != len(h.block_ids) or len(h.shape) != 6:
            raise ValueError(f"bad {self.name} payload: inconsistent lengths")
        return h


def _release_for(h: PoolHandoff) -> KVRelease:
    payload = {"generation": h.generation, "send_id": h.send_id}
    return KVRelease(str(h.raw["transport"]), h.worker_id, h.request_id, payload)


def _owner_alive(fd: int) -> bool:
    """The owner holds an exclusive lock for its life; a shared one is ours only if it died."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _is_pool(t: torch.Tensor, mm: mmap.mmap, offset: int) -> bool:
    base = np.frombuffer(mm, np.uint8, count=1, offset=offset).ctypes.data
    return t.device.type == "cpu" and t.data_ptr() == base and t.is_contiguous()


def _file_name(transport: str, worker_id: str, generation: str) -> str:
    return f"{transport}-{worker_id}-{generation}"


def _safe(key: str) -> str:
    """A file-name-safe worker id or generation (they come from descriptors too)."""
    if not _NAME_PART.fullmatch(key):
        raise ValueError(f"bad pool name part {key!r}")
    return key
