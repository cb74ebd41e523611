"""Shared helpers of the KV connector tests: small caches, known values, the wire round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from shared.kv_transfer import PoolConnector
from shared.wire.messages import KVDescriptor, KVRelease, pack, unpack

# [layers, k/v, blocks, block_size, kv_heads, head_dim]
SHAPE = (2, 2, 8, 4, 2, 8)
BLOCK_SIZE = SHAPE[3]


def sender(root: Path, worker_id: str = "prefill-0", **kw: object) -> PoolConnector:
    conn = PoolConnector(root, worker_id, **kw)  # type: ignore[arg-type]
    kv = conn.allocate_kv_cache(SHAPE, torch.float32, torch.device("cpu"))
    assert kv is not None
    conn.register_kv_cache(kv)
    return conn


def receiver(root: Path, **kw: object) -> PoolConnector:
    conn = PoolConnector(root, "decode-0", export=False, **kw)  # type: ignore[arg-type]
    assert conn.allocate_kv_cache(SHAPE, torch.float32, torch.device("cpu")) is None
    conn.register_kv_cache(torch.full(SHAPE, -1.0))
    return conn


def fill(conn: PoolConnector, blocks: list[int], seed: int) -> torch.Tensor:
    """Write known values into ``blocks`` of a sender's pool; returns them ([L, 2, n, ...])."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn((*SHAPE[:2], len(blocks), *SHAPE[3:]), generator=g)
    conn.kv_cache[:, :, blocks] = values
    return values


def wire(desc: KVDescriptor) -> KVDescriptor:
    """What decode gets: the descriptor after msgpack, as in a HandoffMsg."""
    return KVDescriptor.from_map(unpack(pack(dataclasses.asdict(desc)), 1 << 20))


def wire_release(release: KVRelease) -> KVRelease:
    return KVRelease(**unpack(pack(dataclasses.asdict(release)), 1 << 20))
