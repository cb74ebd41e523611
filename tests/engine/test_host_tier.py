"""Decode with a host tier of the KV cache (``BATON_KV_HOST_CACHE_MB``, shared/runtime/kv_tiers.py),
built as the service builds it and wired as in test_swap_preemption.py: sequences that outgrow
the device pool run from host blocks instead of being preempted, and a sequence holding host
blocks swaps out and in (the transports see only device blocks: staging carries the rest).
Every completion equals Hugging Face's greedy output (on a GPU, where the engines run the Triton
kernels on CUDA and the host tier is pinned memory: the same engines' output without a tier)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shared.config import BatonConfig
from shared.engine.build import build_decode_engine, build_prefill_engine
from shared.engine.decode import DecodeEngine
from shared.engine.engine import EngineCore
from shared.engine.outputs import StepOutput
from tests.engine.test_swap_preemption import (
    MAX_TOKENS,
    PROMPTS,
    Wiring,
    hf_completions,
    run_ring,
)
from tests.runtime.helpers import EnginePair, ForwardLog, engine_config, greedy

BLOCK_BYTES = 8192  # the tiny llama: 2 layers x K,V x 16 tokens x 2 heads x 16 dims x fp32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def expected(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    if DEVICE == "cuda":  # tf32 dots in the kernels: compare with the same engines, no tier
        config = engine_config(model_dir, 64, spill_dir=str(tmp_path_factory.mktemp("ref")))
        plain = serve(
            model_dir, [build_decode_engine(config.replace(device=DEVICE), model_dir)], config
        )
        return plain.completions()
    return hf_completions(model_dir, PROMPTS, [MAX_TOKENS] * len(PROMPTS))


def watch_host_blocks(engine: EngineCore) -> Callable[[], int]:
    """Wraps ``engine.step``; the returned function gives the most host-tier blocks in use that
    any step's load reported (``EngineLoad``, what the metrics read)."""
    most = [0]
    step = engine.step

    def watched(now: float | None = None) -> StepOutput:
        out = step(now)
        most[0] = max(most[0], out.load.num_host_blocks_used)
        return out

    engine.step = watched  # type: ignore[method-assign]
    return lambda: most[0]


def serve(model_dir: Path, decoders: list[DecodeEngine], config: BatonConfig) -> Wiring:
    """Prefill hands off to the first decoder; what one swaps out goes to the next."""
    prefill = build_prefill_engine(config.replace(num_kv_blocks=64, device=DEVICE), model_dir)
    return run_ring(prefill, decoders)


def test_sequences_beyond_the_device_pool_run_from_the_host_tier(
    model_dir: Path, tmp_path: Path, expected: list[list[int]]
) -> None:
    """10 device blocks (5 pool, 5 staging) for four sequences of 4-5 blocks each: without the
    tier decode would swap (test_swap_preemption.py); with it nothing is preempted."""
    config = engine_config(
        model_dir, 10, spill_dir=str(tmp_path / "spill"), kv_host_cache_mb=1, device=DEVICE
    )
    decode = build_decode_engine(config, model_dir)
    tier = decode.runner.host_tier
    assert tier is not None and decode.runner.tiers.num_host_blocks == (1 << 20) // BLOCK_BYTES
    assert tier.host_cache.is_pinned() == (DEVICE == "cuda")
    log = ForwardLog(decode.runner)
    most_on_host = watch_host_blocks(decode)
    wiring = serve(model_dir, [decode], config)
    assert decode.scheduler.num_swaps == 0 and decode.scheduler.num_preemptions == 0
    assert log.prefills == []  # every prompt's KV was loaded (into host blocks too), none rebuilt
    assert most_on_host() >= 8 and tier.num_staged_blocks > 0 and tier.num_written_back_blocks > 0
    assert decode.block_manager.num_used_blocks == 0
    assert wiring.completions() == expected


def test_a_sequence_holding_host_blocks_swaps_out_and_in(
    model_dir: Path, tmp_path: Path, expected: list[list[int]]
) -> None:
    """A: 5 device + 6 host blocks, too few for the batch: it swaps out sequences that hold host
    blocks (read through staging). B: 5 device blocks and a host tier: it loads what A swapped
    into host blocks (written through staging) and hands back what it swaps in turn."""
    # Admission on the current size (no projected growth): B must fill its device blocks and
    # spill into host ones, which is what this test is about.
    config = engine_config(
        model_dir, 10, spill_dir=str(tmp_path / "spill"), device=DEVICE,
        decode_admit_lookahead_tokens=0,
    )  # fmt: skip
    decode_a = build_decode_engine(config, model_dir, kv_host_cache_bytes=6 * BLOCK_BYTES)
    decode_b = build_decode_engine(config, model_dir, kv_host_cache_bytes=64 * BLOCK_BYTES)
    logs = ForwardLog(decode_a.runner), ForwardLog(decode_b.runner)
    tiers = [e.runner.host_tier for e in (decode_a, decode_b)]
    assert tiers[0] is not None and tiers[1] is not None
    wiring = serve(model_dir, [decode_a, decode_b], config)
    assert decode_a.scheduler.num_swaps > 0 and decode_b.num_swaps_in > 0
    for engine, log in zip((decode_a, decode_b), logs, strict=True):
        assert engine.scheduler.num_preemptions == 0 and log.prefills == []
        assert engine.block_manager.num_used_blocks == 0
    assert tiers[0].num_staged_blocks > 0 and tiers[1].num_written_back_blocks > 0
    assert not list((tmp_path / "spill").rglob("*.kv"))
    assert wiring.completions() == expected


@pytest.mark.parametrize("transport", ["shm", "pool"] if DEVICE == "cpu" else ["shm"])
def test_prefill_chunks_long_prompts_through_its_host_tier(
    model_dir: Path, tmp_path: Path, transport: str
) -> None:
    """Prefill with 16 device blocks (8 pool, 8 staging) and a host tier, a 32-token budget:
    prompts of 40-120 tokens are chunked over blocks of both tiers and handed off. The spill
    store copies what it sends; a pooled transport (decode maps prefill's device pool) cannot
    carry a prompt holding host blocks, which then goes through the spill store instead."""
    prompts = [
        [(13 * i + 5 * j) % 300 + 5 for j in range(n)] for i, n in enumerate((120, 40, 77, 95, 60))
    ]
    pair = EnginePair.build(
        model_dir,
        tmp_path / "spill",
        transport=transport,
        prefill_blocks=16,
        prefill={"kv_host_cache_mb": 1, "max_num_batched_tokens": 32, "device": DEVICE},
        decode={"device": DEVICE},
    )
    with pair:
        tier = pair.prefill.runner.host_tier
        assert tier is not None and (pair.prefill.spill is not None) == (transport != "shm")
        most_on_host = watch_host_blocks(pair.prefill)
        for i, prompt in enumerate(prompts):
            pair.add(f"r{i}", prompt, greedy(8, ignore_eos=True))
        got = pair.run()
        pair.assert_clean()
    assert most_on_host() > 0 and tier.num_staged_blocks > 0 and tier.num_written_back_blocks > 0
    by_transport = {h.kv.transport for h in pair.handoffs.values() if h.kv is not None}
    assert len(pair.handoffs) == len(prompts)
    assert by_transport == ({"shm"} if transport == "shm" else {"shm", "pool"})
    if DEVICE == "cpu":
        want = hf_completions(model_dir, prompts, [8] * len(prompts))
        assert [got[f"r{i}"] for i in range(len(prompts))] == want
