"""ModelRunner: KV sizing, chunked prefill contract, seeded sampling and bf16 through the
engines (sliding windows: tests/runtime/test_sliding_window.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels.cpu import cpu_isa
from shared.config import BatonConfig
from shared.runtime import BlockManager, ModelRunner, SamplingParams, Sequence
from tests.runtime.helpers import EnginePair, make_runner, tiny_model_dir, torch_threads


@pytest.fixture(scope="module")
def runner() -> Iterator[ModelRunner]:
    with torch_threads(1):
        yield make_runner(tiny_model_dir("llama"), num_kv_blocks=64)


def test_kv_cache_sized_from_megabytes() -> None:
    r = ModelRunner(BatonConfig(model=str(tiny_model_dir("llama")), kv_cache_mb=1))
    cfg = r.model_config
    per_block = cfg.num_layers * 2 * r.block_size * cfg.num_kv_heads * cfg.head_dim * 4
    assert r.num_kv_blocks == (1 << 20) // per_block
    assert r.kv_cache.shape == (
        cfg.num_layers,
        2,
        r.num_kv_blocks,
        r.block_size,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    assert cfg.eos_token_ids and cfg.arch == "llama"


def test_chunked_prefill_samples_only_at_the_end_and_leaves_seqs_alone(runner: ModelRunner) -> None:
    bm = BlockManager(runner.num_kv_blocks, runner.block_size)
    prompt = list(range(3, 43))
    whole, chunked = (
        Sequence("w", prompt, SamplingParams()),
        Sequence("c", prompt, SamplingParams()),
    )
    bm.allocate(whole)
    bm.allocate(chunked)
    with torch_threads(1):
        assert runner.prefill([chunked], [25]) == [None]
        assert chunked.num_computed_tokens == 0 and chunked.num_tokens == 40  # untouched
        chunked.num_computed_tokens = 25
        # The rest of the chunked one batched with the whole prompt of the other.
        tokens = runner.prefill([chunked, whole], [15, 40])
    assert tokens[0] is not None and tokens[0] == tokens[1]
    with pytest.raises(ValueError):
        runner.prefill([whole], [41])  # past the end of the sequence


def _sample(tmp_path: Path, seed: int, companions: int = 0) -> list[int]:
    """A sampled request through the production engines, alone or with others in its batches."""
    pair = EnginePair.build(tiny_model_dir("llama"), tmp_path / f"spill-{seed}-{companions}")
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=seed, max_tokens=24)
    for i in range(companions):
        pair.add(f"other{i}", list(range(10 + i, 40 + 3 * i)), SamplingParams(max_tokens=30))
    pair.add("s", list(range(100, 120)), params)
    out = pair.run()["s"]
    pair.assert_clean()
    return out


def test_same_seed_same_sample_different_seed_different(tmp_path: Path) -> None:
    first = _sample(tmp_path, seed=1234)
    assert len(first) == 24
    assert _sample(tmp_path, seed=1234) == first
    assert _sample(tmp_path, seed=1234, companions=3) == first  # independent of the batch
    others = [_sample(tmp_path, seed=s) for s in (1, 2, 3)]
    assert all(o != first for o in others)
    greedy = EnginePair.build(tiny_model_dir("llama"), tmp_path / "greedy")
    greedy.add("g", list(range(100, 120)), SamplingParams(max_tokens=24))
    assert greedy.run()["g"] != first  # sampling really sampled


def test_bfloat16_through_both_engines(tmp_path: Path) -> None:
    """bf16 caches in both engines: the KV crosses the spill store as bf16 bytes. On a CPU
    without bf16 instructions a bf16 request computes in fp32 (loader.resolve_dtype), caches
    and handoff included."""
    want = torch.bfloat16 if cpu_isa.computes_bf16() else torch.float32
    bf16 = {"dtype": "bfloat16"}
    pair = EnginePair.build(tiny_model_dir("qwen2"), tmp_path, prefill=bf16, decode=bf16)
    assert pair.prefill.runner.kv_cache.dtype == want
    assert pair.decode.runner.kv_cache.dtype == want
    pair.add("b", list(range(5, 30)), SamplingParams(max_tokens=5, ignore_eos=True))
    out = pair.run()["b"]
    kv = pair.handoffs["b"].kv
    assert kv is not None and kv.payload["dtype"] == str(want).removeprefix("torch.")
    assert not pair.decode_log.prefills  # loaded, not recomputed
    assert len(out) == 5 and all(0 <= t < 512 for t in out)
    pair.assert_clean()
