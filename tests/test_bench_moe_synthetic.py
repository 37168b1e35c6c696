"""``benchmarks/moe_synthetic.py`` writes the MoE benchmark's model: a ``qwen3moe`` GGUF file whose
tensors are where llama.cpp's names put them. A one-layer version of it (8 experts, 2 a token, small
dims; Q8_0 as the full-size file's source could be) loads in ruvllm's candle-compat and computes what
transformers' Qwen3MoeForCausalLM computes with the file's weights, mapped back to Hugging Face's
names by the tests' own table; its byte-level vocabulary round-trips text and merges pairs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from _family_checkpoints import hf_all_logits
from _moe_checkpoints import _EXPERTS, _TO_GGUF, moe_config

from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm.plugins import load_plugins

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def moe_synthetic():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import moe_synthetic
    finally:
        sys.path.pop(0)
    return moe_synthetic


def _as_hf_directory(path: Path, out: Path, shape) -> Path:
    """The GGUF file's weights (dequantized) under transformers' v4 names, with a config of the same
    shape: ``blk.N.ffn_*_exps`` split into ``mlp.experts.E.*_proj``."""
    from safetensors.numpy import save_file

    to_hf = {v: k for k, v in _TO_GGUF.items() if not k.startswith("block_sparse_moe")}
    experts_to_hf = {v: k for k, v in _EXPERTS.items() if k.endswith("_proj")}
    tensors = {}
    for t in gguf.GGUFReader(path).tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name == "token_embd.weight":
            tensors["model.embed_tokens.weight"] = w
        elif t.name == "output_norm.weight":
            tensors["model.norm.weight"] = w
        elif t.name == "output.weight":
            tensors["lm_head.weight"] = w
        else:
            _, layer, key, _ = t.name.split(".")
            if key in experts_to_hf:
                proj = experts_to_hf[key]
                for e in range(shape.experts):
                    tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = np.ascontiguousarray(w[e])
            else:
                tensors[f"model.layers.{layer}.{to_hf[key]}.weight"] = w
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = moe_config(
        "qwen3_moe",
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_experts=shape.experts,
        num_experts_per_tok=shape.experts_per_token,
        moe_intermediate_size=shape.expert_ffn,
        intermediate_size=shape.ffn,
        rms_norm_eps=shape.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        norm_topk_prob=True,  # llama.cpp's qwen3moe graph renormalises the top k, as Qwen3-30B-A3B does
        max_position_embeddings=shape.context,
    )
    config.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    return out


def test_the_synthetic_moe_file_computes_transformers_logits(moe_synthetic, tmp_path) -> None:
    shape = moe_synthetic.MoeShape(
        layers=1, vocab=320, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, experts_per_token=2,
        expert_ffn=32, ffn=96, context=256,
    )  # fmt: skip
    path = moe_synthetic.write_gguf(tmp_path / "tiny.gguf", shape, seed=3, dtype="Q8_0")
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    experts = (cfg.num_experts, cfg.experts_per_token, cfg.expert_intermediate_size)
    assert (cfg.architecture, experts) == ("qwen3_moe", (8, 2, 32))
    assert cfg.qk_norm and cfg.norm_topk_prob and not cfg.tie_word_embeddings
    assert ckpt.matrix_types() == {"Q8_0": 4 + 3 * 8}  # the layer's q, k, v, o and each expert's three

    model = load_plugins().choose_backend("candle-compat").load(ckpt, LoadOptions())
    cache = model.kv_cache(16, 4, {})
    ids = np.random.default_rng(5).integers(0, shape.vocab, size=19).tolist()
    chunk = SequenceChunk(np.asarray(ids, np.int32), 0, np.arange(5, dtype=np.int32), all_logits=True)
    got = model.forward(ForwardBatch([chunk], 4), cache).all_logits[0]
    want = hf_all_logits(_as_hf_directory(path, tmp_path / "hf", shape), ids)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)

    tok = ckpt.tokenizer()
    tokens = moe_synthetic.vocabulary(shape.vocab)[0]
    text = "the synthetic MoE, 30B-A3B's shapes"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("AAAB") == [tokens.index("AA"), tokens.index("AB")]  # the first merges: letter pairs


def test_the_vocabulary_scales_with_the_layers(moe_synthetic) -> None:
    """The LM head keeps its share of a token's bytes: 48 layers give Qwen3-30B-A3B's own vocabulary."""
    assert moe_synthetic.scaled_vocab(48) == 151936
    assert moe_synthetic.synthetic_shape().vocab == moe_synthetic.MoeShape().vocab == 18992
    tokens, merges, types = moe_synthetic.vocabulary(18992)
    assert len(tokens) == len(set(tokens)) == len(types) == 18992 and len(merges) == 18992 - 257
    assert tokens[-1] == "<|endoftext|>" and types[-1] == 3


def test_a_tokens_bytes_count_the_chosen_experts_only(moe_synthetic, tmp_path) -> None:
    """``bench_moe.token_bytes``: k of E experts' blocks a token, every other matrix whole, one
    embedding row; a step of many streams reads each expert at most once."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_moe
    finally:
        sys.path.pop(0)
    shape = moe_synthetic.MoeShape(
        layers=2, vocab=320, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, experts_per_token=2,
        expert_ffn=32, ffn=96, context=256,
    )  # fmt: skip
    tb = bench_moe.token_bytes(moe_synthetic.write_gguf(tmp_path / "m.gguf", shape, dtype="Q8_0"))
    q8 = 34 / 32  # Q8_0: 34 bytes a block of 32
    assert tb.experts_all == 2 * 3 * 8 * 32 * 64 * q8 and tb.experts == tb.experts_all * 2 // 8
    assert tb.attention == 2 * ((64 + 32 + 32) * 64 + 64 * 64) * q8 + 2 * 4 * (64 + 16 + 16)
    assert tb.router == 2 * 8 * 64 * 4 and tb.lm_head == 320 * 64 * q8 and tb.embedding_row == 64 * q8
    assert tb.norms == 3 * 64 * 4
    assert tb.step(1) == tb.total
    assert tb.step(1000) - 999 * tb.embedding_row == pytest.approx(tb.total - tb.experts + tb.experts_all)
