"""The shared-memory KV connector on block ids: exact round trips between two caches, one-shot
entries, prefix-hit loads, the duty to free, atomic writes, capacity, orphans, safe keys."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
import torch

from shared.config import BatonConfig
from shared.kv_transfer import ShmConnector, make_connector
from shared.kv_transfer.shm import PAYLOAD_VERSION
from shared.wire.messages import KVDescriptor, pack, unpack

L, NB, BS, H, D = 2, 8, 4, 2, 8
SHAPE = (L, 2, NB, BS, H, D)  # [layers, k/v, blocks, block_size, kv_heads, head_dim]
BLOCK_BYTES = L * 2 * BS * H * D * 4  # fp32
TIMEOUT_S = 300.0


def cache(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def connector(root: Path, kv_cache: torch.Tensor, max_bytes: int = 1 << 20) -> ShmConnector:
    c = ShmConnector(root, max_bytes, TIMEOUT_S)
    c.register_kv_cache(kv_cache)
    return c


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "spill"


@pytest.fixture
def sender(root: Path) -> ShmConnector:
    """Prefill's side: a cache full of distinct values."""
    return connector(root, cache())


@pytest.fixture
def receiver(root: Path) -> ShmConnector:
    """Decode's side (another process in production): its own, empty cache, the same folder."""
    return connector(root, torch.zeros(SHAPE))


def entries(c: ShmConnector) -> list[str]:
    return sorted(os.listdir(c.root))


def blocks(c: ShmConnector, ids: list[int]) -> torch.Tensor:
    return c.kv_cache[:, :, ids]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_exact(root: Path, dtype: torch.dtype) -> None:
    src = cache(dtype)
    src[0, 0, 5, 0, 0, :3] = torch.tensor([float("inf"), -0.0, 1e-3]).to(dtype)  # odd values
    sender = connector(root, src)
    receiver = connector(root, torch.zeros(SHAPE, dtype=dtype))
    desc = sender.send("req-1", [5, 1, 3], num_tokens=10)  # 10 tokens: 3 blocks of 4
    assert desc is not None
    nbytes = 3 * BLOCK_BYTES * dtype.itemsize // 4
    assert (desc.transport, desc.version, desc.num_tokens, desc.nbytes) == (
        "shm",
        PAYLOAD_VERSION,
        10,
        nbytes,
    )
    assert desc.payload["dtype"] == str(dtype).removeprefix("torch.")
    assert sender.used_bytes() == nbytes and len(entries(sender)) == 1
    result = receiver.load(desc, [0, 6, 2], first_block=0)
    assert result.loaded and result.nbytes == nbytes and result.release is None
    got, want = blocks(receiver, [0, 6, 2]), blocks(sender, [5, 1, 3])
    assert torch.equal(got.view(torch.int8), want.contiguous().view(torch.int8))  # bit for bit
    assert receiver.kv_cache[:, :, [1, 3, 4, 5, 7]].count_nonzero() == 0  # nothing else written
    assert entries(receiver) == []


def test_exactly_the_blocks_given_are_sent(sender: ShmConnector, receiver: ShmConnector) -> None:
    """The engine picks the blocks (a sliding window's, an int8 window's slots after them)."""
    desc = sender.send("req", [5, 1], num_tokens=8)
    assert desc is not None and desc.nbytes == 2 * BLOCK_BYTES
    assert desc.payload["shape"] == [L, 2, 2, BS, H, D]
    assert receiver.load(desc, [4, 0], first_block=0).loaded
    assert torch.equal(blocks(receiver, [4, 0]), blocks(sender, [5, 1]))


def test_sender_may_free_its_blocks_at_once(sender: ShmConnector) -> None:
    """A copy transport hands the duty to free back immediately: each id named once."""
    assert sender.pop_freeable(time.time()) == []
    assert sender.send("a", [0], 1) is not None and sender.send("b", [1], 1) is not None
    assert sender.pop_freeable(time.time()) == ["a", "b"]
    assert sender.pop_freeable(time.time()) == []


def test_load_after_prefix_hits_copies_only_the_rest(
    sender: ShmConnector, receiver: ShmConnector
) -> None:
    desc = sender.send("req", [5, 1, 3], num_tokens=12)
    assert desc is not None
    receiver.kv_cache[:, :, 6] = 7.0  # a prefix-cache hit there: must stay as it is
    assert receiver.load(desc, [0, 2], first_block=1).loaded
    assert torch.equal(blocks(receiver, [0, 2]), blocks(sender, [1, 3]))
    assert bool((receiver.kv_cache[:, :, 6] == 7.0).all())
    everything_hit = sender.send("all", [5, 1, 3], num_tokens=12)
    assert everything_hit is not None
    assert receiver.load(everything_hit, [], first_block=3).loaded
    assert entries(receiver) == []


def test_load_with_the_wrong_number_of_blocks_is_an_error(
    sender: ShmConnector, receiver: ShmConnector
) -> None:
    desc = sender.send("req", [5, 1, 3], num_tokens=12)
    assert desc is not None
    with pytest.raises(ValueError, match="blocks for entry"):
        receiver.load(desc, [0, 2], first_block=0)
    assert receiver.kv_cache.count_nonzero() == 0


def test_load_converts_to_the_receivers_dtype(root: Path, sender: ShmConnector) -> None:
    receiver = connector(root, torch.zeros(SHAPE, dtype=torch.bfloat16))
    desc = sender.send("req", [2], num_tokens=4)
    assert desc is not None and receiver.load(desc, [3], first_block=0).loaded
    assert torch.equal(blocks(receiver, [3]), blocks(sender, [2]).to(torch.bfloat16))


def test_descriptor_survives_the_wire(sender: ShmConnector, receiver: ShmConnector) -> None:
    """What decode receives is rebuilt from a msgpack map: plain fields suffice."""
    desc = sender.send("req", [4, 2], num_tokens=7)
    assert desc is not None
    rebuilt = KVDescriptor.from_map(unpack(pack(dataclasses.asdict(desc)), 1 << 20))
    assert rebuilt == desc
    assert receiver.load(rebuilt, [1, 0], first_block=0).loaded
    assert torch.equal(blocks(receiver, [1, 0]), blocks(sender, [4, 2]))


def test_entry_is_deleted_after_load(sender: ShmConnector, receiver: ShmConnector) -> None:
    desc = sender.send("req", [1], num_tokens=4)
    assert desc is not None and len(entries(sender)) == 1
    assert receiver.load(desc, [0], 0).loaded
    assert not receiver.load(desc, [0], 0).loaded  # a redelivered handoff: decode recomputes
    assert entries(sender) == [] and sender.used_bytes() == 0


def test_discard(sender: ShmConnector, receiver: ShmConnector) -> None:
    keep = sender.send("keep", [1], num_tokens=4)
    drop = sender.send("drop", [2], num_tokens=4)
    assert keep is not None and drop is not None
    assert receiver.discard(drop) is None
    assert receiver.discard(drop) is None  # idempotent
    assert not receiver.load(drop, [0], 0).loaded
    assert receiver.load(keep, [0], 0).loaded
    assert torch.equal(blocks(receiver, [0]), blocks(sender, [1]))


def test_same_request_id_twice_gives_distinct_entries(
    sender: ShmConnector, receiver: ShmConnector
) -> None:
    a = sender.send("req", [1], num_tokens=1)
    b = sender.send("req", [2], num_tokens=1)
    assert a is not None and b is not None and a.payload["key"] != b.payload["key"]
    assert receiver.load(b, [5], 0).loaded and receiver.load(a, [6], 0).loaded
    assert torch.equal(blocks(receiver, [6, 5]), blocks(sender, [1, 2]))


def test_writes_are_atomic(sender: ShmConnector, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that dies before its rename leaves only a temp file: never a readable entry."""
    desc = sender.send("ok", [1], num_tokens=4)
    assert desc is not None and entries(sender) == [desc.payload["key"] + ".kv"]

    def die(*args: object) -> None:
        raise OSError("killed mid-write")

    monkeypatch.setattr(os, "replace", die)
    with pytest.raises(OSError):
        sender.send("dies", [2], num_tokens=4)
    monkeypatch.undo()
    names = entries(sender)
    assert len(names) == 2 and sum(n.endswith(".tmp") for n in names) == 1
    assert [n for n in names if n.endswith(".kv")] == [desc.payload["key"] + ".kv"]
    assert sender.pop_freeable(time.time()) == ["ok"]  # the failed send kept its duty


def test_capacity_refusal(root: Path, receiver: ShmConnector) -> None:
    sender = connector(root, cache(), max_bytes=2 * BLOCK_BYTES)
    first = sender.send("a", [1], num_tokens=4)
    second = sender.send("b", [2], num_tokens=4)
    assert first is not None and second is not None  # exactly at the budget is fine
    assert sender.send("c", [3], num_tokens=4) is None  # full: the engine keeps the blocks
    assert sender.pop_freeable(time.time()) == ["a", "b"]
    assert len(entries(sender)) == 2 and sender.used_bytes() == 2 * BLOCK_BYTES
    assert receiver.load(first, [0], 0).loaded
    sender.pop_freeable(time.time() + 60)  # housekeeping notices what receivers took
    assert sender.send("c", [3], num_tokens=4) is not None  # room again


def test_entry_bigger_than_the_whole_store_is_refused(root: Path) -> None:
    sender = connector(root, cache(), max_bytes=2 * BLOCK_BYTES - 1)
    assert sender.send("a", [1, 2], num_tokens=8) is None
    assert entries(sender) == [] and sender.pop_freeable(time.time()) == []


def test_orphans_reclaimed_by_age(sender: ShmConnector, receiver: ShmConnector) -> None:
    old = sender.send("old", [1], num_tokens=1)
    new = sender.send("new", [2], num_tokens=1)
    assert old is not None and new is not None
    now = time.time()
    assert receiver.reclaim_orphans(now) == 0
    stale = now - TIMEOUT_S - 10
    os.utime(sender.root / (old.payload["key"] + ".kv"), (stale, stale))
    assert receiver.reclaim_orphans(now) == 1
    assert not receiver.load(old, [0], 0).loaded
    assert receiver.load(new, [0], 0).loaded


def test_reclaim_everything_past_the_timeout(sender: ShmConnector) -> None:
    descs = [sender.send(f"r{i}", [i], num_tokens=1) for i in range(3)]
    (sender.root / "leftover.tmp").write_bytes(b"half written")  # a crashed writer's temp file
    assert sender.reclaim_orphans(time.time() + TIMEOUT_S / 2) == 0
    assert sender.reclaim_orphans(time.time() + TIMEOUT_S + 5) == 4
    assert entries(sender) == []
    assert all(d is not None and not sender.load(d, [0], 0).loaded for d in descs)
    assert sender.reclaim_orphans(time.time()) == 0


@pytest.mark.parametrize(
    "key",
    ["../escape", "a/b", "/etc/passwd", ".hidden", "..", ".", "sub/../../x", "", None, 7],
)
def test_path_traversal_keys_are_refused(
    receiver: ShmConnector, tmp_path: Path, key: object
) -> None:
    victim = tmp_path / "escape.kv"
    victim.write_bytes(b"\0" * 16)
    desc = KVDescriptor(
        "shm", PAYLOAD_VERSION, 1, 16, {"key": key, "shape": [4], "dtype": "float32"}
    )
    with pytest.raises(ValueError, match="bad shm key"):
        receiver.load(desc, [0], 0)
    with pytest.raises(ValueError, match="bad shm key"):
        receiver.discard(desc)
    assert victim.exists()


@pytest.mark.parametrize("change", [{"transport": "cuda-ipc"}, {"version": PAYLOAD_VERSION + 1}])
def test_other_transport_or_version_is_refused(
    sender: ShmConnector, receiver: ShmConnector, change: dict[str, object]
) -> None:
    desc = sender.send("req", [1], num_tokens=1)
    assert desc is not None
    other = dataclasses.replace(desc, **change)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an shm v1 descriptor"):
        receiver.load(other, [0], 0)
    with pytest.raises(ValueError, match="not an shm v1 descriptor"):
        receiver.discard(other)
    assert len(entries(receiver)) == 1  # nothing was consumed


@pytest.mark.parametrize(
    "key",
    ["../../etc/passwd", "a/b/c", ".secret", "..", "", "héllo wörld 🙂", "x" * 500, "a\0b"],
)
def test_send_sanitizes_request_ids(sender: ShmConnector, receiver: ShmConnector, key: str) -> None:
    desc = sender.send(key, [3], num_tokens=1)
    assert desc is not None
    name = desc.payload["key"]
    assert "/" not in name and "\0" not in name and not name.startswith(".")
    assert len(name) <= 64 + 1 + 32
    assert entries(sender) == [name + ".kv"]  # inside the store's folder, nowhere else
    assert receiver.load(desc, [0], 0).loaded
    assert torch.equal(blocks(receiver, [0]), blocks(sender, [3]))


def test_unsupported_dtype_in_descriptor(sender: ShmConnector, receiver: ShmConnector) -> None:
    desc = sender.send("req", [1], num_tokens=1)
    assert desc is not None
    wrong = dataclasses.replace(desc, payload={**desc.payload, "dtype": "float64"})
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        receiver.load(wrong, [0], 0)


def test_size_mismatch_is_an_error(sender: ShmConnector, receiver: ShmConnector) -> None:
    desc = sender.send("req", [1], num_tokens=1)
    assert desc is not None
    shape = [2, *desc.payload["shape"]]
    wrong = dataclasses.replace(
        desc, nbytes=desc.nbytes * 2, payload={**desc.payload, "shape": shape}
    )
    with pytest.raises(ValueError, match=desc.payload["key"]):
        receiver.load(wrong, [0], 0)
    assert receiver.kv_cache.count_nonzero() == 0


def test_a_cache_must_be_registered_first(root: Path) -> None:
    with pytest.raises(RuntimeError, match="register_kv_cache"):
        ShmConnector(root, 1 << 20, TIMEOUT_S).send("req", [0], 1)


def test_make_connector(tmp_path: Path) -> None:
    config = BatonConfig(spill_dir=str(tmp_path / "s"), spill_max_bytes=123, kv_transport="shm")
    c = make_connector(config)
    assert isinstance(c, ShmConnector)
    assert (c.root, c.max_bytes, c.orphan_timeout_s) == (tmp_path / "s", 123, 300.0)
    assert c.root.is_dir()
    with pytest.raises(ValueError, match="carrier-pigeon"):
        make_connector(config.replace(kv_transport="carrier-pigeon"))
