"""The host tier of the KV cache: blocks beyond the device pool's share, staged per forward.

A decode worker whose device pool is full would preempt (swap out or recompute) a sequence
rather than serve it, and a prefill worker would hold a long prompt back; with a host tier
(``BATON_KV_HOST_CACHE_MB``) the block manager hands out blocks of host memory instead (pinned
on CUDA), and each forward brings the host blocks its sequences read into *staging* blocks of
the device pool, then writes the blocks it extended back. Attention never sees the tier: it reads
one pool, through block tables in which every host block is replaced by its staging block. The
price is the copy: every forward moves the batch's host blocks across PCIe, so the tier buys
capacity (long contexts served side by side, no preemption), not speed.

Ids (the block manager's): ``[0, D)`` the device pool, ``[D, D + H)`` the host tier.
Device cache: ``[L, 2, D + S, ...]``, its blocks ``[D, D + S)`` the staging area, which no
block table holds outside a forward. Host cache: block-major ``[H, L, 2, ...]``, host block
``D + i`` at index ``i``, so that a run of consecutive host blocks is one contiguous slab: it
crosses PCIe as one DMA copy into a device bounce buffer of the same layout (``[S, L, 2, ...]``,
beside the pool), and one device copy turns that into the pool's layout. The pool's layout on
the host side would make every block ``2 L`` strided pieces, which torch copies through pageable
memory, far slower than one pinned slab (docs/perf-log.md, "Host tier").

Invariants: a forward stages at most ``S`` distinct host blocks (``split`` cuts a batch into
forwards that each fit; ``S`` covers the longest sequence, so one always does); a block written
by a forward is never shared by another sequence (only full, computed blocks are shared), so
writing back only the written blocks loses nothing.

On CPU both tiers are the same memory: the tier costs a copy per forward and buys nothing a
larger ``BATON_KV_CACHE_MB`` would not; it runs there so that the protocol is tested on every
machine (``tests/runtime/test_kv_tiers.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from shared.kv_transfer.connector import block_runs


@dataclass(frozen=True)
class TierLayout:
    """How the device's blocks are split, and how many the host tier adds."""

    num_device_blocks: int  # D: the device pool the block manager allocates from
    num_staging_blocks: int  # S: device blocks staging host blocks for one forward
    num_host_blocks: int  # H

    @classmethod
    def plan(
        cls, num_blocks_on_device: int, num_host_blocks: int, max_seq_blocks: int
    ) -> TierLayout:
        """Staging for the longest sequence, but never more than half the device's blocks."""
        if num_host_blocks <= 0:
            return cls(num_blocks_on_device, 0, 0)
        staging = min(max_seq_blocks, num_blocks_on_device // 2)
        if staging <= 0:
            raise ValueError(
                f"a host KV tier needs at least 2 device blocks, got {num_blocks_on_device}"
            )
        return cls(num_blocks_on_device - staging, staging, num_host_blocks)

    @property
    def num_blocks(self) -> int:
        """The block manager's blocks: both tiers."""
        return self.num_device_blocks + self.num_host_blocks

    @property
    def max_seq_blocks(self) -> int:
        """The most blocks one sequence may hold: all of them may be on the host, so staging
        must hold them (it is at most half the device's blocks, so less than ``num_blocks``)."""
        return self.num_staging_blocks if self.num_host_blocks else self.num_blocks


@dataclass
class Staged:
    """One forward's view of its host blocks."""

    tables: list[list[int]]  # the block tables with host ids replaced by staging ids
    staging_of: dict[int, int]  # host id -> staging block (device index)


class HostKVTier:
    """Owns the host cache and the staging area's use; the block manager owns the ids."""

    def __init__(self, device_cache: torch.Tensor, layout: TierLayout) -> None:
        if layout.num_host_blocks <= 0:
            raise ValueError("a host tier needs host blocks")
        if device_cache.shape[2] != layout.num_device_blocks + layout.num_staging_blocks:
            raise ValueError(f"device cache has {device_cache.shape[2]} blocks, layout {layout}")
        self.layout = layout
        self.device_cache = device_cache
        block_shape = (*device_cache.shape[:2], *device_cache.shape[3:])
        pin = device_cache.device.type == "cuda"  # async DMA needs page-locked memory
        self.host_cache = torch.zeros(
            (layout.num_host_blocks, *block_shape), dtype=device_cache.dtype, pin_memory=pin
        )
        self._bounce = torch.empty(
            (layout.num_staging_blocks, *block_shape),
            dtype=device_cache.dtype,
            device=device_cache.device,
        )
        self._async = pin
        self.num_staged_blocks = 0  # host -> device, cumulative
        self.num_written_back_blocks = 0  # device -> host, cumulative

    def is_host(self, block_id: int) -> bool:
        return block_id >= self.layout.num_device_blocks

    def holds_host(self, block_table: list[int]) -> bool:
        # Host blocks come after device blocks in a table filled in order, but a prefix hit may
        # sit on either tier: check them all.
        return any(map(self.is_host, block_table))

    def split(self, tables: list[list[int]]) -> list[list[int]]:
        """Rows of ``tables`` grouped in order so that each group's distinct host blocks fit the
        staging area (one group when they all do)."""
        groups: list[list[int]] = []
        seen: set[int] = set()
        for row, table in enumerate(tables):
            mine = {b for b in table if self.is_host(b)}
            if len(mine) > self.layout.num_staging_blocks:
                raise ValueError(
                    f"a sequence holds {len(mine)} host blocks; staging holds "
                    f"{self.layout.num_staging_blocks}"
                )
            if groups and len(seen | mine) <= self.layout.num_staging_blocks:
                groups[-1].append(row)
                seen |= mine
            else:
                groups.append([row])
                seen = set(mine)
        return groups

    def stage(self, tables: list[list[int]]) -> Staged:
        """Copy the tables' host blocks into staging; the tables the forward reads through."""
        staged = self._assign(tables)
        n = len(staged.staging_of)
        if n:
            d = self.layout.num_device_blocks
            host_ids = [b - d for b in staged.staging_of]  # staging d + k holds host_ids[k]
            for h, k, length in block_runs(host_ids, list(range(n))):
                # Host memory is only ever written by the blocking copies of write_back, so an
                # asynchronous read of it here cannot race the CPU.
                self._bounce[k : k + length].copy_(
                    self.host_cache[h : h + length], non_blocking=self._async
                )
            self.device_cache[:, :, d : d + n].copy_(self._bounce[:n].movedim(0, 2))
            self.num_staged_blocks += n
        return staged

    def write_back(self, staged: Staged, written: set[int]) -> None:
        """Copy the staged host blocks among ``written`` (block ids) back to the host."""
        ids = sorted(b for b in written if b in staged.staging_of)
        if not ids:
            return
        d, m = self.layout.num_device_blocks, len(ids)
        index = torch.tensor([staged.staging_of[b] for b in ids], device=self._bounce.device)
        self._bounce[:m].copy_(self.device_cache.index_select(2, index).movedim(2, 0))
        for k, h, length in block_runs(list(range(m)), [b - d for b in ids]):
            self.host_cache[h : h + length].copy_(self._bounce[k : k + length])  # blocking
        self.num_written_back_blocks += m

    @contextmanager
    def device_ids(self, block_ids: list[int], *, read: bool, write: bool) -> Iterator[list[int]]:
        """``block_ids`` as device blocks for a transport, which sees only the device cache:
        host blocks are staged in first (``read``: the transport sends them) and copied back
        after (``write``: it loads into them). Only between forwards: staging is free then."""
        # Without ``read`` the staging blocks are only claimed: the transport overwrites them.
        staged = self.stage([block_ids]) if read else self._assign([block_ids])
        yield staged.tables[0]
        if write:
            self.write_back(staged, set(staged.staging_of))

    def _assign(self, tables: list[list[int]]) -> Staged:
        d = self.layout.num_device_blocks
        staging_of: dict[int, int] = {}
        for table in tables:
            for b in table:
                if self.is_host(b) and b not in staging_of:
                    staging_of[b] = d + len(staging_of)
        if len(staging_of) > self.layout.num_staging_blocks:
            raise ValueError(f"{len(staging_of)} host blocks; split the batch first")
        return Staged([[staging_of.get(b, b) for b in t] for t in tables], staging_of)


def written_blocks(block_table: list[int], start: int, end: int, block_size: int) -> set[int]:
    """The blocks holding positions ``start..end-1``."""
    return {block_table[i] for i in range(start // block_size, (end - 1) // block_size + 1)}
