"""Paged KV block allocation with prefix caching (vLLM-style, hash-chained full blocks).

A block is in exactly one of three states:
- in use: ``ref_count > 0``; listed in the block tables of ``ref_count`` sequences;
- cached-free: ``ref_count == 0`` with a published hash; still a prefix hit until evicted, kept
  in LRU order (least recently freed evicted first);
- free: ``ref_count == 0`` and no hash; handed out before any cached-free block is evicted.

Only computed KV is ever published (``cache_computed_blocks``), so a prefix hit never points at
a block whose KV is still being written by another sequence's forward.

Sliding windows (``kv_window``: the widest window, when every layer of the model has one): a
block no future query of a sequence can see — all its positions before ``p - kv_window + 1``,
p the next position computed — is released at once (published first, so it stays a prefix
hit until evicted) and its entry in the block table becomes :data:`NULL_BLOCK`, vLLM's null
block: an id that holds no KV and is never read (attention starts at the window).

int8 KV with a full-precision window (``fp_window`` tokens, ``fp_slots_per_block`` slots per
block; shared/runtime/fp_window.py): every block of a sequence holds its tokens as int8, and the
blocks from ``first_fp_block(num_tokens)`` on also own that many extra blocks of the pool, the
*slots*, which hold the same tokens in the model's dtype (``seq.fp_blocks``). Slots are taken
with their block (allocation, append) and released as the block ages out of the window — block
by block — or with the sequence. A prefix hit never reaches into the window (its slots would be
empty): the window is recomputed.

Two tiers (``num_device_blocks < num_blocks``): ids ``[0, num_device_blocks)`` live in the
device pool, the rest in the host tier (``shared/runtime/kv_tiers.py``). A block is always taken
from the device first — free, then the least recently freed cached one — and from the host only
when the device has none, so the host holds the blocks beyond the device pool's share. With one
tier (the default) this is the plain free-then-evict order.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from shared.runtime.sequence import Sequence

# A block-table entry whose block was released because it lies outside every layer's window.
NULL_BLOCK = -1


def hash_block(prev_hash: bytes, token_ids: list[int]) -> bytes:
    """Chained hash of one full block: stable across processes and runs (no PYTHONHASHSEED)."""
    return hashlib.blake2b(prev_hash + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    """Owns the blocks, the free lists, the hashes and the ref counts. Nothing else touches them.

    Every call costs O(blocks it touches): lookups walk only until the first miss, publishing
    resumes where the previous call stopped.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_device_blocks: int | None = None,
        kv_window: int | None = None,
        fp_window: int = 0,
        fp_slots_per_block: int = 0,
    ):
        """``num_device_blocks``: how many of the ``num_blocks`` are on the device (default: all);
        the others are the host tier. ``kv_window``: keys a query may still need
        (ModelConfig.kv_window); None keeps every block of a running sequence. ``fp_window``,
        ``fp_slots_per_block``: the full-precision window of an int8 cache (0: none)."""
        num_device = num_blocks if num_device_blocks is None else num_device_blocks
        if num_blocks <= 0 or block_size <= 0 or not 0 < num_device <= num_blocks:
            raise ValueError(
                f"need num_blocks > 0, block_size > 0 and 0 < num_device_blocks <= num_blocks, "
                f"got {num_blocks}, {block_size}, {num_device}"
            )
        if kv_window is not None and kv_window < 1:
            raise ValueError(f"kv_window={kv_window}: a window holds at least one key")
        self.kv_window = kv_window
        if fp_window < 0 or (fp_window > 0) != (fp_slots_per_block > 0):
            raise ValueError(f"fp_window={fp_window} needs slots per block ({fp_slots_per_block})")
        self.fp_window, self.fp_slots_per_block = fp_window, fp_slots_per_block
        self.num_blocks = num_blocks
        self.num_device_blocks = num_device
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        # Per tier, device first: the order _take_free_block searches them in.
        self._free: tuple[deque[int], ...] = (
            deque(range(num_device)),
            deque(range(num_device, num_blocks)),
        )
        self._evictable: tuple[OrderedDict[int, None], ...] = (OrderedDict(), OrderedDict())
        # request_id -> number of leading blocks of that sequence already published.
        self._num_published_blocks: dict[str, int] = {}
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0

    # --- accounting ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return sum(map(len, self._free)) + sum(map(len, self._evictable))

    @property
    def num_host_blocks_used(self) -> int:
        """Blocks of the host tier in use (0 without one)."""
        num_host = self.num_blocks - self.num_device_blocks
        return num_host - len(self._free[1]) - len(self._evictable[1])

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(map(len, self._evictable))

    def tier(self, block_id: int) -> int:
        """0: the device pool, 1: the host tier."""
        return int(block_id >= self.num_device_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_freeable_blocks(self, seq: Sequence) -> int:
        """Blocks that freeing ``seq`` gives back (shared ones and null entries do not)."""
        own = sum(1 for b in seq.block_table if b != NULL_BLOCK and self._ref_counts[b] == 1)
        return own + len(seq.fp_blocks)

    # --- the full-precision window of an int8 cache ---------------------------------------------
    def first_fp_block(self, num_tokens: int) -> int:
        """The first block of a ``num_tokens`` sequence whose tokens are kept full precision too
        (the last ``fp_window`` tokens, whole blocks); past the end without a window."""
        if not self.fp_window:
            return self.blocks_for(num_tokens)
        return max(0, num_tokens - self.fp_window) // self.block_size

    def _num_fp_slots(self, num_tokens: int) -> int:
        n = self.blocks_for(num_tokens) - self.first_fp_block(num_tokens)
        return max(0, n) * self.fp_slots_per_block

    def fp_slots(self, seq: Sequence, num_tokens: int) -> list[int]:
        """The slots of the blocks holding positions ``fp_first_block .. num_tokens - 1``: what
        a handoff of ``num_tokens`` positions sends beside the int8 blocks."""
        n = self.blocks_for(num_tokens) - seq.fp_first_block
        return seq.fp_blocks[: max(0, n) * self.fp_slots_per_block]

    def _take_fp_slots(self, seq: Sequence) -> None:
        """Slots for the blocks of the window that have none yet (a new sequence's, or one just
        appended)."""
        if not self.fp_window:
            return
        if not seq.fp_blocks:
            seq.fp_first_block = self.first_fp_block(seq.num_tokens)
        have = seq.fp_first_block + len(seq.fp_blocks) // self.fp_slots_per_block
        missing = (len(seq.block_table) - have) * self.fp_slots_per_block
        seq.fp_blocks.extend(self._take_free_block() for _ in range(missing))

    def _age_fp_slots(self, seq: Sequence) -> None:
        """Release the slots of blocks that left the window (or the sliding window)."""
        if not seq.fp_blocks:
            return
        first, live = self.first_fp_block(seq.num_tokens), 0
        while live < len(seq.block_table) and seq.block_table[live] == NULL_BLOCK:
            live += 1
        num_old = (max(first, live) - seq.fp_first_block) * self.fp_slots_per_block
        if num_old <= 0:
            return
        for slot in seq.fp_blocks[:num_old]:
            self._release(slot)
        del seq.fp_blocks[:num_old]
        seq.fp_first_block += num_old // self.fp_slots_per_block

    def live_blocks(self, seq: Sequence, num_tokens: int) -> tuple[int, list[int]]:
        """The blocks holding positions ``0 .. num_tokens - 1`` that were not released (the
        window's): (index of the first in the table, their ids). What a handoff sends."""
        table = seq.block_table[: self.blocks_for(num_tokens)]
        first = 0
        while first < len(table) and table[first] == NULL_BLOCK:
            first += 1
        return first, table[first:]

    # --- allocation ---------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._prefix_hits(seq)
        num_revived = sum(1 for b in hits if self._ref_counts[b] == 0)
        num_new = self.blocks_for(seq.num_tokens) - len(hits) + self._num_fp_slots(seq.num_tokens)
        return num_new + num_revived <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all ``seq.num_tokens``, sharing cached full blocks of its prefix.

        The hit never covers the last token, so the next forward always has a token to compute
        and produces logits; the block holding it is recomputed rather than shared, so shared
        blocks are only ever read.
        """
        if seq.block_table:
            raise ValueError(f"{seq.request_id!r} already holds {len(seq.block_table)} blocks")
        if not self.can_allocate(seq):
            raise RuntimeError(f"not enough free KV blocks for {seq.request_id!r}")
        hits = self._prefix_hits(seq)
        for block_id in hits:
            if self._ref_counts[block_id] == 0:
                del self._evictable[self.tier(block_id)][block_id]
            self._ref_counts[block_id] += 1
        num_new = self.blocks_for(seq.num_tokens) - len(hits)
        seq.block_table = hits + [self._take_free_block() for _ in range(num_new)]
        self._take_fp_slots(seq)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self._num_published_blocks[seq.request_id] = len(hits)
        self.num_prefix_queries_tokens += seq.num_tokens
        self.num_prefix_hit_tokens += seq.num_cached_tokens

    def can_allocate_blocks(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) + self._num_fp_slots(num_tokens) <= self.num_free_blocks

    def allocate_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Fresh blocks for ``num_tokens`` (receiving side of a KV handoff): no prefix lookup.

        Counters (``num_computed_tokens``) are the caller's: it sets them once the KV has landed.
        """
        if seq.block_table:
            raise ValueError(f"{seq.request_id!r} already holds {len(seq.block_table)} blocks")
        if not self.can_allocate_blocks(num_tokens):
            raise RuntimeError(f"not enough free KV blocks for {seq.request_id!r}")
        self._adopt(seq)
        seq.block_table = [self._take_free_block() for _ in range(self.blocks_for(num_tokens))]
        self._take_fp_slots(seq)
        seq.num_cached_tokens = 0
        self._num_published_blocks[seq.request_id] = 0

    # --- forks (parallel sampling) ---------------------------------------------------------------
    def _num_fork_blocks(self, seq: Sequence) -> int:
        """Blocks a sequence forked from ``seq`` takes of its own: the one holding its next
        position and those after, with their full-precision slots."""
        own = len(seq.block_table) - seq.num_computed_tokens // self.block_size
        first_slot = max(seq.num_computed_tokens // self.block_size, seq.fp_first_block)
        num_slots = (len(seq.block_table) - first_slot) * self.fp_slots_per_block
        return own + (num_slots if seq.fp_blocks else 0)

    def can_fork(self, seq: Sequence) -> bool:
        return self._num_fork_blocks(seq) <= self.num_free_blocks

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Blocks for ``child``, a sequence of the same length as ``parent`` that shares its
        first ``parent.num_computed_tokens`` positions (another choice of the same prompt: vLLM's
        fork of a SequenceGroup). The full computed blocks are shared (one more reference each,
        read only from now on); the block holding the next position is the child's own, a copy
        of the parent's when computed positions share it (copy-on-write: both sequences write
        their next tokens there), as are the blocks after it and their full-precision slots.

        Returns the ``(src, dst)`` block copies to make before either sequence's next forward.
        """
        if child.block_table:
            raise ValueError(f"{child.request_id!r} already holds {len(child.block_table)} blocks")
        if child.num_tokens != parent.num_tokens:
            raise ValueError(f"a fork of {parent.request_id!r} must have its length")
        if not self.can_fork(parent):
            raise RuntimeError(f"not enough free KV blocks to fork {parent.request_id!r}")
        bs = self.block_size
        computed = parent.num_computed_tokens
        shared = computed // bs  # blocks before this one are full and computed
        copies: list[tuple[int, int]] = []

        def own(j: int, block_id: int) -> int:
            if j < shared:
                if block_id != NULL_BLOCK:
                    self._ref_counts[block_id] += 1
                return block_id
            new = self._take_free_block()
            if j == shared and computed % bs:
                copies.append((block_id, new))
            return new

        self._adopt(child)
        child.block_table = [own(j, b) for j, b in enumerate(parent.block_table)]
        spb = self.fp_slots_per_block
        child.fp_first_block = parent.fp_first_block
        child.fp_blocks = [
            own(parent.fp_first_block + k // spb, slot) for k, slot in enumerate(parent.fp_blocks)
        ]
        child.num_computed_tokens = computed
        child.num_cached_tokens = min(parent.num_cached_tokens, computed)
        child.block_hashes = parent.block_hashes[:shared]
        published = self._num_published_blocks.get(parent.request_id, 0)
        self._num_published_blocks[child.request_id] = min(published, shared)
        return copies

    def _num_missing(self, seq: Sequence) -> int:
        """Blocks (and their full-precision slots) that extending ``seq`` to its length takes."""
        missing = self.blocks_for(seq.num_tokens) - len(seq.block_table)
        return missing * (1 + self.fp_slots_per_block)

    def can_append_slot(self, seq: Sequence) -> bool:
        return self._num_missing(seq) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the token at position ``num_tokens - 1`` (a new block on a boundary)."""
        if self._num_missing(seq) > self.num_free_blocks:
            raise RuntimeError(f"no free KV block to extend {seq.request_id!r}")
        missing = self.blocks_for(seq.num_tokens) - len(seq.block_table)
        seq.block_table.extend(self._take_free_block() for _ in range(missing))
        self._take_fp_slots(seq)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Hashed blocks stay reusable until evicted.

        Released tail-first, so a sequence's last blocks are evicted before its first ones (the
        head of a prompt is the part other prompts most likely share).
        """
        for block_id in reversed(seq.fp_blocks + seq.block_table):
            if block_id != NULL_BLOCK:
                self._release(block_id)
        seq.block_table, seq.fp_blocks = [], []
        self._num_published_blocks.pop(seq.request_id, None)

    def release_before(self, seq: Sequence, num_blocks: int) -> None:
        """Release the sequence's first ``num_blocks`` blocks now (null entries from here on):
        their KV is never read again, or never arrived (a handoff sends only the window)."""
        table = seq.block_table
        for i in range(min(num_blocks, len(table)) - 1, -1, -1):
            if table[i] == NULL_BLOCK:
                break  # released earlier, and so is everything before it
            self._release(table[i])
            table[i] = NULL_BLOCK
        self._age_fp_slots(seq)

    def first_kept_block(self, num_computed: int) -> int:
        """The first block a sequence with ``num_computed`` positions computed keeps: the one
        holding the first key its next query sees (0 without a window)."""
        if self.kv_window is None:
            return 0
        return max(0, num_computed - self.kv_window + 1) // self.block_size

    def release_outside_window(self, seq: Sequence) -> None:
        """Release the blocks no future query of ``seq`` can see (see the module docstring)."""
        self.release_before(seq, self.first_kept_block(seq.num_computed_tokens))

    def _release(self, block_id: int) -> None:
        ref = self._ref_counts[block_id] - 1
        if ref < 0:
            raise RuntimeError(f"block {block_id} freed more often than allocated")
        self._ref_counts[block_id] = ref
        if ref == 0:
            if self._block_hash[block_id] is None:
                self._free[self.tier(block_id)].append(block_id)
            else:
                self._evictable[self.tier(block_id)][block_id] = None

    # --- prefix caching -----------------------------------------------------------------------
    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of ``seq``'s full blocks whose KV is now computed, then release
        those outside its window (after: published, they stay prefix hits)."""
        self._publish(seq)
        self.release_outside_window(seq)
        self._age_fp_slots(seq)

    def _publish(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = self._num_published_blocks.get(seq.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes_upto(seq, num_full)
        for i in range(start, num_full):
            block_id, block_hash = seq.block_table[i], hashes[i]
            # Already published (it was a prefix hit), or the same content was computed twice
            # concurrently: the first published copy stays the one lookups find. A null entry
            # holds nothing to publish.
            if (
                block_id != NULL_BLOCK
                and self._block_hash[block_id] is None
                and block_hash not in self._hash_to_block
            ):
                self._block_hash[block_id] = block_hash
                self._hash_to_block[block_hash] = block_id
        self._num_published_blocks[seq.request_id] = num_full

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        # A prompt whose logprobs are asked for is computed whole (vLLM's rule): a hit's
        # positions would have no logits to score them. Its blocks are still published.
        if not self.enable_prefix_caching or seq.sampling.prompt_logprobs is not None:
            return []
        self._adopt(seq)
        bs = self.block_size
        # Never into the full-precision window: hit blocks hold no model-dtype copy.
        max_hits = min((seq.num_tokens - 1) // bs, self.first_fp_block(seq.num_tokens))
        hashes, token_ids, hits = seq.block_hashes, seq.token_ids, []
        for i in range(max_hits):
            if i == len(hashes):
                prev = hashes[-1] if hashes else b""
                hashes.append(hash_block(prev, token_ids[i * bs : (i + 1) * bs]))
            block_id = self._hash_to_block.get(hashes[i])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _hashes_upto(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        self._adopt(seq)
        bs, hashes, token_ids = self.block_size, seq.block_hashes, seq.token_ids
        for i in range(len(hashes), num_blocks):
            prev = hashes[-1] if hashes else b""
            hashes.append(hash_block(prev, token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def _adopt(self, seq: Sequence) -> None:
        # A sequence's hashes and num_blocks follow the block size of the manager holding it.
        if seq.block_size != self.block_size:
            seq.block_size = self.block_size
            seq.block_hashes = []

    def _take_free_block(self) -> int:
        # A cached device block is evicted before a host block is used: the device is where
        # attention reads without a copy, and the prefix cache keeps its host-tier hits.
        for free, evictable in zip(self._free, self._evictable, strict=True):
            if free:
                block_id = free.popleft()
                break
            if evictable:
                block_id, _ = evictable.popitem(last=False)
                block_hash = self._block_hash[block_id]
                assert block_hash is not None
                del self._hash_to_block[block_hash]
                self._block_hash[block_id] = None
                break
        else:
            raise RuntimeError("no free KV block")  # callers check num_free_blocks first
        self._ref_counts[block_id] = 1
        return block_id
