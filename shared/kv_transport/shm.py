"""Shared-memory spill store: KV blocks as files under /dev/shm, one file per entry.

Writes are atomic (write a temp file, then rename), so a reader never sees half an entry. A file
is deleted by the reader that loads it; files nobody loaded within ``orphan_timeout_s`` belonged
to requests that died and are reclaimed by :meth:`reclaim_orphans`. Capacity is a byte budget
over the whole folder: ``send`` refuses (returns None) instead of filling the machine's RAM.
The same store holds KV that decode swaps out on preemption.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import numpy as np
import structlog
import torch

from shared.protocol import KVDescriptor

log = structlog.get_logger(__name__)

_SUFFIX = ".kv"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ShmKVStore:
    def __init__(self, root: str | Path, max_bytes: int, orphan_timeout_s: float) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.orphan_timeout_s = orphan_timeout_s

    # --- sending role ---------------------------------------------------------------------------
    def send(self, key: str, kv: torch.Tensor, num_tokens: int) -> KVDescriptor | None:
        kv = kv.detach().to("cpu").contiguous()
        nbytes = kv.numel() * kv.element_size()
        if self.used_bytes() + nbytes > self.max_bytes:
            log.warning("spill store full, handing off without KV", key=key, nbytes=nbytes)
            return None
        name = f"{_safe(key)}-{uuid.uuid4().hex}"
        path = self.root / (name + _SUFFIX)
        tmp = self.root / (name + ".tmp")
        # bf16 has no numpy dtype: move the raw bytes through an int16 view.
        raw = kv.view(torch.int16) if kv.dtype == torch.bfloat16 else kv
        raw.numpy().tofile(tmp)
        os.replace(tmp, path)
        return KVDescriptor(
            transport="shm",
            key=name,
            num_tokens=num_tokens,
            nbytes=nbytes,
            shape=list(kv.shape),
            dtype=str(kv.dtype).removeprefix("torch."),
        )

    # --- receiving role -------------------------------------------------------------------------
    def receive(self, desc: KVDescriptor) -> torch.Tensor | None:
        path = self._path(desc)
        dtype = _DTYPES.get(desc.dtype)
        if dtype is None:
            raise ValueError(f"unsupported KV dtype {desc.dtype!r}")
        try:
            np_dtype = np.int16 if dtype == torch.bfloat16 else getattr(np, desc.dtype)
            data = np.fromfile(path, dtype=np_dtype)
        except FileNotFoundError:
            return None
        path.unlink(missing_ok=True)
        t = torch.from_numpy(data)
        if dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        if t.numel() * t.element_size() != desc.nbytes:
            raise ValueError(f"KV entry {desc.key} has {t.numel()} elements, expected {desc.shape}")
        return t.view(desc.shape)

    def discard(self, desc: KVDescriptor) -> None:
        self._path(desc).unlink(missing_ok=True)

    # --- housekeeping ---------------------------------------------------------------------------
    def used_bytes(self) -> int:
        total = 0
        with os.scandir(self.root) as it:
            for entry in it:
                try:
                    total += entry.stat().st_size
                except FileNotFoundError:  # a reader deleted it meanwhile
                    pass
        return total

    def reclaim_orphans(self, now: float | None = None) -> int:
        """Delete entries older than the orphan timeout; returns how many."""
        now = time.time() if now is None else now
        removed = 0
        with os.scandir(self.root) as it:
            for entry in it:
                try:
                    if now - entry.stat().st_mtime > self.orphan_timeout_s:
                        os.unlink(entry.path)
                        removed += 1
                except FileNotFoundError:
                    pass
        if removed:
            log.info("reclaimed orphan KV entries", count=removed)
        return removed

    def _path(self, desc: KVDescriptor) -> Path:
        if desc.transport != "shm" or "/" in desc.key or desc.key.startswith("."):
            raise ValueError(f"not an shm descriptor: {desc.transport}:{desc.key!r}")
        return self.root / (desc.key + _SUFFIX)


def _safe(key: str) -> str:
    """A file-name-safe, bounded form of a request id (ids are client-chosen strings)."""
    cleaned = "".join(c if c.isalnum() or c in "-_" else "_" for c in key)
    return cleaned[:64] or "req"
