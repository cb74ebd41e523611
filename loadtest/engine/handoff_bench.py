"""KV handoff micro-benchmark: the spill store (``shm``) vs the pooled transport (``pool``) vs the
cross-node one (``mooncake``), with a plain memcpy of the same bytes as the ceiling.

    python -m loadtest handoff          # bench-model KV; 128- and 1024-token prompts
    python -m loadtest handoff --netns  # mooncake over a veth link between two namespaces

Two processes, as in serving: a prefill process owns the senders (the ``pool`` one exports its
KV cache as the shared pool; ``shm`` copies out of the same cache), this process is decode. Each
side times its own part — sender: ``send`` plus the release/``pop_freeable`` bookkeeping;
receiver: ``load`` — and a handoff is their sum. The descriptor's trip between the two (a pipe
here, the broker in serving) is not the transport's and is not timed. One torch thread each.
Each figure is a median over a sweep's handoffs, best of ``--repeats`` sweeps
(on a shared machine noise only ever adds).

Blocks: "scattered" = random block ids on both sides (a cache after churn: one strided copy
per block); "contiguous" = one run each side (one strided copy in all). The ceiling, memcpy:
``dst.copy_(src)`` of the same byte count, contiguous, single-threaded, done by the receiver on
each message like a load (same wake-ups and cache state; the ratios use it); "tight loop" is the
same copy back to back, for reference — warmer than any handoff can be.
``mooncake`` (when the transfer engine is installed): decode pulls the blocks over TCP from
prefill's registered pool — over loopback, or with ``--netns`` (root) over a veth pair joining
two network namespaces, each process entering its own (``tests/multinode/rig.py``); the other
transports stay on the shared memory they need.
Writes loadtest/results/handoff_bench.json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from loadtest.models import kv_block_bytes, shape
from loadtest.plots import Panel, grouped_bars
from shared.config import REPO_ROOT, BatonConfig
from shared.kv_transfer import KVConnector, KVLoad, PoolConnector, ShmConnector
from shared.wire.messages import KVDescriptor, KVRelease, pack, unpack

# The bench model's KV (loadtest/models.py) in Baton's block size; fp32 on CPU.
BENCH, BLOCK_SIZE, BLOCKS = shape("bench"), BatonConfig().block_size, 512
LAYERS, KV_HEADS, HEAD_DIM = BENCH.num_hidden_layers, BENCH.num_key_value_heads, BENCH.head_dim
SHAPE = (LAYERS, 2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
BLOCK_BYTES = kv_block_bytes("bench", BLOCK_SIZE, 4)
OUT = REPO_ROOT / "loadtest" / "results" / "handoff_bench.json"
WARMUP = 10
CASES = (
    ("memcpy", "per message"),
    ("shm", "scattered"),
    ("pool", "scattered"),
    ("pool", "contiguous"),
)
MOONCAKE_CASES = (("mooncake", "scattered"), ("mooncake", "contiguous"))
HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None


def _enter_netns(name: str | None) -> None:
    """Move this thread (and the threads it starts later) into a named network namespace."""
    if name is None:
        return
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


def _mooncake(root: str, worker: str, host: str, export: bool) -> KVConnector:
    from shared.kv_transfer.mooncake import MooncakeConnector

    return MooncakeConnector(root, worker, export=export, host=host)


class _Memcpy(KVConnector):
    """The ceiling, measured like a transport: on each message the receiver copies the same byte
    count between two contiguous buffers of its own (same wake-ups, same cache state)."""

    name = "memcpy"

    def __init__(self) -> None:
        super().__init__()
        self._sent: list[str] = []
        self._bufs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def send(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVDescriptor:
        self._sent.append(request_id)
        return KVDescriptor(self.name, 1, num_tokens, len(block_ids) * BLOCK_BYTES, {})

    def pop_freeable(self, now: float) -> list[str]:
        out, self._sent = self._sent, []
        return out

    def load(self, desc: KVDescriptor, block_ids: list[int], first_block: int) -> KVLoad:
        if desc.nbytes not in self._bufs:
            self._bufs[desc.nbytes] = (torch.randn(desc.nbytes // 4), torch.empty(desc.nbytes // 4))
        src, dst = self._bufs[desc.nbytes]
        dst.copy_(src)
        return KVLoad(True, desc.nbytes)

    def discard(self, desc: KVDescriptor) -> None:
        return None


def _blocks(layout: str, n: int, seed: int) -> list[int]:
    if layout == "contiguous":
        return list(range(seed * 7 % (BLOCKS - n), seed * 7 % (BLOCKS - n) + n))
    return torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def _prefill(pipe: Any, root: str, link: tuple[str, str] | None) -> None:
    """The sending side: answers each (transport, blocks, tokens, iters) with timed handoffs.
    ``link``: (namespace, address) for mooncake; None = loopback, no mooncake: neither."""
    torch.set_num_threads(1)
    pool = PoolConnector(root, "bench-prefill")
    kv = pool.allocate_kv_cache(SHAPE, torch.float32, torch.device("cpu"))
    assert kv is not None
    pool.register_kv_cache(kv)
    kv.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)))
    shm = ShmConnector(root, 1 << 34, 300.0)
    shm.register_kv_cache(kv)
    memcpy = _Memcpy()
    memcpy.register_kv_cache(kv)
    senders: dict[str, KVConnector] = {"pool": pool, "shm": shm, "memcpy": memcpy}
    kvs = dict.fromkeys(senders, kv)
    if HAVE_MOONCAKE:
        ns, host = link or (None, "127.0.0.1")
        _enter_netns(ns)
        senders["mooncake"] = mc = _mooncake(root, "bench-prefill", host, True)
        mkv = mc.allocate_kv_cache(SHAPE, torch.float32, torch.device("cpu"))
        assert mkv is not None
        mc.register_kv_cache(mkv)
        kvs["mooncake"] = mkv
        mkv.copy_(kv)
    while (cmd := pipe.recv()) is not None:
        transport, blocks, tokens, iters = cmd
        conn = senders[transport]
        pipe.send(kvs[transport][:, :, blocks].clone())  # what the receiver must end up with
        times = []
        for i in range(iters):
            t0 = time.perf_counter()
            desc = conn.send(f"r{i}", blocks, tokens)
            t1 = time.perf_counter()
            assert desc is not None
            pipe.send_bytes(pack(dataclasses.asdict(desc)))
            release = pipe.recv()
            t2 = time.perf_counter()
            if release is not None:
                conn.release(KVRelease(**release))
            freed = conn.pop_freeable(time.time())
            times.append(t1 - t0 + time.perf_counter() - t2)
            assert freed == [f"r{i}"]
        pipe.send(times)
    for conn in senders.values():
        conn.close()


def _median_us(xs: list[float]) -> float:
    return statistics.median(xs[WARMUP:]) * 1e6


def _memcpy_us(nbytes: int, iters: int) -> float:
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return _median_us(times)


def run(prompts: list[int], iters: int, repeats: int, netns: bool = False) -> dict[str, Any]:
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        link = None
        if netns and HAVE_MOONCAKE:
            from tests.multinode.rig import netns_pair

            a, b = stack.enter_context(netns_pair())
            link = ((a.name, a.addr), (b.name, b.addr))
        result = _run(prompts, iters, repeats, link)
    result["mooncake_link"] = (
        ("veth between two network namespaces" if link else "loopback")
        if HAVE_MOONCAKE
        else "not installed"
    )
    return result


def _run(
    prompts: list[int], iters: int, repeats: int, link: tuple[tuple[str, str], ...] | None
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    best: dict[tuple[int, str, str], tuple[float, float]] = {}  # (send, load) of the best sweep
    cases = CASES + (MOONCAKE_CASES if HAVE_MOONCAKE else ())
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as root:
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_prefill, args=(there, root, link[0] if link else None))
        proc.start()
        kv = torch.zeros(SHAPE)
        receivers: dict[str, KVConnector] = {
            "pool": PoolConnector(root, "bench-decode", export=False),
            "shm": ShmConnector(root, 1 << 34, 300.0),
            "memcpy": _Memcpy(),
        }
        if HAVE_MOONCAKE:
            ns, host = link[1] if link else (None, "127.0.0.1")
            _enter_netns(ns)  # this thread only; the pool and shm rows need no network
            receivers["mooncake"] = _mooncake(root, "bench-decode", host, False)
        for conn in receivers.values():
            conn.register_kv_cache(kv)
        for _ in range(repeats):  # best of several sweeps: a shared machine's noise only adds
            for tokens in prompts:
                n = -(-tokens // BLOCK_SIZE)
                count = max(50, iters * 128 // tokens)
                tight = _memcpy_us(n * BLOCK_BYTES, count)
                _keep_best(best, (tokens, "memcpy", "tight loop"), 0.0, tight)
                for transport, layout in cases:
                    src, dst = _blocks(layout, n, 1), _blocks(layout, n, 2)
                    here.send((transport, src, tokens, count))
                    expected = here.recv()
                    loads = []
                    for _ in range(count):
                        desc = KVDescriptor.from_map(unpack(here.recv_bytes(), 1 << 20))
                        t0 = time.perf_counter()
                        res = receivers[transport].load(desc, dst, 0)
                        loads.append(time.perf_counter() - t0)
                        assert res.loaded, f"{transport} handoff refused"
                        here.send(dataclasses.asdict(res.release) if res.release else None)
                    sends = here.recv()
                    ok = transport == "memcpy" or torch.equal(kv[:, :, dst], expected)
                    assert ok, f"{transport}: wrong KV"
                    kv[:, :, dst] = 0.0
                    key = (tokens, transport, layout)
                    _keep_best(best, key, _median_us(sends), _median_us(loads))
        here.send(None)
        proc.join(timeout=60)
        for conn in receivers.values():
            conn.close()
    rows = [_row(*key, *times) for key, times in best.items()]
    return {
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "kv": {"shape": list(SHAPE), "dtype": "float32", "block_bytes": BLOCK_BYTES},
        "method": f"two processes; sender: send + release/pop_freeable; receiver: load; "
        f"median of each sweep, best of {repeats} sweeps",
        "rows": rows,
        "ratios": _ratios(rows),
    }


def _keep_best(
    best: dict[tuple[int, str, str], tuple[float, float]],
    key: tuple[int, str, str],
    send: float,
    load: float,
) -> None:
    if key not in best or send + load < sum(best[key]):
        best[key] = (send, load)


def _row(tokens: int, transport: str, layout: str, send: float, load: float) -> dict:
    total, nbytes = send + load, -(-tokens // BLOCK_SIZE) * BLOCK_BYTES
    return {
        "tokens": tokens,
        "transport": transport,
        "layout": layout,
        "bytes": nbytes,
        "send_us": round(send, 1),
        "load_us": round(load, 1),
        "handoff_us": round(total, 1),
        "gb_per_s": round(nbytes / total / 1e3, 2),
    }


def _ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for tokens in sorted({r["tokens"] for r in rows}):
        by = {(r["transport"], r["layout"]): r["handoff_us"] for r in rows if r["tokens"] == tokens}
        pool, memcpy = by[("pool", "scattered")], by[("memcpy", "per message")]
        out[str(tokens)] = {
            "pool_vs_memcpy_bandwidth": round(memcpy / pool, 3),
            "pool_contiguous_vs_memcpy_bandwidth": round(memcpy / by[("pool", "contiguous")], 3),
            "pool_vs_tight_loop_memcpy_bandwidth": round(by[("memcpy", "tight loop")] / pool, 3),
            "pool_speedup_over_shm": round(by[("shm", "scattered")] / pool, 2),
        }
        if ("mooncake", "scattered") in by:
            mc = by[("mooncake", "scattered")]
            out[str(tokens)]["mooncake_vs_memcpy_bandwidth"] = round(memcpy / mc, 3)
            out[str(tokens)]["mooncake_contiguous_vs_memcpy_bandwidth"] = round(
                memcpy / by[("mooncake", "contiguous")], 3
            )
            out[str(tokens)]["mooncake_slowdown_vs_pool"] = round(mc / pool, 2)
    return out


def report(result: dict[str, Any]) -> str:
    lines = [f"{'tokens':>6} {'transport':<9} {'layout':<11} {'send+free us':>12} "
             f"{'load us':>9} {'handoff us':>10} {'GB/s':>7}"]  # fmt: skip
    for r in result["rows"]:
        lines.append(
            f"{r['tokens']:>6} {r['transport']:<9} {r['layout']:<11} {r['send_us']:>12.1f} "
            f"{r['load_us']:>9.1f} {r['handoff_us']:>10.1f} {r['gb_per_s']:>7.2f}"
        )
    for tokens, rat in result["ratios"].items():
        lines.append(
            f"{tokens} tokens: pool/memcpy bandwidth {rat['pool_vs_memcpy_bandwidth']:.0%} "
            f"(contiguous {rat['pool_contiguous_vs_memcpy_bandwidth']:.0%}; "
            f"vs the tight loop {rat['pool_vs_tight_loop_memcpy_bandwidth']:.0%}), "
            f"pool is {rat['pool_speedup_over_shm']:.1f}x faster than shm"
        )
        if "mooncake_vs_memcpy_bandwidth" in rat:
            lines.append(
                f"{tokens} tokens: mooncake ({result.get('mooncake_link')})/memcpy bandwidth "
                f"{rat['mooncake_vs_memcpy_bandwidth']:.1%} (contiguous "
                f"{rat['mooncake_contiguous_vs_memcpy_bandwidth']:.1%}), "
                f"{rat['mooncake_slowdown_vs_pool']:.1f}x pool's handoff time"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    panels = []
    for tokens in sorted({r["tokens"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["tokens"] == tokens]
        panels.append(Panel(
            f"{tokens}-token prompt ({rows[0]['bytes'] >> 10} KiB of KV)",
            [f"{r['transport']}\n{r['layout']}" for r in rows],
            {"handoff": [r["handoff_us"] for r in rows]},
            [f"{r['gb_per_s']:.1f} GB/s" for r in rows],
        ))  # fmt: skip
    grouped_bars(path, panels, ylabel="µs per handoff, log scale (lower is better)", log=True,
                 title="KV handoff, two processes, bench-model KV (fp32)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="128,1024", help="prompt lengths in tokens")
    parser.add_argument("--iters", type=int, default=400, help="handoffs per 128-token case")
    parser.add_argument("--repeats", type=int, default=3, help="sweeps; the best one is kept")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--netns", action="store_true", help="mooncake over a veth link (root)")
    args = parser.parse_args(argv)
    prompts = [int(x) for x in args.prompts.split(",")]
    result = run(prompts, args.iters, args.repeats, args.netns)
    print(report(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
