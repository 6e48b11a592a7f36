"""Paged KV block allocation with reference counts and a version-keyed prefix cache.

Invariants: every block is exactly one of used, free or evictable, so free + evictable + used
== num_blocks; a block gets a key only once it is full *and* its KV is computed, and keys
chain the kv_version, so KV computed under other weights is never reused.
Pure and synchronous: no torch, no I/O.
"""

from __future__ import annotations

import struct
from collections import OrderedDict, deque
from dataclasses import dataclass

import xxhash

from agentroll.engine.sequence import Sequence

_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def block_key(parent: int | None, kv_version: int, token_ids: list[int]) -> int:
    """The prefix-cache key of a full block: xxh3-128 of its parent's key, the weights version
    its KV was computed under and its token ids (little-endian, so keys are portable)."""
    h = xxhash.xxh3_128()
    if parent is None:
        h.update(_NO_PARENT)
    else:
        h.update(_HAS_PARENT + parent.to_bytes(16, "little"))
    h.update(struct.pack(f"<q{len(token_ids)}q", kv_version, *token_ids))
    return h.intdigest()


@dataclass(slots=True, eq=False)
class Block:
    """One page of KV cache. ``key`` is set while the block is in the prefix cache; the
    version and token ids are kept to rule out hash collisions on a hit."""

    block_id: int
    ref_count: int = 0
    key: int | None = None
    kv_version: int = 0
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out KV blocks to sequences and keeps freed full blocks as a prefix cache.

    Statistics: ``num_prefix_queries`` and ``num_prefix_hits`` count tokens over all
    ``allocate`` calls that use the cache; ``num_evictions`` counts cached blocks reused for
    other content.

    A block is used (``ref_count > 0``), free (no key) or evictable (a prefix-cache key,
    ``ref_count == 0``, LRU order).  The key chains (parent key, kv_version, token ids), and
    only sequences whose KV is all of one version register keys.  A reference is a sequence's
    block-table entry or a ``hold`` (a migrating request's KV, read by another engine after its
    sequence was freed here), dropped by ``free`` or ``release``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        # ref-0 blocks that still hold a key, oldest first; they are reused last
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cache: dict[int, int] = {}  # key -> block id
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_evictions = 0

    # -- sizes and statistics ------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take now (evictable cached blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence (counted from the reference counts)."""
        return sum(1 for block in self.blocks if block.ref_count > 0)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, in use or evictable."""
        return len(self._cache)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up (0.0 if none)."""
        if self.num_prefix_queries == 0:
            return 0.0
        return self.num_prefix_hits / self.num_prefix_queries

    # -- allocation ----------------------------------------------------------------------

    def _match(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Block ids and keys of the longest cached prefix of ``seq`` under its kv_version.

        Only blocks inside the first ``num_tokens - 1`` tokens count: the last token is always
        computed (its logits are needed), and it must not be written into a shared block.
        """
        if not self.enable_prefix_caching:
            return [], []
        block_ids: list[int] = []
        keys: list[int] = []
        parent: int | None = None
        for index in range((seq.num_tokens - 1) // self.block_size):
            token_ids = seq.block_token_ids(index, self.block_size)
            key = block_key(parent, seq.kv_version, token_ids)
            block_id = self._cache.get(key)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.kv_version != seq.kv_version or block.token_ids != tuple(token_ids):
                break  # a hash collision: treat as a miss
            block_ids.append(block_id)
            keys.append(key)
            parent = key
        return block_ids, keys

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of ``seq`` that ``allocate`` would serve from the cache (no side
        effects)."""
        return len(self._match(seq)[0]) * self.block_size

    def can_allocate(self, seq: Sequence, *, use_prefix_cache: bool = True) -> bool:
        """Whether ``allocate`` can give ``seq`` blocks for all its current tokens now."""
        hits = self._match(seq)[0] if use_prefix_cache else []
        revived = sum(1 for block_id in hits if self.blocks[block_id].ref_count == 0)
        needed = seq.num_blocks_needed(self.block_size) - len(hits) + revived
        return needed <= self.num_free_blocks

    def allocate(self, seq: Sequence, *, use_prefix_cache: bool = True) -> int:
        """Give ``seq`` (which holds no blocks) a block table for all its current tokens,
        sharing cached full blocks of its prefix; sets ``seq.block_table`` and
        ``seq.block_hashes``.

        Returns the number of leading tokens whose KV is already cached (a multiple of
        ``block_size``, at most ``num_tokens - 1``); the caller sets ``num_computed_tokens``.
        ``use_prefix_cache=False`` gives fresh blocks (to be filled from a snapshot).
        Raises RuntimeError if ``can_allocate`` is false.
        """
        if seq.block_table:
            raise RuntimeError(f"{seq.seq_id!r} already holds blocks; free it first")
        if not self.can_allocate(seq, use_prefix_cache=use_prefix_cache):
            raise RuntimeError(f"not enough free KV blocks for {seq.seq_id!r}")
        block_ids, keys = self._match(seq) if use_prefix_cache else ([], [])
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
        for _ in range(seq.num_blocks_needed(self.block_size) - len(block_ids)):
            block_ids.append(self._take_free_block())
        seq.block_table = block_ids
        seq.block_hashes = keys
        num_cached = len(keys) * self.block_size
        if use_prefix_cache and self.enable_prefix_caching:
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += num_cached
        return num_cached

    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(self.blocks[block_id])
            self.num_evictions += 1
        else:
            raise RuntimeError("no free KV block")
        self.blocks[block_id].ref_count = 1
        return block_id

    def _uncache(self, block: Block) -> None:
        if block.key is not None:
            del self._cache[block.key]
        block.key = None
        block.token_ids = ()

    def num_missing_blocks(self, seq: Sequence) -> int:
        """Blocks ``seq`` lacks to hold the KV of all its current tokens."""
        return max(0, seq.num_blocks_needed(self.block_size) - len(seq.block_table))

    def can_append(self, seq: Sequence) -> bool:
        """Whether ``append_slot`` can cover all current tokens of ``seq`` now."""
        return self.num_missing_blocks(seq) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> None:
        """Grow ``seq.block_table`` to cover all its current tokens (usually by zero or one
        block, after a sampled token crossed a block boundary). Raises RuntimeError if
        ``can_append`` is false."""
        missing = self.num_missing_blocks(seq)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"not enough free KV blocks to grow {seq.seq_id!r}")
        for _ in range(missing):
            seq.block_table.append(self._take_free_block())

    def can_fork(self, src: Sequence) -> bool:
        """Whether ``fork`` can give a sequence the KV of ``src``'s tokens now."""
        return (src.num_tokens % self.block_size != 0) <= self.num_free_blocks

    def fork(self, src: Sequence, dst: Sequence) -> tuple[int, int] | None:
        """Give ``dst`` (same tokens as ``src``, no blocks) the blocks of ``src``'s tokens:
        the full ones shared, the last partial one a fresh block whose KV the caller copies
        from ``src``'s (returned as ``(src block, dst block)``; None when there is none).
        Raises RuntimeError if ``dst`` holds blocks or ``can_fork`` is false."""
        if dst.block_table:
            raise RuntimeError(f"{dst.seq_id!r} already holds blocks; free it first")
        if not self.can_fork(src):
            raise RuntimeError(f"not enough free KV blocks to fork {src.seq_id!r}")
        full = src.num_tokens // self.block_size
        table = src.block_table[:full]
        for block_id in table:
            self.blocks[block_id].ref_count += 1  # in use by src: never evictable here
        copy = None
        if src.num_tokens % self.block_size:
            copy = (src.block_table[full], self._take_free_block())
            table.append(copy[1])
        dst.block_table = table
        dst.block_hashes = src.block_hashes[:full]
        return copy

    # -- prefix cache --------------------------------------------------------------------

    def mark_computed(self, seq: Sequence) -> None:
        """Register the full blocks within ``seq.num_computed_tokens`` in the prefix cache.

        Call after the KV of those tokens is written (chunked prefill registers a block only
        when its last token is computed). Does nothing while the sequence's KV mixes weights
        versions: such blocks are never reachable from a single-version lookup. When another
        block already holds the same key, this one stays uncached (it is freed, not cached).
        """
        if not self.enable_prefix_caching or not seq.is_kv_uniform:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for index in range(len(seq.block_hashes), num_full):
            token_ids = seq.block_token_ids(index, self.block_size)
            key = block_key(parent, seq.kv_version, token_ids)
            if key not in self._cache:
                block = self.blocks[seq.block_table[index]]
                block.key = key
                block.kv_version = seq.kv_version
                block.token_ids = tuple(token_ids)
                self._cache[key] = block.block_id
            seq.block_hashes.append(key)
            parent = key

    def reset_prefix_cache(self) -> int:
        """Forget every cached key (blocks in use keep their KV, evictable ones become free).
        Returns the number of keys dropped. Not needed for correctness after a weight update,
        since keys include the kv_version; it only releases the memory of stale entries."""
        num_dropped = len(self._cache)
        for block_id in self._evictable:
            self._free.append(block_id)
        self._evictable.clear()
        for block_id in list(self._cache.values()):
            self._uncache(self.blocks[block_id])
        return num_dropped

    # -- release -------------------------------------------------------------------------

    def hold(self, block_ids: list[int]) -> None:
        """Take one more reference on blocks in use (a migrating request's KV, read by the
        engine it moves to after this one went on): they are neither reused nor evicted
        until ``release``."""
        blocks = [self.blocks[b] for b in block_ids]
        if any(b.ref_count < 1 for b in blocks):
            raise ValueError("only blocks in use can be held")
        for block in blocks:
            block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop the references ``hold`` took (as ``free`` drops a sequence's)."""
        if any(self.blocks[b].ref_count < 1 for b in block_ids):
            raise ValueError("release of blocks that are not held")
        self._drop(block_ids)

    def _drop(self, block_ids: list[int]) -> None:
        """One reference less on each block, the tail first; blocks nobody references become
        free, or evictable if cached."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.key is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody references become free, or evictable if
        cached. The tail is released first so that it is evicted first (it is the part least
        likely to be shared). Clears ``seq.block_table`` and ``seq.block_hashes``."""
        self._drop(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
