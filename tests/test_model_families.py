"""Every family of the architecture table computes what Hugging Face transformers computes, on both
backends: logits at every position, over steps that mix a whole prompt, a prompt prefilled in chunks,
a sequence that reuses another's cached prefix blocks (prefix caching as the block manager does it)
and decode steps, with scattered block tables that cross block boundaries, for contexts longer than
the sliding windows.

Tolerance 2e-5 absolute on float32 logits of O(1-10): a few ulps of accumulated rounding over the
layers, far below a wrong window, frequency, norm or scale (each moves logits by 1e-2 or more)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _family_checkpoints import ARCHITECTURE, FAMILIES, hf_all_logits, write_family_checkpoint

from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm.plugins import load_plugins

pytest.importorskip("transformers")

ATOL = 2e-5
#: The GGUF check runs one 26-token prefill; on the jax backend one logit of 2,626 lands 2.2e-5 from
#: transformers (the same with the HF directory: XLA's float32 rounding, not the file).
GGUF_ATOL = 3e-5
BLOCK = 4
BACKENDS = ("candle-compat", "jax")
#: The jax backend with its layers unrolled, as it runs on CUDA (``unroll_layers``, auto there).
STEP_BACKENDS = (*BACKENDS, "jax-unrolled")


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, write_family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def _load(path: Path, backend: str):
    host = load_plugins()
    ckpt = open_checkpoint(path)
    extra = {"unroll_layers": True} if backend == "jax-unrolled" else {}
    model = host.choose_backend(backend.removesuffix("-unrolled")).load(ckpt, LoadOptions(extra=extra))
    cache = model.kv_cache(48, BLOCK, {})
    return ckpt, model, cache


@pytest.mark.parametrize("backend", STEP_BACKENDS)
def test_ragged_chunked_prefix_cached_steps_match_transformers(family_dir, backend) -> None:
    family, path = family_dir
    ckpt, model, cache = _load(path, backend)
    cfg = ckpt.config
    assert cfg.architecture == ARCHITECTURE[family]
    rng = np.random.default_rng(3)
    vocab = cfg.vocab_size
    a = rng.integers(3, vocab, size=30).tolist()
    b = a[:12] + rng.integers(3, vocab, size=9).tolist()  # shares a's first 12 tokens (3 blocks)
    c = rng.integers(3, vocab, size=23).tolist()
    perm = rng.permutation(48).astype(np.int32)
    table_a, table_c = perm[0:9], perm[9:16]
    table_b = np.concatenate([table_a[:3], perm[16:22]])  # prefix blocks shared, then its own
    ref = {"a": hf_all_logits(path, a), "b": hf_all_logits(path, b), "c": hf_all_logits(path, c)}
    seqs = {"a": (a, table_a), "b": (b, table_b), "c": (c, table_c)}

    def run(step: list[tuple[str, int, int]]) -> None:
        chunks = [
            SequenceChunk(np.asarray(seqs[k][0][lo:hi], np.int32), lo, seqs[k][1], all_logits=True)
            for k, lo, hi in step
        ]
        out = model.forward(ForwardBatch(chunks, BLOCK), cache)
        for row, (k, lo, hi) in enumerate(step):
            got = out.all_logits[row]
            np.testing.assert_allclose(
                got,
                ref[k][lo:hi],
                atol=ATOL,
                rtol=0,
                err_msg=f"{family} on {backend}: sequence {k} positions {lo}..{hi - 1}",
            )

    run([("a", 0, 12), ("c", 0, 5)])  # a's prefix; c's first chunk
    run([("a", 12, 21), ("b", 12, 13), ("c", 5, 19)])  # b reuses a's 3 cached blocks; chunks continue
    for pos in range(21, 30):  # decode a past every window, with b and c alongside
        step = [("a", pos, pos + 1)]
        if pos - 8 < len(b) and pos - 8 >= 13:
            step.append(("b", pos - 8, pos - 7))
        if pos - 2 < len(c) and pos - 2 >= 19:
            step.append(("c", pos - 2, pos - 1))
        run(step)
    if backend.startswith("jax"):  # the steps ran as asked: scanned layers, or unrolled
        assert {plan.unroll_layers for plan in model.compiled_steps.stats.plans} == {backend == "jax-unrolled"}


def test_context_is_the_short_factor_range_for_longrope(tmp_path) -> None:
    """phi3's LongRoPE: ruvllm serves the pre-trained context with the short factors (what transformers
    computes there) and says so in the context length, instead of switching frequencies mid-sequence."""
    path = write_family_checkpoint(tmp_path, "phi3")
    cfg = open_checkpoint(path).config
    assert cfg.rope.kind == "longrope" and cfg.max_position_embeddings == 64
    assert cfg.rope.attention_factor == pytest.approx(np.sqrt(1 + np.log(256 / 64) / np.log(64)))


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2-yarn", "phi3"])
def test_sona_gradient_model_reads_the_same_description(family, tmp_path) -> None:
    """SONA's own float copy (the model it differentiates) computes transformers' logits for the
    families it trains, windows and scaled RoPE included."""
    from ruvllm_sona.model import LoraLlama

    path = write_family_checkpoint(tmp_path, family)
    model = LoraLlama.from_checkpoint(open_checkpoint(path))
    ids = np.random.default_rng(5).integers(3, 101, size=26).tolist()
    tape = model.tail_forward(model.prefix(ids, 0), 0, {})
    np.testing.assert_allclose(model.logits(tape.z), hf_all_logits(path, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("family", "field"), [("gemma3", "qk_norm"), ("qwen3", "qk_norm")])
def test_sona_refuses_what_its_backward_lacks_by_name(family, field, tmp_path) -> None:
    from ruvllm_sona.errors import SonaError
    from ruvllm_sona.model import LoraLlama

    path = write_family_checkpoint(tmp_path, family)
    with pytest.raises(SonaError, match=field):
        LoraLlama.from_checkpoint(open_checkpoint(path))


@pytest.mark.parametrize(
    ("family", "edit", "field"),
    [
        ("llama3", {"rope_parameters": {"rope_type": "ntk-by-parts", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
        ("llama3", {"rope_parameters": None, "rope_scaling": {"type": "su", "factor": 2.0}}, "rope_scaling.rope_type"),
        (
            "llama3",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        (
            "llama3",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "alpha": 3}},
            "rope_parameters.alpha",
        ),
        ("llama3", {"mlp_bias": True}, "mlp_bias"),
        ("llama3", {"attention_bias": True}, "attention_bias"),
        ("llama3", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama3", {"sliding_window": 8}, "sliding_window"),
        ("llama3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("qwen3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3", {"layer_types": ["chunked_attention"] * 7}, "layer_types"),
        ("qwen3", {"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_fields_that_change_the_arithmetic_are_refused_by_name(family, edit, field, tmp_path) -> None:
    import json

    from ruvllm.errors import ModelFormatError

    path = write_family_checkpoint(tmp_path, family)
    config = json.loads((path / "config.json").read_text())
    config.update(edit)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=field.replace(".", r"\.")) as info:
        _ = open_checkpoint(path).config
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2-yarn", "qwen3", "phi3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gguf_files_of_each_family_match_transformers(family, backend, tmp_path) -> None:
    """The same weights written as GGUF (llama.cpp's names and metadata: permuted Q/K, ``rope_freqs``,
    LongRoPE factor tensors, YaRN and window keys) compute transformers' logits. (gemma3's GGUF form is
    checked on the real Gemma-3-270M file: its GGUF metadata has no query scalar.)"""
    from _family_checkpoints import write_family_gguf

    hf_dir = write_family_checkpoint(tmp_path / "hf", family)
    gguf_path = write_family_gguf(hf_dir, family, tmp_path / "model.gguf")
    _ckpt, model, cache = _load(gguf_path, backend)
    ids = np.random.default_rng(7).integers(3, 101, size=26).tolist()
    table = np.random.default_rng(8).permutation(48)[:7].astype(np.int32)
    chunks = [SequenceChunk(np.asarray(ids, np.int32), 0, table, all_logits=True)]
    out = model.forward(ForwardBatch(chunks, BLOCK), cache)
    np.testing.assert_allclose(out.all_logits[0], hf_all_logits(hf_dir, ids), atol=GGUF_ATOL, rtol=0)
