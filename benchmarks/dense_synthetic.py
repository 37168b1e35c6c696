"""A synthetic dense model with Llama-3.1-8B's shapes, written as a GGUF file that llama.cpp and ruvllm
both load (architecture ``llama``, llama.cpp's tensor names), for ``bench_scale.py`` (issue 60: load
time, resident memory and weight bytes at 8B scale).

Every shape is Llama-3.1-8B's: hidden 4096, 32 layers, 32 query and 8 KV heads of 128, FFN 14336,
vocabulary 128,256 (an untied LM head), RoPE theta 500,000 with Llama 3.1's scaling (factor 8, low
and high frequency factors 1 and 4, original context 8,192: the ``rope_freqs.weight`` tensor
llama.cpp's converter writes for it), RMSNorm eps 1e-5, context 131,072 (the real key: both engines
size their KV caches from their own settings, not from it). ``--layers`` keeps fewer layers (the
vocabulary stays whole), e.g. 2 for a file written in two minutes to try things on.

The weights are random (projections N(0, 1/fan_in), norms near 1, the embedding N(0, 1)). The file
is written in Q8_0 with the ``gguf`` library's quantizer (float16 would be 16 GB), a few hundred
rows at a time, so no more than one tensor's Q8_0 bytes are in memory, then converted to Q4_K_M by
llama.cpp's own quantizer (``moe_synthetic.quantize_q4_k_m``): Q4_K for most matrices, Q6_K for the
LM head and for ``attn_v`` / ``ffn_down`` of some layers, as ``llama-quantize ... Q4_K_M`` gives a
real Llama-3.1-8B (Q4_K x193, Q6_K x33; 4.92 GB). The Q8_0 intermediate (8.5 GB at 32 layers) is
deleted unless ``--keep-source``. On 2 Zen 4 cores the 32-layer file took 2.5 minutes to write in
Q8_0 and 8.5 to quantize, the 2-layer one 30 s and 85 s (the vocabulary's embedding and LM head are
most of it).

The vocabulary is byte-level BPE with Llama 3's pre-tokenizer (``llama-bpe``): the 256 byte tokens,
the pairs of bytes of ``moe_synthetic.vocabulary`` with their merges, then triples (a pair and a
byte, merged from the pair) to 128,000 tokens, and Llama 3's 256 special tokens (``<|begin_of_text|>``
128000, ``<|end_of_text|>`` 128001, ``<|eot_id|>`` 128009 ...; control tokens).

    python benchmarks/dense_synthetic.py                  # ~/.cache/ruvllm-bench/llama3-8b-synthetic-32l-s0-Q4_K_M.gguf
    python benchmarks/dense_synthetic.py --layers 2       # the same with 2 layers (0.99 GB)
    python benchmarks/dense_synthetic.py --dir /tmp/dense --keep-source

Needs ``gguf`` and ``llama_cpp`` (the nox ``bench`` session's venv).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from moe_synthetic import CACHE, cached_q4_k_m, vocabulary

LLAMA31_8B_LAYERS = 32
#: Llama 3's byte-level BPE tokens (its special tokens follow them).
LLAMA3_BPE_TOKENS = 128000
LLAMA3_SPECIAL_TOKENS = 256
#: Llama 3's named special tokens by offset from the first (the rest are reserved_special_token_N).
LLAMA3_NAMED_SPECIALS = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    4: "<|finetune_right_pad_id|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: "<|eot_id|>",
    10: "<|python_tag|>",
}
#: Llama 3 Instruct's chat format (headers, ``<|eot_id|>`` after each turn), without its tool and date
#: preamble: what a chat request needs to reach the model (``ruvllm serve`` answers chat requests only
#: for a model with a template).
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
#: Rows of a matrix generated and quantized at a time (a few tens of MB of float32).
CHUNK_ROWS = 512


@dataclass(frozen=True)
class DenseShape:
    """A llama model's hyperparameters; the defaults are Llama-3.1-8B's."""

    layers: int = LLAMA31_8B_LAYERS
    vocab: int = LLAMA3_BPE_TOKENS + LLAMA3_SPECIAL_TOKENS
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    context: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    #: Llama 3.1's RoPE scaling (config.json's ``rope_scaling``, rope_type llama3).
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...], str]]:
        """(name, numpy shape, kind) of every tensor, in the order llama.cpp's converter writes them;
        kinds: ``rope_freqs``, ``embed``, ``norm``, ``matrix`` (N(0, 1/fan_in))."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        yield "rope_freqs.weight", (self.head_dim // 2,), "rope_freqs"
        yield "token_embd.weight", (self.vocab, self.hidden), "embed"
        for i in range(self.layers):
            b = f"blk.{i}"
            yield f"{b}.attn_norm.weight", (self.hidden,), "norm"
            yield f"{b}.attn_q.weight", (q, self.hidden), "matrix"
            yield f"{b}.attn_k.weight", (kv, self.hidden), "matrix"
            yield f"{b}.attn_v.weight", (kv, self.hidden), "matrix"
            yield f"{b}.attn_output.weight", (self.hidden, q), "matrix"
            yield f"{b}.ffn_norm.weight", (self.hidden,), "norm"
            yield f"{b}.ffn_gate.weight", (self.ffn, self.hidden), "matrix"
            yield f"{b}.ffn_up.weight", (self.ffn, self.hidden), "matrix"
            yield f"{b}.ffn_down.weight", (self.hidden, self.ffn), "matrix"
        yield "output_norm.weight", (self.hidden,), "norm"
        yield "output.weight", (self.vocab, self.hidden), "matrix"

    def rope_freqs(self) -> np.ndarray:
        """The per-frequency divisors of Llama 3's RoPE scaling, as llama.cpp's converter computes
        them (``LlamaModel.generate_extra_tensors``)."""
        dim = self.head_dim
        freqs = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        low_wavelen = self.rope_original_context / self.rope_low_freq_factor
        high_wavelen = self.rope_original_context / self.rope_high_freq_factor
        out = []
        for freq in freqs:
            wavelen = 2 * math.pi / float(freq)
            if wavelen < high_wavelen:
                out.append(1.0)
            elif wavelen > low_wavelen:
                out.append(self.rope_factor)
            else:
                smooth = (self.rope_original_context / wavelen - self.rope_low_freq_factor) / (
                    self.rope_high_freq_factor - self.rope_low_freq_factor
                )
                out.append(1 / ((1 - smooth) / self.rope_factor + smooth))
        return np.asarray(out, np.float32)


def synthetic_shape(layers: int = LLAMA31_8B_LAYERS) -> DenseShape:
    return DenseShape(layers=layers)


def llama3_vocabulary(size: int = LLAMA3_BPE_TOKENS + LLAMA3_SPECIAL_TOKENS) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a byte-level BPE vocabulary of ``size`` tokens laid out as
    Llama 3's: ``size - 256`` BPE tokens (``moe_synthetic.vocabulary``'s bytes and pairs, then triples
    of a pair and a byte, each merged from its pair), then the 256 special tokens (control)."""
    bpe = size - LLAMA3_SPECIAL_TOKENS
    most = 256 * 256 + 257  # the largest vocabulary() writes: bytes, every pair, <|endoftext|>
    tokens, merges, _ = vocabulary(min(bpe + 1, most))
    tokens = tokens[:-1]  # its <|endoftext|>: Llama 3's specials replace it
    base = tokens[:256]
    order = sorted(range(256), key=lambda b: (not chr(b).isalpha(), b))  # as vocabulary() ranks pairs
    pairs = iter(tokens[256:])
    need = bpe - len(tokens)
    if need > len(tokens[256:]) * 256:
        raise ValueError(f"a vocabulary of {size} tokens is more than bytes, pairs and triples give")
    extra: list[str] = []
    extra_merges: list[str] = []
    while len(extra) < need:
        pair = next(pairs)
        for b in order[: need - len(extra)]:
            extra.append(pair + base[b])
            extra_merges.append(f"{pair} {base[b]}")
    specials = [LLAMA3_NAMED_SPECIALS.get(i, f"<|reserved_special_token_{i}|>") for i in range(LLAMA3_SPECIAL_TOKENS)]
    tokens = tokens + extra + specials
    return tokens, merges + extra_merges, [1] * bpe + [3] * LLAMA3_SPECIAL_TOKENS


def write_gguf(path: Path, shape: DenseShape, seed: int = 0, dtype: str = "Q8_0") -> Path:
    """``shape``'s model with random weights as a GGUF file: matrices and the embedding in ``dtype``
    (Q8_0, F16 or F32; the gguf library's quantizer), norms and ``rope_freqs`` in float32 as
    llama.cpp's converter writes them. Each tensor is generated and encoded ``CHUNK_ROWS`` rows at a
    time into its encoded bytes, the only tensor in memory."""
    import gguf

    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[dtype]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"llama synthetic {shape.layers}-layer (Llama-3.1-8B shapes)")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_layer_norm_rms_eps(shape.rms_norm_eps)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_vocab_size(shape.vocab)
    w.add_file_type({"F16": gguf.LlamaFileType.MOSTLY_F16, "F32": gguf.LlamaFileType.ALL_F32,
                     "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])  # fmt: skip
    tokens, merges, types = llama3_vocabulary(shape.vocab)
    bos = shape.vocab - LLAMA3_SPECIAL_TOKENS
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)  # <|begin_of_text|>
    w.add_eos_token_id(bos + 1)  # <|end_of_text|> (the base model's)
    w.add_add_bos_token(True)
    w.add_eot_token_id(bos + 9)  # <|eot_id|>: the end of a chat turn
    w.add_chat_template(LLAMA3_CHAT_TEMPLATE)

    def stored(kind: str) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType.F32 if kind in ("norm", "rope_freqs") else qtype

    specs = list(shape.tensors())
    for name, dims, kind in specs:  # the tensor table first: the data is then written tensor by tensor
        q = stored(kind)
        nbytes = int(np.prod(gguf.quant_shape_to_byte_shape(dims, q)))
        w.add_tensor_info(name, dims, np.dtype(np.float32), nbytes, raw_dtype=q)  # dims: the logical shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, dims, kind in specs:
        q = stored(kind)
        if kind == "rope_freqs":
            w.write_tensor_data(shape.rope_freqs())
            continue
        if kind == "norm":
            w.write_tensor_data((1.0 + 0.1 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32))
            continue
        rows, cols = dims
        scale = np.float32(1.0 if kind == "embed" else cols**-0.5)  # unit-variance outputs for unit inputs
        out = np.empty(gguf.quant_shape_to_byte_shape(dims, q), np.uint8)
        for r0 in range(0, rows, CHUNK_ROWS):
            r1 = min(rows, r0 + CHUNK_ROWS)
            t = rng.standard_normal((r1 - r0, cols), dtype=np.float32)
            t *= scale
            out[r0:r1] = gguf.quants.quantize(t, q).view(np.uint8).reshape(r1 - r0, -1)
        w.write_tensor_data(out)
        del out
    w.close()
    return path


def synthetic_q4_k_m(
    layers: int = LLAMA31_8B_LAYERS,
    directory: Path = CACHE,
    seed: int = 0,
    threads: int | None = None,
    keep_source: bool = False,
    log: bool = True,
) -> Path:
    """The Q4_K_M file of :func:`synthetic_shape` (``layers``), written on first use and then reused
    from ``directory``; the Q8_0 source (0.23 GB a layer plus 1.1 GB of embedding and LM head) is
    deleted unless ``keep_source``."""
    shape = synthetic_shape(layers)
    stem = directory / f"llama3-8b-synthetic-{layers}l-s{seed}"
    return cached_q4_k_m(stem, "Q8_0", lambda p: write_gguf(p, shape, seed, "Q8_0"), threads, keep_source, log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=LLAMA31_8B_LAYERS)
    ap.add_argument("--dir", type=Path, default=CACHE, help="where the files are kept (RUVLLM_BENCH_CACHE)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp quantizer's threads")
    ap.add_argument("--keep-source", action="store_true", help="keep the Q8_0 file next to the Q4_K_M one")
    args = ap.parse_args(argv)
    print(dataclasses.asdict(synthetic_shape(args.layers)))
    print(synthetic_q4_k_m(args.layers, args.dir, args.seed, args.threads, args.keep_source))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
