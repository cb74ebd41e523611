"""The pooled protocol with two PoolConnectors in one process: pins, releases, leases, restarts.

Every test ends with nothing pinned: a leaked pin is a leaked block in the prefill engine."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
import torch

from shared.kv_transfer import PoolConnector
from shared.wire.messages import KVDescriptor, KVRelease
from tests.kv.helpers import BLOCK_SIZE, SHAPE, fill, receiver, sender, wire, wire_release

BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 8 * 4


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "spill"


def sent(
    tx: PoolConnector, rid: str, blocks: list[int], num_tokens: int, seed: int
) -> tuple[torch.Tensor, KVDescriptor]:
    """``blocks`` of the sender filled with known values (``seed``), then sent as ``rid``: the
    values and the descriptor."""
    values = fill(tx, blocks, seed=seed)
    desc = tx.send(rid, blocks, num_tokens=num_tokens)
    assert desc is not None
    return values, desc


def test_handoff_copies_exact_bytes_and_frees_once_on_release(root: Path) -> None:
    tx, rx = sender(root), receiver(root)
    values = fill(tx, [5, 2, 7], seed=1)
    desc = tx.send("r1", [5, 2, 7], num_tokens=10)  # 10 tokens: 3 blocks of 4
    assert desc is not None and desc.transport == "pool" and desc.nbytes == 3 * BLOCK_BYTES
    assert tx.num_pinned_blocks == 3 and tx.pop_freeable(time.time()) == []
    res = rx.load(wire(desc), [0, 1, 3], first_block=0)
    assert res.loaded and res.nbytes == 3 * BLOCK_BYTES and res.seconds > 0
    assert torch.equal(rx.kv_cache[:, :, [0, 1, 3]], values)
    assert (rx.kv_cache[:, :, 2] == -1).all()  # nothing else written
    assert res.release is not None and res.release.sender_id == "prefill-0"
    tx.release(wire_release(res.release))
    assert tx.pop_freeable(time.time()) == ["r1"]
    tx.release(res.release)  # a duplicate release frees nothing twice
    assert tx.pop_freeable(time.time()) == [] and tx.num_pinned_blocks == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_round_trip_is_bit_exact(root: Path, dtype: torch.dtype) -> None:
    tx = PoolConnector(root, "prefill-0")
    kv = tx.allocate_kv_cache(SHAPE, dtype, torch.device("cpu"))
    assert kv is not None
    tx.register_kv_cache(kv)
    kv[:, :, 3] = torch.randn(kv[:, :, 3].shape).to(dtype)
    kv.view(-1)[:2] = torch.tensor([float("inf"), -0.0]).to(dtype)
    rx = PoolConnector(root, "decode-0", export=False)
    rx.register_kv_cache(torch.zeros(SHAPE, dtype=dtype))
    desc = tx.send("r", [0, 3], num_tokens=8)
    assert desc is not None
    res = rx.load(wire(desc), [6, 1], 0)
    assert res.loaded and res.release is not None
    got, sent = rx.kv_cache[:, :, [6, 1]], kv[:, :, [0, 3]]
    assert torch.equal(got.view(torch.int16), sent.view(torch.int16))  # bit for bit
    tx.release(res.release)
    assert tx.pop_freeable(time.time()) == ["r"] and tx.num_pinned_blocks == 0


def test_prefix_hit_blocks_are_not_copied(root: Path) -> None:
    tx, rx = sender(root), receiver(root)
    values, desc = sent(tx, "r", [4, 6], 8, seed=2)
    res = rx.load(desc, [5], first_block=1)  # block 0 was a prefix hit on the receiver
    assert res.loaded and res.nbytes == BLOCK_BYTES
    assert torch.equal(rx.kv_cache[:, :, 5], values[:, :, 1])
    with pytest.raises(ValueError):
        rx.load(desc, [5, 6], first_block=1)  # one block too many: a caller bug, not a recompute
    assert res.release is not None
    tx.release(res.release)
    assert tx.pop_freeable(time.time()) == ["r"]


def test_lease_expiry_frees_an_orphan_and_its_descriptor_is_then_refused(root: Path) -> None:
    tx, rx = sender(root, lease_s=5.0), receiver(root)
    _, desc = sent(tx, "orphan", [1, 2], 8, seed=3)
    assert tx.pop_freeable(time.time()) == []
    assert tx.pop_freeable(time.time() + 10) == ["orphan"]  # decode died: nobody released
    assert tx.num_leases_expired == 1 and tx.num_pinned_blocks == 0
    assert tx.reclaimed()[("pool_blocks", "lease_expired")] == 2  # counted, by block
    fill(tx, [1, 2], seed=4)  # the engine reused the blocks
    res = rx.load(desc, [0, 3], 0)  # a late (redelivered) handoff: never the new KV
    assert not res.loaded and rx.num_stale_loads == 1
    assert (rx.kv_cache == -1).all()
    assert res.release is not None
    tx.release(res.release)  # a release after expiry frees nothing twice
    assert tx.pop_freeable(time.time()) == []


def test_receiver_does_not_start_a_copy_when_the_lease_is_about_to_end(root: Path) -> None:
    tx, rx = sender(root, lease_s=0.5), receiver(root, lease_margin_s=1.0)
    _, desc = sent(tx, "r", [0], 3, seed=5)
    res = rx.load(desc, [2], 0)
    assert not res.loaded and rx.num_stale_loads == 1 and (rx.kv_cache == -1).all()
    assert res.release is not None
    tx.release(res.release)  # the refusal still releases: the sender frees at once
    assert tx.pop_freeable(time.time()) == ["r"] and tx.num_pinned_blocks == 0


def test_redelivered_handoff_loads_while_pinned_and_is_refused_after_release(root: Path) -> None:
    tx, rx = sender(root), receiver(root)
    values, desc = sent(tx, "r", [3, 4], 8, seed=6)
    first, again = rx.load(desc, [0, 1], 0), rx.load(desc, [6, 7], 0)  # decode redelivery
    assert first.loaded and again.loaded
    assert torch.equal(rx.kv_cache[:, :, [6, 7]], values)
    assert first.release == again.release and first.release is not None
    assert len(rx._maps) == 1  # the pool is mapped once, not per handoff
    tx.release(first.release)
    tx.release(first.release)
    assert tx.pop_freeable(time.time()) == ["r"]  # exactly once
    fill(tx, [3, 4], seed=7)
    other = tx.send("s", [4, 3], num_tokens=8)  # the same blocks, pinned again for another
    assert other is not None
    stale = rx.load(desc, [2, 5], 0)
    assert not stale.loaded and (rx.kv_cache[:, :, [2, 5]] == -1).all()
    ok = rx.load(other, [2, 5], 0)
    assert ok.loaded and ok.release is not None
    tx.release(ok.release)
    assert tx.pop_freeable(time.time()) == ["s"] and tx.num_pinned_blocks == 0


def test_a_block_shared_by_two_requests_stays_pinned_until_both_release(root: Path) -> None:
    tx, rx = sender(root), receiver(root)
    fill(tx, [0, 1, 2], seed=8)
    a, b = tx.send("a", [0, 1], 8), tx.send("b", [0, 2], 8)  # block 0: a shared prefix
    assert a is not None and b is not None and tx.num_pinned_blocks == 3
    ra = rx.load(a, [4, 5], 0)
    assert ra.loaded and ra.release is not None
    tx.release(ra.release)
    assert tx.pop_freeable(time.time()) == ["a"] and tx.num_pinned_blocks == 2
    rb = rx.load(b, [6, 7], 0)  # block 0's epoch survived a's release
    assert rb.loaded and rb.release is not None
    assert torch.equal(rx.kv_cache[:, :, 6], tx.kv_cache[:, :, 0])
    tx.release(rb.release)
    assert tx.pop_freeable(time.time()) == ["b"] and tx.num_pinned_blocks == 0


def test_discard_releases_so_the_sender_frees_at_once(root: Path) -> None:
    tx, rx = sender(root), receiver(root)
    desc = tx.send("cancelled", [1], num_tokens=2)
    assert desc is not None
    release = rx.discard(wire(desc))
    assert release is not None
    tx.release(wire_release(release))
    assert tx.pop_freeable(time.time()) == ["cancelled"] and tx.num_pinned_blocks == 0


def test_sender_restart_new_generation_the_old_handle_is_never_read(root: Path) -> None:
    old, rx = sender(root), receiver(root)
    fill(old, [0, 1], seed=9)
    d1, d2 = old.send("a", [0], 4), old.send("b", [1], 4)
    assert d1 is not None and d2 is not None
    assert rx.load(d1, [0], 0).loaded  # the receiver has the old pool mapped now
    os.close(old._fd)  # the old prefill dies: its lock goes, its file stays
    res = rx.load(d2, [1], 0)
    assert not res.loaded and rx.num_map_failures == 1 and (rx.kv_cache[:, :, 1] == -1).all()
    new = sender(root)  # restarted under the same worker id: a new generation, old file reaped
    assert new.generation != old.generation
    assert sorted(os.listdir(root)) == [f"pool-prefill-0-{new.generation}"]
    assert not rx.load(d2, [1], 0).loaded and rx.num_map_failures == 2  # file gone
    values = fill(new, [1], seed=10)
    d3 = new.send("b", [1], 4)  # the replayed request
    assert d3 is not None
    res = rx.load(d3, [1], 0)
    assert res.loaded and torch.equal(rx.kv_cache[:, :, 1], values[:, :, 0])
    assert list(rx._maps) == [("prefill-0", new.generation)]  # the dead pool is unmapped
    assert res.release is not None and d3.payload["send_id"] == d1.payload["send_id"]
    new.release(res.release)
    assert new.pop_freeable(time.time()) == ["b"] and new.num_pinned_blocks == 0
    # Send ids restart with a generation: an old generation's release never frees a new pin.
    d4 = new.send("a", [0], 4)
    assert d4 is not None
    stale = {"generation": old.generation, "send_id": d4.payload["send_id"]}
    new.release(KVRelease("pool", "prefill-0", "a", stale))
    assert new.pop_freeable(time.time()) == [] and new.num_pinned_blocks == 1
    assert new.pop_freeable(time.time() + 60) == ["a"] and new.num_pinned_blocks == 0


def test_clean_close_and_housekeeping_remove_the_pool(root: Path) -> None:
    tx, rx = sender(root), receiver(root)
    name = f"pool-prefill-0-{tx.generation}"
    assert stat.S_IMODE(os.stat(root / name).st_mode) == 0o600
    assert rx.reclaim_orphans(time.time()) == 0  # alive: untouched
    tx.close()
    assert os.listdir(root) == []
    crashed = sender(root, worker_id="prefill-1")
    os.close(crashed._fd)
    assert rx.reclaim_orphans(time.time()) == 1 and os.listdir(root) == []


def test_misuse_fails_loudly(root: Path) -> None:
    tx = PoolConnector(root, "prefill-0")
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        tx.register_kv_cache(torch.zeros(SHAPE))  # a cache that is not the shared pool
    with pytest.raises(RuntimeError, match="cuda-ipc"):
        tx.allocate_kv_cache(SHAPE, torch.float32, torch.device("meta"))
    with pytest.raises(ValueError):
        PoolConnector(root, "../etc")
    tx2, rx = sender(root, worker_id="prefill-2"), receiver(root)
    rx.register_kv_cache(torch.zeros((2, 2, 8, 4, 2, 4)))  # another head_dim: never mixed
    desc = tx2.send("r", [0], 4)
    assert desc is not None
    with pytest.raises(ValueError, match="does not fit"):
        rx.load(desc, [0], 0)
    assert rx.discard(desc) is not None
    tx2.close()


def test_mappings_are_bounded(root: Path) -> None:
    rx = receiver(root, max_mappings=2)
    senders = [sender(root, worker_id=f"prefill-{i}") for i in range(3)]
    for i, tx in enumerate(senders):
        desc = tx.send("r", [i], 4)
        assert desc is not None
        res = rx.load(desc, [i], 0)
        assert res.loaded and res.release is not None
        tx.release(res.release)
        assert tx.pop_freeable(time.time()) == ["r"]
        tx.close()
    assert [k[0] for k in rx._maps] == ["prefill-1", "prefill-2"]  # least recently used went


def test_a_second_send_of_a_pinned_request_is_refused_not_confused(root: Path) -> None:
    """Freeing by request id must never free another send's blocks: the replay goes without KV
    (the engine frees its blocks itself), the first send stays pinned until its release."""
    tx, rx = sender(root), receiver(root)
    first = tx.send("r", [1, 2], 8)
    assert first is not None
    assert tx.send("r", [3, 4], 8) is None
    assert tx.num_pinned_blocks == 2 and tx.pop_freeable(time.time()) == []
    res = rx.load(first, [0, 1], 0)
    assert res.loaded and res.release is not None
    tx.release(res.release)
    assert tx.pop_freeable(time.time()) == ["r"] and tx.num_pinned_blocks == 0
