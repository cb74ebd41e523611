"""``cuda-ipc``: the pooled protocol (``pool.py``) on a CUDA KV pool shared by IPC handle.

The sender exports its whole KV cache once (``torch.multiprocessing.reductions.reduce_tensor``:
a ``cudaIpcMemHandle`` of the cudaMalloc segment plus the tensor's place in it) and every
descriptor carries that export as msgpack-able fields. A receiver rebuilds the tensor once per
(worker id, generation) and copies a request's blocks device-to-device on a side stream, which it
synchronises before the pin check that closes the copy (``pool.py``: the seqlock). The pin table,
the liveness lock and the generation live in a small host shared-memory file, as for ``pool``.

Decisions (after SGLang's ``patch_torch.py`` and vLLM's IPC weight handoff, not copied):

- The device travels as its UUID, mapped to the receiver's own index (``CUDA_VISIBLE_DEVICES``
  may number GPUs differently in each process).
- torch's per-export reference counter assumes one consumer per export; here one export serves
  every decode worker, so the counter ends negative. That only matters when the producer frees
  the storage, and the pool lives as long as the producer process.
- The sender calls ``send`` after the forward that wrote the blocks has synchronised (the sampled
  tokens were copied to the host), so the blocks are complete in device memory when decode reads.

``python -m shared.kv_transfer.cuda_ipc --selftest`` checks a real two-process handoff on a GPU.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from shared.kv_transfer.connector import copy_blocks
from shared.kv_transfer.pooled import PooledConnector, PoolHandoff, PoolMapping

_NO_CUDA = (
    "BATON_KV_TRANSPORT=cuda-ipc needs CUDA: torch.cuda.is_available() is False; "
    "use pool or shm, or set BATON_KV_FALLBACK=spill"
)
# What a receiver needs from reduce_tensor's rebuild arguments (by name: a torch that renames
# them fails loudly at export, not with a misread pool).
_WIRE_ARGS = (
    "tensor_size", "tensor_stride", "tensor_offset", "storage_handle", "storage_size_bytes",
    "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle",
    "event_sync_required",
)  # fmt: skip


class CudaIpcConnector(PooledConnector):
    name = "cuda-ipc"

    @classmethod
    def check_available(cls, device: str | torch.device) -> None:
        """Raise, naming the cause, where CUDA IPC cannot work (called at start-up)."""
        if not torch.cuda.is_available():
            raise RuntimeError(_NO_CUDA)
        if torch.device(device).type != "cuda":
            raise RuntimeError(
                f"BATON_KV_TRANSPORT=cuda-ipc needs the KV cache on a CUDA device, not "
                f"BATON_DEVICE={device}; use pool or shm, or set BATON_KV_FALLBACK=spill"
            )

    def __init__(self, root: str | Path, *args: Any, device: str = "cuda", **kw: Any) -> None:
        self.check_available(device)
        super().__init__(root, *args, **kw)
        self._ipc: dict[str, Any] = {}
        self._stream: torch.cuda.Stream | None = None

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        if not kv_cache.is_cuda or not kv_cache.is_contiguous():
            raise RuntimeError("cuda-ipc: the KV cache must be one contiguous CUDA tensor")
        super().register_kv_cache(kv_cache)
        self._stream = torch.cuda.Stream(kv_cache.device)
        if self.export:
            self._create_pool_file(kv_cache.shape[2], 0)  # the pin table only
            self._ipc = _export(kv_cache)

    def _export(self) -> dict[str, Any]:
        return {"ipc": self._ipc}

    def _open_source(self, h: PoolHandoff, mm: Any) -> torch.Tensor:
        if (h.worker_id, h.generation) == (self.worker_id, self.generation):
            return self.kv_cache  # our own pool: CUDA cannot open a process's own IPC handle
        ipc = h.raw.get("ipc")
        if not isinstance(ipc, dict):
            raise ValueError("cuda-ipc payload without its export")
        return _rebuild(ipc, h.dtype)

    def _copy(self, m: PoolMapping, src_ids: list[int], dst_ids: list[int]) -> None:
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(self._stream):
            copy_blocks(self.kv_cache, m.source, src_ids, dst_ids)
        self._stream.synchronize()  # the copy is done before pool.py re-checks the pins


def _export(t: torch.Tensor) -> dict[str, Any]:
    rebuild, args = reduce_tensor(t)
    named = dict(zip(inspect.signature(rebuild_cuda_tensor).parameters, args, strict=True))
    if rebuild is not rebuild_cuda_tensor or not set(_WIRE_ARGS) <= named.keys():
        raise RuntimeError(f"torch {torch.__version__} exports CUDA tensors differently")
    out: dict[str, Any] = {k: named[k] for k in _WIRE_ARGS}
    out["tensor_size"], out["tensor_stride"] = list(t.shape), list(t.stride())
    out["device_uuid"] = str(torch.cuda.get_device_properties(t.device).uuid)
    return out


def _rebuild(ipc: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    uuids = [
        str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
    ]
    if ipc.get("device_uuid") not in uuids:
        raise ValueError(f"the pool's GPU {ipc.get('device_uuid')} is not visible here")
    kw = {k: ipc[k] for k in _WIRE_ARGS}
    kw["tensor_size"], kw["tensor_stride"] = (
        torch.Size(kw["tensor_size"]),
        tuple(kw["tensor_stride"]),
    )
    return rebuild_cuda_tensor(
        tensor_cls=torch.Tensor,
        storage_cls=torch.storage.TypedStorage,
        dtype=dtype,
        storage_device=uuids.index(ipc["device_uuid"]),
        requires_grad=False,
        **kw,
    )


# --- GPU self-test: two processes, a Llama-3.1-8B-shaped KV, bytes compared -------------------
_LAYERS, _HEADS, _DIM, _BS = 32, 8, 128, 16


def _shape(blocks: int) -> tuple[int, ...]:
    return (_LAYERS, 2, blocks, _BS, _HEADS, _DIM)


def _expected(round_: int, blocks: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(round_)
    return torch.randn(_shape(blocks), generator=g, device="cuda", dtype=torch.bfloat16)


def _sender(root: str, tokens: int, rounds: int, descs: Any, releases: Any) -> None:
    import dataclasses
    import time

    from shared.wire.messages import KVRelease, pack

    conn = CudaIpcConnector(root, "selftest-prefill")
    conn.register_kv_cache(torch.zeros(_shape(256), dtype=torch.bfloat16, device="cuda"))
    n = tokens // _BS
    for r in range(rounds):
        blocks = torch.randperm(256, generator=torch.Generator().manual_seed(r))[:n].tolist()
        conn.kv_cache[:, :, blocks] = _expected(r, n)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        desc = conn.send(f"req-{r}", blocks, tokens)
        assert desc is not None
        descs.put((pack(dataclasses.asdict(desc)), time.perf_counter() - t0))
        conn.release(KVRelease(**releases.get()))
        assert conn.pop_freeable(time.time()) == [f"req-{r}"]
    assert conn.num_pinned_blocks == 0
    descs.put(None)
    releases.get()  # keep the pool alive until the receiver is done
    conn.close()


def _receiver(root: str, tokens: int, descs: Any, releases: Any, out: Any) -> None:
    import dataclasses

    from shared.wire.messages import KVDescriptor, unpack

    conn = CudaIpcConnector(root, "selftest-decode", export=False)
    conn.register_kv_cache(torch.zeros(_shape(128), dtype=torch.bfloat16, device="cuda"))
    n, r, results = tokens // _BS, 0, []
    while (item := descs.get()) is not None:
        body, send_s = item
        desc = KVDescriptor.from_map(unpack(body, 1 << 20))
        dst = list(range(127, 127 - n, -1))  # scattered the other way round
        res = conn.load(desc, dst, 0)
        ok = res.loaded and torch.equal(conn.kv_cache[:, :, dst], _expected(r, n))
        results.append((ok, send_s, res.seconds, res.nbytes))
        assert res.release is not None
        releases.put(dataclasses.asdict(res.release))
        r += 1
    releases.put(None)
    out.put(results)


def selftest(tokens: int = 1024, rounds: int = 20) -> int:
    import multiprocessing as mp
    import queue
    import tempfile

    CudaIpcConnector.check_available("cuda")
    ctx = mp.get_context("spawn")
    descs, releases, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        procs = [
            ctx.Process(target=_sender, args=(root, tokens, rounds, descs, releases)),
            ctx.Process(target=_receiver, args=(root, tokens, descs, releases, out)),
        ]
        for p in procs:
            p.start()
        results: list[tuple[bool, float, float, int]] = []
        while not results and any(p.is_alive() for p in procs):
            try:
                results = out.get(timeout=1.0)
            except queue.Empty:
                pass
        for p in procs:
            p.join(timeout=60)
    if not results:
        print("cuda-ipc selftest: a process died (see above)", file=sys.stderr)
        return 1
    ok = all(r[0] for r in results) and len(results) == rounds
    send = sorted(r[1] for r in results)[len(results) // 2]
    later = sorted(r[2] for r in results[1:]) or [results[0][2]]
    load, nbytes = later[len(later) // 2], results[0][3]
    print(f"{rounds} handoffs of {tokens} tokens ({nbytes / 2**20:.0f} MiB): bytes equal: {ok}")
    print(f"first load (opens the handle): {results[0][2] * 1e3:.2f} ms")
    gbs = nbytes / load / 1e9
    print(f"median send {send * 1e6:.0f} us, median load {load * 1e6:.0f} us ({gbs:.1f} GB/s)")
    return 0 if ok and all(p.exitcode == 0 for p in procs) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--selftest", action="store_true", help="two-process GPU handoff check")
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    if not args.selftest:
        parser.print_help()
        return 2
    try:
        return selftest(args.tokens)
    except RuntimeError as exc:
        print(f"cuda-ipc selftest cannot run: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
