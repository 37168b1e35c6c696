"""Small GGUF files written by tests: a tiny random-weight Llama, and broken variants of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_tiny_llama_gguf(
    path: Path,
    *,
    arch: str = "llama",
    weight_type: str = "F32",
    hidden: int = 256,
    layers: int = 1,
    seed: int = 0,
) -> Path:
    """A one-layer Llama with random weights and a byte-level BPE vocabulary of 256 tokens + specials."""
    import gguf

    rng = np.random.default_rng(seed)
    n_head, n_kv, ffn = 4, 2, 2 * hidden
    head_dim = hidden // n_head
    tokens = [bytes([b]).decode("latin-1") for b in range(256)] + ["<|im_start|>", "<|im_end|>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3])
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)

    def add(name: str, shape: tuple[int, ...]) -> None:
        data = rng.standard_normal(shape).astype(np.float32) * 0.05
        qt = gguf.GGMLQuantizationType[weight_type]
        if len(shape) == 2 and qt not in (gguf.GGMLQuantizationType.F32,):
            block, type_size = gguf.GGML_QUANT_SIZES[qt]
            raw = rng.integers(0, 256, size=(shape[0], shape[1] // block * type_size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=qt)
        else:
            w.add_tensor(name, data)

    add("token_embd.weight", (vocab, hidden))
    add("output_norm.weight", (hidden,))
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,))
        add(f"blk.{i}.ffn_norm.weight", (hidden,))
        add(f"blk.{i}.attn_q.weight", (hidden, hidden))
        add(f"blk.{i}.attn_k.weight", (n_kv * head_dim, hidden))
        add(f"blk.{i}.attn_v.weight", (n_kv * head_dim, hidden))
        add(f"blk.{i}.attn_output.weight", (hidden, hidden))
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
