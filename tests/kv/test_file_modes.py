"""KV files on /dev/shm are private: 0600 files, under names nobody can guess, in a directory that
is this user's and 0700 — whatever the umask, and whatever state the directory was found in.

Why it matters: a spill entry or a pool holds other users' KV (their prompts, in effect); a name
someone can guess or a directory someone else can write to lets them read, swap or delete it.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shared.kv_transfer import PoolConnector, ShmConnector
from shared.kv_transfer.shm import private_dir
from tests.kv.helpers import SHAPE, sender


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The laxest umask: modes must come from the code, not from the caller's umask."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_spill_entries(tmp_path: Path, open_umask: None) -> None:
    root = tmp_path / "a" / "spill"
    conn = ShmConnector(root, 1 << 20, orphan_timeout_s=300.0)
    conn.register_kv_cache(torch.randn(SHAPE))
    for i in range(50):
        assert conn.send(f"req-{i}", [0, 1], num_tokens=8) is not None
    names = os.listdir(root)
    assert len(names) == 50 and mode(root) == 0o700
    assert {mode(root / n) for n in names} == {0o600}
    # <request id made safe>-<random>.kv: the random part alone is 128 bits, fresh per entry.
    randoms = [re.fullmatch(r"req-\d+-([0-9a-f]+)\.kv", n).group(1) for n in names]  # type: ignore[union-attr]
    assert all(len(r) * 4 >= 128 for r in randoms) and len(set(randoms)) == len(randoms)


def test_pool_file(tmp_path: Path, open_umask: None) -> None:
    root = tmp_path / "spill"
    pools = [sender(root, worker_id=f"prefill-{i}") for i in range(8)]
    try:
        assert mode(root) == 0o700
        for conn in pools:
            path = root / f"pool-{conn.worker_id}-{conn.generation}"
            assert mode(path) == 0o600
        # The worker id is hostname-pid (guessable); the generation is not, and is per start.
        gens = [p.generation for p in pools]
        assert all(re.fullmatch(r"[0-9a-f]{16,}", g) for g in gens)  # >= 64 random bits
        assert len(set(gens)) == len(gens)
        assert [n for n in os.listdir(root) if n.endswith(".tmp")] == []
    finally:
        for conn in pools:
            conn.close()


@pytest.mark.parametrize("kind", ["shm", "pool"])
def test_an_existing_open_directory_is_made_private(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "spill"
    root.mkdir()
    os.chmod(root, 0o777)
    if kind == "shm":
        ShmConnector(root, 1 << 20, orphan_timeout_s=300.0)
    else:
        PoolConnector(root, "decode-0", export=False)
    assert mode(root) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another user needs root")
@pytest.mark.parametrize("kind", ["shm", "pool"])
def test_a_directory_of_another_user_is_refused(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "theirs"
    root.mkdir()
    os.chmod(root, 0o777)
    os.chown(root, 65534, 65534)  # nobody
    with pytest.raises(PermissionError, match="BATON_SPILL_DIR"):
        if kind == "shm":
            ShmConnector(root, 1 << 20, orphan_timeout_s=300.0)
        else:
            PoolConnector(root, "prefill-0")
    assert mode(root) == 0o777, "never touched"


def test_a_private_subdirectory_of_a_shared_mount_point(tmp_path: Path) -> None:
    """/dev/shm, or a Compose tmpfs volume, is world-writable (sticky): Baton's directory is a
    subdirectory of it, created 0700."""
    shared = tmp_path / "shm"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    assert mode(private_dir(shared / "kv")) == 0o700
    assert mode(shared) == 0o1777
