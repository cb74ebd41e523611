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

**Layer by layer** (``BATON_KV_LAYERWISE``, layerwise.py): prefill announces a prompt before
its first forward and publishes its progress in a table of records beside the pin table; the
receiver pulls each layer's ready positions in a thread of its own while prefill computes, and
reads the first token from the record at the end. The pin checks frame the whole pull.

Liveness needs no lock file: a dead sender's engine no longer answers (the read fails:
recompute), a restarted one has another port and generation. Releases go back through the
release queue (``baton.kv_release.<worker>``), and a lease frees what no receiver released.
The lease deadline is the sender's wall clock: nodes must be NTP-synced to within
``lease_margin_s`` (a skew beyond it only refuses handoffs near their deadline; the pin checks
alone decide correctness). This backing shares host memory only (``BATON_DEVICE=cpu``).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import socket
import threading
import time
from typing import Any

import numpy as np
import structlog
import torch

from kernels.cpu import omp_team
from shared.kv_transfer.connector import KVLoad, PinLedger, block_runs
from shared.kv_transfer.layerwise import (
    FAILED,
    FINISHED,
    NUM_RECORDS,
    READY,
    RECORD_WORDS,
    LayerwiseLoad,
    Progress,
    ProgressTable,
)
from shared.kv_transfer.pooled import PooledConnector, PoolHandoff, _release_for
from shared.wire.messages import KVDescriptor

log = structlog.get_logger(__name__)

_PAGE = 1 << 12
_SCRATCH = 8192  # int64 words: pin tables of up to 8190 blocks are read in one piece
MAX_BATCH = 256  # entries per batch call: the TCP transport rejects very large batches
# How often a layer-wise pull re-reads the progress record. Each read is served by the sender's
# transfer engine, on the cores computing the prompt: polling at a fixed short interval takes
# those cores from the prompt's forward and delays its first token, on a small machine by much
# of the forward (docs/perf-log.md, "Layer-wise handoff"). So after each layer the pull
# sleeps most of the time the last one took (LAYER_POLL_AHEAD of it), then polls from
# LAYER_POLL_S doubling to LAYER_POLL_MAX_S, which bounds how late it sees the last layer (and,
# once every layer is in, the first token: no sleep ahead then).
LAYER_POLL_S, LAYER_POLL_MAX_S, LAYER_POLL_AHEAD = 0.0002, 0.002, 0.8
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
        # Reads into the scratch buffer come from the engine thread and from layer-wise pulls.
        self._scratch_lock = threading.Lock()
        self._streams: dict[str, int] = {}  # sender: announced request -> its progress record
        self.load_done = threading.Event()  # receiver: set whenever a layer-wise pull ends
        self._progress_offset = 0
        self._progress: ProgressTable | None = None
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
        self._progress_offset = 8 + 8 * num_blocks  # after the generation and the pin table
        words = RECORD_WORDS * NUM_RECORDS
        self._data_offset = -(-(self._progress_offset + 8 * words) // _PAGE) * _PAGE
        self._buf = mmap.mmap(-1, self._data_offset + numel * dtype.itemsize)  # zeroed
        head = np.frombuffer(self._buf, np.int64, count=1 + num_blocks)
        head[0] = _generation_word(self.generation)
        self._base = head.ctypes.data
        self._register(self._base, len(self._buf))
        self._ledger = PinLedger(head[1:], self.lease_s)
        records = np.frombuffer(self._buf, np.int64, count=words, offset=self._progress_offset)
        self._progress = ProgressTable(records)
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

    # --- layer-wise: the sender's progress (layerwise.py) ---------------------------------------
    layerwise = True

    def announce(
        self, request_id: str, block_ids: list[int], num_tokens: int, num_computed: int
    ) -> KVDescriptor | None:
        desc = self.send(request_id, block_ids, num_tokens)
        if desc is None or self._progress is None:
            return desc
        record = self._progress.open(int(desc.payload["send_id"]), num_computed)
        self._streams[request_id] = record
        progress = {"layerwise": True, "record": record, "progress_offset": self._progress_offset}
        return dataclasses.replace(desc, payload={**desc.payload, **progress})

    def stream_chunk(self, request_id: str, tokens_upto: int) -> None:
        assert self._progress is not None
        self._progress.chunk(self._streams[request_id], tokens_upto)

    def stream_layer(self, request_id: str, layers: int) -> None:
        assert self._progress is not None
        self._progress.layer(self._streams[request_id], layers)

    def stream_end(self, request_id: str, state: int, first_token: int = 0) -> None:
        record = self._streams.pop(request_id, None)
        if record is not None and self._progress is not None:
            self._progress.finish(record, state, first_token)

    # --- layer-wise: the receiver's pull ----------------------------------------------------------
    def start_load(
        self, desc: KVDescriptor, block_ids: list[int], first_block: int
    ) -> LayerwiseLoad:
        h = self._parse(desc)
        n = len(h.block_ids)
        if not desc.payload.get("layerwise") or not 0 <= first_block <= n:
            raise ValueError(f"not a layer-wise handoff of {n} blocks from {first_block}")
        if len(block_ids) != n - first_block:
            raise ValueError(f"{len(block_ids)} blocks for handoff blocks {first_block}..{n}")
        load = LayerwiseLoad()
        release = _release_for(h)

        def run() -> None:
            omp_team.serial()  # the step thread owns the process's one OpenMP team
            t0 = time.perf_counter()
            try:
                ok = self._pull_layers(h, desc, block_ids, first_block, load)
            except Exception:
                log.exception("layer-wise pull failed; recomputing", request_id=h.request_id)
                ok = False
            nbytes = (n - first_block) * self._block_nbytes if ok else 0
            load.result = KVLoad(ok, nbytes, time.perf_counter() - t0, release)
            load.done.set()
            self.load_done.set()

        load.thread = threading.Thread(target=run, name=f"kv-pull-{h.request_id}", daemon=True)
        load.thread.start()
        return load

    def _pull_layers(
        self,
        h: PoolHandoff,
        desc: KVDescriptor,
        block_ids: list[int],
        skip: int,
        load: LayerwiseLoad,
    ) -> bool:
        """Pull each layer's written positions until all are in and the state is final. The
        handoff's entries: blocks ``desc.first_block ..`` of the table, then ``fp_slots``
        full-precision slots (pulled per layer once the layer holds the whole prompt)."""
        segment, base, src_ids, expect = self._source(h, skip, block_ids)
        if not self._pinned(h, segment, base, src_ids, expect, "blocks no longer pinned"):
            return False
        dst = self.kv_cache
        num_layers, bs, first = dst.shape[0], dst.shape[3], desc.first_block
        num_blocks = len(h.block_ids) - desc.fp_slots  # entries that are table blocks
        record = base + int(h.raw["progress_offset"]) + 8 * RECORD_WORDS * int(h.raw["record"])
        pulled = [0] * num_layers  # per layer, positions [0, pulled) are here
        wait, last_move, interval = LAYER_POLL_S, time.monotonic(), 0.0
        while True:
            words = self._read_words(segment, record, RECORD_WORDS)
            if words is None:
                return self._unreachable(h, segment)
            if words[0] != h.send_id:
                return self._refused(h, "progress record reused")
            state, progress = words[2] & 0xFF, Progress.of(words[1])
            if state in (FINISHED, FAILED):
                load.state = state
                return False
            moved = False
            for layer in range(num_layers):
                ready = progress.ready(layer)
                if ready <= pulled[layer]:
                    continue
                lo = max(skip, pulled[layer] // bs - first)
                hi = min(num_blocks, -(-ready // bs) - first)
                entries = list(range(lo, hi))
                if ready >= desc.num_tokens:  # the layer is whole: its window's slots too
                    entries += list(range(max(skip, num_blocks), len(h.block_ids)))
                if entries and not self._read_layer(
                    h, base, segment, layer, entries, block_ids, skip
                ):
                    return self._unreachable(h, segment)
                pulled[layer], moved = ready, True
            if state == READY and min(pulled) >= desc.num_tokens:
                load.first_token = int(words[2] >> 8)
                break
            if load.cancelled.is_set() or time.time() >= h.deadline:
                return self._refused(h, "cancelled or past its lease")
            if moved:  # sleep through most of the next layer's expected time, if one is due
                now = time.monotonic()
                interval, last_move, wait = now - last_move, now, LAYER_POLL_S
                if min(pulled) < desc.num_tokens:
                    time.sleep(LAYER_POLL_AHEAD * interval)
            else:
                time.sleep(wait)
                wait = min(2 * wait, LAYER_POLL_MAX_S)
        if not self._pinned(h, segment, base, src_ids, expect, "pin lost during the copy"):
            return False
        load.state = READY
        return True

    def _read_layer(
        self,
        h: PoolHandoff,
        base: int,
        segment: str,
        layer: int,
        entries: list[int],
        block_ids: list[int],
        skip: int,
    ) -> bool:
        src = [h.block_ids[e] for e in entries]
        dst = [block_ids[e - skip] for e in entries]
        rows = range(2 * layer, 2 * layer + 2)  # its K and V rows
        return self._read(segment, *self._data_entries(h, base, src, dst, rows))

    def _read_words(self, segment: str, addr: int, count: int) -> np.ndarray | None:
        with self._scratch_lock:
            ok = self._read(segment, [self._scratch.ctypes.data], [addr], [8 * count])
            return self._scratch[:count].copy() if ok else None

    # --- receiving role -------------------------------------------------------------------------
    def _pull(
        self, h: PoolHandoff, src_ids: list[int], block_ids: list[int], epochs: np.ndarray
    ) -> bool:
        segment, base, src_ids, expect = self._source(h, len(h.block_ids) - len(src_ids), block_ids)
        if not self._pinned(h, segment, base, src_ids, expect, "blocks no longer pinned"):
            return False
        if not self._read(segment, *self._data_entries(h, base, src_ids, block_ids)):
            return self._unreachable(h, segment)
        # Seqlock close: had the sender unpinned (and so possibly reused) a block during the
        # copy, its entry would differ now. A partial write here is recomputed by the engine.
        return self._pinned(h, segment, base, src_ids, expect, "pin lost during the copy")

    def _source(
        self, h: PoolHandoff, skip: int, block_ids: list[int]
    ) -> tuple[str, int, list[int], np.ndarray]:
        """Check a descriptor against this cache: (segment, pool base, the entries' source
        blocks from ``skip``, the generation and pin epochs they must carry)."""
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
        src_ids = h.block_ids[skip:]
        for ids, limit in ((src_ids, h.shape[2]), (block_ids, dst.shape[2])):
            if min(ids) < 0 or max(ids) >= limit:
                raise ValueError(f"block ids outside 0..{limit - 1}")
        return segment, base, src_ids, np.array([_generation_word(h.generation), *h.epochs[skip:]])

    def _pinned(
        self,
        h: PoolHandoff,
        segment: str,
        base: int,
        src_ids: list[int],
        expect: np.ndarray,
        why: str,
    ) -> bool:
        """The sender's generation and the blocks' pins still as the descriptor says."""
        with self._scratch_lock:
            pins = self._read_pins(segment, base, src_ids)
        if pins is None:
            return self._unreachable(h, segment)
        return bool((pins == expect).all()) or self._refused(h, why)

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
        self,
        h: PoolHandoff,
        base: int,
        src_ids: list[int],
        dst_ids: list[int],
        rows: range | None = None,
    ) -> tuple[list[int], list[int], list[int]]:
        """One (dst, src, length) per layer/K-V row (``rows``: those of ``[L * 2]``, default
        all) and run of blocks consecutive on both sides."""
        dst = self.kv_cache
        num_rows = dst.shape[0] * dst.shape[1]
        row_bytes = self._block_nbytes // num_rows
        runs = np.array(block_runs(src_ids, dst_ids), dtype=np.int64)  # (runs, 3)
        r = np.array(rows if rows is not None else range(num_rows), dtype=np.int64)[:, None]
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
