"""The pooled protocol across processes (spawn): a prefill process owns the pool, this test
process plays decode. Also: the sender dies — its handle is never read again."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import torch

from tests.kv.helpers import fill, receiver, sender, wire, wire_release


def _prefill(root: str, to_decode: Any, from_decode: Any) -> None:
    """Allocate the pool, write known values, send two requests, serve one release, then die."""
    import dataclasses

    from shared.wire.messages import KVRelease, pack

    tx = sender(Path(root))
    fill(tx, [6, 1, 4], seed=11)
    fill(tx, [2], seed=12)
    a, b = tx.send("a", [6, 1, 4], num_tokens=12), tx.send("b", [2], num_tokens=3)
    assert a is not None and b is not None
    to_decode.put((pack(dataclasses.asdict(a)), pack(dataclasses.asdict(b))))
    tx.release(KVRelease(**from_decode.get()))
    to_decode.put((tx.pop_freeable(time.time()), tx.num_pinned_blocks))
    from_decode.get()  # then die without cleaning up (no close(): as a crash would)


def test_two_processes_hand_off_exact_bytes_and_a_dead_sender_is_never_read(
    tmp_path: Path,
) -> None:
    import dataclasses

    from shared.wire.messages import KVDescriptor, unpack

    ctx = mp.get_context("spawn")
    to_decode, from_decode = ctx.Queue(), ctx.Queue()
    root = tmp_path / "spill"
    proc = ctx.Process(target=_prefill, args=(str(root), to_decode, from_decode))
    proc.start()
    try:
        a_body, b_body = to_decode.get(timeout=120)
        a, b = (KVDescriptor.from_map(unpack(x, 1 << 20)) for x in (a_body, b_body))
        rx = receiver(root)
        res = rx.load(a, [0, 5, 7], first_block=0)
        assert res.loaded and res.release is not None
        # The sender's values, regenerated here from the same seed.
        expected = torch.randn((2, 2, 3, 4, 2, 8), generator=torch.Generator().manual_seed(11))
        assert torch.equal(rx.kv_cache[:, :, [0, 5, 7]], expected)
        from_decode.put(dataclasses.asdict(wire_release(res.release)))
        freed, pinned = to_decode.get(timeout=60)
        assert freed == ["a"] and pinned == 1  # released exactly; b still pinned
        from_decode.put("die")
        proc.join(timeout=60)
        assert proc.exitcode == 0
        # b's sender is gone: its blocks will never be released, so they are not read.
        res_b = rx.load(wire(b), [3], 0)
        assert not res_b.loaded and rx.num_map_failures == 1
        assert (rx.kv_cache[:, :, 3] == -1).all()
        assert rx.reclaim_orphans(time.time()) == 1 and list(root.iterdir()) == []
    finally:
        if proc.is_alive():
            proc.kill()
