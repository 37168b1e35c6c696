"""An untrained SONA adapter changes nothing, bit for bit; a trained one adds exactly its low-rank
update; snapshots cannot be changed after the fact."""

from __future__ import annotations

import numpy as np
import pytest
from _sona_fixtures import random_entries, sona_net, sona_smollm2

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.inference import InferenceRequest
from ruvllm.sampling import SamplingParams
from ruvllm_sona import Sona, SonaAdapter, SonaConfig
from ruvllm_sona.sona import ADAPTER_METADATA_KEY


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return sona_smollm2(str(smollm2_path)), sona_net(str(smollm2_path))


def _prefill_and_decode(model, ids, next_id, adapter):
    cache = model.allocate_cache(8, 16)
    table = np.arange(8, dtype=np.int32)
    pre = model.forward(ForwardBatch([SequenceChunk(np.asarray(ids, np.int32), 0, table, all_logits=True,
                                                    adapter=adapter)], 16), cache)
    dec = model.forward(ForwardBatch([SequenceChunk(np.asarray([next_id], np.int32), len(ids), table,
                                                    adapter=adapter)], 16), cache)
    return pre.all_logits[0], dec.logits[0]


def test_all_zero_adapter_gives_bit_identical_logits(smollm2):
    model, net = smollm2
    sona = Sona(model.checkpoint, SonaConfig(projections=("q_proj", "k_proj", "v_proj", "o_proj"), num_layers=4),
                start=False, net=net)
    adapter = sona.adapter()
    assert adapter.is_zero and len(adapter.entries) == 16
    assert adapter.lora_params() == {}
    x = np.ones((3, 576), np.float32)
    assert all(adapter.delta(li, p, x) is None for li, p in adapter.entries)

    ids = model.tokenizer.encode("Bit for bit, the adapter must not change a thing:")
    base_pre, base_dec = _prefill_and_decode(model, ids, 42, None)
    with_pre, with_dec = _prefill_and_decode(model, ids, 42, adapter)
    assert np.array_equal(base_pre, with_pre)
    assert np.array_equal(base_dec, with_dec)


def test_pre_inference_attaches_only_non_zero_adapters(smollm2):
    model, net = smollm2
    sona = Sona(model.checkpoint, SonaConfig(), start=False, net=net)
    request = InferenceRequest("r1", [1, 2, 3], SamplingParams())
    sona.pre_inference(request)
    # A zero adapter is left off so the request stays prefix-cacheable; the snapshot is still kept.
    assert request.adapter is None
    assert request.metadata[ADAPTER_METADATA_KEY] is sona.adapter()
    assert request.metadata["sona"] == {"scope": "global", "adapter_version": 0}


def test_non_zero_adapter_adds_exactly_its_low_rank_update(smollm2):
    model, net = smollm2
    entries = random_entries(net, [(29, "q_proj"), (29, "v_proj")], seed=2, size=0.1)
    adapter = SonaAdapter("global", 3, entries)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 576)).astype(np.float32)
    for key, f in entries.items():
        ref = f.scale * (x.astype(np.float64) @ f.A.T.astype(np.float64)) @ f.B.T.astype(np.float64)
        np.testing.assert_allclose(adapter.delta(*key, x), ref, rtol=1e-5, atol=1e-6)
        a, b, scale = adapter.lora_params()[key]
        assert np.array_equal(a, f.A) and np.array_equal(b, f.B) and scale == f.scale
    assert adapter.delta(29, "k_proj", x) is None
    assert adapter.delta(3, "q_proj", x) is None

    ids = model.tokenizer.encode("A trained adapter changes the logits:")
    base, _ = _prefill_and_decode(model, ids, 7, None)
    adapted, _ = _prefill_and_decode(model, ids, 7, adapter)
    assert np.abs(adapted - base).max() > 1e-3


def test_snapshots_are_immutable_copies(smollm2):
    _, net = smollm2
    entries = random_entries(net, [(29, "v_proj")], seed=4)
    adapter = SonaAdapter("global", 1, entries)
    before = adapter.delta(29, "v_proj", np.ones((1, 576), np.float32))
    entries[(29, "v_proj")].B[...] = 0.0  # the learner's arrays change; the snapshot must not
    np.testing.assert_array_equal(adapter.delta(29, "v_proj", np.ones((1, 576), np.float32)), before)
    with pytest.raises(ValueError):
        adapter.entries[(29, "v_proj")].B[0, 0] = 1.0


# -- the same on the JAX backend, which applies adapters through lora_params() in its compiled step --

JAX_PROMPT = "Bit for bit, the adapter must not change a thing:"


@pytest.fixture(scope="module")
def jax_smollm2(smollm2_path):
    pytest.importorskip("ruvllm_jax")
    from _jax_fixtures import jax_model_at

    return jax_model_at(str(smollm2_path))


def test_all_zero_adapter_gives_bit_identical_logits_on_jax(smollm2, jax_smollm2):
    model, net = smollm2
    sona = Sona(model.checkpoint, SonaConfig(projections=("q_proj", "v_proj", "down_proj"), num_layers=4),
                start=False, net=net)
    adapter = sona.adapter()
    assert adapter.is_zero and adapter.lora_params() == {}
    ids = model.tokenizer.encode(JAX_PROMPT)
    base_pre, base_dec = _prefill_and_decode(jax_smollm2, ids, 42, None)
    buckets = jax_smollm2.compiled_buckets
    with_pre, with_dec = _prefill_and_decode(jax_smollm2, ids, 42, adapter)
    assert np.array_equal(base_pre, with_pre)
    assert np.array_equal(base_dec, with_dec)
    assert jax_smollm2.compiled_buckets == buckets  # the no-adapter steps themselves ran


def test_non_zero_adapter_changes_jax_logits_as_it_changes_numpy_backend_logits(smollm2, jax_smollm2):
    model, net = smollm2
    adapter = SonaAdapter("global", 3, random_entries(net, [(29, "q_proj"), (29, "v_proj"), (28, "down_proj")],
                                                      seed=2, size=0.1))
    ids = model.tokenizer.encode(JAX_PROMPT)
    np_base, np_with = _prefill_and_decode(model, ids, 42, None), _prefill_and_decode(model, ids, 42, adapter)
    jax_base, jax_with = _prefill_and_decode(jax_smollm2, ids, 42, None), _prefill_and_decode(jax_smollm2, ids, 42,
                                                                                              adapter)
    for i in range(2):  # prefill (every position), then the decode step
        change = np_with[i] - np_base[i]
        assert np.abs(change).max() > 0.05
        # SmolLM2's logits reach ~30: the backends agree to 1e-3 absolute (test_jax_smollm2_parity).
        np.testing.assert_allclose(jax_with[i], np_with[i], rtol=0, atol=1e-3)
        np.testing.assert_allclose(jax_with[i] - jax_base[i], change, rtol=0, atol=1e-3)
