"""KV transfer: the connector's sending role (prefill) and receiving role (decode).

Only a small :class:`~shared.wire.messages.KVDescriptor` travels through the broker. Handing
blocks to a connector transfers the duty to free them (see ``connector.py``). Transports:
``shm`` (the spill store: a copy), ``pool`` (host shared-memory pool, mapped by decode) and
``cuda-ipc`` (the GPU pool by IPC handle); the last two share one protocol (``pool.py``), and
``mooncake`` carries it across nodes on Mooncake's transfer engine (``mooncake.py``, optional).
"""

from __future__ import annotations

from typing import Any

import structlog

from shared.config import BatonConfig
from shared.kv_transfer.connector import KVConnector, KVConnectorStats, KVLoad
from shared.kv_transfer.cuda_ipc import CudaIpcConnector
from shared.kv_transfer.pool import PoolConnector
from shared.kv_transfer.pooled import PooledConnector
from shared.kv_transfer.shm import ShmConnector
from shared.wire.messages import KVDescriptor

__all__ = [
    "CudaIpcConnector",
    "FallbackConnector",
    "KVConnector",
    "KVConnectorStats",
    "KVLoad",
    "PoolConnector",
    "PooledConnector",
    "ShmConnector",
    "make_connector",
]

log = structlog.get_logger(__name__)

TRANSPORTS = ("shm", "pool", "cuda-ipc", "mooncake")
FALLBACKS = ("spill",)


class FallbackConnector(ShmConnector):
    """The spill store standing in for a transport that cannot work here (explicit opt-in).

    Its descriptors are plain ``shm`` ones (any decode reads them); every handoff it carries is
    counted (``num_fallbacks``, for ``baton:kv_handoff_fallbacks_total``) and logged."""

    def __init__(self, wanted: str, reason: str, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.wanted, self.reason = wanted, reason
        self.num_fallbacks = 0

    def stats(self) -> KVConnectorStats:
        return KVConnectorStats(fallbacks=self.num_fallbacks)

    def send(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVDescriptor | None:
        desc = super().send(request_id, block_ids, num_tokens)
        if desc is not None:
            self.num_fallbacks += 1
            log.warning(
                "kv handoff fell back to the spill store",
                request_id=request_id,
                wanted=self.wanted,
                reason=self.reason,
            )
        return desc


def make_connector(
    config: BatonConfig,
    *,
    role: str | None = None,
    fallback: str | None = None,
    worker_id: str | None = None,
    lease_s: float | None = None,
) -> KVConnector:
    """The configured transport; one that cannot work here fails now, never silently later.

    ``role``: "prefill" (sends), "decode" (receives; a pooled transport then exports no pool) or
    None (both). ``fallback="spill"`` (``BATON_KV_FALLBACK``) turns a transport that cannot
    work into the spill store, counted and logged; without it, that is a start-up error.
    ``worker_id``/``lease_s`` default to ``BATON_KV_WORKER_ID``/``BATON_KV_LEASE_S``.
    """
    kind = config.kv_transport
    fallback = fallback if fallback is not None else getattr(config, "kv_fallback", "") or None
    if fallback is not None and fallback not in FALLBACKS:
        raise ValueError(f"BATON_KV_FALLBACK={fallback!r}: expected one of {FALLBACKS} or unset")
    if role not in (None, "prefill", "decode"):
        raise ValueError(f"role={role!r}: expected 'prefill', 'decode' or None")
    spill = (config.spill_dir, config.spill_max_bytes, config.spill_orphan_timeout_s)
    if kind == "shm":
        return ShmConnector(*spill)
    if kind not in TRANSPORTS:
        raise ValueError(
            f"BATON_KV_TRANSPORT={kind!r} is not available (available: {', '.join(TRANSPORTS)})"
        )
    pooled: dict[str, Any] = {
        "worker_id": worker_id or getattr(config, "kv_worker_id", "") or None,
        "lease_s": lease_s if lease_s is not None else float(getattr(config, "kv_lease_s", 30.0)),
        "export": role != "decode",
    }
    try:
        if kind == "pool":
            if config.device != "cpu":
                raise RuntimeError(
                    f"BATON_KV_TRANSPORT=pool shares a host-memory KV cache; BATON_DEVICE="
                    f"{config.device} keeps it on the device (use cuda-ipc there)"
                )
            return PoolConnector(config.spill_dir, **pooled)
        if kind == "mooncake":
            from shared.kv_transfer.mooncake import MooncakeConnector

            if config.device != "cpu":
                raise RuntimeError(
                    f"BATON_KV_TRANSPORT=mooncake shares host memory, not {config.device}"
                )
            return MooncakeConnector(
                config.spill_dir,
                host=config.kv_mooncake_host,
                protocol=config.kv_mooncake_protocol,
                metadata=config.kv_mooncake_metadata,
                device=config.kv_mooncake_device,
                **pooled,
            )
        return CudaIpcConnector(config.spill_dir, device=config.device, **pooled)
    except (RuntimeError, OSError) as exc:
        reason = str(exc) if isinstance(exc, RuntimeError) else f"BATON_KV_TRANSPORT={kind}: {exc}"
        if fallback is None:
            raise RuntimeError(reason) from exc
        log.warning("kv transport unavailable; using the spill store", wanted=kind, reason=reason)
        return FallbackConnector(kind, reason, *spill)
