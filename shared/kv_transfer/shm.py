"""Shared-memory spill store: a request's KV blocks as one file under /dev/shm.

The sender copies the blocks out and writes them atomically (a temp file, then a rename), so a
reader never sees half an entry; its own blocks are free again at once. The receiver reads the
file into its blocks and deletes it. Files nobody loaded within ``orphan_timeout_s`` belonged to
requests that died and are reclaimed. Capacity is a byte budget over the folder's entries:
``send`` refuses (None) rather than fill the machine's RAM.

Capacity is checked in O(1): an estimate = the folder's size at the last scan + what this process
wrote since. Receivers delete entries this process never hears of, so the estimate only errs
high (an early refusal, never an overfilled folder) until the next scan, which runs at most every
``resync_interval_s`` from ``pop_freeable``/``reclaim_orphans`` — never inside ``send``. Other
writers' entries since the last scan are unseen for that long: the budget may be overshot by
what they write in one interval. (``statvfs`` would be O(1) and exact, but measures the whole
tmpfs — pooled transports' KV pools included — not this store.)

Entries are created 0600 (prefill and decode run as one user) under unguessable names (128
random bits from ``secrets``) in a directory that is this user's and 0700 (``private_dir``); the
store touches only its own ``*.kv``/``*.tmp`` files, never the pools beside them.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from collections import deque
from pathlib import Path

import numpy as np
import structlog
import torch

from shared.kv_transfer.connector import KV_DTYPES, KVConnector, KVLoad
from shared.wire.messages import KVDescriptor, KVRelease

log = structlog.get_logger(__name__)

PAYLOAD_VERSION = 1
_SUFFIX = ".kv"
_TMP = ".tmp"


class ShmConnector(KVConnector):
    name = "shm"

    def __init__(
        self,
        root: str | Path,
        max_bytes: int,
        orphan_timeout_s: float,
        resync_interval_s: float = 1.0,
    ) -> None:
        super().__init__()
        self.root = private_dir(Path(root))
        self.max_bytes = max_bytes
        self.orphan_timeout_s = orphan_timeout_s
        self.resync_interval_s = resync_interval_s
        self._copied: deque[str] = deque()  # sent: the engine may free their blocks
        self._estimate = self.used_bytes()  # see the module docstring
        self._synced_at = time.time()
        self.num_reclaimed = 0

    # --- sending role ---------------------------------------------------------------------------
    def send(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVDescriptor | None:
        index = torch.tensor(block_ids, dtype=torch.int64)
        kv = self.kv_cache.index_select(2, index.to(self.kv_cache.device)).cpu().contiguous()
        nbytes = kv.numel() * kv.element_size()
        if self._estimate + nbytes > self.max_bytes:
            log.warning("spill store full", request_id=request_id, nbytes=nbytes)
            return None
        name = f"{_safe(request_id)}-{secrets.token_hex(16)}"
        tmp = self.root / (name + _TMP)
        # bf16 has no numpy dtype: move the raw bytes through an int16 view.
        raw = kv.view(torch.int16) if kv.dtype == torch.bfloat16 else kv
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            raw.numpy().tofile(f)
        os.replace(tmp, self.root / (name + _SUFFIX))
        self._estimate += nbytes
        self._copied.append(request_id)
        payload = {"key": name, "shape": list(kv.shape), "dtype": _dtype_name(kv.dtype)}
        return KVDescriptor("shm", PAYLOAD_VERSION, num_tokens, nbytes, payload)

    def pop_freeable(self, now: float) -> list[str]:
        self._maybe_resync(now)
        out = list(self._copied)
        self._copied.clear()
        return out

    # --- receiving role -------------------------------------------------------------------------
    def load(self, desc: KVDescriptor, block_ids: list[int], first_block: int) -> KVLoad:
        t0 = time.perf_counter()
        kv = self._read(desc)
        if kv is None:
            return KVLoad(loaded=False)
        n = kv.shape[2]
        if len(block_ids) != n - first_block:
            raise ValueError(f"{len(block_ids)} blocks for entry blocks {first_block}..{n}")
        # Float rows convert between float dtypes; int8's packed rows (kv_codec.py) never do.
        quantized = (kv.dtype == torch.int8, self.kv_cache.dtype == torch.int8)
        if quantized[0] != quantized[1] or kv.shape[3:] != self.kv_cache.shape[3:]:
            raise ValueError(
                f"KV entry {tuple(kv.shape)} {kv.dtype} does not fit this cache "
                f"{tuple(self.kv_cache.shape)} {self.kv_cache.dtype} (BATON_DTYPE and "
                "BATON_KV_CACHE_DTYPE must match between prefill and decode)"
            )
        if n > first_block:
            index = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_cache.device)
            src = kv[:, :, first_block:].to(self.kv_cache.device, self.kv_cache.dtype)
            self.kv_cache.index_copy_(2, index, src)
        return KVLoad(loaded=True, nbytes=desc.nbytes, seconds=time.perf_counter() - t0)

    def discard(self, desc: KVDescriptor) -> KVRelease | None:
        self._path(desc).unlink(missing_ok=True)
        return None

    def _read(self, desc: KVDescriptor) -> torch.Tensor | None:
        path = self._path(desc)
        dtype = KV_DTYPES.get(str(desc.payload.get("dtype")))
        if dtype is None:
            raise ValueError(f"unsupported KV dtype {desc.payload.get('dtype')!r}")
        np_dtype = np.int16 if dtype == torch.bfloat16 else getattr(np, str(desc.payload["dtype"]))
        try:
            data = np.fromfile(path, dtype=np_dtype)
        except FileNotFoundError:
            return None
        path.unlink(missing_ok=True)
        t = torch.from_numpy(data)
        if dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        shape = [int(x) for x in desc.payload["shape"]]
        if t.numel() * t.element_size() != desc.nbytes or t.numel() != _prod(shape):
            raise ValueError(f"KV entry {path.name} does not hold shape {shape}")
        return t.view(shape)

    # --- housekeeping ---------------------------------------------------------------------------
    def used_bytes(self) -> int:
        """The store's size now, by a scan of the folder (housekeeping, never per send)."""
        total = 0
        with os.scandir(self.root) as it:
            for entry in it:
                if not entry.name.endswith((_SUFFIX, _TMP)):
                    continue  # a pooled transport's pool, or a stranger
                try:
                    total += entry.stat().st_size
                except FileNotFoundError:  # a reader deleted it meanwhile
                    pass
        return total

    def _maybe_resync(self, now: float) -> None:
        if now - self._synced_at >= self.resync_interval_s:
            self._estimate, self._synced_at = self.used_bytes(), now

    def reclaim_orphans(self, now: float) -> int:
        removed = 0
        with os.scandir(self.root) as it:
            for entry in it:
                if not entry.name.endswith((_SUFFIX, _TMP)):
                    continue
                try:
                    if now - entry.stat().st_mtime > self.orphan_timeout_s:
                        os.unlink(entry.path)
                        removed += 1
                except FileNotFoundError:
                    pass
        if removed:
            log.info("reclaimed orphan KV entries", count=removed)
        self.num_reclaimed += removed
        self._maybe_resync(now)
        return removed

    def reclaimed(self) -> dict[tuple[str, str], int]:
        return {("spill_entries", "unclaimed"): self.num_reclaimed}

    def _path(self, desc: KVDescriptor) -> Path:
        key = desc.payload.get("key")
        if desc.transport != self.name or desc.version != PAYLOAD_VERSION:
            raise ValueError(f"not an shm v{PAYLOAD_VERSION} descriptor: {desc.transport}")
        if not isinstance(key, str) or "/" in key or key.startswith(".") or not key:
            raise ValueError(f"bad shm key {key!r}")
        return self.root / (key + _SUFFIX)


def private_dir(root: Path) -> Path:
    """``root``, created 0700, or an existing one checked to be this user's and made 0700.

    The files in it are 0600, but whoever may write to the directory could delete or swap an
    entry under its name (decode would load their bytes as KV), and whoever may list it sees the
    request ids in the names. A directory of another user (a shared mount point such as
    /dev/shm itself) is refused: a subdirectory of it, created here, is private."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = root.stat()
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"KV directory {root} belongs to uid {st.st_uid}, not to this process "
            f"(uid {os.geteuid()}): set BATON_SPILL_DIR to a directory of Baton's own, "
            f"e.g. {root / 'kv'}"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(root, 0o700)
    return root


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _prod(shape: list[int]) -> int:
    out = 1
    for x in shape:
        out *= x
    return out


def _safe(key: str) -> str:
    """A file-name-safe, bounded form of a request id (ids are client-chosen strings)."""
    cleaned = "".join(c if c.isalnum() or c in "-_" else "_" for c in key)
    return cleaned[:64] or "req"
