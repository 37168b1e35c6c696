"""The JAX backend computes what Hugging Face transformers computes, for each architecture it claims
(llama untied, mistral tied, qwen2 with q/k/v biases), over ragged batches that mix prefill, chunked
prefill continuing earlier context, and decode, with block tables that cross block boundaries.

Tolerance: float32 throughout; logits of these random models are O(1), so 2e-5 absolute is a few
float32 ulps of accumulated rounding over two layers, far below any indexing or masking mistake."""

from __future__ import annotations

import numpy as np
import pytest
from _jax_fixtures import load_jax, write_tiny_hf_model

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.checkpoint import open_checkpoint

pytest.importorskip("transformers")

ATOL = 2e-5
BLOCK = 4


@pytest.fixture(scope="module", params=[("llama", False), ("mistral", True), ("qwen2", False)], ids=lambda p: p[0])
def tiny(request, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    arch, tied = request.param
    path = write_tiny_hf_model(tmp_path_factory.mktemp(arch), arch, tied=tied)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ckpt = open_checkpoint(path)
    assert ckpt.config.architecture == arch and ckpt.config.tie_word_embeddings == tied
    return hf, ckpt


def _reference(hf, ids):
    import torch

    with torch.no_grad():
        out = hf.model(torch.tensor([ids]))
        hidden = out.last_hidden_state[0]
        return hf.lm_head(hidden).numpy(), hidden.numpy()


def test_mixed_ragged_steps_match_transformers(tiny):
    hf, ckpt = tiny
    model = load_jax(ckpt)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 97, size=n).tolist() for n in (13, 21, 7)]
    refs = [_reference(hf, s) for s in seqs]
    cache = model.allocate_cache(32, BLOCK)
    # Scattered, non-monotonic blocks per sequence.
    perm = rng.permutation(32).astype(np.int32)
    tables = [perm[0:6], perm[6:12], perm[12:14]]

    def check(out, i, row, lo, hi):
        want_logits, want_hidden = refs[i]
        np.testing.assert_allclose(out.logits[row], want_logits[hi - 1], atol=ATOL, rtol=0)
        if row in out.all_logits:
            np.testing.assert_allclose(out.all_logits[row], want_logits[lo:hi], atol=ATOL, rtol=0)
        if row in out.hidden_states:
            np.testing.assert_allclose(out.hidden_states[row], want_hidden[lo:hi], atol=ATOL, rtol=0)

    # Step 1: a whole prompt, the first chunk of another, a short prompt.
    step1 = [(0, 0, 12), (1, 0, 9), (2, 0, 6)]
    # Step 2: decode, a chunk continuing at position 9 across block boundaries, decode with hidden states.
    step2 = [(0, 12, 13), (1, 9, 21), (2, 6, 7)]
    for step in (step1, step2):
        chunks = [
            SequenceChunk(
                np.asarray(seqs[i][lo:hi], np.int32), lo, tables[i], all_logits=(i != 0), hidden_states=(i == 2)
            )
            for i, lo, hi in step
        ]
        out = model.forward(ForwardBatch(chunks, BLOCK), cache)
        assert out.logits.shape == (3, 97) and out.logits.dtype == np.float32
        assert set(out.all_logits) == {1, 2} and set(out.hidden_states) == {2}
        for row, (i, lo, hi) in enumerate(step):
            check(out, i, row, lo, hi)
