"""Sliding windows in the paged cache: for a model whose every layer is windowed, blocks that fall
wholly behind the window are released as a sequence grows, cached ones stay available to prefix
hits, and generation through the engine (chunked prefill, prefix caching, decode across released
blocks) still computes what transformers computes, on both backends."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from _family_checkpoints import hf_all_logits, write_family_checkpoint

from ruvllm.block_manager import NO_BLOCK, BlockManager


def _check_refcounts(bm: BlockManager) -> None:
    held = Counter(b for entry in bm._seqs.values() for b in entry.table if b != NO_BLOCK)
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == held.get(b, 0), f"block {b}"
    assert bm.num_used_blocks == len(held)


def _live(bm: BlockManager, seq) -> list[int]:
    return [b for b in bm.block_table(seq) if b != NO_BLOCK]


def test_blocks_behind_the_window_are_released_as_the_sequence_grows():
    bm = BlockManager(16, 4, sliding_window=6, enable_prefix_caching=False)
    assert bm.allocate_slots("a", 0, 10)  # prefill 10 tokens: blocks 0..2, all still needed
    assert len(_live(bm, "a")) == 3
    for pos in range(10, 60):  # decode: the token at pos reads keys pos-5 .. pos
        assert bm.allocate_slots("a", pos, 1)
        table = bm.block_table("a")
        first = (pos - 5) // 4
        assert all(b == NO_BLOCK for b in table[:first]) and NO_BLOCK not in table[first:]
        assert len(_live(bm, "a")) <= bm.peak_blocks(pos + 1, 1) == 3
        _check_refcounts(bm)
    assert bm.num_used_blocks == 2  # position 59 reads 54..59: blocks 13 and 14
    bm.free("a")
    assert bm.num_free_blocks == 16


def test_peak_blocks_bounds_chunked_prefill():
    bm = BlockManager(64, 4, sliding_window=8)
    assert bm.peak_blocks(10, 16) == 3 and bm.peak_blocks(1000, 16) == 7 and bm.peak_blocks(1000, 1) == 3
    assert BlockManager(64, 4).peak_blocks(1000, 16) == 250


def test_released_cached_blocks_serve_prefix_hits_and_forks_skip_released_entries():
    bm = BlockManager(32, 4, sliding_window=5)
    prompt = list(range(100, 130))
    assert bm.allocate_slots("a", 0, len(prompt))
    bm.commit("a", prompt, len(prompt))
    assert bm.allocate_slots("a", 30, 1)  # the next step releases what the window left behind
    assert bm.block_table("a")[:6] == [NO_BLOCK] * 6
    hit = bm.get_cached_prefix(prompt)  # every released full block is still cached
    assert hit.num_tokens == 28
    assert bm.allocate_slots("b", hit.num_tokens, 2, hit)
    assert bm.block_table("b")[:5] == [NO_BLOCK] * 5  # taken and released again past its window
    bm.fork("b", "c")
    _check_refcounts(bm)
    for seq in ("a", "b", "c"):
        bm.free(seq)
    _check_refcounts(bm)
    assert bm.num_free_blocks == 32


def test_random_workload_keeps_reference_counts_exact():
    rng = random.Random(5)
    bm = BlockManager(40, 4, sliding_window=7)
    prompts = {}
    pos = {}
    for step in range(400):
        live = list(pos)
        if live and rng.random() < 0.1:
            seq = rng.choice(live)
            bm.free(seq)
            del pos[seq]
            continue
        if len(pos) < 4 and rng.random() < 0.3:
            seq = f"s{step}"
            prompts[seq] = [rng.randrange(3) for _ in range(rng.randrange(2, 20))]
            hit = bm.get_cached_prefix(prompts[seq])
            if bm.allocate_slots(seq, hit.num_tokens, len(prompts[seq]) - hit.num_tokens, hit):
                pos[seq] = len(prompts[seq])
                bm.commit(seq, prompts[seq], pos[seq])
            continue
        if live:
            seq = rng.choice(live)
            prompts[seq].append(rng.randrange(3))
            if bm.allocate_slots(seq, pos[seq], 1):
                pos[seq] += 1
                bm.commit(seq, prompts[seq], pos[seq])
        _check_refcounts(bm)
        for seq, n in pos.items():
            assert len(_live(bm, seq)) <= bm.peak_blocks(n + 1, 20)


@pytest.mark.parametrize("backend", ["candle-compat", "jax"])
def test_engine_releases_blocks_and_still_matches_transformers(backend, tmp_path, smollm2_checkpoint):
    """Mistral-style model, window 5, blocks of 4: prompts of 23 tokens prefilled in chunks of 8,
    40 tokens decoded; the second request shares the first's prompt (prefix hit on released, cached
    blocks). Each continuation is transformers' greedy one, and no sequence ever holds more than its
    window's blocks."""
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model
    from ruvllm.sampling import SamplingParams

    path = write_family_checkpoint(tmp_path / "mistral", "mistral")
    llm = load_model(str(path), backend=backend, host=load_plugins(backend))
    assert llm.config.uniform_window == 5
    engine = LLMEngine(
        llm,
        EngineConfig(num_blocks=24, block_size=4, max_num_batched_tokens=8, max_num_seqs=2),
        tokenizer=smollm2_checkpoint.tokenizer(),  # the tiny model has none; ids < 101 decode fine
    )
    bm = engine.block_manager
    rng = np.random.default_rng(11)
    prompt = rng.integers(3, 101, size=23).tolist()
    other = prompt[:16] + rng.integers(3, 101, size=7).tolist()
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for p in (prompt, other):
        engine.add_request(GenerationRequest(list(p), sampling))
    tokens: dict[str, list[int]] = {}
    peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(t for d in out.deltas for t in d.token_ids)
        peak = max(peak, bm.num_used_blocks)
    assert peak <= 2 * bm.peak_blocks(23 + 40, 8) < 2 * bm.blocks_needed(23 + 40)
    assert engine.scheduler.prefix_cache_hit_tokens >= 16
    for p, ours in zip((prompt, other), tokens.values(), strict=True):
        want = hf_all_logits(path, p + ours)[len(p) - 1 : -1].argmax(-1).tolist()
        assert ours == want
