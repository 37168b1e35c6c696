"""SmolLM2 and Gemma-3-270M from their GGUF files on the mlx backend: with float weights it gives
transformers' greedy tokens; with the file's blocks (the default, ``quantization="auto"``) its mean
KL to float32 is reported (``-s`` prints it) and is no worse than the jax backend's w4a8 form on the
same prompts. SmolLM2's Q4_1 / Q8_0 blocks are exact in MLX's form, so its KL is float rounding only;
Gemma's Q4_K / Q5_0 / Q8_0 are exact and its Q6_K go to 8-bit codes (ruvllm_mlx.gguf_blocks)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from _hf_reference import hf_greedy
from _jax_fixtures import SMOLLM2_PROMPTS, GreedyDecoder, jax_model_at, mean_kl, prompt_logits

from ruvllm.backend import LoadOptions
from ruvllm.plugins import load_plugins
from ruvllm.runtime import load_model

pytest.importorskip("mlx.core")

NEW_TOKENS = 8


@functools.cache
def _mlx(path: str, quantization: str):
    return load_model(path, backend="mlx", host=load_plugins("mlx"), options=LoadOptions(quantization=quantization))


def _kl_report(path, prompts: list[list[int]], name: str) -> tuple[float, float]:
    """Mean KL to the float32 model over the prompts' positions: mlx with the file's blocks, jax w4a8."""
    from ruvllm_jax import native

    if not native.has_vector_path():
        pytest.skip("no vector kernel variant on this CPU: the jax backend has no w4a8 to compare with")
    reference = _mlx(str(path), "none")
    blocks = _mlx(str(path), "auto")
    assert blocks.model.options.quantization == "gguf"
    w4a8 = jax_model_at(str(path), "w4a8")
    want = [prompt_logits(reference, ids) for ids in prompts]
    ours = float(np.mean([mean_kl(w, prompt_logits(blocks, ids)) for w, ids in zip(want, prompts, strict=True)]))
    theirs = float(np.mean([mean_kl(w, prompt_logits(w4a8, ids)) for w, ids in zip(want, prompts, strict=True)]))
    print(f"\n{name}: mean KL to float32, mlx with the file's blocks {ours:.3g} nats, jax w4a8 {theirs:.3g} nats")
    return ours, theirs


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_checkpoint):
    tok = smollm2_checkpoint.tokenizer()
    return [tok.encode(p) for p in SMOLLM2_PROMPTS]


@pytest.mark.slow
def test_smollm2_float_weights_give_transformers_greedy_tokens(smollm2_path, smollm2_prompts):
    model = _mlx(str(smollm2_path), "none")
    got = GreedyDecoder(model).run(smollm2_prompts, NEW_TOKENS)
    for ids, ours in zip(smollm2_prompts, got, strict=True):
        assert ours == hf_greedy(smollm2_path, ids, NEW_TOKENS)


def test_smollm2_blocks_are_no_worse_than_jax_w4a8(smollm2_path, smollm2_prompts):
    ours, theirs = _kl_report(smollm2_path, smollm2_prompts, "SmolLM2 Q4_1/Q8_0")
    assert ours <= theirs
    assert ours < 1e-4  # exact weights: only the float order differs


@pytest.mark.slow
def test_gemma3_float_greedy_and_blocks_no_worse_than_jax_w4a8(gemma3_path):
    from ruvllm.checkpoint import open_checkpoint

    tok = open_checkpoint(gemma3_path).tokenizer()
    prompts = [tok.encode(p) for p in SMOLLM2_PROMPTS]
    got = GreedyDecoder(_mlx(str(gemma3_path), "none")).run(prompts, NEW_TOKENS)
    for ids, ours in zip(prompts, got, strict=True):
        assert ours == hf_greedy(gemma3_path, ids, NEW_TOKENS)
    ours, theirs = _kl_report(gemma3_path, prompts, "Gemma-3-270M Q4_K_M")
    assert ours <= theirs
