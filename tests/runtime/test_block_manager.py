"""BlockManager: allocation, ref counts, prefix hits, publishing, LRU eviction."""

from __future__ import annotations

import pytest

from shared.runtime import BlockManager, SamplingParams, Sequence
from shared.runtime.block_manager import hash_block

BS = 4


def seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(), block_size=BS)


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """Mark the whole sequence computed (as after its prefill) and publish its blocks."""
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)
    return s


def prefilled(bm: BlockManager, request_id: str, tokens: list[int]) -> Sequence:
    """Allocate a sequence and mark it computed, as after its prefill."""
    s = seq(request_id, tokens)
    bm.allocate(s)
    return computed(bm, s)


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(8, BS)
    a, b = seq("a", list(range(10))), seq("b", list(range(100, 105)))
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert len(set(a.block_table) | set(b.block_table)) == 5
    assert bm.num_free_blocks == 3 and bm.num_used_blocks == 5
    assert bm.usage == pytest.approx(5 / 8)
    assert a.num_computed_tokens == 0 and a.num_cached_tokens == 0
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and a.block_table == []


def test_double_free_is_refused() -> None:
    bm = BlockManager(4, BS)
    a = seq("a", [1, 2, 3])
    bm.allocate(a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(a)


def test_can_allocate_false_when_full() -> None:
    bm = BlockManager(4, BS)
    bm.allocate(seq("a", list(range(12))))  # 3 blocks
    assert bm.can_allocate(seq("b", list(range(50, 54))))  # 1 block fits
    big = seq("c", list(range(50, 59)))  # 3 blocks do not
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError):
        bm.allocate(big)
    assert bm.num_free_blocks == 1  # the refused allocation took nothing


def test_append_slot_across_block_boundary() -> None:
    bm = BlockManager(3, BS)
    s = seq("a", [1, 2, 3, 4])  # exactly one block
    bm.allocate(s)
    s.append_token(5)  # position 4 starts block 2
    assert bm.can_append_slot(s)
    bm.append_slot(s)
    assert len(s.block_table) == 2
    for t in (6, 7, 8):  # positions 5..7 fit in block 2: no new block
        s.append_token(t)
        bm.append_slot(s)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 1
    other = seq("b", [9])
    bm.allocate(other)  # takes the last block
    s.append_token(9)
    assert not bm.can_append_slot(s)
    with pytest.raises(RuntimeError):
        bm.append_slot(s)


def test_prefix_hit_shares_blocks_and_counts_refs() -> None:
    bm = BlockManager(16, BS)
    prefix = [7, 8, 9, 10, 11, 12, 13, 14]  # two full blocks
    a = prefilled(bm, "a", prefix + [1, 2])
    b = seq("b", prefix + [3])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == b.num_computed_tokens == 2 * BS
    assert [bm.ref_count(x) for x in a.block_table] == [2, 2, 1]
    assert bm.num_prefix_hit_tokens == 2 * BS
    assert bm.num_prefix_queries_tokens == a.num_tokens + b.num_tokens
    bm.free(a)
    assert [bm.ref_count(x) for x in b.block_table] == [1, 1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16
    # Freed but hashed: still a hit, and reviving it takes it out of the free count.
    c = seq("c", prefix + [4, 5])
    bm.allocate(c)
    assert c.num_cached_tokens == 2 * BS and bm.num_free_blocks == 13


def test_hit_never_covers_the_last_token() -> None:
    bm = BlockManager(8, BS)
    prefix = list(range(20, 28))
    prefilled(bm, "a", prefix + [1])
    whole = seq("b", prefix)  # both blocks cached, but one token must be computed
    bm.allocate(whole)
    assert whole.num_cached_tokens == BS and whole.num_computed_tokens == BS
    assert len(whole.block_table) == 2


def test_cache_computed_blocks_publishes_only_computed_full_blocks() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(30, 41))  # 2 full blocks + 3 tokens
    a = seq("a", tokens)
    bm.allocate(a)
    # Nothing computed yet: a twin gets no hit.
    bm.cache_computed_blocks(a)
    twin = seq("twin", tokens)
    bm.allocate(twin)
    assert twin.num_cached_tokens == 0
    bm.free(twin)
    # First chunk of 6 tokens computed: only block 0 is full and computed.
    a.num_computed_tokens = 6
    bm.cache_computed_blocks(a)
    probe = seq("p1", tokens)
    bm.allocate(probe)
    assert probe.num_cached_tokens == BS and probe.block_table[0] == a.block_table[0]
    bm.free(probe)
    # All computed: blocks 0 and 1 published; the partial block 2 never is.
    a.num_computed_tokens = a.num_tokens
    bm.cache_computed_blocks(a)
    probe = seq("p2", tokens + [99, 98])
    bm.allocate(probe)
    assert probe.num_cached_tokens == 2 * BS and probe.block_table[:2] == a.block_table[:2]
    assert probe.block_table[2] != a.block_table[2]


def test_decode_tokens_fill_and_publish_a_block() -> None:
    bm = BlockManager(8, BS)
    s = seq("a", [1, 2, 3])
    bm.allocate(s)
    computed(bm, s)
    s.append_token(4)  # the sampled token fills block 0 once it is computed
    bm.append_slot(s)
    probe = seq("p", [1, 2, 3, 4, 5])
    bm.allocate(probe)
    assert probe.num_cached_tokens == 0  # token 4's KV is not computed yet
    bm.free(probe)
    computed(bm, s)
    probe = seq("q", [1, 2, 3, 4, 5])
    bm.allocate(probe)
    assert probe.num_cached_tokens == BS


def test_eviction_under_pressure_is_lru_and_unhashes() -> None:
    bm = BlockManager(4, BS)
    old = prefilled(bm, "old", [1, 2, 3, 4, 5])  # block 0 hashed, block 1 not (partial)
    new = prefilled(bm, "new", [6, 7, 8, 9, 10])
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 2
    # 3 fresh blocks: the 2 never-hashed ones first, then the least recently freed cached one.
    big = seq("big", list(range(100, 112)))
    bm.allocate(big)
    assert bm.num_cached_free_blocks == 1
    again_old = seq("o2", [1, 2, 3, 4, 0])
    again_new = seq("n2", [6, 7, 8, 9, 0])
    bm.free(big)
    bm.allocate(again_new)
    assert again_new.num_cached_tokens == BS  # the later-freed block survived
    bm.allocate(again_old)
    assert again_old.num_cached_tokens == 0  # evicted: its hash is gone


def test_free_releases_tail_first_so_prompt_heads_survive() -> None:
    bm = BlockManager(4, BS)
    a = prefilled(bm, "a", list(range(50, 62)) + [1])  # 3 full (hashed) blocks + 1 partial
    bm.free(a)
    assert bm.num_cached_free_blocks == 3
    x = seq("x", list(range(900, 908)))
    bm.allocate(x)  # the unhashed block, then the LRU cached one
    bm.free(x)
    probe = seq("p", list(range(50, 62)) + [2])
    bm.allocate(probe)
    assert probe.num_cached_tokens == 2 * BS


def test_allocate_blocks_for_a_handoff_skips_prefix_lookup() -> None:
    bm = BlockManager(8, BS)
    s = prefilled(bm, "a", list(range(9)))
    received = seq("a-decode", list(range(9)))
    bm.allocate_blocks(received, received.num_tokens)
    assert len(received.block_table) == 3
    assert not set(received.block_table) & set(s.block_table)
    assert received.num_cached_tokens == 0
    with pytest.raises(ValueError):
        bm.allocate_blocks(received, 4)
    assert not bm.can_allocate_blocks(100)


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    s = prefilled(bm, "a", list(range(9)))
    b = seq("b", list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(b.block_table) & set(s.block_table)


def test_block_hash_is_chained_and_stable() -> None:
    h0 = hash_block(b"", [1, 2, 3, 4])
    assert h0 == hash_block(b"", [1, 2, 3, 4])
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(b"", [5, 6, 7, 8])
    assert len(h0) == 16


def test_a_fork_shares_the_full_blocks_and_copies_the_partial_one() -> None:
    bm = BlockManager(16, BS)
    parent = seq("p", list(range(10)) + [50])  # a prompt of 10 (2 full blocks) + first token
    bm.allocate(parent)
    parent.num_computed_tokens = 10  # the prompt's KV is in
    bm.cache_computed_blocks(parent)
    children = [seq(f"c{i}", list(range(10)) + [60 + i]) for i in range(3)]
    copies = [bm.fork(parent, c) for c in children]
    full, partial = parent.block_table[:2], parent.block_table[2]
    assert all(c.block_table[:2] == full for c in children)
    assert [bm.ref_count(b) for b in full] == [4, 4]
    own = [c.block_table[2] for c in children]
    assert len({partial, *own}) == 4 and all(bm.ref_count(b) == 1 for b in own)
    assert copies == [[(partial, b)] for b in own]  # copy-on-write: each before its first write
    assert all(c.num_computed_tokens == 10 for c in children)
    assert bm.num_used_blocks == 6
    for s in (parent, *children):
        bm.free(s)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 16


def test_a_fork_on_a_block_boundary_copies_nothing_and_needs_room() -> None:
    bm = BlockManager(4, BS)
    parent = seq("p", list(range(8)) + [50])  # the prompt fills 2 blocks: the next is empty
    bm.allocate(parent)
    parent.num_computed_tokens = 8
    child = seq("c", list(range(8)) + [51])
    assert bm.can_fork(parent) and bm.fork(parent, child) == []
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]
    assert not bm.can_fork(parent)  # the cache is full: a third choice has to wait
    with pytest.raises(RuntimeError):
        bm.fork(parent, seq("d", list(range(8)) + [52]))
