"""The spill store (ShmConnector): 0600 files, an O(1) capacity check, only its own files."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
import torch

from shared.kv_transfer import ShmConnector
from tests.kv.helpers import SHAPE

ENTRY_BYTES = 2 * 2 * 2 * 4 * 2 * 8 * 4  # two blocks


def store(root: Path, max_bytes: int = 1 << 20) -> ShmConnector:
    conn = ShmConnector(root, max_bytes, orphan_timeout_s=300.0)
    conn.register_kv_cache(torch.randn(SHAPE))
    return conn


def test_entries_are_0600_with_unguessable_names(tmp_path: Path) -> None:
    conn = store(tmp_path / "spill")
    desc = conn.send("req/../1", [0, 1], num_tokens=8)
    assert desc is not None
    (entry,) = os.listdir(conn.root)
    assert stat.S_IMODE(os.stat(conn.root / entry).st_mode) == 0o600
    assert "/" not in entry and len(entry) > 32  # the request id made safe + a uuid4
    assert stat.S_IMODE(os.stat(conn.root).st_mode) == 0o700


def test_capacity_is_refused_without_scanning_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = store(tmp_path / "spill", max_bytes=ENTRY_BYTES * 3 // 2)

    def no_scan(path: object) -> None:
        raise AssertionError("send scanned the spill folder")

    monkeypatch.setattr(os, "scandir", no_scan)
    assert conn.send("a", [0, 1], 8) is not None
    assert conn.send("b", [2, 3], 8) is None  # full: refused from the running count
    assert conn.pop_freeable(conn._synced_at) == ["a"]  # no resync within the interval
    monkeypatch.undo()
    assert conn.used_bytes() == ENTRY_BYTES


def test_the_estimate_is_resynced_after_receivers_consume(tmp_path: Path) -> None:
    root = tmp_path / "spill"
    tx, rx = store(root, max_bytes=ENTRY_BYTES * 3 // 2), store(root)
    desc = tx.send("a", [0, 1], 8)
    assert desc is not None and tx.send("b", [0, 1], 8) is None
    assert rx.load(desc, [4, 5], 0).loaded  # the entry is gone; the sender does not know yet
    assert tx.send("b", [0, 1], 8) is None  # the estimate errs high: an early refusal
    tx.pop_freeable(time.time() + tx.resync_interval_s)  # the periodic resync
    assert tx.send("b", [0, 1], 8) is not None


def test_housekeeping_touches_only_spill_entries(tmp_path: Path) -> None:
    conn = store(tmp_path / "spill")
    pool = conn.root / "pool-prefill-0-abc"
    pool.write_bytes(b"\0" * 4096)
    os.utime(pool, (0, 0))  # old, as a long-lived pool's mtime is
    assert conn.used_bytes() == 0
    assert conn.send("a", [0], 4) is not None
    assert conn.reclaim_orphans(time.time() + 1000) == 1  # the orphaned entry, not the pool
    assert os.listdir(conn.root) == [pool.name]


def test_unclaimed_entries_are_reclaimed_and_counted(tmp_path: Path) -> None:
    conn = ShmConnector(tmp_path / "spill", 1 << 20, orphan_timeout_s=5.0)
    conn.register_kv_cache(torch.randn(SHAPE))
    assert conn.send("a", [0, 1], 8) is not None and conn.send("b", [2, 3], 8) is not None
    assert conn.reclaim_orphans(time.time()) == 0  # young: a receiver may still take them
    assert conn.reclaim_orphans(time.time() + 10) == 2
    assert conn.reclaimed() == {("spill_entries", "unclaimed"): 2}
    assert os.listdir(conn.root) == []
