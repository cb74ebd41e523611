"""Layer-wise handoff over ``mooncake`` (shared/kv_transfer/layerwise.py): two connectors in one
process over loopback TCP. The receiver pulls each layer once the sender's progress record says
it is written — before the later layers are — and ends with the first token; a prompt that
ended at prefill, failed or was cancelled leaves its blocks unread and pinned until released.
The engines over it: tests/engine/test_layerwise.py."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shared.kv_transfer.layerwise import FAILED, FINISHED, READY, Progress
from tests.kv.helpers import BLOCK_SIZE, SHAPE, wire

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
from shared.kv_transfer.mooncake import MooncakeConnector  # noqa: E402


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[MooncakeConnector, MooncakeConnector]]:
    tx = MooncakeConnector(str(tmp_path / "tx"), "prefill-0", host="127.0.0.1")
    rx = MooncakeConnector(str(tmp_path / "rx"), "decode-0", export=False, host="127.0.0.1")
    kv = tx.allocate_kv_cache(SHAPE, torch.float32, torch.device("cpu"))
    assert kv is not None
    tx.register_kv_cache(kv)
    rx.register_kv_cache(torch.full(SHAPE, -1.0))
    yield tx, rx
    rx.close()
    tx.close()


def _until(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_progress_words_round_trip() -> None:
    p = Progress(48, 112, 3)
    assert Progress.of(p.word()) == p
    assert (p.ready(2), p.ready(3)) == (112, 48)
    with pytest.raises(ValueError, match="fit"):
        Progress(0, 1 << 24, 0).word()


def test_each_layer_lands_as_it_is_written(
    pair: tuple[MooncakeConnector, MooncakeConnector],
) -> None:
    """Two chunks of a 14-token prompt over 4 blocks, layer by layer: the receiver holds layer 0
    of a chunk while layer 1 is still unwritten, and the whole prompt with the first token at
    the end; the pins hold until its release."""
    tx, rx = pair
    blocks, dst = [5, 2, 3, 7], [6, 0, 1, 4]
    tx.kv_cache[:, :, blocks] = 0.0
    desc = tx.announce("r", blocks, num_tokens=14, num_computed=0)
    assert desc is not None and desc.payload["layerwise"] and tx.num_pinned_blocks == 4
    load = rx.start_load(wire(desc), dst, 0)
    g = torch.Generator().manual_seed(0)
    values = torch.randn((*SHAPE[:2], 4, *SHAPE[3:]), generator=g)
    for upto in (8, 14):  # chunk 1: blocks 0-1, chunk 2: blocks 2-3
        tx.stream_chunk("r", upto)
        ids = range((upto - 8) // BLOCK_SIZE if upto > 8 else 0, -(-upto // BLOCK_SIZE))
        for layer in range(SHAPE[0]):
            tx.kv_cache[layer, :, [blocks[i] for i in ids]] = values[layer, :, list(ids)]
            tx.stream_layer("r", layer + 1)
            got = rx.kv_cache[layer, :, [dst[i] for i in ids]]
            _until(lambda got=got, layer=layer, ids=ids: torch.equal(
                rx.kv_cache[layer, :, [dst[i] for i in ids]], values[layer, :, list(ids)]
            ))  # fmt: skip
            if layer + 1 < SHAPE[0]:  # the next layer of this chunk is not there yet
                assert not torch.equal(
                    rx.kv_cache[layer + 1, :, [dst[i] for i in ids]],
                    values[layer + 1, :, list(ids)],
                )
    assert not load.done.is_set()  # no first token yet
    tx.stream_end("r", READY, first_token=321)
    assert load.done.wait(10)
    assert load.result.loaded and load.state == READY and load.first_token == 321
    assert torch.equal(rx.kv_cache[:, :, dst], values)
    assert tx.num_pinned_blocks == 4 and load.result.release is not None
    tx.release(load.result.release)
    assert tx.pop_freeable(time.time()) == ["r"] and tx.num_pinned_blocks == 0


@pytest.mark.parametrize("state", [FINISHED, FAILED])
def test_a_prompt_that_ends_at_prefill_is_not_loaded(
    pair: tuple[MooncakeConnector, MooncakeConnector], state: int
) -> None:
    tx, rx = pair
    desc = tx.announce("r", [1, 2], num_tokens=8, num_computed=0)
    assert desc is not None
    load = rx.start_load(wire(desc), [3, 4], 0)
    tx.stream_chunk("r", 8)
    tx.stream_layer("r", 1)
    tx.stream_end("r", state, first_token=7)
    assert load.done.wait(10) and load.state == state and not load.result.loaded
    assert tx.num_pinned_blocks == 2  # until the receiver's release
    assert load.result.release is not None
    tx.release(load.result.release)
    assert tx.pop_freeable(time.time()) == ["r"]


def test_cancel_stops_the_pull_before_returning(
    pair: tuple[MooncakeConnector, MooncakeConnector],
) -> None:
    tx, rx = pair
    desc = tx.announce("r", [1], num_tokens=4, num_computed=0)
    assert desc is not None
    load = rx.start_load(wire(desc), [2], 0)
    load.cancel()
    assert load.done.is_set() and not load.result.loaded
    assert load.thread is not None and not load.thread.is_alive()


def test_a_cached_prefix_is_ready_from_the_start(
    pair: tuple[MooncakeConnector, MooncakeConnector],
) -> None:
    """Positions computed before the announce (a prefix hit) are pulled at once, in every
    layer; the receiver skips the blocks it holds already."""
    tx, rx = pair
    values = torch.randn((*SHAPE[:2], 3, *SHAPE[3:]))
    tx.kv_cache[:, :, [4, 5, 6]] = values
    desc = tx.announce("r", [4, 5, 6], num_tokens=10, num_computed=8)
    assert desc is not None
    load = rx.start_load(wire(desc), [1, 2], 1)  # block 0 was a prefix hit here
    _until(lambda: torch.equal(rx.kv_cache[:, :, 1], values[:, :, 1]))
    tx.stream_chunk("r", 10)
    for layer in range(SHAPE[0]):
        tx.stream_layer("r", layer + 1)
    tx.stream_end("r", READY, 9)
    assert load.done.wait(10) and load.result.loaded
    assert torch.equal(rx.kv_cache[:, :, [1, 2]], values[:, :, 1:])
    assert (rx.kv_cache[:, :, 0] == -1).all()
    assert load.result.release is not None
    tx.release(load.result.release)
