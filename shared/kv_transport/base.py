"""The transport interface: one sending and one receiving role."""

from __future__ import annotations

from typing import Protocol

import torch

from shared.config import BatonConfig
from shared.protocol import KVDescriptor


class KVSender(Protocol):
    def send(self, key: str, kv: torch.Tensor, num_tokens: int) -> KVDescriptor | None:
        """Store ``kv`` ([layers, 2, blocks, block_size, kv_heads, head_dim]) for the receiver.

        Returns None when the transport is full: the caller then hands off without KV and the
        receiver recomputes (backpressure never loses a request)."""
        ...


class KVReceiver(Protocol):
    def receive(self, desc: KVDescriptor) -> torch.Tensor | None:
        """Load and release the entry; None if it is gone (e.g. a redelivered handoff whose
        entry an earlier, crashed receiver already consumed): the caller recomputes."""
        ...

    def discard(self, desc: KVDescriptor) -> None:
        """Release an entry without loading it (the request was cancelled or timed out)."""
        ...


class KVTransport(KVSender, KVReceiver, Protocol):
    """A store that plays both roles (each process uses the one it needs)."""

    def reclaim_orphans(self, now: float | None = None) -> int: ...


def make_transport(config: BatonConfig) -> KVTransport:
    if config.kv_transport == "shm":
        from shared.kv_transport.shm import ShmKVStore

        return ShmKVStore(config.spill_dir, config.spill_max_bytes, config.spill_orphan_timeout_s)
    # cuda-ipc needs a GPU to build and test; it plugs in here behind the same two roles.
    raise ValueError(f"unsupported BATON_KV_TRANSPORT {config.kv_transport!r} (available: shm)")
