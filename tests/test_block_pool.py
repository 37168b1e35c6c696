"""The KV block pool on its own: reference counts, the free queue, the prefix cache's map, eviction."""

from __future__ import annotations

import pytest

from ruvllm.block_pool import BlockManagerError, BlockPool


def test_free_blocks_are_handed_out_before_cached_ones_and_in_order():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == (0, 1) and pool.ref_count(a) == 1 and pool.num_free_blocks == 1
    pool.cache(a, b"h-a")
    pool.release(a)  # cached: evictable, not free
    pool.release(b)  # uncached: back to the free queue
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 1
    assert [pool.allocate(), pool.allocate()] == [2, 1]  # the free ones first, in queue order
    assert pool.cached_block(b"h-a") == a and pool.evictions == 0
    assert pool.allocate() == a  # then the cached one, evicted
    assert pool.cached_block(b"h-a") is None and pool.evictions == 1
    with pytest.raises(BlockManagerError):
        pool.allocate()


def test_taking_a_cached_block_keeps_it_from_eviction():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.cache(b, b"h")
    pool.release(b)
    pool.take(b, hit=True)
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 1
    assert pool.allocate() != b
    with pytest.raises(BlockManagerError):
        pool.allocate()


def test_a_hash_keeps_its_first_block_and_a_block_its_first_hash():
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    pool.cache(a, b"h")
    pool.cache(b, b"h")  # an identical block is cached already: a stays
    pool.cache(a, b"other")  # a is cached under h: it stays so
    assert pool.cached_block(b"h") == a and pool.cached_block(b"other") is None
    assert pool.must_copy(a) and not pool.must_copy(b)
    pool.take(b)
    assert pool.must_copy(b)  # shared


@pytest.mark.parametrize(
    ("eviction", "first"),
    [("lru", 1), ("lfu", 0), ("fifo", 0)],
)
def test_eviction_policies_pick_their_victim(eviction, first):
    """Block 0 is cached first and released last; block 1 was hit by a prefix once more than 0."""
    pool = BlockPool(2, eviction)
    a, b = pool.allocate(), pool.allocate()
    pool.cache(a, b"a")
    pool.cache(b, b"b")
    pool.release(b)
    pool.take(b, hit=True)  # a prefix hit on b
    pool.release(b)
    pool.release(a)
    assert pool.allocate() == first


def test_reset_forgets_only_unreferenced_cached_blocks():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.cache(a, b"a")
    pool.cache(b, b"b")
    pool.release(a)
    pool.reset_prefix_cache()
    assert pool.cached_block(b"a") is None and pool.cached_block(b"b") == b
    assert pool.num_free_blocks == 2


def test_bad_sizes_are_refused():
    with pytest.raises(BlockManagerError):
        BlockPool(0)
    with pytest.raises(BlockManagerError):
        BlockPool(4, "random")
