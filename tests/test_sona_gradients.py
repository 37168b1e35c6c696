"""SONA's hand-written LoRA forward and backward against independent references: the candle-compat
backend's logits with the same adapter applied through ``delta``, and float64 autograd through
Hugging Face transformers with the factors hooked onto its projections.

Tolerances: SONA computes in float32; relative errors of gradients are measured against the largest
reference entry of each factor (typically 1e-6 .. 1e-5 here, bounded at 1e-4)."""

from __future__ import annotations

import numpy as np
import pytest
from _candle_compat_fixtures import write_tiny_hf_checkpoint
from _sona_fixtures import hf_float64, hf_weighted_loglik_grads, random_entries, sona_net, sona_smollm2

from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm_sona.capture import capture_trajectory, instant_gradient
from ruvllm_sona.lora import SonaAdapter
from ruvllm_sona.model import PROJECTIONS, LoraLlama

GRAD_RTOL = 1e-4


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-12))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_every_projection_gradient_matches_float64_autograd(tmp_path, model_type):
    """All seven projections of every layer adapted, gradient through the whole model."""
    ckpt = open_checkpoint(write_tiny_hf_checkpoint(tmp_path / model_type, model_type=model_type, layers=2, hidden=48))
    net = LoraLlama.from_checkpoint(ckpt)
    keys = [(li, p) for li in range(2) for p in PROJECTIONS]
    entries = random_entries(net, keys, size=0.3, seed=1)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ckpt.config.vocab_size, 13).tolist()
    rows = np.arange(4, 12)
    targets = np.asarray(ids[5:13])
    weights = rng.uniform(-1.0, 2.0, len(rows)).astype(np.float32)  # advantages may be negative

    residual = net.prefix(ids, 0, entries)
    tape = net.tail_forward(residual, 0, entries)
    dr, logp = net.head_backward(tape, rows, targets, weights)
    grads, d_residual = net.tail_backward(tape, dr, entries)

    ref_obj, ref_grads, ref_d_residual = hf_weighted_loglik_grads(
        hf_float64(ckpt), 0, residual, entries, rows, targets, weights)
    assert float(np.dot(weights, logp)) == pytest.approx(ref_obj, rel=1e-5, abs=1e-5)
    assert set(grads) == set(ref_grads)
    for key, (ga, gb) in grads.items():
        assert _rel(ga, ref_grads[key][0]) < GRAD_RTOL, key
        assert _rel(gb, ref_grads[key][1]) < GRAD_RTOL, key
    assert _rel(d_residual, ref_d_residual) < GRAD_RTOL


def test_tiny_forward_with_adapter_matches_backend(tmp_path):
    """The backend applying the adapter through ``delta`` and SONA's own forward agree."""
    from ruvllm_candle_compat import CandleCompatModel, PagedKVCache

    ckpt = open_checkpoint(write_tiny_hf_checkpoint(tmp_path / "m", model_type="qwen2", layers=2))
    net = LoraLlama.from_checkpoint(ckpt)
    entries = random_entries(net, [(li, p) for li in range(2) for p in PROJECTIONS], size=0.3)
    backend = CandleCompatModel.from_checkpoint(ckpt, LoadOptions())
    cache = PagedKVCache(ckpt.config, 4, 16)
    ids = np.arange(3, 20, dtype=np.int32)
    adapter = SonaAdapter("t", 1, entries)
    out = backend.forward(ForwardBatch([SequenceChunk(ids, 0, np.arange(4, dtype=np.int32), all_logits=True,
                                                      adapter=adapter)], 16), cache)
    ours = net.logits(net.tail_forward(net.prefix(ids, 0, entries), 0, entries).z)
    np.testing.assert_allclose(ours, out.all_logits[0], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    model = sona_smollm2(str(smollm2_path))
    return model, sona_net(str(smollm2_path))


def test_smollm2_forward_matches_backend_logits_and_hidden_states(smollm2):
    model, net = smollm2
    ids = model.tokenizer.encode("The capital of France is Paris. The capital of Zorblandia is")
    entries = random_entries(net, [(28, "q_proj"), (29, "v_proj"), (29, "o_proj")], size=0.05)
    cache = model.allocate_cache(4, 16)
    out = model.forward(ForwardBatch([SequenceChunk(np.asarray(ids, np.int32), 0, np.arange(4, dtype=np.int32),
                                                    all_logits=True, hidden_states=True,
                                                    adapter=SonaAdapter("t", 1, entries))], 16), cache)
    tape = net.tail_forward(net.prefix(ids, 28), 28, entries)
    # Same float32 arithmetic in a different order: measured max |diff| ~4e-5 on logits of size ~30.
    np.testing.assert_allclose(net.logits(tape.z), out.all_logits[0], rtol=0, atol=5e-4)
    np.testing.assert_allclose(tape.z, out.hidden_states[0], rtol=0, atol=5e-4)


def test_smollm2_tail_gradient_matches_float64_autograd(smollm2):
    """The last two layers of the real model, q/k/v/o adapted, against transformers in float64."""
    model, net = smollm2
    ids = model.tokenizer.encode("The capital of Zorblandia is Quimtown, a small city.")
    keys = [(li, p) for li in (28, 29) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")]
    entries = random_entries(net, keys, size=0.05, seed=3)
    residual = net.prefix(ids, 28)
    rows = np.arange(5, len(ids) - 1)
    targets = np.asarray(ids[6:])
    weights = np.linspace(0.5, 1.5, len(rows)).astype(np.float32)
    tape = net.tail_forward(residual, 28, entries)
    dr, _ = net.head_backward(tape, rows, targets, weights)
    grads, _ = net.tail_backward(tape, dr, entries)
    _, ref, _ = hf_weighted_loglik_grads(hf_float64(model.checkpoint, 28), 28, residual, entries, rows, targets,
                                         weights)
    for key in keys:
        assert _rel(grads[key][0], ref[key][0]) < GRAD_RTOL, key
        assert _rel(grads[key][1], ref[key][1]) < GRAD_RTOL, key


def test_instant_gradient_equals_full_backward(smollm2):
    """The instant loop's closed form (captured vectors + attention backward) gives the same
    gradient as the full backward, for every last-layer attention projection."""
    model, net = smollm2
    prompt = model.tokenizer.encode("Question: what is the capital of Zorblandia? Answer:")
    ids = prompt + model.tokenizer.encode(" The capital of Zorblandia is Quimtown.", add_special_tokens=False)
    keys = [(29, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    entries = random_entries(net, [(28, "v_proj"), *keys], size=0.05, seed=5)
    _, cap = capture_trajectory(net, ids, len(prompt), entries, 1, 28, keys)
    assert cap.instant is not None
    t = len(cap.rows)
    weights = np.linspace(-1.0, 1.0, t).astype(np.float32)
    fast = instant_gradient(net, cap.instant, weights, keys)

    tape = net.tail_forward(cap.residual, 28, entries)
    dr, _ = net.head_backward(tape, cap.rows, cap.targets, weights)
    full, _ = net.tail_backward(tape, dr, entries)
    for key in keys:
        assert _rel(fast[key][0], full[key][0]) < 1e-5, key
        assert _rel(fast[key][1], full[key][1]) < 1e-5, key
    # The capture's mean log-likelihood gradient is the same computation with weights 1/T.
    mean = instant_gradient(net, cap.instant, np.full(t, 1.0 / t, np.float32), keys)
    for key in keys:
        assert _rel(mean[key][1], cap.loglik_grad[key][1]) < 1e-5, key
