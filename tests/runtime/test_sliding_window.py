"""Sliding windows in the runtime: per-layer windows from the config, every CPU attention path
(torch, the C kernels, int8) against an fp64 reference with the blocks before each window
released (null entries, read as a block of NaNs), the block manager's releases, and the
engines holding and handing off only the window's blocks. Greedy parity with transformers:
tests/test_parity.py (mistral-w48, qwen2-w48) and tests/integration/test_sliding_window.py."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.cpu.paged_decode_attention import DecodeKernel, load_kernel
from kernels.cpu.prefill_attention import PrefillKernel, load_prefill_kernel
from shared.runtime import BlockManager, ModelConfig, SamplingParams, Sequence
from shared.runtime.attention import FLOAT_KV, TorchAttentionBackend
from shared.runtime.block_manager import NULL_BLOCK
from shared.runtime.kv_codec import Int8KV
from tests.runtime.helpers import EnginePair, greedy, tiny_model_dir

CPU = torch.device("cpu")
BS, D = 16, 32
BASE = {
    "architectures": ["MistralForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
}


def test_layer_windows_as_transformers_applies_them() -> None:
    def windows(**raw: Any) -> tuple[int | None, ...]:
        return ModelConfig.from_dict({**BASE, **raw}).layer_windows

    assert windows(sliding_window=48) == (48,) * 4
    assert windows(sliding_window=None) == (None,) * 4
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}
    assert windows(**qwen2, use_sliding_window=True, max_window_layers=3) == (None,) * 3 + (64,)
    assert windows(**qwen2, use_sliding_window=False, max_window_layers=0) == (None,) * 4
    types = ["sliding_attention", "full_attention"] * 2
    assert windows(**qwen2, layer_types=types) == (64, None, 64, None)
    cfg = ModelConfig.from_dict({**BASE, "sliding_window": 48})
    assert cfg.kv_window == cfg.sliding_window == 48
    hybrid = ModelConfig.from_dict({**BASE, **qwen2, "layer_types": types})
    assert hybrid.sliding_window == 64 and hybrid.kv_window is None  # full layers keep all
    assert ModelConfig.from_dir(tiny_model_dir("qwen2", window=48)).layer_windows == (None, 48)


# --- attention ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decode_kernel(tmp_path_factory: pytest.TempPathFactory) -> DecodeKernel | None:
    return load_kernel(tmp_path_factory.mktemp("kernels"), max_threads=1)


@pytest.fixture(scope="module")
def prefill_kernel(tmp_path_factory: pytest.TempPathFactory) -> PrefillKernel | None:
    return load_prefill_kernel(tmp_path_factory.mktemp("kernels"), max_threads=1)


def _released_tables(
    lens: list[int], firsts: list[int], num_blocks: int, rng: random.Random
) -> list[list[int]]:
    """Scattered blocks 1.. per sequence; entries wholly before ``first`` are null."""
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables = []
    for n, first in zip(lens, firsts, strict=True):
        need = -(-n // BS)
        table, ids = ids[:need], ids[need:]
        tables.append([NULL_BLOCK] * (first // BS) + table[first // BS :])
    return tables


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int], window: int
) -> torch.Tensor:
    """fp64 attention of each query (at position q_pos[i]) over k/v rows 0..its position, within
    ``window``; k/v ``[n, Hkv, D]`` of one sequence."""
    group = q.shape[1] // k.shape[1]
    out = []
    for qi, p in zip(q, q_pos, strict=True):
        lo = max(0, p - window + 1)
        ks = k[lo : p + 1].double().repeat_interleave(group, 1)
        vs = v[lo : p + 1].double().repeat_interleave(group, 1)
        probs = (torch.einsum("hd,nhd->hn", qi.double(), ks) * D**-0.5).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", probs, vs))
    return torch.stack(out)


def _pool(num_blocks: int, hkv: int, g: torch.Generator) -> torch.Tensor:
    pool = torch.randn(2, num_blocks, BS, hkv, D, generator=g)
    pool[:, 0] = float("nan")  # block 0 stands for every released block (null entries read it)
    return pool


def _seq_kv(pool: torch.Tensor, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = [table[p // BS] * BS + p % BS for p in range(n)]
    flat = pool.flatten(1, 2)
    return flat[0, slots], flat[1, slots]


@pytest.mark.parametrize("path", ["torch", "c", "int8"])
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_decode_attends_to_the_window_only(
    path: str, window: int, decode_kernel: DecodeKernel | None
) -> None:
    if path == "c" and decode_kernel is None:
        pytest.skip("no C compiler")
    rng, g = random.Random(window), torch.Generator().manual_seed(window)
    lens = [1, window, window + 1, BS + 3, 70, 129]
    firsts = [max(0, n - window) for n in lens]
    pool = _pool(40, 2, g)
    tables = _released_tables(lens, firsts, 40, rng)
    q = torch.randn(len(lens), 4, D, generator=g)
    k, v = torch.randn(2, len(lens), 2, D, generator=g)
    slots = [t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens, strict=True)]
    codec = Int8KV() if path == "int8" else None
    layer = codec.encode(pool) if codec else pool.clone()
    kernel = decode_kernel if path == "c" else None
    backend = TorchAttentionBackend(
        40, BS, 2, D**-0.5, CPU, codec or FLOAT_KV, decode_kernel=kernel
    )
    got = backend.decode_metadata(slots, tables, lens).forward(q, k, v, layer, window)
    assert not got.isnan().any()
    stored = codec.decode(layer, torch.float32) if codec else layer
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        ks, vs = _seq_kv(stored, table, n)
        want = _reference(q[i : i + 1], ks, vs, [n - 1], window)
        torch.testing.assert_close(got[i : i + 1].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["sdpa", "c"])
@pytest.mark.parametrize("window", [1, 9, 48])
def test_prefill_attends_to_the_window_only(
    path: str, window: int, prefill_kernel: PrefillKernel | None
) -> None:
    """A fresh 100-token prompt (C kernel or SDPA with a windowed mask) and a 20-token chunk
    after 70 cached tokens whose blocks before the chunk's window were released (SDPA)."""
    if path == "c" and prefill_kernel is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(window)
    pool = _pool(24, 2, g)
    fresh_table = list(range(1, 8))  # 100 tokens
    chunk_first = max(0, 70 - window + 1)
    chunk_table = [NULL_BLOCK] * (chunk_first // BS) + list(range(8 + chunk_first // BS, 14))
    tables = [fresh_table, chunk_table]
    slots = [p for p in range(BS, BS + 100)] + [(8 + p // BS) * BS + p % BS for p in range(70, 90)]
    q = torch.randn(120, 4, D, generator=g)
    k, v = torch.randn(2, 120, 2, D, generator=g)
    backend = TorchAttentionBackend(
        24, BS, 2, D**-0.5, CPU, prefill_kernel=prefill_kernel if path == "c" else None
    )
    meta = backend.prefill_metadata(slots, tables, [100, 20], [100, 90])
    layer = pool.clone()
    got = meta.forward(q, k, v, layer, window)
    assert not got.isnan().any()
    want = _reference(q[:100], k[:100], v[:100], list(range(100)), window)
    torch.testing.assert_close(got[:100].double(), want, atol=1e-5, rtol=1e-5)
    ks, vs = _seq_kv(layer, [0] * (chunk_first // BS) + chunk_table[chunk_first // BS :], 90)
    want = _reference(q[100:], ks, vs, list(range(70, 90)), window)
    torch.testing.assert_close(got[100:].double(), want, atol=1e-5, rtol=1e-5)


# --- blocks ------------------------------------------------------------------------------------
def test_blocks_outside_the_window_are_released_after_publishing() -> None:
    bm = BlockManager(16, BS, kv_window=20)
    seq = Sequence("a", list(range(100)), SamplingParams(), block_size=BS)
    bm.allocate(seq)
    assert len(seq.block_table) == 7 and bm.num_free_blocks == 9
    seq.num_computed_tokens = 64  # the next query (position 64) sees 45..64: blocks 2..
    bm.cache_computed_blocks(seq)
    assert seq.block_table[:2] == [NULL_BLOCK] * 2 and NULL_BLOCK not in seq.block_table[2:]
    assert bm.num_free_blocks == 11 and bm.num_cached_free_blocks == 2  # still prefix hits
    assert bm.live_blocks(seq, 64) == (2, seq.block_table[2:4])
    assert bm.num_freeable_blocks(seq) == 5
    other = Sequence("b", list(range(40)), SamplingParams(), block_size=BS)
    bm.allocate(other)
    assert other.num_cached_tokens == 2 * BS  # the released, published blocks were hits
    bm.free(seq)
    bm.free(other)
    assert bm.num_free_blocks == 16
    full = BlockManager(16, BS)  # a model with a full-attention layer releases nothing
    seq2 = Sequence("c", list(range(100)), SamplingParams(), block_size=BS)
    full.allocate(seq2)
    seq2.num_computed_tokens = 99
    full.cache_computed_blocks(seq2)
    assert NULL_BLOCK not in seq2.block_table


def test_engines_hold_and_hand_off_only_the_window(tmp_path: Path) -> None:
    """A 250-token prompt on a 48-token window: prefill sends the window's 4 blocks (from block
    12) and decode, generating 100 tokens, holds at most 5 blocks once the first step ran (its
    admission allocates the whole prompt for a moment: a failed load recomputes in place)."""
    model = tiny_model_dir("mistral", window=48)
    prompt = [random.Random(0).randrange(3, 512) for _ in range(250)]
    with EnginePair.build(model, tmp_path / "spill") as pair:
        pair.add("long", prompt, greedy(100, ignore_eos=True))
        held: list[int] = []
        while pair.prefill.has_work() or pair.decode.has_work():
            pair.step()
            held.append(pair.decode.block_manager.num_used_blocks)
        desc = pair.handoffs["long"].kv
        assert desc is not None and desc.first_block == (250 - 48 + 1) // BS == 12
        assert desc.nbytes == 4 * pair.prefill.runner.block_bytes
        assert max(held[1:]) <= 5 and len(pair.tokens["long"]) == 100
        pair.assert_clean()
