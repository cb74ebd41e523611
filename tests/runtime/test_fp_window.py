"""int8 KV with a full-precision window (shared/runtime/fp_window.py): the slot layout, the block
manager's slots (taken with the window's blocks, released block by block as they age), the C
and torch decode paths against an fp64 reference, and the engines: within the window int8
computes exactly what fp32 does (chunked prefill, handoffs over both CPU transports). The
agreement figures beyond the window: python -m loadtest kv-dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.cpu.paged_decode_int8 import load_int8_kernel
from shared.config import BatonConfig
from shared.runtime import BlockManager, ModelRunner, SamplingParams, Sequence
from shared.runtime.attention import TorchAttentionBackend
from shared.runtime.block_manager import NULL_BLOCK
from shared.runtime.fp_window import FpWindow, fp_batch
from shared.runtime.kv_codec import Int8KV
from tests.runtime.helpers import KV_TRANSPORTS, EnginePair, greedy, tiny_model_dir

CPU = torch.device("cpu")
BS, HKV, D = 16, 2, 32


def test_slot_layout() -> None:
    assert FpWindow.plan(0, BS, D, torch.float32) is None
    fp32 = FpWindow.plan(128, BS, D, torch.float32)
    assert fp32 is not None and (fp32.slots_per_block, fp32.sub_block) == (4, 4)
    bf16 = FpWindow.plan(128, BS, 128, torch.bfloat16)
    assert bf16 is not None and bf16.slots_per_block == 2
    with pytest.raises(ValueError, match="divisible by 4"):
        FpWindow.plan(128, 2, D, torch.float32)
    pool = torch.zeros(2, 6, BS, HKV, D + 4, dtype=torch.int8)
    view = fp32.view(pool)
    assert view.shape == (2, 6, 4, HKV, D) and view.dtype == torch.float32
    batch = fp_batch(fp32, [(0, 6)], [0], [[5, 2]], CPU)  # positions 0-3 in slot 5, 4-5 in 2
    k, v = torch.randn(2, 6, HKV, D)
    batch.store(view, k, v)  # strided slots: written in place
    assert torch.equal(view[0, 5], k[:4]) and torch.equal(view[1, 2, :2], v[4:])
    assert pool[:, [0, 1, 3, 4]].count_nonzero() == 0


def test_slots_follow_the_window_block_by_block() -> None:
    bm = BlockManager(64, BS, fp_window=40, fp_slots_per_block=4)
    seq = Sequence("a", list(range(100)), SamplingParams(), block_size=BS)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    # Positions 60..99 are the window: blocks 3..6 (whole blocks), 4 slots each.
    assert seq.fp_first_block == 3 and len(seq.fp_blocks) == 16
    assert bm.num_used_blocks == 7 + 16 and bm.fp_slots(seq, 100) == seq.fp_blocks
    assert bm.fp_slots(seq, 80) == seq.fp_blocks[:8]  # blocks 3 and 4 hold positions < 80
    seq.num_computed_tokens = 100
    for _ in range(13):  # decode up to 113 tokens: block 3 (48..63) leaves the window at 104
        seq.append_token(1)
        bm.append_slot(seq)
        bm.cache_computed_blocks(seq)
        seq.num_computed_tokens = seq.num_tokens - 1
    assert seq.fp_first_block == 4 and len(seq.fp_blocks) == 4 * (8 - 4)
    assert bm.num_freeable_blocks(seq) == 8 + 16
    other = Sequence("b", list(range(100)) + [7], SamplingParams(), block_size=BS)
    bm.allocate(other)  # a prefix hit stops before its own window: blocks 0..2 only
    assert other.num_cached_tokens == 3 * BS
    bm.free(seq)
    bm.free(other)
    assert bm.num_free_blocks == 64 and not seq.fp_blocks


def test_a_sliding_window_releases_the_slots_of_released_blocks() -> None:
    bm = BlockManager(64, BS, kv_window=20, fp_window=100, fp_slots_per_block=2)
    seq = Sequence("a", list(range(70)), SamplingParams(), block_size=BS)
    bm.allocate(seq)
    assert seq.fp_first_block == 0 and len(seq.fp_blocks) == 10
    seq.num_computed_tokens = 70
    bm.cache_computed_blocks(seq)  # the next query sees 51..70: blocks 0-2 released
    assert seq.block_table[:3] == [NULL_BLOCK] * 3
    assert seq.fp_first_block == 3 and len(seq.fp_blocks) == 4


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_decode_reads_int8_rows_then_the_window(window: int | None, use_kernel: bool) -> None:
    kernel = load_int8_kernel(max_threads=1) if use_kernel else None
    if use_kernel and kernel is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(3)
    codec, fp = Int8KV(), FpWindow.plan(24, BS, D, torch.float32)
    assert fp is not None
    lens, firsts = [3, 30, 75], [0, 0, 3]  # the windows: from 0, 0 and 48
    tables = [[1], [2, 3], [4, 5, 6, 7, 8]]
    slots = [[9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23, 24, 25, 26, 27, 28]]
    pool = codec.encode(torch.randn(2, 30, BS, HKV, D, generator=g))
    view = fp.view(pool)
    view.copy_(torch.randn(view.shape, generator=g))
    q = torch.randn(3, 4, D, generator=g)
    k, v = torch.randn(2, 3, HKV, D, generator=g)
    new = [t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens, strict=True)]
    batch = fp_batch(fp, [(n - 1, n) for n in lens], firsts, slots, CPU)
    backend = TorchAttentionBackend(
        30, BS, HKV, D**-0.5, CPU, codec, fp_window=fp, int8_kernel=kernel
    )
    got = backend.decode_metadata(new, tables, lens, batch).forward(q, k, v, pool, window)
    for i, (table, n, first) in enumerate(zip(tables, lens, firsts, strict=True)):
        pos = torch.arange(n)
        rows = codec.decode(pool[:, table], torch.float64).flatten(1, 2)[:, :n]
        rel = pos[first * BS :] - first * BS
        rows[:, first * BS :] = view[:, torch.tensor(slots[i])[rel // 4], rel % 4].double()
        lo = 0 if window is None else max(0, n - window)
        ks, vs = (x.repeat_interleave(2, 1) for x in rows[:, lo:])
        probs = (torch.einsum("hd,nhd->hn", q[i].double(), ks) * D**-0.5).softmax(-1)
        want = torch.einsum("hn,nhd->hd", probs, vs)
        torch.testing.assert_close(got[i].double(), want, atol=1e-5, rtol=1e-5)


def _run(model: Path, spill: Path, transport: str, prompts: dict[str, list[int]], **kw: object):  # type: ignore[no-untyped-def]
    with EnginePair.build(model, spill, transport=transport, prefill=kw, decode=kw) as pair:
        for name, prompt in prompts.items():
            pair.add(name, prompt, greedy(40, ignore_eos=True))
        out = pair.run()
        pair.assert_clean()
        return out, pair.handoffs


PROMPTS = {f"p{n}": [(11 * n + 7 * j) % 500 + 3 for j in range(n)] for n in (5, 40, 77, 200)}


@pytest.mark.parametrize("transport", KV_TRANSPORTS)
def test_within_the_window_int8_computes_what_fp32_does(tmp_path: Path, transport: str) -> None:
    """A 256-token window holds every prompt and output here whole: the same tokens as fp32,
    with prompts chunked over 64-token prefill steps (a chunk reads the earlier ones from the
    slots) and every handoff carrying its window's slots."""
    model = tiny_model_dir("llama")
    chunked = {"max_num_batched_tokens": 64}
    fp32, _ = _run(model, tmp_path / "fp32", transport, PROMPTS, **chunked)
    int8, handoffs = _run(
        model, tmp_path / "int8", transport, PROMPTS,
        kv_cache_dtype="int8", kv_fp_window=256, **chunked,
    )  # fmt: skip
    assert int8 == fp32
    desc = handoffs["p200"].kv
    assert desc is not None and desc.fp_first_block == 0 and desc.fp_slots == 13 * 4


def test_a_host_tier_is_refused_beside_the_window() -> None:
    def runner(fp_window: int) -> ModelRunner:
        config = BatonConfig(
            model=str(tiny_model_dir("llama")),
            num_kv_blocks=64,
            kv_cache_dtype="int8",
            kv_fp_window=fp_window,
        )
        return ModelRunner(config, kv_host_cache_bytes=1 << 20)

    with pytest.raises(ValueError, match="BATON_KV_FP_WINDOW=0"):
        runner(128)
    assert runner(0).host_tier is not None
