"""The jax backend's encoder pass: :func:`ruvllm.modeling.encode_hidden` jitted once per padded shape
(rows by :func:`padded_rows`, length by :func:`padded_length`, so a server meets a bounded set of
shapes), short sequences packed several to a row, no KV cache. Weights in float32; with
``dtype="bfloat16"`` the layers' matrices in bfloat16, each product's input rounded to bfloat16 and
summed in float32; or with ``quantization="w8a8"`` the matrices as int8 blocks of 32 (Q8_0)
multiplied by the native kernels with int8 activations per group of 32 (llama.cpp's CPU scheme for
Q8_0). Everything else (embeddings, norms, attention) stays float32."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ruvllm.backend import LoadOptions
from ruvllm.checkpoint import Checkpoint
from ruvllm.encoder import EncodeBatch, packed_passes
from ruvllm.errors import BackendError, ModelFormatError
from ruvllm.modeling.encoder import (
    EncoderWeights,
    check_encoder,
    encode_hidden,
    load_encoder_weights,
)
from ruvllm.modeling.schema import PROJECTIONS

#: Padded positions one jitted pass holds (rows x length): all-MiniLM-L6-v2 on a 2-core Zen 4 ran 256
#: texts of 10-55 tokens at 127 texts/s in passes of 16,384, 185 at 2,048 (the activations stay in
#: cache); 1,024 split batches of 32 into passes too small.
_TOKENS_PER_PASS = 2048
#: Short sequences share rows of this many positions (their attention scores are the row's length
#: squared, masked to each sequence's own): batches of 32 texts of 10-45 tokens on a 2-core Zen 4 ran
#: at 27.9 texts/s (EmbeddingGemma-300M, 3 heads) in rows of 128, 25.4 in rows of 64, 16.4 padded by
#: length; all-MiniLM-L6-v2 (12 heads: 4x the softmax work a position) at 261 in rows of 64, 240 in
#: rows of 128, 159 padded by length.
_PACK_LENGTH = 128
_PACK_LENGTH_MANY_HEADS = 64


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def padded_rows(n: int) -> int:
    """The rows a pass of ``n`` rows is padded to: 1, 2, 4, then the next multiple of 4 (multiples of 8
    ran all-MiniLM-L6-v2's batches of 32 texts 8% slower)."""
    return _pow2(n) if n <= 4 else -(-n // 4) * 4


def padded_length(n: int) -> int:
    """The length a sequence of ``n`` tokens is padded to: the next multiple of 8 up to 64, of 16 up to
    128, of 64 up to 512, of 256 beyond: fewer than 8 padding positions up to 64 tokens, 16 up to 128
    (a power of two pads up to half the pass), at 18 lengths up to 512 to compile (powers of two: 7).
    Multiples of 8 rather than 16 below 64 ran EmbeddingGemma-300M one text of 11-41 tokens at a
    time 6% faster on a 2-core Zen 4 (20.0 against 18.9 texts/s)."""
    step = 8 if n <= 64 else 16 if n <= 128 else 64 if n <= 512 else 256
    return -(-n // step) * step


#: ``LoadOptions.quantization`` values the jax encoder takes.
ENCODER_QUANTIZATIONS = ("none", "auto", "w8a8")
#: The layer fields ``w8a8`` quantizes: BERT's and a decoder layer's matrices (not norms, not biases).
_MATRICES = frozenset({"q_w", "k_w", "v_w", "o_w", "up_w", "down_w", *PROJECTIONS})


def _check_w8a8(cfg: Any) -> None:
    from ruvllm_jax import native

    if not native.available():
        raise BackendError(f"quantization w8a8 runs on the native CPU kernels, which are not loaded: "
                           f"{native.unavailable_reason()}")  # fmt: skip
    widths = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_heads * head_dim": cfg.num_heads * cfg.head_dim}  # fmt: skip
    odd = [f"{k}={v}" for k, v in widths.items() if v % 32]
    if odd:
        raise BackendError(f"quantization w8a8 multiplies inputs in groups of 32: {', '.join(odd)} is not a multiple")


def _q8_0(w: Any) -> Any:
    """A float ``[out, in]`` matrix as Q8_0 blocks in the native kernels' panel layout."""
    import jax

    from ruvllm_jax.quant import quantize_wxa8, to_panels

    return jax.tree_util.tree_map(jax.numpy.asarray, to_panels(quantize_wxa8(np.asarray(w, np.float32), 8)))


def _products(x: Any, ws: list[Any]) -> list[Any]:
    """The layers' products: float matrices, held transposed (``[in, out]``), by XLA (the input in the
    matrix's dtype, the sums in float32); Q8_0 matrices by
    the native kernels (the input quantized once per call, one call per layout)."""
    import jax.numpy as jnp

    from ruvllm_jax import native
    from ruvllm_jax.quant import QuantArray

    if not isinstance(ws[0], QuantArray):
        return [jnp.matmul(x.astype(w.dtype), w, preferred_element_type=jnp.float32) for w in ws]
    ys: list[Any] = [None] * len(ws)
    for panel in (True, False):
        idx = [i for i, w in enumerate(ws) if bool(w.panel) == panel]
        if idx:
            got = native.wxa8_group(x, 0, [(ws[i].quant, ws[i].scale, ws[i].offset) for i in idx], panel=panel)
            for i, y in zip(idx, got, strict=True):
                ys[i] = y
    return ys


class JaxEncoder:
    """An encoder's weights as jax arrays and its jitted pass."""

    def __init__(self, checkpoint: Checkpoint, options: LoadOptions) -> None:
        import jax
        import jax.numpy as jnp

        import ruvllm_jax.model  # noqa: F401 (registers jax's primitives with ruvllm.modeling)

        if options.quantization not in ENCODER_QUANTIZATIONS:
            raise BackendError(
                f"the jax encoder runs float32 weights (quantization none or auto) or w8a8 (int8 blocks of 32 "
                f"for weights and activations, native CPU kernels): quantization {options.quantization!r}"
            )
        if options.dtype not in ("auto", "float32", "bfloat16"):
            raise BackendError(f"the jax encoder's dtypes are float32 and bfloat16: dtype {options.dtype!r}")
        if options.extra:
            raise BackendError(f"the jax encoder takes no extra options (got {', '.join(sorted(options.extra))})")
        quantization = "none" if options.quantization == "auto" else options.quantization
        dtype = "float32" if options.dtype == "auto" else options.dtype
        if dtype == "bfloat16" and quantization == "w8a8":
            raise BackendError("the jax encoder's w8a8 form is int8 products: dtype bfloat16 does not apply to it")
        self.options = LoadOptions(quantization=quantization, dtype=dtype)
        cfg = self.config = checkpoint.config
        check_encoder(cfg, str(getattr(checkpoint, "path", "")))
        if quantization == "w8a8":
            _check_w8a8(cfg)

        def read(name: str, shape: tuple[int, ...]) -> Any:
            t = np.asarray(checkpoint.tensor(name), dtype=np.float32)
            if t.shape != shape:
                raise ModelFormatError(f"tensor {name} has shape {t.shape}, the config implies {shape}")
            return jnp.asarray(t)

        w = load_encoder_weights(cfg, read)
        # XLA:CPU multiplies a few rows by a transposed operand at half the rate of a plain one (EmbeddingGemma's
        # 32 x 768 x 1152 on a 2-core Zen 4: 82 against 170 GFLOP/s), so float matrices are held [in, out].
        def transposed(a: Any) -> Any:
            return jnp.transpose(a).astype(jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)

        form = _q8_0 if quantization == "w8a8" else transposed
        w.layers = [{f: form(a) if f in _MATRICES else a for f, a in layer.items()} for layer in w.layers]
        self._tree = (w.globals, w.layers)

        def run(tree: Any, ids: Any, types: Any, segments: Any, positions: Any) -> Any:
            return encode_hidden(EncoderWeights(tree[0], tree[1]), cfg, ids, types, segments, positions, _products)

        self._run = jax.jit(run)
        self._pack_length = _PACK_LENGTH_MANY_HEADS if cfg.num_heads >= 8 else _PACK_LENGTH
        self._lock = threading.Lock()  # one pass at a time: XLA's CPU threads are the machine's already

    def _length(self, n: int) -> int:
        return min(padded_length(n), max(n, self.config.max_position_embeddings))

    def encode(self, batch: EncodeBatch) -> list[np.ndarray]:
        lengths = [len(t) for t in batch.token_ids]
        out: list[np.ndarray] = [np.empty((0, self.config.hidden_size), np.float32)] * len(lengths)
        passes = packed_passes(
            batch, _TOKENS_PER_PASS, bucket=self._length, pack_length=self._pack_length, row_count=padded_rows
        )
        for p in passes:
            with self._lock:
                hidden = np.asarray(self._run(self._tree, p.ids, p.types, p.segments, p.positions))
            for i, row, start in p.places:
                out[i] = hidden[row, start : start + lengths[i]]
        return out
