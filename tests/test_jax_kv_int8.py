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
from ruvllm.engine.config import default_num_blocks
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
    jm = tiny.model
    f32, i8 = jm.kv_block_bytes(16), jm.kv_block_bytes(16, {"quantization": "int8"})
    hd = jm.spec.head_dim
    assert f32 / i8 == pytest.approx(4 * hd / (hd + 4 * kv_scale_groups(hd)))  # 3.2x here; 3.2x at SmolLM2's 64
    config = EngineConfig(max_num_seqs=256, kv_cache_memory_bytes=64 * f32, kv_cache_options={"quantization": "int8"})
    engine = LLMEngine(tiny, config)
    assert engine.num_blocks == default_num_blocks(tiny.config, config, engine.max_model_len, i8) == 64 * f32 // i8
    assert engine.cache.state.k.dtype == jnp.int8 and engine.cache.state.k_scale is not None


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
