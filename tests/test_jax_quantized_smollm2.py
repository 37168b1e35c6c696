"""Quantized SmolLM2 on the JAX backend: resident weight bytes shrink as promised, and the model
stays the same model: perplexity on a fixed text within 2% of float32, and top-1 predictions that
agree with float32's at nearly every position of that text.

SmolLM2's GGUF stores Q4_1 / Q8_0 blocks; ``q4`` uses Q4_1's scheme and group size, so it recovers
those weights exactly, while ``q8``'s symmetric grid cannot (docs/performance-journal.md has the figures)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from _jax_fixtures import jax_model_at, load_jax, perplexity, prompt_logits

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
    "from Mainz, combined movable metal type, oil-based ink and a wooden screw press into a system that could "
    "produce books quickly and cheaply. Before his invention, books were copied by hand, usually by monks, and a "
    "single volume could take months to finish. Within fifty years, printing shops had spread to more than two "
    "hundred cities across Europe, and millions of books were in circulation. Cheaper books helped more people "
    "learn to read, spread new scientific ideas, and changed the way religion, politics and education worked."
)

#: Largest resident size as a fraction of float32 (int8: 8.5 bits/weight with float16 group scales;
#: int4: 5 bits/weight with scale and minimum, embeddings int8).
MAX_BYTES_FRACTION = {"q8": 0.27, "q4": 0.19}
MAX_PPL_CHANGE = 0.02
MIN_TOP1_AGREEMENT = 0.95


@pytest.fixture(scope="module")
def text_ids(smollm2_checkpoint):
    return smollm2_checkpoint.tokenizer().encode(TEXT)


@functools.cache
def _logits(path: str, quantization: str, ids: tuple[int, ...]) -> np.ndarray:
    return prompt_logits(jax_model_at(path, quantization), list(ids))


@pytest.mark.parametrize("quantization", ["q8", "q4"])
def test_quantized_model_is_smaller_and_close(smollm2_path, text_ids, quantization):
    base = jax_model_at(str(smollm2_path))
    quant = jax_model_at(str(smollm2_path), quantization)
    assert quant.weight_bytes <= MAX_BYTES_FRACTION[quantization] * base.weight_bytes

    want = _logits(str(smollm2_path), "none", tuple(text_ids))
    got = _logits(str(smollm2_path), quantization, tuple(text_ids))
    ppl_base, ppl_quant = perplexity(want, text_ids), perplexity(got, text_ids)
    assert 5 < ppl_base < 40  # the float model itself reads this text sensibly
    assert abs(ppl_quant / ppl_base - 1) <= MAX_PPL_CHANGE
    agreement = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    assert agreement >= MIN_TOP1_AGREEMENT


def test_gguf_blocks_kept_as_stored(smollm2_path, smollm2_checkpoint, text_ids):
    """Q4_1 / Q8_0 blocks loaded without re-quantizing: file-sized in memory, float32's logits."""
    model = load_jax(smollm2_checkpoint, extra={"keep_gguf_blocks": True})
    assert model.weight_bytes <= 1.1 * smollm2_checkpoint.size_bytes
    got = prompt_logits(model, text_ids)
    np.testing.assert_allclose(got, _logits(str(smollm2_path), "none", tuple(text_ids)), atol=1e-3, rtol=0)
