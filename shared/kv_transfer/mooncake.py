"""``mooncake``: the pooled protocol (``pooled.py``) across nodes, on Mooncake's transfer engine.

The prefill engine's KV cache lives in one host buffer registered with a ``TransferEngine``
(``mooncake-transfer-engine``; TCP here, RDMA where the NICs have it). The buffer is laid out as
``[generation: int64][pin table: int64 per block][pad][KV data]`` — the pin table of ``pool``,
but read over the network. A descriptor adds, to the pooled payload, the engine's *segment name*
(``host:rpc_port``) and the buffer's address: that is how a worker announces its endpoint, in the
handoff message itself, through the broker. No metadata server: the engine runs with
``P2PHANDSHAKE`` (peers exchange segment descriptors on first contact, as vLLM's and SGLang's
Mooncake connectors do).

**Pull, not push.** Decode reads (``batch_transfer_sync_read``) straight from prefill's pool into
its own cache. Pushing would need decode's destination block ids before prefill could write,
i.e. a decode-to-prefill round trip per request (vLLM's connector has a side channel for it);
pulling needs nothing that the handoff does not already carry, keeps prefill's step free of
network waits, and lets the receiver check the pins around its copy, as ``pool`` does:

- before the copy it reads the generation word and its blocks' pin-table entries and compares
  them with the descriptor (a restart or a release meanwhile: refused, decode recomputes);
- after the copy it reads them again (the seqlock close). The reads are sequential
  request/response round trips and prefill clears a block's entry before the engine may reuse
  it, so an unchanged entry after the copy means the bytes read were pinned throughout.

Liveness needs no lock file: a dead sender's engine no longer answers (the read fails:
recompute), a restarted one has another port and generation. Releases go back through the
release queue (``baton.kv_release.<worker>``), and a lease frees what no receiver released.
The lease deadline is the sender's wall clock: nodes must be NTP-synced to within
``lease_margin_s`` (a skew beyond it only refuses handoffs near their deadline; the pin checks
alone decide correctness). This backing shares host memory only (``BATON_DEVICE=cpu``).
"""

from __future__ import annotations

import mmap
import os
import re
import socket
from typing import Any

import numpy as np
import structlog
import torch

from shared.kv_transfer.connector import PinLedger, block_runs
from shared.kv_transfer.pooled import PooledConnector, PoolHandoff

log = structlog.get_logger(__name__)

_PAGE = 1 << 12
_SCRATCH = 8192  # int64 words: pin tables of up to 8190 blocks are read in one piece
MAX_BATCH = 256  # entries per batch call: the TCP transport rejects very large batches
_SEGMENT = re.compile(r"[A-Za-z0-9_.:\[\]-]{1,255}:\d{1,5}")


def default_host() -> str:
    """The address of the interface the default route leaves by (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only routes are looked up
            return str(s.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def new_engine(host: str, protocol: str, metadata: str, device: str) -> Any:
    """A started ``TransferEngine``; RuntimeError (a start-up error) where it cannot run."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO lines are per connection
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise RuntimeError(
            "BATON_KV_TRANSPORT=mooncake needs the Mooncake transfer engine: pip install "
            "mooncake-transfer-engine-non-cuda (CPU nodes) or mooncake-transfer-engine (CUDA 12)"
            f" ({exc})"
        ) from exc
    engine = TransferEngine()
    if engine.initialize(host, metadata, protocol, device) != 0:
        raise RuntimeError(f"mooncake: the transfer engine did not start ({protocol} on {host})")
    return engine


class MooncakeConnector(PooledConnector):
    """``mooncake``: the pooled protocol over a transfer engine; decode pulls blocks."""

    name = "mooncake"

    def __init__(
        self,
        root: str,
        worker_id: str | None = None,
        lease_s: float = 30.0,
        *,
        export: bool = True,
        host: str = "",
        protocol: str = "tcp",
        metadata: str = "P2PHANDSHAKE",
        device: str = "",
        lease_margin_s: float = 1.0,
    ) -> None:
        super().__init__(root, worker_id, lease_s, export=export, lease_margin_s=lease_margin_s)
        host = host or default_host()
        self.engine: Any = new_engine(host, protocol, metadata, device)
        self.segment = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._buf: mmap.mmap | None = None
        self._base = 0
        self._scratch = np.zeros(0, dtype=np.int64)  # receiver: pin entries read back
        log.info("mooncake transfer engine started", segment=self.segment, protocol=protocol)

    def _register(self, addr: int, nbytes: int) -> None:
        if self.engine.register_memory(addr, nbytes) != 0:
            raise RuntimeError(f"mooncake: cannot register {nbytes >> 20} MiB with the engine")
        self._registered.append(addr)

    # --- the pool (sender) ----------------------------------------------------------------------
    def allocate_kv_cache(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        if not self.export:
            return None
        if torch.device(device).type != "cpu":
            raise RuntimeError(
                "BATON_KV_TRANSPORT=mooncake registers host memory: BATON_DEVICE=cpu"
            )
        num_blocks, numel = shape[2], int(np.prod(shape))
        self._data_offset = -(-(8 + 8 * num_blocks) // _PAGE) * _PAGE
        self._buf = mmap.mmap(-1, self._data_offset + numel * dtype.itemsize)  # zeroed
        head = np.frombuffer(self._buf, np.int64, count=1 + num_blocks)
        head[0] = _generation_word(self.generation)
        self._base = head.ctypes.data
        self._register(self._base, len(self._buf))
        self._ledger = PinLedger(head[1:], self.lease_s)
        pool = torch.frombuffer(self._buf, dtype=dtype, count=numel, offset=self._data_offset)
        return pool.view(shape)

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            raise RuntimeError("mooncake: the KV cache must be contiguous host memory")
        if self.export and kv_cache.data_ptr() != self._base + self._data_offset:
            raise RuntimeError("mooncake: register the tensor allocate_kv_cache() returned")
        super().register_kv_cache(kv_cache)
        if not self.export:  # the receiver's own cache: the engine writes into it
            self._register(kv_cache.data_ptr(), kv_cache.nbytes)
        self._scratch = np.zeros(max(1 + kv_cache.shape[2], _SCRATCH), dtype=np.int64)
        self._register(self._scratch.ctypes.data, self._scratch.nbytes)

    def _export(self) -> dict[str, Any]:
        return {"segment": self.segment, "base": self._base}

    # --- receiving role -------------------------------------------------------------------------
    def _pull(
        self, h: PoolHandoff, src_ids: list[int], block_ids: list[int], epochs: np.ndarray
    ) -> bool:
        segment, base = str(h.raw.get("segment", "")), int(h.raw.get("base", 0))
        if not _SEGMENT.fullmatch(segment) or base <= 0:
            raise ValueError(f"bad {self.name} payload: segment {segment!r}, base {base}")
        dst = self.kv_cache
        if (
            h.dtype != dst.dtype
            or h.shape[:2] != list(dst.shape[:2])
            or (h.shape[3:] != list(dst.shape[3:]))
        ):  # another model or layout: never mixed (a configuration error)
            raise ValueError(f"pool {h.shape} {h.dtype} does not fit {tuple(dst.shape)}")
        for ids, limit in ((src_ids, h.shape[2]), (block_ids, dst.shape[2])):
            if min(ids) < 0 or max(ids) >= limit:
                raise ValueError(f"block ids outside 0..{limit - 1}")
        expect = np.array([_generation_word(h.generation), *epochs])
        pins = self._read_pins(segment, base, src_ids)
        if pins is None:
            return self._unreachable(h, segment)
        if not (pins == expect).all():
            return self._refused(h, "blocks no longer pinned")
        if not self._read(segment, *self._data_entries(h, base, src_ids, block_ids)):
            return self._unreachable(h, segment)
        # Seqlock close: had the sender unpinned (and so possibly reused) a block during the
        # copy, its entry would differ now. A partial write here is recomputed by the engine.
        after = self._read_pins(segment, base, src_ids)
        if after is None:
            return self._unreachable(h, segment)
        if not (after == expect).all():
            return self._refused(h, "pin lost during the copy")
        return True

    def _read_pins(self, segment: str, base: int, src_ids: list[int]) -> np.ndarray | None:
        """The sender's generation word and the pin entries of ``src_ids``, read remotely: one
        read of the table's head where it fits the scratch buffer (each batch entry costs a
        round of the transport), else one entry per run of consecutive blocks."""
        m, top, local = len(src_ids), max(src_ids), self._scratch.ctypes.data
        if 2 + top <= len(self._scratch):
            ok = self._read(segment, [local], [base], [8 * (2 + top)])
            return (
                np.concatenate([self._scratch[:1], self._scratch[1 + np.array(src_ids)]])
                if ok
                else None
            )
        dsts, srcs, lens = [local], [base], [8]
        for s, d, k in block_runs(src_ids, list(range(m))):
            dsts.append(local + 8 * (1 + d))
            srcs.append(base + 8 * (1 + s))
            lens.append(8 * k)
        return self._scratch[: 1 + m].copy() if self._read(segment, dsts, srcs, lens) else None

    def _data_entries(
        self, h: PoolHandoff, base: int, src_ids: list[int], dst_ids: list[int]
    ) -> tuple[list[int], list[int], list[int]]:
        """One (dst, src, length) per layer/K-V row and run of blocks consecutive on both sides."""
        dst = self.kv_cache
        rows, row_bytes = (
            dst.shape[0] * dst.shape[1],
            self._block_nbytes // (dst.shape[0] * dst.shape[1]),
        )
        runs = np.array(block_runs(src_ids, dst_ids), dtype=np.int64)  # (runs, 3)
        r = np.arange(rows, dtype=np.int64)[:, None]
        src = base + h.data_offset + (r * h.shape[2] + runs[:, 0]) * row_bytes
        dst_addr = dst.data_ptr() + (r * dst.shape[2] + runs[:, 1]) * row_bytes
        lens = np.broadcast_to(runs[:, 2] * row_bytes, src.shape)
        return dst_addr.ravel().tolist(), src.ravel().tolist(), lens.ravel().tolist()

    def _read(self, segment: str, dsts: list[int], srcs: list[int], lens: list[int]) -> bool:
        for i in range(0, len(dsts), MAX_BATCH):
            j = i + MAX_BATCH
            if self.engine.batch_transfer_sync_read(segment, dsts[i:j], srcs[i:j], lens[i:j]):
                return False
        return True

    def _unreachable(self, h: PoolHandoff, segment: str) -> bool:
        self.num_map_failures += 1
        log.warning("kv pool unreachable; recomputing", request_id=h.request_id, segment=segment)
        return False

    def reap_dead_pools(self) -> int:
        return 0  # no files: a dead sender's engine simply stops answering

    def close(self) -> None:
        super().close()
        for addr in self._registered:
            self.engine.unregister_memory(addr)
        self._registered.clear()


def _generation_word(generation: str) -> int:
    return int(generation, 16) & ((1 << 63) - 1)
