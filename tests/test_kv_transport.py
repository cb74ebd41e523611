"""Shared-memory KV store: exact round trips, one-shot entries, capacity, orphans, safe keys."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
import torch

from shared.config import BatonConfig
from shared.kv_transport import ShmKVStore, make_transport
from shared.protocol import KVDescriptor

SHAPE = (2, 2, 3, 4, 2, 8)  # [layers, k/v, blocks, block_size, kv_heads, head_dim]
TIMEOUT_S = 300.0


def kv(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.fixture
def store(tmp_path: Path) -> ShmKVStore:
    return ShmKVStore(tmp_path / "spill", 1 << 20, TIMEOUT_S)


def entries(store: ShmKVStore) -> list[str]:
    return sorted(os.listdir(store.root))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_exact(store: ShmKVStore, dtype: torch.dtype) -> None:
    t = kv(dtype)
    t.view(-1)[:3] = torch.tensor([float("inf"), -0.0, 1e-3]).to(dtype)  # odd values survive
    desc = store.send("req-1", t, num_tokens=10)
    assert desc is not None
    assert (desc.transport, desc.num_tokens, desc.nbytes) == ("shm", 10, nbytes(t))
    assert desc.shape == list(SHAPE) and desc.dtype == str(dtype).removeprefix("torch.")
    assert store.used_bytes() == nbytes(t)
    back = store.receive(desc)
    assert back is not None
    assert back.dtype == dtype and back.shape == SHAPE
    assert torch.equal(back.view(torch.int8), t.view(torch.int8))  # bit for bit
    assert entries(store) == []


def test_non_contiguous_and_grad_tensors(store: ShmKVStore) -> None:
    base = kv().requires_grad_(True)
    t = base.transpose(2, 3)  # a view with other strides
    assert not t.is_contiguous()
    desc = store.send("req", t, num_tokens=1)
    assert desc is not None and desc.shape == list(t.shape)
    back = store.receive(desc)
    assert back is not None and torch.equal(back, t.detach())


def test_descriptor_survives_the_wire(store: ShmKVStore) -> None:
    """What decode receives is rebuilt from a msgpack map: plain fields suffice."""
    desc = store.send("req", kv(torch.bfloat16), num_tokens=7)
    assert desc is not None
    rebuilt = KVDescriptor(**dataclasses.asdict(desc))
    back = store.receive(rebuilt)
    assert back is not None and torch.equal(back, kv(torch.bfloat16))


def test_entry_is_deleted_after_receive(store: ShmKVStore) -> None:
    desc = store.send("req", kv(), num_tokens=4)
    assert desc is not None and len(entries(store)) == 1
    assert store.receive(desc) is not None
    assert store.receive(desc) is None  # a redelivered handoff: the caller recomputes
    assert entries(store) == [] and store.used_bytes() == 0


def test_discard(store: ShmKVStore) -> None:
    keep = store.send("keep", kv(seed=1), num_tokens=4)
    drop = store.send("drop", kv(seed=2), num_tokens=4)
    assert keep is not None and drop is not None
    store.discard(drop)
    store.discard(drop)  # idempotent
    assert store.receive(drop) is None
    back = store.receive(keep)
    assert back is not None and torch.equal(back, kv(seed=1))


def test_same_request_id_twice_gives_distinct_entries(store: ShmKVStore) -> None:
    a = store.send("req", kv(seed=1), num_tokens=1)
    b = store.send("req", kv(seed=2), num_tokens=1)
    assert a is not None and b is not None and a.key != b.key
    rb, ra = store.receive(b), store.receive(a)
    assert ra is not None and rb is not None
    assert torch.equal(ra, kv(seed=1)) and torch.equal(rb, kv(seed=2))


def test_capacity_refusal(tmp_path: Path) -> None:
    size = nbytes(kv())
    store = ShmKVStore(tmp_path, 2 * size, TIMEOUT_S)
    first = store.send("a", kv(), num_tokens=1)
    second = store.send("b", kv(), num_tokens=1)
    assert first is not None and second is not None  # exactly at the budget is fine
    assert store.send("c", kv(), num_tokens=1) is None
    assert len(entries(store)) == 2 and store.used_bytes() == 2 * size
    assert store.receive(first) is not None
    assert store.send("c", kv(), num_tokens=1) is not None  # room again


def test_entry_bigger_than_the_whole_store_is_refused(tmp_path: Path) -> None:
    store = ShmKVStore(tmp_path, nbytes(kv()) - 1, TIMEOUT_S)
    assert store.send("a", kv(), num_tokens=1) is None
    assert entries(store) == []


def test_orphans_reclaimed_by_age(store: ShmKVStore) -> None:
    old = store.send("old", kv(), num_tokens=1)
    new = store.send("new", kv(), num_tokens=1)
    assert old is not None and new is not None
    now = time.time()
    assert store.reclaim_orphans(now=now) == 0
    stale = now - TIMEOUT_S - 10
    os.utime(store.root / (old.key + ".kv"), (stale, stale))
    assert store.reclaim_orphans(now=now) == 1
    assert store.receive(old) is None
    assert store.receive(new) is not None


def test_reclaim_everything_past_the_timeout(store: ShmKVStore) -> None:
    descs = [store.send(f"r{i}", kv(), num_tokens=1) for i in range(3)]
    (store.root / "leftover.tmp").write_bytes(b"half written")  # a crashed writer's temp file
    assert store.reclaim_orphans(now=time.time() + TIMEOUT_S / 2) == 0
    assert store.reclaim_orphans(now=time.time() + TIMEOUT_S + 5) == 4
    assert entries(store) == [] and all(d is not None and store.receive(d) is None for d in descs)
    assert store.reclaim_orphans() == 0


@pytest.mark.parametrize(
    "key",
    ["../escape", "a/b", "/etc/passwd", ".hidden", "..", ".", "sub/../../x"],
)
def test_path_traversal_keys_are_refused(store: ShmKVStore, tmp_path: Path, key: str) -> None:
    victim = tmp_path / "escape.kv"
    victim.write_bytes(b"\0" * 16)
    desc = KVDescriptor("shm", key, 1, 16, [4], "float32")
    with pytest.raises(ValueError, match="not an shm descriptor"):
        store.receive(desc)
    with pytest.raises(ValueError, match="not an shm descriptor"):
        store.discard(desc)
    assert victim.exists()


def test_other_transport_descriptor_is_refused(store: ShmKVStore) -> None:
    desc = store.send("req", kv(), num_tokens=1)
    assert desc is not None
    ipc = dataclasses.replace(desc, transport="cuda-ipc")
    with pytest.raises(ValueError, match="not an shm descriptor"):
        store.receive(ipc)
    assert len(entries(store)) == 1  # nothing was consumed


@pytest.mark.parametrize(
    "key",
    ["../../etc/passwd", "a/b/c", ".secret", "..", "", "héllo wörld 🙂", "x" * 500, "a\0b"],
)
def test_send_sanitizes_request_ids(store: ShmKVStore, key: str) -> None:
    desc = store.send(key, kv(), num_tokens=1)
    assert desc is not None
    assert "/" not in desc.key and "\0" not in desc.key and not desc.key.startswith(".")
    assert len(desc.key) <= 64 + 1 + 32
    assert entries(store) == [desc.key + ".kv"]  # inside the store's folder, nowhere else
    back = store.receive(desc)
    assert back is not None and torch.equal(back, kv())


def test_unsupported_dtype_in_descriptor(store: ShmKVStore) -> None:
    desc = store.send("req", kv(), num_tokens=1)
    assert desc is not None
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        store.receive(dataclasses.replace(desc, dtype="float64"))


def test_size_mismatch_is_an_error(store: ShmKVStore) -> None:
    desc = store.send("req", kv(), num_tokens=1)
    assert desc is not None
    wrong = dataclasses.replace(desc, nbytes=desc.nbytes * 2, shape=[2, *desc.shape])
    with pytest.raises(ValueError, match=desc.key):
        store.receive(wrong)


def test_make_transport(tmp_path: Path) -> None:
    config = BatonConfig(spill_dir=str(tmp_path / "s"), spill_max_bytes=123, kv_transport="shm")
    t = make_transport(config)
    assert isinstance(t, ShmKVStore)
    assert (t.root, t.max_bytes, t.orphan_timeout_s) == (tmp_path / "s", 123, 300.0)
    assert t.root.is_dir()
    with pytest.raises(ValueError, match="cuda-ipc"):
        make_transport(config.replace(kv_transport="cuda-ipc"))
