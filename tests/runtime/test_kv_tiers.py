"""The host tier of the KV cache (shared/runtime/kv_tiers.py): the block manager's tier order, the
layout, staging and write-back, and a runner with a host tier computing what a runner without one
computes. On CPU both tiers are host memory; on a GPU (where these run on CUDA, the host tier
pinned) the protocol is the same."""

from __future__ import annotations

import pytest
import torch

from shared.config import BatonConfig
from shared.runtime.block_manager import BlockManager
from shared.runtime.kv_tiers import HostKVTier, TierLayout, written_blocks
from shared.runtime.model_runner import ModelRunner
from shared.runtime.sequence import Sequence
from shared.wire.sampling import SamplingParams
from tests.runtime.helpers import make_runner, tiny_model_dir, torch_threads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def seq(rid: str, n: int, start: int = 1) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=8), block_size=4)


# --- block manager ----------------------------------------------------------------------------
def test_blocks_come_from_the_device_first_and_then_the_host() -> None:
    bm = BlockManager(10, 4, enable_prefix_caching=False, num_device_blocks=4)
    a, b = seq("a", 12), seq("b", 16)  # 3 and 4 blocks
    bm.allocate(a)
    bm.allocate(b)
    assert [bm.tier(x) for x in a.block_table] == [0, 0, 0]
    assert [bm.tier(x) for x in b.block_table] == [0, 1, 1, 1]  # beyond the device's share
    assert bm.num_host_blocks_used == 3 and bm.num_free_blocks == 3
    bm.free(a)
    c = seq("c", 8)
    bm.allocate(c)
    assert [bm.tier(x) for x in c.block_table] == [0, 0]  # freed device blocks before the host
    bm.free(b)
    assert bm.num_host_blocks_used == 0


def test_a_cached_device_block_is_evicted_before_a_host_block_is_used() -> None:
    bm = BlockManager(6, 4, enable_prefix_caching=True, num_device_blocks=2)
    a = seq("a", 9)  # blocks 0, 1 on the device (2 full, published), the third on the host
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.cache_computed_blocks(a)
    bm.free(a)
    assert bm.num_cached_free_blocks == 2  # the two full ones; the host block went back free
    b = seq("b", 8, start=100)  # no prefix hit
    bm.allocate(b)
    assert [bm.tier(x) for x in b.block_table] == [0, 0]
    assert bm.num_cached_free_blocks == 0


def test_a_prefix_hit_on_the_host_tier_is_shared() -> None:
    bm = BlockManager(6, 4, enable_prefix_caching=True, num_device_blocks=1)
    a = seq("a", 9)
    bm.allocate(a)  # [device, host, host]
    a.num_computed_tokens = 9
    bm.cache_computed_blocks(a)
    b = seq("b", 10)  # the same first 8 tokens
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert bm.tier(b.block_table[1]) == 1


def test_one_tier_by_default() -> None:
    bm = BlockManager(4, 4)
    assert bm.num_device_blocks == 4 and bm.num_host_blocks_used == 0
    with pytest.raises(ValueError):
        BlockManager(4, 4, num_device_blocks=5)


# --- layout -----------------------------------------------------------------------------------
def test_layout_stages_the_longest_sequence_from_at_most_half_the_device() -> None:
    assert TierLayout.plan(100, 0, 30) == TierLayout(100, 0, 0)
    plan = TierLayout.plan(100, 500, 30)
    assert plan == TierLayout(70, 30, 500) and plan.num_blocks == 570 and plan.max_seq_blocks == 30
    small = TierLayout.plan(10, 500, 30)  # the longest sequence is capped by half the device
    assert small == TierLayout(5, 5, 500) and small.max_seq_blocks == 5
    with pytest.raises(ValueError):
        TierLayout.plan(1, 10, 30)


# --- staging ----------------------------------------------------------------------------------
def make_tier(num_device: int = 4, num_staging: int = 3, num_host: int = 6) -> HostKVTier:
    layout = TierLayout(num_device, num_staging, num_host)
    cache = torch.randn(2, 2, num_device + num_staging, 4, 1, 8, device=DEVICE)
    tier = HostKVTier(cache, layout)
    assert tier.host_cache.is_pinned() == (DEVICE == "cuda")
    tier.host_cache.copy_(torch.randn_like(tier.host_cache))
    return tier


def test_split_keeps_each_forward_within_the_staging_area() -> None:
    tier = make_tier(num_staging=3)
    tables = [[0, 4, 5], [1, 4], [2, 6, 7], [3, 8]]  # host ids: 4..9
    # rows 0-1 share 4, 5 (2 distinct); row 2 adds 6, 7 (4 > 3): a new group; row 3 adds 8.
    assert tier.split(tables) == [[0, 1], [2, 3]]
    assert tier.split([[0, 1], [2]]) == [[0, 1]]
    with pytest.raises(ValueError, match="host blocks"):
        tier.split([[4, 5, 6, 7]])


def test_stage_copies_host_blocks_in_and_write_back_copies_written_ones_out() -> None:
    tier = make_tier()
    d = tier.layout.num_device_blocks
    staged = tier.stage([[0, 5, 7], [1, 5]])
    assert staged.tables == [[0, d, d + 1], [1, d]]
    device = tier.device_cache
    assert torch.equal(device[:, :, d].cpu(), tier.host_cache[1])
    assert torch.equal(device[:, :, d + 1].cpu(), tier.host_cache[3])
    before = tier.host_cache.clone()
    device[:, :, d + 1] += 1.0  # the forward extends host block 7 only
    device[:, :, d] += 1.0  # (and scribbles on 5, which it did not write)
    tier.write_back(staged, {0, 7})
    assert torch.equal(tier.host_cache[3], before[3] + 1.0)
    assert torch.equal(tier.host_cache[1], before[1])  # not written: not copied
    assert tier.num_staged_blocks == 2 and tier.num_written_back_blocks == 1


def test_device_ids_let_a_transport_read_and_write_host_blocks() -> None:
    tier = make_tier()
    d = tier.layout.num_device_blocks
    with tier.device_ids([2, 6], read=True, write=False) as ids:  # a send reads them
        assert ids == [2, d]
        assert torch.equal(tier.device_cache[:, :, d].cpu(), tier.host_cache[2])
    fresh = torch.randn_like(tier.device_cache[:, :, 0])
    with tier.device_ids([8], read=False, write=True) as ids:  # a load writes them
        tier.device_cache[:, :, ids[0]] = fresh
    assert torch.equal(tier.host_cache[4], fresh.cpu())


def test_written_blocks() -> None:
    assert written_blocks([7, 8, 9], 3, 5, 4) == {7, 8}
    assert written_blocks([7, 8, 9], 8, 9, 4) == {9}


# --- the runner -------------------------------------------------------------------------------
def test_a_runner_with_a_host_tier_computes_what_one_without_computes() -> None:
    """Twelve sequences over 2 device blocks + 2 staging + a host tier: every forward stages, most
    are split; prefill (chunked) and decode give the same tokens as a plain runner's."""
    model_dir = tiny_model_dir("llama")
    plain = make_runner(model_dir, num_kv_blocks=256, device=DEVICE)
    assert plain.host_tier is None
    config = BatonConfig(model=str(model_dir), num_kv_blocks=4, max_model_len=64, device=DEVICE)
    tiered = ModelRunner(config, kv_host_cache_bytes=300 * plain.block_bytes)
    assert tiered.tiers == TierLayout(2, 2, 300) and tiered.max_seq_tokens == 32
    tier = tiered.host_tier
    assert tier is not None
    prompts = [[(5 * i + 3 * j) % 250 + 3 for j in range(9 + i)] for i in range(12)]
    results = []
    for runner in (plain, tiered):
        bm = BlockManager(runner.num_kv_blocks, 16, False, runner.tiers.num_device_blocks)
        seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=8)) for i, p in enumerate(prompts)]
        tokens: list[list[int]] = [[] for _ in seqs]
        with torch_threads(1):
            for s in seqs:
                bm.allocate(s)
            first = [s.num_tokens // 2 for s in seqs]  # two chunks
            runner.prefill(seqs, first)
            for s, n in zip(seqs, first, strict=True):
                s.num_computed_tokens += n
            out = runner.prefill(seqs, [s.num_tokens - s.num_computed_tokens for s in seqs])
            for i, (s, t) in enumerate(zip(seqs, out, strict=True)):
                assert t is not None
                s.num_computed_tokens = s.num_tokens
                s.append_token(t)
                tokens[i].append(t)
            for _ in range(6):
                for s in seqs:
                    bm.append_slot(s)
                for i, (s, t) in enumerate(zip(seqs, runner.decode(seqs), strict=True)):
                    s.num_computed_tokens = s.num_tokens
                    s.append_token(t)
                    tokens[i].append(t)
        results.append(tokens)
    assert results[0] == results[1]
    assert tier.num_staged_blocks > 0 and tier.num_written_back_blocks > 0
