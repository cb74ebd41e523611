"""``mooncake``: two connectors in one process, each with its own transfer engine, over loopback
TCP (``P2PHANDSHAKE``: no metadata server). The sender registers its pool; the receiver pulls.

Every handoff test ends with nothing pinned: a leaked pin is a leaked block in prefill."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.config import BatonConfig
from shared.kv_transfer import FallbackConnector, make_connector
from shared.wire.messages import KVDescriptor
from tests.kv.helpers import BLOCK_SIZE, SHAPE, wire, wire_release

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # read when the engine library loads
pytest.importorskip(
    "mooncake.engine",
    reason="mooncake-transfer-engine is not installed (pip install "
    "mooncake-transfer-engine-non-cuda; it also needs libibverbs1)",
)
from shared.kv_transfer.mooncake import MooncakeConnector  # noqa: E402

BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 8 * 4


@pytest.fixture
def made(tmp_path: Path) -> Iterator[list[MooncakeConnector]]:
    conns: list[MooncakeConnector] = []
    yield conns
    for c in conns:
        c.close()


def sender(made: list[MooncakeConnector], root: Path, dtype: torch.dtype = torch.float32,
           **kw: Any) -> MooncakeConnector:  # fmt: skip
    conn = MooncakeConnector(str(root / "tx"), "prefill-0", host="127.0.0.1", **kw)
    made.append(conn)
    kv = conn.allocate_kv_cache(SHAPE, dtype, torch.device("cpu"))
    assert kv is not None and (kv == 0).all()
    conn.register_kv_cache(kv)
    return conn


def receiver(made: list[MooncakeConnector], root: Path, dtype: torch.dtype = torch.float32
             ) -> MooncakeConnector:  # fmt: skip
    conn = MooncakeConnector(str(root / "rx"), "decode-0", export=False, host="127.0.0.1")
    made.append(conn)
    assert conn.allocate_kv_cache(SHAPE, dtype, torch.device("cpu")) is None
    conn.register_kv_cache(torch.full(SHAPE, -1.0, dtype=dtype))
    return conn


def fill(conn: MooncakeConnector, blocks: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn((*SHAPE[:2], len(blocks), *SHAPE[3:]), generator=g)
    conn.kv_cache[:, :, blocks] = values.to(conn.kv_cache.dtype)
    return conn.kv_cache[:, :, blocks].clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pull_copies_exact_bytes_and_frees_once_on_release(
    made: list[MooncakeConnector], tmp_path: Path, dtype: torch.dtype
) -> None:
    tx, rx = sender(made, tmp_path, dtype), receiver(made, tmp_path, dtype)
    values = fill(tx, [5, 2, 3, 7], seed=1)
    desc = tx.send("r1", [5, 2, 3, 7], num_tokens=14)  # 14 tokens: 4 blocks of 4
    assert desc is not None and desc.transport == "mooncake"
    assert desc.payload["segment"] == tx.segment and tx.segment.startswith("127.0.0.1:")
    assert tx.num_pinned_blocks == 4 and tx.pop_freeable(time.time()) == []
    res = rx.load(wire(desc), [6, 0, 1, 4], first_block=0)
    assert res.loaded and res.nbytes == 4 * BLOCK_BYTES * dtype.itemsize // 4
    got = rx.kv_cache[:, :, [6, 0, 1, 4]]
    assert torch.equal(got.view(torch.uint8), values.view(torch.uint8))  # bit for bit
    assert (rx.kv_cache[:, :, [2, 3, 5, 7]] == -1).all()  # nothing else written
    assert res.release is not None and res.release.sender_id == "prefill-0"
    tx.release(wire_release(res.release))
    assert tx.pop_freeable(time.time()) == ["r1"]
    tx.release(res.release)  # a duplicate release frees nothing twice
    assert tx.pop_freeable(time.time()) == [] and tx.num_pinned_blocks == 0


def test_prefix_hit_blocks_are_not_pulled(made: list[MooncakeConnector], tmp_path: Path) -> None:
    tx, rx = sender(made, tmp_path), receiver(made, tmp_path)
    values = fill(tx, [4, 6], seed=2)
    desc = tx.send("r", [4, 6], num_tokens=8)
    assert desc is not None
    res = rx.load(wire(desc), [5], first_block=1)
    assert res.loaded and res.nbytes == BLOCK_BYTES
    assert torch.equal(rx.kv_cache[:, :, 5], values[:, :, 1])
    assert (rx.kv_cache[:, :, 4] == -1).all()
    assert res.release is not None
    tx.release(res.release)
    assert tx.pop_freeable(time.time()) == ["r"] and tx.num_pinned_blocks == 0


def test_lease_expiry_frees_an_orphan_and_its_descriptor_is_then_refused(
    made: list[MooncakeConnector], tmp_path: Path
) -> None:
    tx, rx = sender(made, tmp_path, lease_s=5.0), receiver(made, tmp_path)
    fill(tx, [1, 2], seed=3)
    desc = tx.send("orphan", [1, 2], num_tokens=8)
    assert desc is not None
    assert tx.pop_freeable(time.time() + 1.0) == []  # within its lease: still pinned
    assert tx.pop_freeable(time.time() + 6.0) == ["orphan"]
    assert tx.stats().leases_expired == 1 and tx.num_pinned_blocks == 0
    rx.lease_margin_s = -10.0  # look past the deadline: the pin table alone must refuse it
    res = rx.load(wire(desc), [0, 1], 0)
    assert not res.loaded and rx.stats().stale_loads == 1
    assert (rx.kv_cache == -1).all()


def test_descriptor_of_another_generation_is_refused(
    made: list[MooncakeConnector], tmp_path: Path
) -> None:
    """A restarted sender reachable at the same address: the generation word differs."""
    tx, rx = sender(made, tmp_path), receiver(made, tmp_path)
    fill(tx, [3], seed=4)
    desc = tx.send("r", [3], num_tokens=4)
    assert desc is not None
    stale = KVDescriptor(desc.transport, desc.version, desc.num_tokens, desc.nbytes,
                         {**desc.payload, "generation": "0123456789abcdef"})  # fmt: skip
    res = rx.load(wire(stale), [0], 0)
    assert not res.loaded and rx.stats().stale_loads == 1
    assert res.release is not None and res.release.payload["generation"] == "0123456789abcdef"
    tx.release(res.release)  # a notice for another generation frees nothing
    assert tx.num_pinned_blocks == 1
    ok = rx.load(wire(desc), [0], 0)
    assert ok.loaded and ok.release is not None
    tx.release(ok.release)
    assert tx.pop_freeable(time.time()) == ["r"]


def test_pin_lost_during_the_copy_is_refused(
    made: list[MooncakeConnector], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seqlock close: the sender frees the blocks while the receiver is pulling them."""
    tx, rx = sender(made, tmp_path), receiver(made, tmp_path)
    fill(tx, [0, 1], seed=5)
    desc = tx.send("r", [0, 1], num_tokens=8)
    assert desc is not None
    entries = rx._data_entries

    def racing(*args: Any) -> Any:
        assert tx.pop_freeable(time.time() + 3600.0) == ["r"]  # lease ends mid-copy
        return entries(*args)

    monkeypatch.setattr(rx, "_data_entries", racing)
    res = rx.load(wire(desc), [2, 3], 0)
    assert not res.loaded and rx.stats().stale_loads == 1


def test_an_unreachable_sender_is_a_recompute(
    made: list[MooncakeConnector], tmp_path: Path
) -> None:
    tx, rx = sender(made, tmp_path), receiver(made, tmp_path)
    desc = tx.send("r", [0], num_tokens=4)
    assert desc is not None
    gone = KVDescriptor(desc.transport, desc.version, desc.num_tokens, desc.nbytes,
                        {**desc.payload, "segment": "127.0.0.1:1"})  # nobody listens  # fmt: skip
    res = rx.load(wire(gone), [0], 0)
    assert not res.loaded and rx.stats().map_failures == 1 and res.release is not None
    tx.release(res.release)
    assert tx.pop_freeable(time.time()) == ["r"]


def test_make_connector_builds_it_and_fails_loudly_without_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = BatonConfig(
        kv_transport="mooncake", spill_dir=str(tmp_path / "spill"), kv_mooncake_host="127.0.0.1"
    )
    conn = make_connector(config, role="decode")
    assert isinstance(conn, MooncakeConnector) and conn.release_route is None
    conn.close()
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # as if not installed
    with pytest.raises(RuntimeError, match="pip install mooncake-transfer-engine"):
        make_connector(config, role="prefill")
    fallback = make_connector(config, role="prefill", fallback="spill")
    assert isinstance(fallback, FallbackConnector) and fallback.wanted == "mooncake"
