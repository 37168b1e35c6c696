"""The JAX backend's int8 KV cache (issue 14, item 5): int8 codes with one float32 scale per token
and kv head.

- quantize/dequantize against float64 NumPy: every value within half a step of its scale;
- attention over an int8 cache equals float64 attention over the dequantized keys and values (1e-5);
- a model step over an int8 cache stays close to the float cache (a tiny random Llama: logits within
  0.05, the quantization error of its keys and values and nothing else), through chunked prefill,
  prefix-cache hits and n > 1 forks (block copies carry the scales);
- the cache reports its smaller blocks, so the same memory budget holds 3.2x more;
- bad options are refused by name; the server takes ``kv_cache_quantization`` on both backends.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.engine.config import EngineConfigError, default_num_blocks
from ruvllm.errors import BackendError
from ruvllm.sampling import SamplingParams
from ruvllm_jax.attention import reference_paged_attention
from ruvllm_jax.model import KV_SCALE_GROUP, kv_scale_groups, quantize_kv


def _dequantize(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float64 values of int8 codes ``[..., D]`` with group scales ``[..., D // KV_SCALE_GROUP]``."""
    groups = np.repeat(scale.astype(np.float64), KV_SCALE_GROUP, axis=-1)
    return codes.astype(np.float64) * groups


def test_int8_codes_are_within_half_a_step_of_each_value():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 3, 64)).astype(np.float32) * rng.uniform(0.01, 20, (50, 3, 64)).astype(np.float32)
    x[3, 1] = 0.0  # an all-zero head: scales 0, codes 0
    codes, scale = (np.asarray(a) for a in quantize_kv(jnp.asarray(x)))
    assert codes.dtype == np.int8 and scale.shape == (50, 3, 64 // KV_SCALE_GROUP)
    want_scale = np.abs(x.astype(np.float64)).reshape(50, 3, -1, KV_SCALE_GROUP).max(-1) / 127
    np.testing.assert_allclose(scale, want_scale, rtol=1e-6)
    err = np.abs(_dequantize(codes, scale) - x)
    assert (err <= np.repeat(scale, KV_SCALE_GROUP, -1) / 2 * (1 + 1e-5) + 1e-12).all()
    assert (codes[3, 1] == 0).all() and (scale[3, 1] == 0).all()


def test_attention_over_an_int8_cache_is_attention_over_its_dequantized_values():
    from test_jax_pallas_kernels import numpy_attention

    rng = np.random.default_rng(1)
    layers, blocks, bs, kv, hd, heads = 2, 40, 16, 2, 32, 6
    k = rng.standard_normal((layers, blocks, bs, kv, hd)).astype(np.float32)
    v = rng.standard_normal((layers, blocks, bs, kv, hd)).astype(np.float32)
    kc, ks = (np.asarray(a) for a in quantize_kv(jnp.asarray(k)))
    vc, vs = (np.asarray(a) for a in quantize_kv(jnp.asarray(v)))
    k_deq, v_deq = _dequantize(kc, ks), _dequantize(vc, vs)
    contexts = np.asarray([300, 17, 0], np.int32)
    tables = np.zeros((3, 32), np.int32)
    for s, c in enumerate(contexts):
        tables[s, : -(-int(c) // bs)] = rng.choice(blocks, -(-int(c) // bs), replace=False)
    for q_len in (1, 12):
        q = rng.standard_normal((3, q_len, heads, hd)).astype(np.float32)
        q_pos = (np.maximum(contexts, q_len) - q_len)[:, None] + np.arange(q_len, dtype=np.int32)[None]
        got = np.asarray(
            reference_paged_attention(
                q, kc, vc, jnp.int32(1), tables, q_pos, contexts, k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs)
            )
        )
        want = numpy_attention(q, k_deq, v_deq, 1, tables, q_pos, contexts)
        real = q_pos < contexts[:, None]
        np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from _jax_fixtures import write_tiny_hf_model
    from _tiny_served_fixtures import write_word_tokenizer

    from ruvllm.runtime import load_model

    path = write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    write_word_tokenizer(path)
    return load_model(str(path), backend="jax")


def _logits(llm, options, prompt, chunk):
    """Logits of every position, the prompt run in chunks of ``chunk`` (later chunks read the cache)."""
    from ruvllm.backend import ForwardBatch, SequenceChunk

    cache = llm.allocate_cache(32, 16, **options)
    table = np.arange(32, dtype=np.int32)
    out = []
    for start in range(0, len(prompt), chunk):
        ids = np.asarray(prompt[start : start + chunk], np.int32)
        res = llm.forward(ForwardBatch([SequenceChunk(ids, start, table, all_logits=True)], 16), cache)
        out.append(res.all_logits[0])
    return np.concatenate(out)


def test_a_step_over_an_int8_cache_stays_close_to_the_float_cache(tiny):
    prompt = [(5 * i + 3) % 90 + 1 for i in range(120)]
    want = _logits(tiny, {}, prompt, 120)
    for chunk in (120, 7, 1):
        got = _logits(tiny, {"quantization": "int8"}, prompt, chunk)
        assert np.abs(got - want).max() < 0.05
    # The cache is what differs: the float cache, chunked, is the same as in one piece.
    np.testing.assert_allclose(_logits(tiny, {}, prompt, 7), want, atol=2e-5)


def test_forks_and_prefix_hits_read_the_same_int8_blocks_as_a_request_alone(tiny):
    shared = [11] * 40

    def requests(tag):
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        seeded = SamplingParams(max_tokens=6, temperature=0.7, seed=3, n=3, ignore_eos=True)
        return [
            GenerationRequest([*shared, 3, 4, 5], greedy, request_id=f"{tag}a"),
            GenerationRequest([*shared, 6, 7], greedy, request_id=f"{tag}b"),
            GenerationRequest([9, 8, 7] * 7, seeded, request_id=f"{tag}c"),
        ]

    def tokens(outs):
        got: dict[int, list[int]] = {}
        for o in outs:
            for d in o.deltas:
                got.setdefault(d.index, []).extend(d.token_ids)
        return got

    config = EngineConfig(num_blocks=64, kv_cache_options={"quantization": "int8"})
    together = LLMEngine(tiny, config).generate(requests("t"))
    for req, outs in zip(requests("alone"), together, strict=True):
        alone = LLMEngine(tiny, config).generate([req])[0]
        assert tokens(outs) == tokens(alone)


def test_int8_blocks_are_smaller_and_the_budget_holds_more_of_them(tiny):
    from dataclasses import replace

    jm = tiny.model
    f32, i8 = jm.kv_block_bytes(16), jm.kv_block_bytes(16, {"quantization": "int8"})
    hd = jm.spec.head_dim
    assert f32 / i8 == pytest.approx(4 * hd / (hd + 4 * kv_scale_groups(hd)))  # 3.2x here; 3.2x at SmolLM2's 64
    one_tier = {"quantization": "int8", "recent_blocks": 0}
    config = EngineConfig(max_num_seqs=256, kv_cache_memory_bytes=64 * f32, kv_cache_options=one_tier)
    engine = LLMEngine(tiny, config)
    assert engine.num_blocks == default_num_blocks(tiny.config, config, engine.max_model_len, i8) == 64 * f32 // i8
    assert engine.cache.state.k.dtype == jnp.int8 and engine.cache.state.k_scale is not None
    assert engine.cache.state.hot_k is None and engine.cache.nbytes == engine.kv_cache_bytes
    # Two tiers (int8's default): float slots for each sequence's 2 recent blocks and its tail block
    # come off the budget first; the rest is int8 blocks.
    two = EngineConfig(max_num_seqs=4, kv_cache_memory_bytes=64 * f32, kv_cache_options={"quantization": "int8"})
    engine = LLMEngine(tiny, two)
    assert engine.cache.state.hot_k.shape[1] == 4 * (2 + 1) and engine.cache.hot.slots == 12
    rest = replace(two, kv_cache_memory_bytes=(64 - 12) * f32)
    assert engine.num_blocks == default_num_blocks(tiny.config, rest, engine.max_model_len, i8)
    assert engine.cache.nbytes == engine.kv_cache_bytes == 12 * f32 + engine.num_blocks * i8
    with pytest.raises(EngineConfigError, match="fixed part"):
        LLMEngine(tiny, replace(two, max_num_seqs=64))


def test_two_tiers_read_the_recent_blocks_at_full_precision(tiny):
    """Recent blocks come from their float slots: with every block recent the two-tier cache gives the
    float cache's logits (the slots hold exactly what was written), and with the default 2 recent
    blocks the logits are closer to the float cache's than with every block read from int8 codes."""
    prompt = [(5 * i + 3) % 90 + 1 for i in range(120)]
    want = _logits(tiny, {}, prompt, 120)
    everything = {"quantization": "int8", "recent_blocks": 8, "hot_blocks": 16}
    for chunk in (7, 1):
        np.testing.assert_allclose(_logits(tiny, everything, prompt, chunk), want, atol=2e-5)
    one = np.abs(_logits(tiny, {"quantization": "int8", "recent_blocks": 0}, prompt, 1) - want)
    two = np.abs(_logits(tiny, {"quantization": "int8"}, prompt, 1) - want)
    assert two.max() < 0.05 and two.mean() < 0.8 * one.mean()
    # The first 3 blocks' positions read only recent blocks: exact there, as the float cache.
    np.testing.assert_allclose(two[: 3 * 16], 0, atol=2e-5)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"quantization": "int4"}, "'none' or 'int8'"),
        ({"quantize_old": "int8"}, "unknown KV cache option(s) quantize_old"),
    ],
)
def test_bad_kv_options_are_refused_by_name(tiny, options, words):
    with pytest.raises(BackendError, match=words.replace("(", r"\(").replace(")", r"\)")):
        tiny.allocate_cache(8, 16, **options)


@pytest.mark.parametrize("backend", ["jax", "candle-compat"])
def test_the_server_serves_from_a_quantized_kv_cache(tmp_path, backend):
    import httpx
    from _candle_compat_fixtures import write_tiny_hf_checkpoint
    from _server_fixtures import live_server
    from _tiny_served_fixtures import write_word_tokenizer

    from ruvllm.runtime import load_model

    write_tiny_hf_checkpoint(tmp_path, layers=2, hidden=48, vocab=97, max_positions=128)
    write_word_tokenizer(tmp_path)
    model = load_model(str(tmp_path), backend=backend)
    with live_server(model, kv_cache_quantization="int8", num_kv_blocks=32, precompile=False) as srv:
        body = {"model": "smollm2", "prompt": "w1 w2 w3 " * 10, "max_tokens": 5, "temperature": 0}
        r = httpx.post(srv.url("/v1/completions"), json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        cache = srv.app.state["ruvllm"].engine.engine.cache
        if backend == "jax":
            assert cache.state.k.dtype == jnp.int8
        else:
            assert type(cache).__name__ == "TwoTierKVCache"


def test_attention_reads_slotted_blocks_from_their_float_copies():
    """The reference attention over an int8 cache with float slots = float64 attention over keys and
    values where each table entry with a slot reads the slot's floats and every other its codes."""
    from test_jax_pallas_kernels import numpy_attention

    rng = np.random.default_rng(4)
    layers, blocks, bs, kvh, hd, heads, slots = 2, 12, 4, 2, 32, 4, 5
    k = rng.standard_normal((layers, blocks, bs, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((layers, blocks, bs, kvh, hd)).astype(np.float32)
    kc, ks = (np.asarray(a) for a in quantize_kv(jnp.asarray(k)))
    vc, vs = (np.asarray(a) for a in quantize_kv(jnp.asarray(v)))
    hot_k = rng.standard_normal((layers, slots, bs, kvh, hd)).astype(np.float32)
    hot_v = rng.standard_normal((layers, slots, bs, kvh, hd)).astype(np.float32)
    tables = np.array([[3, 7, 1, 0], [5, 2, 9, 11], [4, 6, 8, 10]], np.int32)
    hot_tables = np.array([[-1, -1, 2, 0], [-1, 4, 1, -1], [-1, -1, -1, -1]], np.int32)
    contexts = np.array([15, 13, 9], np.int32)
    k_mix, v_mix = _dequantize(kc, ks), _dequantize(vc, vs)
    for s_, row in enumerate(hot_tables):  # the reference reads each sequence's own blocks
        for j, slot in enumerate(row):
            if slot >= 0:
                k_mix[:, tables[s_, j]] = hot_k[:, slot]
                v_mix[:, tables[s_, j]] = hot_v[:, slot]
    for q_len in (1, 5):
        q = rng.standard_normal((3, q_len, heads, hd)).astype(np.float32)
        q_pos = (contexts - q_len)[:, None] + np.arange(q_len, dtype=np.int32)[None]
        got = reference_paged_attention(
            q,
            kc,
            vc,
            jnp.int32(1),
            tables,
            q_pos,
            contexts,
            k_scale=jnp.asarray(ks),
            v_scale=jnp.asarray(vs),
            hot=(jnp.asarray(hot_k), jnp.asarray(hot_v), jnp.asarray(hot_tables)),
        )
        want = numpy_attention(q, k_mix, v_mix, 1, tables, q_pos, contexts)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


def test_float_slots_follow_fresh_recent_blocks():
    from ruvllm_jax.two_tier import HotSlots

    hot = HotSlots(slots=4, recent=1, block_size=4)
    table = [10, 11, 12, 13, 14]
    # A 9-token prompt: blocks 1 and 2 are recent (tail and one behind); block 0 is written cold.
    assert hot.plan([(table, 0, 9)]) == {11: 0, 12: 1}
    # Decoding on: block 2 fills, block 3 is fresh at position 12 and block 1 ages out.
    for pos in range(9, 13):
        slots = hot.plan([(table, pos, pos + 1)])
    assert slots == {12: 1, 13: 0}
    # Another sequence sharing block 12 (a prefix hit) keeps it recent; its own fresh block 20 takes
    # a free slot.
    other = [10, 11, 12, 20]
    slots = hot.plan([(table, 13, 14), (other, 12, 13)])
    assert slots == {12: 1, 13: 0, 20: 2}
    # A recent block written before without a slot (block 0 of the prompt, written cold) gets none.
    assert 10 not in hot.plan([([10, 60], 4, 5)])
    # Copy-on-write: a slotted source gives the destination a slot to copy into; an unslotted
    # source takes the destination's away.
    pair = hot.copy(13, 30)
    assert pair is not None and pair[0] == slots[13] and hot.assigned[30] == pair[1]
    assert hot.copy(99, 30) is None and 30 not in hot.assigned
    # Full: a fresh block takes the least recently needed slot, never one this pass needs.
    for b in (40, 41, 42, 43):
        hot.plan([([b], 0, 1)])
    assert len(hot.assigned) == 4 and set(hot.assigned) == {40, 41, 42, 43}
    assert set(hot.plan([([50, 51], 0, 8), ([43], 1, 2)])) == {42, 43, 50, 51}
