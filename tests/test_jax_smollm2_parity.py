"""On the real SmolLM2 checkpoint, the JAX backend (float32) agrees with Hugging Face transformers
reading the same GGUF, and with the NumPy candle-compat backend: logits at every position, and
identical greedy continuations of 64 tokens for three prompts.

Greedy agreement is checked teacher-forced: the reference runs once over prompt + our continuation
and its argmax at every position must be our next token. By induction that is the same as the
reference generating the continuation itself, and costs one forward pass instead of 64.

Tolerance: SmolLM2's logits reach about 30 in magnitude; after 30 float32 layers independent
implementations differ by ~1e-4 there, so 1e-3 absolute is tight enough to catch any real mistake
(a wrong RoPE, norm or mask moves logits by whole units)."""

from __future__ import annotations

import numpy as np
import pytest
from _hf_reference import hf_logits
from _jax_fixtures import SMOLLM2_PROMPTS, GreedyDecoder, jax_model_at, prompt_logits

LOGIT_ATOL = 1e-3
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def jax_model(smollm2_path):
    return jax_model_at(str(smollm2_path))


@pytest.fixture(scope="module")
def sequences(smollm2_checkpoint, jax_model):
    """(prompt ids, our 64-token greedy continuation), the three prompts decoded in one batch."""
    tok = smollm2_checkpoint.tokenizer()
    prompts = [tok.encode(p) for p in SMOLLM2_PROMPTS]
    continuations = GreedyDecoder(jax_model).run(prompts, NEW_TOKENS)
    assert all(len(c) == NEW_TOKENS for c in continuations)
    return list(zip(prompts, continuations, strict=True))


def _argmax_after_prompt(logits: np.ndarray, ids: list[int], n: int) -> list[int]:
    return logits[len(ids) - 1 : len(ids) - 1 + n].argmax(-1).tolist()


@pytest.mark.slow
def test_logits_and_greedy_continuations_match_transformers(smollm2_path, jax_model, sequences):
    for ids, ours in sequences:
        want = hf_logits(smollm2_path, ids + ours)
        got = prompt_logits(jax_model, ids + ours)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=LOGIT_ATOL, rtol=0)
        assert _argmax_after_prompt(want, ids, NEW_TOKENS) == ours


def test_matches_numpy_backend(smollm2_path, jax_model, sequences):
    pytest.importorskip("ruvllm_candle_compat", reason="the NumPy backend is not installed")
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    numpy_model = load_model(str(smollm2_path), backend="candle-compat", host=load_plugins("candle-compat"))
    for ids, ours in sequences:
        want = prompt_logits(numpy_model, ids + ours)
        np.testing.assert_allclose(prompt_logits(jax_model, ids + ours), want, atol=LOGIT_ATOL, rtol=0)
        assert _argmax_after_prompt(want, ids, NEW_TOKENS) == ours
