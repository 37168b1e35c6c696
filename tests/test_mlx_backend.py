"""The mlx backend passes the conformance kit third-party backends run (on MLX's CPU build), comes in
through the entry-point group, and refuses what it does not do in one line naming it: a Metal-only
device on a machine without Metal, the two-tier KV cache, an option it does not know, a dtype."""

from __future__ import annotations

import pytest

from ruvllm.backend import LoadOptions
from ruvllm.checkpoint import open_checkpoint
from ruvllm.errors import BackendError
from ruvllm.plugins import load_plugins
from ruvllm.testing import CHECKS, run_backend_conformance, write_tiny_checkpoint

mx = pytest.importorskip("mlx.core")


def test_mlx_conforms(tmp_path):
    assert run_backend_conformance("mlx", tmp_path) == list(CHECKS)


def test_found_through_its_entry_point_below_the_default_without_metal():
    host = load_plugins()
    backend = host.backends["mlx"]
    assert backend.available() and host.pm.has_plugin("mlx")
    if not mx.metal.is_available():  # picked by name on a CPU, never by default over candle-compat / jax
        assert backend.priority < host.backends["candle-compat"].priority


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return open_checkpoint(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def _load(ckpt, **options):
    return load_plugins().choose_backend("mlx").load(ckpt, LoadOptions(**options))


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"extra": {"threads": 2}}, "threads"),
        ({"extra": {"device": "tpu"}}, "tpu"),
        ({"quantization": "w4a8"}, "w4a8"),
        ({"quantization": "gguf"}, "not GGUF"),
        ({"dtype": "float64"}, "float64"),
    ],
)
def test_what_it_cannot_load_is_refused_by_name(tiny, options, named):
    with pytest.raises(BackendError, match=named) as info:
        _load(tiny, **options)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(mx.metal.is_available(), reason="this machine has Metal")
def test_the_metal_gpu_is_refused_on_a_machine_without_it(tiny):
    with pytest.raises(BackendError, match="'gpu' is Metal-only") as info:
        _load(tiny, extra={"device": "gpu"})
    assert "\n" not in str(info.value)


def test_device_cpu_runs_on_the_cpu_and_the_cache_budget_is_the_hosts(tiny):
    model = _load(tiny, extra={"device": "cpu"})
    assert model.device == mx.cpu
    assert model.device_memory() is None  # the server then sizes the KV cache from available RAM


@pytest.mark.parametrize(
    ("options", "named"),
    [({"quantization": "int8"}, "two-tier"), ({"quantize_old": "int4"}, "two-tier"), ({"paged": 1}, "paged")],
)
def test_kv_cache_options_it_does_not_have_are_refused_by_name(tiny, options, named):
    with pytest.raises(BackendError, match=named):
        _load(tiny).kv_cache(8, 4, options)


def test_rounded_weights_and_16_bit_dtypes_stay_close(tiny, tmp_path):
    """q8 (MLX's 8-bit affine form, group 32) and bfloat16 run and stay near float32's logits."""
    import numpy as np

    from ruvllm.backend import ForwardBatch, SequenceChunk
    from ruvllm.testing import QUANTIZABLE_TINY

    ckpt = open_checkpoint(write_tiny_checkpoint(tmp_path / "q", seed=3, sizes=QUANTIZABLE_TINY))
    ids = np.arange(3, 15, dtype=np.int32)
    outs = {}
    for name, options in {"f32": {}, "q8": {"quantization": "q8"}, "bf16": {"dtype": "bfloat16"}}.items():
        model = _load(ckpt, **options)
        chunk = SequenceChunk(ids, 0, np.arange(4, dtype=np.int32), all_logits=True)
        outs[name] = model.forward(ForwardBatch([chunk], 4), model.kv_cache(4, 4, {})).all_logits[0]
    scale = np.abs(outs["f32"]).max()
    assert np.abs(outs["q8"] - outs["f32"]).max() < 0.05 * scale
    assert np.abs(outs["bf16"] - outs["f32"]).max() < 0.1 * scale


@pytest.mark.parametrize("quantization", ["none", "q8", "q4"])
def test_batch_invariant_bit_for_bit_on_the_cpu(tmp_path, quantization):
    """On MLX's CPU build a row's products, norms and attention do not depend on the other rows of
    the step: a prompt's logits and a decode's are the same bits alone and beside others (the kit's
    quantized_batch_invariance, for mlx's own forms; on Metal this is not claimed)."""
    import numpy as np

    from ruvllm.backend import ForwardBatch, SequenceChunk
    from ruvllm.runtime import load_model
    from ruvllm.testing import QUANTIZABLE_TINY

    path = write_tiny_checkpoint(tmp_path / "t", seed=3, sizes=QUANTIZABLE_TINY)
    model = load_model(
        str(path), backend="mlx", options=LoadOptions(quantization=quantization, extra={"device": "cpu"})
    )
    rng = np.random.default_rng(9)
    ids = rng.integers(3, 97, size=8).tolist()
    others = [rng.integers(3, 97, size=n).tolist() for n in (3, 11, 1, 6, 2)]

    def chunk(s, start, table, **kw):
        return SequenceChunk(np.asarray(s, np.int32), start, np.asarray(table, np.int32), **kw)

    def step(chunks, cache=None):
        return model.forward(ForwardBatch(chunks, 4), cache or model.allocate_cache(48, 4))

    alone = step([chunk(ids, 0, [1, 2], all_logits=True)]).all_logits[0]
    beside = [chunk(o, 0, [10 + 3 * k, 11 + 3 * k, 12 + 3 * k]) for k, o in enumerate(others)]
    crowd = step([beside[0], chunk(ids, 0, [1, 2], all_logits=True), *beside[1:]]).all_logits[1]
    np.testing.assert_array_equal(crowd, alone)
    seqs = [ids, *others]
    tables = [[1, 2, 3, 4]] + [[10 + 4 * k, 11 + 4 * k, 12 + 4 * k, 13 + 4 * k] for k in range(len(others))]
    cache = model.allocate_cache(48, 4)
    step([chunk(s, 0, t) for s, t in zip(seqs, tables, strict=True)], cache)
    nxt = int(np.argmax(alone[-1]))
    one = step([chunk([nxt], len(ids), tables[0])], cache).logits[0]
    many = step(
        [chunk([nxt if k == 0 else 5], len(s), t) for k, (s, t) in enumerate(zip(seqs, tables, strict=True))], cache
    )
    np.testing.assert_array_equal(many.logits[0], one)


def test_a_verification_chunk_gives_the_token_at_a_time_logits(tiny):
    """Speculative decoding's verification chunks (``SequenceChunk.verify``): their logits are the bits
    each position gets decoded alone, so drafts never change greedy output; the cache rewrites
    positions (``kv_rewrites_positions``), so refused drafts are written over."""
    import numpy as np

    from ruvllm.backend import ForwardBatch, SequenceChunk

    model = _load(tiny)
    ids, table = np.arange(3, 18, dtype=np.int32), np.arange(4, dtype=np.int32)

    def prefilled():
        cache = model.kv_cache(8, 4, {})
        model.forward(ForwardBatch([SequenceChunk(ids[:10], 0, table)], 4), cache)
        return cache

    cache = prefilled()
    assert model.kv_rewrites_positions(cache)
    chunk = SequenceChunk(ids[10:15], 10, table, all_logits=True, verify=True)
    verified = model.forward(ForwardBatch([chunk], 4), cache).all_logits[0]
    cache = prefilled()
    one_by_one = [model.forward(ForwardBatch([SequenceChunk(ids[i : i + 1], i, table)], 4), cache).logits[0]
                  for i in range(10, 15)]  # fmt: skip
    np.testing.assert_array_equal(verified, np.stack(one_by_one))


def test_speculative_greedy_output_is_unchanged(smollm2_path):
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.runtime import load_model
    from ruvllm.sampling import SamplingParams

    llm = load_model(str(smollm2_path), backend="mlx", options=LoadOptions(quantization="auto"))
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the")

    def run(speculative):
        engine = LLMEngine(llm, EngineConfig(speculative=speculative, num_blocks=64, max_model_len=256))
        [out] = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=16, temperature=0.0))])
        return [t for o in out for d in o.deltas for t in d.token_ids], engine.stats()

    plain, _ = run(None)
    drafted, stats = run("ngram")
    assert drafted == plain and stats.spec_draft_tokens > 0
