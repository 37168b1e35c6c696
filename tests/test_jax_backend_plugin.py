"""The JAX backend as a ruvllm plugin: found through its entry point as the default backend, driven
by the engine, copy-on-write of cache blocks, bfloat16 compute, and clear errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
from _gguf_files import write_tiny_llama_gguf
from _jax_fixtures import GreedyDecoder, jax_model_at, load_jax

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm.errors import BackendError, RequestError, RuvllmError
from ruvllm.plugins import load_plugins


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return open_checkpoint(write_tiny_llama_gguf(tmp_path_factory.mktemp("jax") / "tiny.gguf", hidden=64, layers=2))


@pytest.fixture(scope="module")
def tiny_model(tiny):
    return load_jax(tiny)


def test_registered_through_entry_point_as_default():
    host = load_plugins(allowed="")
    rec = {r.name: r for r in host.records}["jax"]
    assert rec.error is None and rec.module == "ruvllm_jax.plugin"
    # The backend object's methods are called directly; the hooks are the backend's registration, the
    # `ruvllm follow` command and releasing a process group at unload (no per-step hook).
    assert set(rec.hooks) == {"register_backends", "register_commands", "model_unloading"}
    info = host.backends["jax"]
    assert info.priority == 100 and info.available()
    assert host.choose_backend().name == "jax"


def test_engine_on_jax_gives_the_direct_greedy_tokens(smollm2_path, smollm2_checkpoint):
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.runtime import LoadedModel
    from ruvllm.sampling import SamplingParams

    host = load_plugins(allowed="jax")
    jax_model = jax_model_at(str(smollm2_path))
    loaded = LoadedModel("smollm2", smollm2_checkpoint, host.backends["jax"], jax_model, host, jax_model.options)
    tok = smollm2_checkpoint.tokenizer()
    prompts = [tok.encode(p) for p in ("The capital of France is", "Water boils at", "1, 2, 3, 5, 8, 13,")]
    engine = LLMEngine(loaded, EngineConfig(block_size=16, num_blocks=48))
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = engine.generate([GenerationRequest(p, sampling) for p in prompts])
    got = [[t for o in req for d in o.deltas for t in d.token_ids] for req in outs]
    assert got == GreedyDecoder(jax_model).run(prompts, 6)


def test_block_copies_duplicate_cache_contents(tiny_model):
    ids = np.arange(3, 13, dtype=np.int32)  # 10 tokens: blocks 0 (full, 4) 1 (full, 4) 2 (2 of 4)
    cache = tiny_model.allocate_cache(8, 4)
    tiny_model.forward(ForwardBatch([SequenceChunk(ids, 0, np.array([5, 1, 6], np.int32))], 4), cache)
    nxt = np.array([42], np.int32)
    # Copy the partly filled last block, then continue the copy and the original the same way.
    batch = ForwardBatch(
        [SequenceChunk(nxt, 10, np.array([5, 1, 6], np.int32)), SequenceChunk(nxt, 10, np.array([5, 1, 3], np.int32))],
        4,
        block_copies=[(6, 3)],
    )
    out = tiny_model.forward(batch, cache)
    np.testing.assert_array_equal(out.logits[0], out.logits[1])
    # Without the copy, block 3 holds nothing of this sequence and the result differs.
    fresh = tiny_model.allocate_cache(8, 4)
    tiny_model.forward(ForwardBatch([SequenceChunk(ids, 0, np.array([5, 1, 6], np.int32))], 4), fresh)
    alone = tiny_model.forward(ForwardBatch([SequenceChunk(nxt, 10, np.array([5, 1, 3], np.int32))], 4), fresh)
    assert not np.allclose(alone.logits[0], out.logits[1])


@pytest.mark.parametrize("dtype, tolerance", [("bfloat16", 0.05), ("float16", 0.006)])
def test_half_precision_compute_stays_close_to_float32(tiny, tiny_model, dtype, tolerance):
    half = load_jax(tiny, dtype=dtype)
    assert half.options.dtype == dtype and half.spec.dtype == dtype
    ids = np.arange(20, 37, dtype=np.int32)
    outs = []
    for m in (tiny_model, half):
        cache = m.allocate_cache(6, 4)
        chunk = SequenceChunk(ids, 0, np.arange(5, dtype=np.int32), all_logits=True)
        outs.append(m.forward(ForwardBatch([chunk], 4), cache).all_logits[0])
    assert outs[1].dtype == np.float32
    assert half.kv_block_bytes(4, {}) * 2 == tiny_model.kv_block_bytes(4, {})  # the cache is half-width too
    scale = np.abs(outs[0]).max()
    # bfloat16 keeps 8 mantissa bits, float16 11: a few percent (tenths of a percent) of the logit
    # range after two layers.
    assert np.abs(outs[1] - outs[0]).max() <= tolerance * scale
    assert not np.array_equal(outs[0], outs[1])  # it really ran in half precision


def test_a_half_width_kv_cache_under_float32_compute(tiny, tiny_model):
    """``kv_cache`` option ``dtype`` (``--kv-cache-dtype``): keys and values stored in bfloat16 while
    the model computes in float32: half the bytes per block, logits within bfloat16's rounding of
    the float32 cache's; prefill then decode over the stored keys."""
    ids = np.arange(20, 37, dtype=np.int32)
    outs = []
    for options in ({}, {"dtype": "auto"}, {"dtype": "bfloat16"}):
        cache = tiny_model.allocate_cache(6, 4, options)
        first = SequenceChunk(ids[:-1], 0, np.arange(5, dtype=np.int32), all_logits=True)
        pre = tiny_model.forward(ForwardBatch([first], 4), cache).all_logits[0]
        last = SequenceChunk(ids[-1:], len(ids) - 1, np.arange(5, dtype=np.int32))
        dec = tiny_model.forward(ForwardBatch([last], 4), cache)
        outs.append(np.concatenate([pre, dec.logits]))
    assert str(tiny_model.allocate_cache(2, 4, {"dtype": "bfloat16"}).state.k.dtype) == "bfloat16"
    assert tiny_model.kv_block_bytes(4, {"dtype": "bfloat16"}) * 2 == tiny_model.kv_block_bytes(4, {})
    np.testing.assert_array_equal(outs[1], outs[0])  # auto: the model's dtype
    scale = np.abs(outs[0]).max()
    assert np.abs(outs[2] - outs[0]).max() <= 0.02 * scale
    assert not np.array_equal(outs[2], outs[0])
    for bad, needle in (({"dtype": "float64"}, "KV cache dtype must be auto or one of"),
                        ({"dtype": "bfloat16", "quantization": "int8"}, "not both"),
                        ({"dtypes": "bfloat16"}, "unknown KV cache option")):  # fmt: skip
        with pytest.raises(BackendError, match=needle):
            tiny_model.kv_block_bytes(4, bad)


def test_dtype_auto_is_float32_on_a_cpu(tiny):
    assert load_jax(tiny, dtype="auto").options.dtype == "float32"


@pytest.mark.parametrize("value, unrolled", [("auto", False), ("true", True), (True, True), ("false", False)])
def test_unroll_layers_is_a_scan_on_a_cpu_unless_asked(tiny, value, unrolled):
    """auto unrolls on CUDA only (where a scanned layer's weights are copied before use); the CUDA
    lowering test lowers the unrolled steps."""
    from ruvllm_jax.runner import unroll_layers_option

    assert load_jax(tiny, extra={"unroll_layers": value}).unroll_layers is unrolled
    assert unroll_layers_option({"unroll_layers": value}, "cuda") is (value != "false")


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(quantization="q3"), "unknown quantization"),
        (dict(dtype="float64"), "dtype"),
        (dict(extra={"tensor_parallel": 64}), "tensor_parallel=64 needs 64 devices"),
        (dict(extra={"attention": "pallas"}), "needs a CUDA device"),
        (dict(extra={"num_threads": 2}), "unknown option"),
        (dict(extra={"threads": 0}), "threads must be a positive integer"),
        (dict(quantization="q8", extra={"keep_gguf_blocks": True}), "keep_gguf_blocks"),
        (dict(extra={"unroll_layers": "sometimes"}), "unroll_layers must be auto, true or false"),
    ],
)
def test_bad_load_options_raise_backend_error(tiny, options, message):
    with pytest.raises(BackendError, match=message):
        load_jax(tiny, **options)


def test_bad_batches_raise_clear_errors(tiny_model):
    cache = tiny_model.allocate_cache(4, 4)
    table = np.array([0, 1], np.int32)

    def run(*chunks, block_size=4):
        return tiny_model.forward(ForwardBatch(list(chunks), block_size), cache)

    with pytest.raises(RequestError, match="cannot hold positions up to 9"):
        run(SequenceChunk(np.arange(9, dtype=np.int32), 0, table))
    with pytest.raises(RequestError, match="token ids must be in"):
        run(SequenceChunk(np.array([1, 9999], np.int32), 0, table))
    with pytest.raises(RequestError, match=r"outside 0\.\.3"):
        run(SequenceChunk(np.array([1], np.int32), 0, np.array([7], np.int32)))
    with pytest.raises(RequestError, match="no tokens"):
        run(SequenceChunk(np.zeros(0, np.int32), 0, table))
    with pytest.raises(BackendError, match="block size 8 differs"):
        run(SequenceChunk(np.array([1], np.int32), 0, table), block_size=8)
    with pytest.raises(BackendError, match="adapters"):
        run(SequenceChunk(np.array([1], np.int32), 0, table, adapter=object()))
    with pytest.raises(RuvllmError):
        tiny_model.allocate_cache(0, 4)


def test_decode_step_logits_are_the_steps_rows_in_chunk_order(tiny_model):
    """A decode step returns its logits without a copy (one pass over the chunks in order): the rows
    are each chunk's own, the same as when the chunks run one at a time."""
    cache = tiny_model.allocate_cache(16, 4)
    tables = [np.array([2 * i, 2 * i + 1], np.int32) for i in range(3)]
    prompts = [np.arange(3, 8, dtype=np.int32) + i for i in range(3)]
    tiny_model.forward(ForwardBatch([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)], 4), cache)
    nxt = [np.array([20 + i], np.int32) for i in range(3)]
    batch = ForwardBatch([SequenceChunk(n, 5, t) for n, t in zip(nxt, tables, strict=True)], 4)
    together = tiny_model.forward(batch, cache).logits
    assert together.shape == (3, tiny_model.spec.vocab_size)
    alone = [
        tiny_model.forward(ForwardBatch([SequenceChunk(n, 5, t)], 4), cache).logits[0]
        for n, t in zip(nxt, tables, strict=True)
    ]
    np.testing.assert_allclose(together, np.stack(alone), rtol=0, atol=1e-5)
    assert not np.allclose(alone[0], alone[1], atol=1e-3)  # the rows are three different sequences'


def test_host_buffers_policy_is_logged_and_can_be_turned_off():
    """On glibc the backend keeps freed large host buffers for reuse (ruvllm_jax.host_memory);
    RUVLLM_JAX_KEEP_HOST_BUFFERS=0 leaves the allocator alone. Each in a fresh process."""
    import os
    import subprocess
    import sys

    code = "from ruvllm_jax.host_memory import keep_large_buffers; print(keep_large_buffers())"
    env = {k: v for k, v in os.environ.items() if k != "RUVLLM_JAX_KEEP_HOST_BUFFERS"}
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    off = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "RUVLLM_JAX_KEEP_HOST_BUFFERS": "0"},
        capture_output=True,
        text=True,
        check=True,
    )
    import platform

    expected = "kept for reuse" if platform.libc_ver()[0] == "glibc" else "allocator default (not glibc)"
    assert on.stdout.strip() == expected
    assert off.stdout.strip() == "allocator default (RUVLLM_JAX_KEEP_HOST_BUFFERS=0)"
