"""BlockManager: allocation and reference counts, the version-keyed prefix cache, LRU eviction."""

from __future__ import annotations

import pytest

from agentroll.engine.block_manager import BlockManager, block_key
from agentroll.engine.sequence import Sequence


def make_seq(seq_id: str, tokens: list[int], kv_version: int = 0) -> Sequence:
    return Sequence(seq_id, list(tokens), kv_version=kv_version, min_kv_version=kv_version)


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Allocate ``seq`` and pretend its whole prompt is computed, as a finished prefill would."""
    cached = bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)
    return cached


def check_accounting(bm: BlockManager, seqs: list[Sequence]) -> None:
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for block in bm.blocks:
        holders = sum(seq.block_table.count(block.block_id) for seq in seqs)
        assert block.ref_count == holders, block


def test_allocate_and_free_count_references() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq("a", list(range(10)))
    assert bm.can_allocate(a)
    assert bm.allocate(a) == 0
    assert len(a.block_table) == 3
    assert len(set(a.block_table)) == 3
    assert bm.num_free_blocks == 5
    check_accounting(bm, [a])
    bm.free(a)
    assert a.block_table == []
    assert bm.num_free_blocks == 8
    assert bm.num_used_blocks == 0
    check_accounting(bm, [])


def test_held_blocks_outlive_their_sequence_until_released() -> None:
    """A migrating request's blocks: held, the sequence freed (aborted here), the blocks are
    neither reused nor evicted until the engine it moved to has read them."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq("a", list(range(10)))
    admit(bm, a)
    held = list(a.block_table)
    bm.hold(held)
    bm.free(a)
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    b = make_seq("b", list(range(100, 124)))
    assert not bm.can_allocate(b)  # 6 blocks needed, 5 free: the held ones are not
    bm.release(held)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8
    assert bm.can_allocate(b)
    with pytest.raises(ValueError, match="not held"):
        bm.release(held)
    with pytest.raises(ValueError, match="in use"):
        bm.hold(held)  # free blocks cannot be held


def test_allocate_refuses_when_the_pool_is_short() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    a = make_seq("a", list(range(9)))
    assert not bm.can_allocate(a)
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.allocate(a)
    assert bm.num_free_blocks == 2


def test_prefix_hit_under_the_same_kv_version_shares_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq("a", list(range(12)))
    admit(bm, a)
    assert bm.num_cached_blocks == 3
    b = make_seq("b", list(range(8)) + [100, 101, 102])
    assert bm.num_cached_tokens(b) == 8
    assert bm.allocate(b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.num_prefix_queries == 12 + 11
    assert bm.num_prefix_hits == 8
    assert bm.prefix_hit_rate == pytest.approx(8 / 23)
    check_accounting(bm, [a, b])
    bm.free(a)
    bm.free(b)
    check_accounting(bm, [])
    assert bm.num_free_blocks == 16


def test_prefix_miss_when_kv_version_differs() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    admit(bm, make_seq("a", list(range(12)), kv_version=0))
    b = make_seq("b", list(range(12)), kv_version=1)
    assert bm.num_cached_tokens(b) == 0
    assert bm.allocate(b) == 0
    assert bm.num_prefix_hits == 0
    # a request under the old version still hits the old blocks
    c = make_seq("c", list(range(12)), kv_version=0)
    assert bm.allocate(c) == 8


def test_only_full_computed_blocks_are_cached() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq("a", list(range(10)))
    bm.allocate(a)
    a.num_computed_tokens = 3  # a first prefill chunk: no block is full yet
    bm.mark_computed(a)
    assert bm.num_cached_blocks == 0
    a.num_computed_tokens = 6
    bm.mark_computed(a)
    assert bm.num_cached_blocks == 1
    a.num_computed_tokens = 10  # the last block holds 2 of 4 tokens: never cached
    bm.mark_computed(a)
    assert bm.num_cached_blocks == 2
    assert len(a.block_hashes) == 2
    b = make_seq("b", list(range(10)))
    assert bm.num_cached_tokens(b) == 8


def test_a_fully_cached_prompt_still_computes_its_last_token_in_a_fresh_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq("a", list(range(8)))
    admit(bm, a)
    assert bm.num_cached_blocks == 2
    b = make_seq("b", list(range(8)))
    assert bm.allocate(b) == 4
    assert b.block_table[0] == a.block_table[0]
    assert (
        bm.blocks[b.block_table[1]].ref_count == 1
    )  # the last token is never written into a shared block


def test_mixed_version_kv_is_never_registered() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence("a", list(range(12)), kv_version=1, min_kv_version=0)  # after a `keep` resume
    bm.allocate(a, use_prefix_cache=False)
    a.num_computed_tokens = 12
    bm.mark_computed(a)
    assert bm.num_cached_blocks == 0
    assert a.block_hashes == []


def test_block_key_depends_on_parent_version_and_tokens() -> None:
    base = block_key(None, 0, [1, 2, 3, 4])
    assert base == block_key(None, 0, [1, 2, 3, 4])
    assert base != block_key(None, 1, [1, 2, 3, 4])
    assert base != block_key(None, 0, [1, 2, 3, 5])
    assert base != block_key(base, 0, [1, 2, 3, 4])
    assert block_key(None, 0, [1]) != block_key(0, 0, [1])


def test_freed_cached_blocks_are_evicted_least_recently_used_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 9])
    b = make_seq("b", [5, 6, 7, 8, 9])
    admit(bm, a)
    admit(bm, b)
    a_blocks = list(a.block_table)
    bm.free(a)
    bm.free(b)
    # the partial tail blocks are plain free; the full ones wait in the cache
    assert bm.num_evictable_blocks == 4
    assert bm.num_free_blocks == 6
    c = make_seq("c", [20, 21, 22, 23, 24, 25])
    bm.allocate(c)  # 2 plain free blocks, then the oldest cached one: a's tail
    assert bm.num_evictions == 1
    assert a_blocks[1] in c.block_table
    assert bm.num_cached_tokens(make_seq("a2", [1, 2, 3, 4, 9])) == 2
    assert bm.num_cached_tokens(make_seq("b2", [5, 6, 7, 8, 9])) == 4


def test_a_cache_hit_makes_a_block_most_recently_used() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq("a", [1, 2, 3])
    b = make_seq("b", [4, 5, 6])
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    bm.free(b)  # cached, oldest first: a's head, b's head
    a2 = make_seq("a2", [1, 2, 7])
    assert bm.allocate(a2) == 2
    bm.free(a2)  # a's head is now the most recently used
    bm.allocate(make_seq("e", [10, 11, 12, 13, 14, 15]))  # 2 free blocks + 1 eviction
    assert bm.num_evictions == 1
    assert bm.num_cached_tokens(make_seq("a3", [1, 2, 3])) == 2
    assert bm.num_cached_tokens(make_seq("b3", [4, 5, 6])) == 0


def test_can_allocate_counts_revived_cached_blocks() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    b = make_seq("b", [1, 2, 3, 4, 5])
    assert bm.can_allocate(b)
    assert bm.allocate(b) == 4
    assert bm.num_free_blocks == 0
    check_accounting(bm, [b])


def test_append_slot_grows_the_table_one_block_at_a_time() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    a = make_seq("a", [1, 2, 3, 4])
    admit(bm, a)
    assert bm.num_missing_blocks(a) == 0
    a.append_token(5)
    assert bm.num_missing_blocks(a) == 1
    assert bm.can_append(a)
    bm.append_slot(a)
    assert len(a.block_table) == 2
    for token in (6, 7, 8, 9):
        a.append_token(token)
    assert not bm.can_append(a)
    with pytest.raises(RuntimeError, match="grow"):
        bm.append_slot(a)


def test_reset_prefix_cache_forgets_every_key() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq("a", list(range(12)))
    admit(bm, a)
    b = make_seq("b", list(range(100, 112)))
    admit(bm, b)
    bm.free(b)
    assert bm.reset_prefix_cache() == 6
    assert bm.num_cached_blocks == 0
    assert bm.num_evictable_blocks == 0
    assert bm.num_free_blocks == 8 - 3
    assert bm.num_cached_tokens(make_seq("a2", list(range(12)))) == 0
    check_accounting(bm, [a])
    bm.free(a)  # a's blocks lost their keys: they become plain free
    assert bm.num_free_blocks == 8
    assert bm.num_evictable_blocks == 0


def test_prefix_caching_disabled_never_shares() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq("a", list(range(12)))
    admit(bm, a)
    b = make_seq("b", list(range(12)))
    assert bm.allocate(b) == 0
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_cached_blocks == 0
    assert bm.prefix_hit_rate == 0.0


def test_a_duplicate_block_stays_uncached_and_is_freed_plainly() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq("a", list(range(8)))
    b = make_seq("b", list(range(8)))
    bm.allocate(a)
    bm.allocate(b)  # nothing cached yet: both compute the same blocks
    for seq in (a, b):
        seq.num_computed_tokens = 8
        bm.mark_computed(seq)
    assert bm.num_cached_blocks == 2
    assert a.block_hashes == b.block_hashes
    bm.free(b)
    assert bm.num_evictable_blocks == 0  # b's copies are not the cached ones
    bm.free(a)
    assert bm.num_evictable_blocks == 2
    check_accounting(bm, [])


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0)])
def test_sizes_are_validated(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        BlockManager(num_blocks, block_size)
