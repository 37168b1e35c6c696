"""Batching does not change results: 16 different prompts decoded together (prefilled in one ragged
step, then decoded in one batch) give exactly the greedy tokens each gives decoded alone, and
prefilling in chunks changes nothing either. Steady-state decoding compiles nothing new."""

from __future__ import annotations

import pytest
from _jax_fixtures import GreedyDecoder, jax_model_at

NEW_TOKENS = 12

PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "Water boils at",
    "My favourite colour is blue because",
    "In 1969, astronauts",
    "The quick brown fox",
    "import numpy as np\nx =",
    "Dear Sir or Madam, I am writing to",
    "The three primary colours are",
    "A haiku about autumn:",
    "SELECT * FROM users WHERE",
    "The best way to learn a language is",
    "Photosynthesis is the process by which plants",
    "1, 2, 3, 5, 8, 13,",
    "Translate to French: Good morning ->",
    "Once upon a time there was a dragon who",
]


@pytest.fixture(scope="module")
def setup(smollm2_path, smollm2_checkpoint):
    tok = smollm2_checkpoint.tokenizer()
    return jax_model_at(str(smollm2_path)), [tok.encode(p) for p in PROMPTS]


@pytest.mark.slow
def test_sixteen_prompts_together_equal_each_alone(setup):
    model, prompts = setup
    assert len({tuple(p) for p in prompts}) == 16
    together = GreedyDecoder(model).run(prompts, NEW_TOKENS)
    alone = [GreedyDecoder(model).run([p], NEW_TOKENS)[0] for p in prompts]
    assert together == alone
    chunked = GreedyDecoder(model, block_size=8).run(prompts, NEW_TOKENS, prefill_chunk=5)
    assert chunked == together


def test_steady_state_decoding_compiles_nothing(setup):
    model, prompts = setup
    decoder = GreedyDecoder(model)
    decoder.run(prompts[:8], 4)  # warm: the prefill and decode buckets of this batch exist now
    before = model.compiled_buckets
    decoder.run(prompts[:8], 4)
    assert model.compiled_buckets == before
