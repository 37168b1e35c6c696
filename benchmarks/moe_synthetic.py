"""A synthetic mixture of experts with Qwen3-30B-A3B's layer shapes, written as a GGUF file that
llama.cpp and ruvllm both load (architecture ``qwen3moe``, llama.cpp's tensor names), for
``bench_moe.py``.

Each layer is Qwen3-30B-A3B's own: hidden 2048, 32 query and 4 KV heads of 128 with QK-norm, 128
experts of 768, 8 chosen per token, renormalised. Only the layer count is smaller (6 of 48 by
default), and the vocabulary shrinks with it (151,936 x 6/48 = 18,992 rows): the LM head then keeps
the share of a token's bytes it has in the real model (one eighth as many layers, one eighth as large
a head), where the full head would be most of what a 6-layer step reads.

The weights are random (projections N(0, 1/fan_in), norms near 1), so the router's logits are O(1)
and tokens spread over the experts as they do in a trained model. The file is written in float16
with the ``gguf`` library, then converted to Q4_K_M by llama.cpp's own quantizer
(``llama_model_quantize`` in llama-cpp-python), which gives exactly llama.cpp's Q4_K_M mixture: Q4_K
for most matrices, Q6_K for the LM head and for the attention V and expert down projections of some
layers, the router in float32. The vocabulary is byte-level BPE (the 256 byte tokens, then pairs of
them with their merges, and ``<|endoftext|>``), so both tokenizers read it.

    python benchmarks/moe_synthetic.py                 # ~/.cache/ruvllm-bench/qwen3moe-synthetic-6l-s0-Q4_K_M.gguf
    python benchmarks/moe_synthetic.py --layers 8 --dir /tmp/moe
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Qwen3-30B-A3B's vocabulary (its config.json's vocab_size) and layer count.
QWEN3_30B_A3B_VOCAB = 151936
QWEN3_30B_A3B_LAYERS = 48
DEFAULT_LAYERS = 6
CACHE = Path(os.environ.get("RUVLLM_BENCH_CACHE", Path.home() / ".cache" / "ruvllm-bench"))


@dataclass(frozen=True)
class MoeShape:
    """A qwen3moe model's hyperparameters; the defaults are Qwen3-30B-A3B's layers."""

    layers: int = DEFAULT_LAYERS
    vocab: int = 18992  # QWEN3_30B_A3B_VOCAB * layers / 48, see scaled_vocab
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    experts_per_token: int = 8
    expert_ffn: int = 768
    #: The dense intermediate_size of the config (llama.cpp's converter writes it; no layer uses it).
    ffn: int = 6144
    context: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...], str]]:
        """(name, numpy shape, kind) of every tensor, in llama.cpp's order; kinds: ``embed``,
        ``norm``, ``matrix`` (N(0, 1/fan_in)), ``router``, ``experts`` ([experts, out, in])."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        yield "token_embd.weight", (self.vocab, self.hidden), "embed"
        for i in range(self.layers):
            b = f"blk.{i}"
            yield f"{b}.attn_norm.weight", (self.hidden,), "norm"
            yield f"{b}.attn_q.weight", (q, self.hidden), "matrix"
            yield f"{b}.attn_k.weight", (kv, self.hidden), "matrix"
            yield f"{b}.attn_v.weight", (kv, self.hidden), "matrix"
            yield f"{b}.attn_output.weight", (self.hidden, q), "matrix"
            yield f"{b}.attn_q_norm.weight", (self.head_dim,), "norm"
            yield f"{b}.attn_k_norm.weight", (self.head_dim,), "norm"
            yield f"{b}.ffn_norm.weight", (self.hidden,), "norm"
            yield f"{b}.ffn_gate_inp.weight", (self.experts, self.hidden), "router"
            yield f"{b}.ffn_gate_exps.weight", (self.experts, self.expert_ffn, self.hidden), "experts"
            yield f"{b}.ffn_up_exps.weight", (self.experts, self.expert_ffn, self.hidden), "experts"
            yield f"{b}.ffn_down_exps.weight", (self.experts, self.hidden, self.expert_ffn), "experts"
        yield "output_norm.weight", (self.hidden,), "norm"
        yield "output.weight", (self.vocab, self.hidden), "matrix"


def scaled_vocab(layers: int) -> int:
    """Qwen3-30B-A3B's vocabulary times ``layers``/48, rounded up to a multiple of 16: the LM head
    keeps its real share of a token's bytes."""
    return -(-QWEN3_30B_A3B_VOCAB * layers // QWEN3_30B_A3B_LAYERS // 16) * 16


def synthetic_shape(layers: int = DEFAULT_LAYERS) -> MoeShape:
    return MoeShape(layers=layers, vocab=scaled_vocab(layers))


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-character map (byte-level BPE's 256 base tokens), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def vocabulary(size: int) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a byte-level BPE vocabulary of ``size`` tokens: the 256
    bytes, pairs of bytes (each with its merge) and ``<|endoftext|>`` last (a control token)."""
    base = _byte_tokens()
    order = sorted(range(256), key=lambda b: (not chr(b).isalpha(), b))  # letters' pairs rank first
    pairs = ((base[a], base[b]) for a in order for b in order)
    n_pairs = size - 257
    if not 0 <= n_pairs <= 256 * 256:
        raise ValueError(f"a vocabulary of {size} tokens: at least 257 and at most {256 * 256 + 257}")
    chosen = [next(pairs) for _ in range(n_pairs)]
    tokens = base + [a + b for a, b in chosen] + ["<|endoftext|>"]
    merges = [f"{a} {b}" for a, b in chosen]
    return tokens, merges, [1] * (size - 1) + [3]  # llama.cpp's token types: 1 normal, 3 control


def write_gguf(path: Path, shape: MoeShape, seed: int = 0, dtype: str = "F16") -> Path:
    """``shape``'s model with random weights as a GGUF file: matrices in ``dtype`` (F16, F32 or
    Q8_0, the gguf library's quantizer), norms and the router in float32 as llama.cpp's converter
    writes them. One tensor is in memory at a time."""
    import gguf

    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[dtype]
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name(f"qwen3moe synthetic {shape.layers}-layer (Qwen3-30B-A3B layer shapes)")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_layer_norm_rms_eps(shape.rms_norm_eps)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_expert_count(shape.experts)
    w.add_expert_used_count(shape.experts_per_token)
    w.add_expert_feed_forward_length(shape.expert_ffn)
    w.add_file_type({"F16": gguf.LlamaFileType.MOSTLY_F16, "F32": gguf.LlamaFileType.ALL_F32,
                     "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])  # fmt: skip
    tokens, merges, types = vocabulary(shape.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(shape.vocab - 1)
    w.add_add_bos_token(False)

    def stored(kind: str) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType.F32 if kind in ("norm", "router") else qtype

    def encode(t: np.ndarray, q: gguf.GGMLQuantizationType) -> np.ndarray:
        if q == gguf.GGMLQuantizationType.F32:
            return t
        if q == gguf.GGMLQuantizationType.F16:
            return t.astype(np.float16)
        return gguf.quants.quantize(t, q)

    specs = list(shape.tensors())
    for name, dims, kind in specs:  # the tensor table first: the data is then written tensor by tensor
        q = stored(kind)
        nbytes = int(np.prod(gguf.quant_shape_to_byte_shape(dims, q)))
        w.add_tensor_info(name, dims, np.dtype(np.float32), nbytes, raw_dtype=q)  # dims: the logical shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, dims, kind in specs:
        if kind == "norm":
            t = (1.0 + 0.1 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
        elif kind == "embed":
            t = rng.standard_normal(dims, dtype=np.float32)
        else:  # matrix, router, experts: rows of unit-variance outputs for unit-variance inputs
            t = rng.standard_normal(dims, dtype=np.float32)
            t *= np.float32(dims[-1] ** -0.5)
        w.write_tensor_data(encode(t, stored(kind)))
        del t
    w.close()
    return path


def quantize_q4_k_m(src: Path, dst: Path, threads: int | None = None) -> Path:
    """``src`` converted by llama.cpp's quantizer to its Q4_K_M mixture (``llama-quantize ... Q4_K_M``)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads or os.cpu_count() or 1
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True  # a Q8_0 source; from F16 it changes nothing
    tmp = dst.with_name(dst.name + ".part")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src}")
    tmp.replace(dst)
    return dst


def synthetic_q4_k_m(
    layers: int = DEFAULT_LAYERS,
    directory: Path = CACHE,
    seed: int = 0,
    threads: int | None = None,
    keep_source: bool = False,
    log: bool = True,
) -> Path:
    """The Q4_K_M file of :func:`synthetic_shape` (``layers``), written on first use and then
    reused from ``directory``; the float16 source (about 1.2 GB a layer) is deleted unless
    ``keep_source``."""
    shape = synthetic_shape(layers)
    stem = directory / f"qwen3moe-synthetic-{layers}l-s{seed}"
    return cached_q4_k_m(stem, "F16", lambda p: write_gguf(p, shape, seed, "F16"), threads, keep_source, log)


def cached_q4_k_m(
    stem: Path,
    source_type: str,
    write_source: Callable[[Path], object],
    threads: int | None = None,
    keep_source: bool = False,
    log: bool = True,
) -> Path:
    """``<stem>-Q4_K_M.gguf``, made on first use: ``write_source`` writes ``<stem>-<source_type>.gguf``
    (under a temporary name, renamed when whole), llama.cpp's quantizer converts it, and the source is
    deleted unless ``keep_source``."""
    out = stem.with_name(f"{stem.name}-Q4_K_M.gguf")
    if out.exists():
        return out
    stem.parent.mkdir(parents=True, exist_ok=True)
    src = stem.with_name(f"{stem.name}-{source_type}.gguf")
    if not src.exists():
        t0 = time.perf_counter()
        part = src.with_name(src.name + ".part")
        write_source(part)
        part.replace(src)
        if log:
            print(f"wrote {src} ({src.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - t0:.0f} s)", flush=True)
    t0 = time.perf_counter()
    quantize_q4_k_m(src, out, threads)
    if log:
        print(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - t0:.0f} s)", flush=True)
    if not keep_source:
        src.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    ap.add_argument("--dir", type=Path, default=CACHE, help="where the files are kept (RUVLLM_BENCH_CACHE)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp quantizer's threads")
    ap.add_argument("--keep-source", action="store_true", help="keep the float16 file next to the Q4_K_M one")
    args = ap.parse_args(argv)
    print(dataclasses.asdict(synthetic_shape(args.layers)))
    print(synthetic_q4_k_m(args.layers, args.dir, args.seed, args.threads, args.keep_source))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
