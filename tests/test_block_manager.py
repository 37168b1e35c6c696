"""The paged KV block manager: allocation, reference counts, prefix caching, eviction, copy-on-write."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ruvllm.block_manager import BlockManager, BlockManagerError, block_hash


def _check_refcounts(bm: BlockManager) -> None:
    """Every block's reference count equals the number of block tables that hold it."""
    held = Counter(b for entry in bm._seqs.values() for b in entry.table)
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == held.get(b, 0), f"block {b}"
    assert bm.num_used_blocks == len(held)


def _run(bm: BlockManager, seq: str, tokens: list[int]) -> int:
    """Admit ``tokens`` as a prompt the way the scheduler does; returns the prefix-hit tokens."""
    hit = bm.get_cached_prefix(tokens)
    assert bm.allocate_slots(seq, hit.num_tokens, len(tokens) - hit.num_tokens, hit)
    bm.commit(seq, tokens, len(tokens))
    return hit.num_tokens


def test_allocate_covers_slots_and_free_returns_every_block():
    bm = BlockManager(10, 4)
    assert bm.allocate_slots("a", 0, 9)
    assert len(bm.block_table("a")) == 3
    assert bm.allocate_slots("a", 9, 1)  # slot 9 still fits block 2
    assert len(bm.block_table("a")) == 3
    assert bm.allocate_slots("a", 12, 1)
    assert len(bm.block_table("a")) == 4
    assert len(set(bm.block_table("a"))) == 4
    assert bm.num_used_blocks == 4
    bm.free("a")
    assert bm.num_free_blocks == 10 and bm.num_used_blocks == 0


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(4, 4)
    assert bm.allocate_slots("a", 0, 12)
    assert not bm.allocate_slots("b", 0, 8)
    assert not bm.has("b")
    assert bm.num_free_blocks == 1
    assert not bm.allocate_slots("a", 12, 5)  # needs 2 more blocks, 1 is free
    assert len(bm.block_table("a")) == 3


def test_full_blocks_are_reused_by_a_later_prompt_with_the_same_prefix():
    bm = BlockManager(16, 4)
    prompt = list(range(100, 111))  # 2 full blocks + 3 tokens
    assert _run(bm, "a", prompt) == 0
    first_two = bm.block_table("a")[:2]
    bm.free("a")
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2
    assert _run(bm, "b", [*prompt[:8], 7, 7, 7]) == 8
    assert bm.block_table("b")[:2] == first_two
    # A different first block breaks the chain even though block 2's tokens are the same.
    assert bm.get_cached_prefix([0, *prompt[1:]]).num_tokens == 0
    _check_refcounts(bm)


def test_cached_block_is_shared_by_running_sequences():
    bm = BlockManager(16, 4)
    _run(bm, "a", list(range(9)))
    assert _run(bm, "b", list(range(9))) == 8
    assert bm.block_table("a")[:2] == bm.block_table("b")[:2]
    assert bm.block_table("a")[2] != bm.block_table("b")[2]
    assert bm.ref_count(bm.block_table("a")[0]) == 2
    _check_refcounts(bm)


def test_last_token_is_always_left_to_compute():
    bm = BlockManager(16, 4)
    prompt = list(range(8))
    _run(bm, "a", prompt)
    assert bm.num_cached_blocks == 2
    assert bm.get_cached_prefix(prompt).num_tokens == 4  # not 8: the last token's logits are needed
    assert bm.get_cached_prefix([*prompt, 9]).num_tokens == 8


def test_partial_and_uncomputed_blocks_are_never_cached():
    bm = BlockManager(16, 4)
    assert bm.allocate_slots("a", 0, 7)
    bm.commit("a", list(range(7)), 3)  # only 3 tokens computed: no full block yet
    assert bm.num_cached_blocks == 0
    bm.commit("a", list(range(7)), 7)
    assert bm.num_cached_blocks == 1


def test_prefix_caching_off_caches_nothing():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    _run(bm, "a", list(range(12)))
    bm.free("a")
    assert bm.num_cached_blocks == 0
    assert _run(bm, "b", list(range(12))) == 0


def test_hash_chains_the_parent():
    assert block_hash(b"", [1, 2]) != block_hash(block_hash(b"", [0, 0]), [1, 2])
    assert block_hash(b"", [1, 2]) == block_hash(b"", [1, 2])
    assert block_hash(b"", [1, 2]) != block_hash(b"", [2, 1])


@pytest.mark.parametrize(
    ("eviction", "survivors"),
    [("lru", {0, 2}), ("lfu", {0, 1}), ("fifo", {1, 2})],
)
def test_eviction_policy_chooses_the_victim(eviction, survivors):
    bm = BlockManager(8, 4, eviction=eviction)
    prompts = [[p] * 4 + [99] for p in (1, 2, 3)]  # one full (cached) block + one partial each
    for i, p in enumerate(prompts):
        _run(bm, f"s{i}", p)  # cached in order 0, 1, 2 (FIFO evicts prompt 0)

    def touch(i: int) -> None:
        assert _run(bm, "t", prompts[i]) == 4
        bm.free("t")

    bm.free("s1")
    touch(1)
    touch(1)  # prompt 1: 2 hits, then untouched the longest (LRU evicts it)
    bm.free("s0")
    bm.free("s2")
    touch(0)  # prompt 0: 1 hit, most recent; prompt 2: 0 hits (LFU evicts it)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 8
    # 6 fresh blocks: the 5 uncached free ones go first, then exactly one cached block is evicted.
    assert bm.allocate_slots("x", 0, 24)
    assert bm.evictions == 1
    assert {i for i, p in enumerate(prompts) if bm.get_cached_prefix(p).num_tokens == 4} == survivors


def test_fork_shares_blocks_and_copy_on_write_splits_the_partial_one():
    bm = BlockManager(16, 4)
    prompt = list(range(6))  # one full block + a partial one
    _run(bm, "p", prompt)
    bm.fork("p", "c")
    assert bm.block_table("c") == bm.block_table("p")
    shared_partial = bm.block_table("p")[1]
    assert bm.ref_count(shared_partial) == 2
    # The child writes slot 6 (inside the shared partial block): it gets a copy.
    assert bm.allocate_slots("c", 6, 1)
    copies = bm.take_copies()
    assert len(copies) == 1 and copies[0][0] == shared_partial
    assert bm.block_table("c")[1] == copies[0][1] != shared_partial
    assert bm.block_table("c")[0] == bm.block_table("p")[0]  # full block still shared
    # The parent is now the only holder of the partial block: it writes in place.
    assert bm.allocate_slots("p", 6, 1)
    assert bm.take_copies() == []
    assert bm.block_table("p")[1] == shared_partial
    _check_refcounts(bm)
    bm.free("p")
    bm.free("c")
    assert bm.num_used_blocks == 0


def test_copy_on_write_counts_against_free_blocks():
    bm = BlockManager(2, 4)
    assert bm.allocate_slots("p", 0, 6)
    bm.fork("p", "c")
    assert not bm.allocate_slots("c", 6, 1)  # the copy needs a free block and there is none
    assert bm.take_copies() == []


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(BlockManagerError, match="eviction"):
        BlockManager(4, 4, eviction="random")
    with pytest.raises(BlockManagerError, match="num_blocks"):
        BlockManager(0, 4)
    bm = BlockManager(4, 4)
    with pytest.raises(BlockManagerError, match="no blocks"):
        bm.block_table("nobody")
    bm.free("nobody")  # freeing a sequence that never got blocks is harmless


def test_random_operations_keep_reference_counts_consistent():
    rng = random.Random(0)
    bm = BlockManager(24, 4, eviction="lru")
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    for step in range(2000):
        op = rng.random()
        live = list(tokens)
        if op < 0.3 or not live:
            sid = f"s{step}"
            # Few distinct prompts so prefixes collide often.
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            hit = bm.get_cached_prefix(prompt)
            if bm.allocate_slots(sid, hit.num_tokens, len(prompt) - hit.num_tokens, hit):
                tokens[sid], computed[sid] = prompt, len(prompt)
                bm.commit(sid, prompt, len(prompt))
        elif op < 0.6:
            sid = rng.choice(live)
            tokens[sid].append(rng.randrange(3))
            if bm.allocate_slots(sid, computed[sid], 1):
                computed[sid] += 1
                bm.commit(sid, tokens[sid], computed[sid])
            else:
                tokens[sid].pop()
        elif op < 0.75:
            sid = rng.choice(live)
            child = f"f{step}"
            bm.fork(sid, child)
            tokens[child], computed[child] = list(tokens[sid]), computed[sid]
        else:
            sid = rng.choice(live)
            bm.free(sid)
            del tokens[sid], computed[sid]
        bm.take_copies()
        _check_refcounts(bm)
        # A cached block's hash always matches the tokens of every sequence that holds it.
        for sid, entry in bm._seqs.items():
            parent = b""
            for i, h in enumerate(entry.hashes):
                expect = block_hash(parent, tokens[sid][i * 4 : (i + 1) * 4])
                assert h == expect
                parent = h
    for sid in list(tokens):
        bm.free(sid)
    assert bm.num_used_blocks == 0
