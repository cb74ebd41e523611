"""``pool``: the CPU backing of the pooled protocol (``pooled.py``).

The prefill engine's KV cache *is* a MAP_SHARED file in the spill folder (``allocate_kv_cache``);
decode maps that file read-only once per (worker, generation) and copies a request's blocks out
of it into its own cache. On a CPU-only node this is the CUDA-IPC protocol with host memory, and
how that protocol is tested without a GPU.
"""

from __future__ import annotations

import mmap
import warnings

import numpy as np
import torch

from shared.kv_transfer.connector import block_rows, copy_block_rows
from shared.kv_transfer.pooled import PooledConnector, PoolHandoff, PoolMapping, _is_pool


class PoolConnector(PooledConnector):
    """``pool``: the sender's KV cache *is* a MAP_SHARED file in the spill folder."""

    name = "pool"

    def allocate_kv_cache(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        if not self.export:
            return None  # receiving only: the engine's own memory will do
        if torch.device(device).type != "cpu":
            raise RuntimeError("BATON_KV_TRANSPORT=pool shares host memory; on a GPU use cuda-ipc")
        numel = int(np.prod(shape))
        self._data_offset = self._create_pool_file(shape[2], numel * dtype.itemsize)
        assert self._mm is not None
        pool = torch.frombuffer(self._mm, dtype=dtype, count=numel, offset=self._data_offset)
        return pool.view(shape)  # zeroed by posix_fallocate

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        if self.export and (
            self._mm is None or not _is_pool(kv_cache, self._mm, self._data_offset)
        ):
            # Descriptors would name blocks of a pool the engine never writes: wrong KV.
            raise RuntimeError("pool: register the tensor allocate_kv_cache() returned")
        super().register_kv_cache(kv_cache)

    def _open_source(self, h: PoolHandoff, mm: mmap.mmap) -> torch.Tensor:
        numel = int(np.prod(h.shape))
        if h.data_offset + numel * h.dtype.itemsize > len(mm):
            raise ValueError(f"pool file {h.file_name} is smaller than its descriptor says")
        with warnings.catch_warnings():  # read-only on purpose: a stray write faults, not corrupts
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(mm, dtype=h.dtype, count=numel, offset=h.data_offset)
        return src.view(h.shape)

    def _copy(self, m: PoolMapping, src_ids: list[int], dst_ids: list[int]) -> None:
        if self._rows is None:  # not a plain host cache: torch copies
            return super()._copy(m, src_ids, dst_ids)
        if m.rows is None:
            m.rows = block_rows(m.source)
        copy_block_rows(self._rows, m.rows, src_ids, dst_ids)
