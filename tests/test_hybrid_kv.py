"""The hybrid KV cache for models that interleave windowed and global layers (issue 12; Gemma 3's
5 local : 1 global): the global layers keep every block in one pool, the windowed layers keep their
window's blocks in a pool of their own (vLLM's hybrid KV cache manager is the reference design), so
the memory count reflects which layers keep everything.

``HybridBlockManager`` on its own (allocation in both groups or neither, releases, prefix hits that
need the window's blocks), then the engine on a random Gemma-3 checkpoint written through
transformers (7 layers: 0-4 and 6 windowed, window 6, blocks of 4) on the backend that keeps the two
pools: chunked prefill, prefix caching and decode far past the window give transformers' greedy
tokens, the windowed pool holds about a window per sequence, and the cache holds what was counted.
"""

from __future__ import annotations

import numpy as np
import pytest
from _family_checkpoints import hf_all_logits, write_family_checkpoint

from ruvllm.block_manager import NO_BLOCK, HybridBlockManager


def _refcounts_exact(bm: HybridBlockManager) -> None:
    for group in (bm.full, bm.local):
        held = [0] * group.num_blocks
        for entry in group._seqs.values():
            for b in entry.table:
                if b != NO_BLOCK:
                    held[b] += 1
        assert held == [group.ref_count(b) for b in range(group.num_blocks)]


def test_the_windowed_group_releases_what_the_global_group_keeps():
    bm = HybridBlockManager(num_blocks=20, local_blocks=8, block_size=4, sliding_window=6)
    ids = list(range(100, 140))
    computed = 0
    for n in (8, 8, 8, 1, 1, 1, 1):  # chunked prefill, then decode
        assert bm.allocate_slots("a", computed, n)
        computed += n
        bm.commit("a", ids, computed)
    full, local = bm.block_table("a"), bm.local_block_table("a")
    assert NO_BLOCK not in full and len(full) == bm.blocks_needed(computed)
    live = [b for b in local if b != NO_BLOCK]
    assert local[: bm.local.first_live_block(computed - 1)] == [NO_BLOCK] * bm.local.first_live_block(computed - 1)
    assert len(live) <= bm.local.peak_blocks(computed, 8)
    assert bm.peak_blocks(40, 8) == (10, bm.local.peak_blocks(40, 8))
    _refcounts_exact(bm)
    bm.free("a")
    assert bm.full.num_used_blocks == bm.local.num_used_blocks == 0


def test_an_allocation_happens_in_both_groups_or_in_neither():
    bm = HybridBlockManager(num_blocks=20, local_blocks=3, block_size=4, sliding_window=6)
    assert not bm.allocate_slots("a", 0, 16)  # 4 blocks: the windowed pool has 3
    assert not bm.has("a") and bm.full.num_free_blocks == 20 and bm.local.num_free_blocks == 3
    assert bm.allocate_slots("a", 0, 8)
    assert not bm.allocate_slots("b", 0, 8)  # the windowed pool is the short one now
    assert not bm.has("b") and bm.full.num_used_blocks == 2


def test_a_prefix_hit_needs_the_windows_blocks_in_the_windowed_group():
    bm = HybridBlockManager(num_blocks=32, local_blocks=32, block_size=4, sliding_window=6)
    ids = list(range(1, 30))
    assert bm.allocate_slots("a", 0, 28)
    bm.commit("a", ids, 28)
    bm.free("a")
    hit = bm.get_cached_prefix(ids)
    assert hit.num_tokens == 28  # (the last token is always left to compute: 29 tokens, 7 full blocks)
    lo = bm.local.first_live_block(28)
    assert hit.local.block_ids[:lo] == [NO_BLOCK] * lo and NO_BLOCK not in hit.local.block_ids[lo:]
    assert bm.allocate_slots("b", 28, 1, hit)
    assert bm.block_table("b")[:7] == hit.full.block_ids
    _refcounts_exact(bm)
    bm.free("b")
    # The windowed group loses the window's blocks of that prefix: the hit shrinks to where it has them.
    bm.local.reset_prefix_cache()
    assert bm.get_cached_prefix(ids).num_tokens == 0


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return write_family_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3")


def _run_engine(llm, smollm2_checkpoint, kv_options=None, memory=2**16, precompile=False):
    """The tiny Gemma-3 on ``llm`` through the engine: two prompts sharing a 16-token prefix, chunked
    prefill of 8 and 30 decoded tokens each, far past the window. Returns the engine, each request's
    tokens with their logprobs, and the windowed pool's peak use."""
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.sampling import SamplingParams

    cfg = llm.config
    assert cfg.hybrid_window == 6 and cfg.local_layers == (0, 1, 2, 3, 4, 6)
    engine = LLMEngine(
        llm,
        EngineConfig(
            block_size=4,
            max_num_batched_tokens=8,
            max_num_seqs=2,
            kv_cache_memory_bytes=memory,
            kv_cache_options=kv_options or {},
        ),
        tokenizer=smollm2_checkpoint.tokenizer(),  # the tiny model has none; ids < 101 decode fine
    )
    if precompile:  # then the run compiles nothing: the hybrid steps are in the precompiled set
        engine.precompile()
        compiled = (llm.model.compiled_steps.stats.count, llm.model.block_copier.programs.stats.count)
    bm = engine.block_manager
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 101, size=23).tolist()
    other = prompt[:16] + rng.integers(3, 101, size=7).tolist()
    sampling = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=0)
    for p in (prompt, other):
        engine.add_request(GenerationRequest(list(p), sampling))
    got: dict[str, tuple[list[int], list[float]]] = {}
    local_peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            toks, lps = got.setdefault(out.request_id, ([], []))
            for d in out.deltas:
                toks.extend(d.token_ids)
                lps.extend(lp.logprob for lp in d.logprobs or ())
        if engine.hybrid:
            local_peak = max(local_peak, bm.local.num_used_blocks)
            _refcounts_exact(bm)
    assert engine.scheduler.prefix_cache_hit_tokens >= 16
    assert engine.scheduler.preemptions == 0
    if precompile:
        assert (llm.model.compiled_steps.stats.count, llm.model.block_copier.programs.stats.count) == compiled
    assert engine.block_manager.num_used_blocks == 0 if not engine.hybrid else bm.full.num_used_blocks == 0
    return engine, (prompt, other), list(got.values()), local_peak


def _check_pools(engine, llm, kv_options=None) -> None:
    cfg = llm.config
    # (A two-tier int8 cache holds float slots besides its blocks: a fixed part of the budget.)
    reserved, _ = llm.kv_reserve(4, 2, **(kv_options or {}))
    assert engine.hybrid and engine.cache.local_blocks == engine.local_blocks
    assert engine.cache.nbytes == engine.kv_cache_bytes <= 2**16  # what was allocated is what was counted
    # The global layers' pool holds whole sequences; the windowed layers' a window and a step each.
    assert engine.local_blocks < engine.num_blocks
    layer_bytes = engine.block_bytes // cfg.num_layers
    # 4x the context one pool of every layer gives, or (int8 KV) every sequence's whole context.
    assert engine.num_blocks > 4 * (2**16 // engine.block_bytes) or engine.num_blocks == 2 * 256 // 4
    assert engine.kv_cache_bytes == reserved + layer_bytes * (engine.num_blocks + 6 * engine.local_blocks)
    stats = engine.stats()
    assert stats.local_blocks_total == engine.local_blocks and stats.blocks_total == engine.num_blocks


@pytest.mark.parametrize(
    ("backend", "extra"),
    [("candle-compat", {}), ("jax", {}), ("jax", {"attention": "pallas_interpret"})],
    ids=["candle-compat", "jax", "jax-pallas-interpret"],
)
def test_engine_on_gemma3_matches_transformers_with_two_pools(gemma3_dir, smollm2_checkpoint, backend, extra):
    from ruvllm.backend import LoadOptions
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    llm = load_model(str(gemma3_dir), backend=backend, host=load_plugins(backend), options=LoadOptions(extra=extra))
    engine, prompts, got, local_peak = _run_engine(llm, smollm2_checkpoint, precompile=backend == "jax")
    _check_pools(engine, llm)
    bm = engine.block_manager
    assert local_peak <= 2 * bm.local.peak_blocks(23 + 30, 8) < 2 * bm.blocks_needed(23 + 30)
    for p, (ours, _) in zip(prompts, got, strict=True):
        want = hf_all_logits(gemma3_dir, p + ours)[len(p) - 1 : -1].argmax(-1).tolist()
        assert ours == want


@pytest.mark.parametrize(
    ("quantization", "kv_options"),
    [("w8a8", {}), ("none", {"quantization": "int8"}), ("none", {"quantization": "int8", "recent_blocks": 0})],
    ids=["native-kernels", "int8-kv-two-tiers", "int8-kv-one-tier"],
)
def test_jax_two_pools_give_what_one_pool_gives(gemma3_dir, smollm2_checkpoint, monkeypatch, quantization, kv_options):
    """Where the arithmetic is not transformers' (the native kernels on quantized weights, an int8 KV
    cache), the two pools give exactly what one pool of every layer gives: the same keys and values,
    only stored elsewhere. Same tokens, same logprobs to the bit."""
    import dataclasses

    from ruvllm.backend import LoadOptions
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model
    from ruvllm_jax import native
    from ruvllm_jax.runner import JaxModel

    if quantization == "w8a8" and not native.has_vector_path():
        pytest.skip("the native kernels run w8a8 only on a vector path")
    llm = load_model(
        str(gemma3_dir), backend="jax", host=load_plugins("jax"), options=LoadOptions(quantization=quantization)
    )
    assert llm.model.native == (quantization == "w8a8")
    hybrid, _, two, _ = _run_engine(llm, smollm2_checkpoint, kv_options)
    _check_pools(hybrid, llm, kv_options)
    caps = JaxModel.capabilities.fget
    one_pool = property(lambda self: dataclasses.replace(caps(self), hybrid_kv=False))
    monkeypatch.setattr(JaxModel, "capabilities", one_pool)
    # (One pool needs 4x the memory to hold both sequences whole, as the hybrid cache does: no preemption.)
    single, _, one, _ = _run_engine(llm, smollm2_checkpoint, kv_options, memory=2**18)
    assert not single.hybrid and single.cache.local_blocks == 0
    assert single.scheduler.prefix_cache_hit_tokens == hybrid.scheduler.prefix_cache_hit_tokens
    assert two == one and all(len(lps) == 30 for _, lps in two)


def test_jax_hybrid_cache_refuses_what_it_cannot_hold(gemma3_dir, tmp_path):
    import dataclasses

    from ruvllm.backend import ForwardBatch, SequenceChunk
    from ruvllm.errors import BackendError, RequestError
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    llm = load_model(str(gemma3_dir), backend="jax", host=load_plugins("jax"))
    model = llm.model
    cache = model.allocate_cache(8, 4, {"local_blocks": 3})
    assert cache.state.k.shape[0] == 1 and cache.state.local.k.shape[:2] == (6, 3)
    chunk = SequenceChunk(np.arange(3, 8, dtype=np.int32), 0, np.array([0, 1], np.int32))
    with pytest.raises(RequestError, match="local_block_table"):
        model.forward(ForwardBatch([chunk], block_size=4), cache)
    far = dataclasses.replace(chunk, local_block_table=np.array([0, 5], np.int32))
    with pytest.raises(RequestError, match=r"outside 0\.\.2"):
        model.forward(ForwardBatch([far], block_size=4), cache)
    # Copy-on-write in both pools, in one compiled copy.
    written = dataclasses.replace(chunk, local_block_table=np.array([2, 1], np.int32))
    model.forward(ForwardBatch([written], block_size=4), cache)
    model.forward(ForwardBatch([], block_size=4, block_copies=[(0, 5)], local_block_copies=[(2, 0)]), cache)
    g, loc = np.asarray(cache.state.k), np.asarray(cache.state.local.k)
    assert np.abs(g[:, 0]).sum() > 0 and np.array_equal(g[:, 5], g[:, 0])
    assert np.abs(loc[:, 2]).sum() > 0 and np.array_equal(loc[:, 0], loc[:, 2])
    with pytest.raises(RequestError, match="local_block_copies"):
        model.forward(ForwardBatch([], block_size=4, local_block_copies=[(0, 1)]), model.allocate_cache(8, 4))
    llama = load_model(str(write_family_checkpoint(tmp_path, "llama3")), backend="jax", host=load_plugins("jax"))
    with pytest.raises(BackendError, match="interleaves windowed and global layers"):
        llama.model.allocate_cache(8, 4, {"local_blocks": 3})
