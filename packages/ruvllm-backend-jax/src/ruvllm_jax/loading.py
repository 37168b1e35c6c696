"""Checkpoint -> :class:`Weights` on host: per-layer tensors stacked on a leading layer axis, matrices
optionally quantized (RTN from float32) or kept in their GGUF blocks."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import structlog

from ruvllm.checkpoint import Checkpoint
from ruvllm.errors import BackendError, ModelFormatError, RuvllmError
from ruvllm_jax.gguf_blocks import (
    GGUF_DIRECT_TYPES,
    WXA8_GGUF_TYPES,
    common_format,
    from_gguf_blocks,
    kernel_form,
    storage_format,
    wxa8_from_gguf_blocks,
)
from ruvllm_jax.model import LayerWeights, ModelSpec, Weights
from ruvllm_jax.quant import ROW_FIELDS, QuantArray, quantize, quantize_int8, quantize_w8a8, quantize_wxa8, to_panels

_MATRICES = {
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
_VECTORS = {"input_norm": "input_layernorm.weight", "post_attention_norm": "post_attention_layernorm.weight"}
_BIASES = {"q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias"}
_QK_NORMS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
_OUTPUT_NORMS = {"attn_output_norm": "attn_output_norm.weight", "mlp_output_norm": "mlp_output_norm.weight"}

log = structlog.get_logger("ruvllm_jax.loading")

#: SmoothQuant's migration strength per projection input (0: none, 1: all onto the weights).
SMOOTHING_ALPHA = {"attention_in": 0.5, "output_in": 0.5, "mlp_in": 0.5, "down_in": 0.5, "head_in": 0.5}

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _float(a: np.ndarray, dtype: str) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=DTYPES[dtype])


def _stack(items: list):
    """Stack per-layer arrays (or QuantArrays, brought to one format, see :func:`common_format`) on
    a new leading axis; ``w4a8`` matrices come out in the native kernels' panel layout."""
    first = items[0]
    if isinstance(first, QuantArray):
        if all(isinstance(x, QuantArray) for x in items):
            items = common_format(items)
            first = items[0]
        if any(not isinstance(x, QuantArray) or storage_format(x) != storage_format(first) for x in items):
            raise BackendError("layers store one weight in different formats; load with quantization q8/q4 or none")
        arrays = {
            f: np.stack([getattr(x, f) for x in items])
            for f in ("quant", "in_scale", *ROW_FIELDS)
            if getattr(first, f) is not None
        }
        return to_panels(dataclasses.replace(first, **arrays))
    return np.stack(items)


def _calibration_ids(checkpoint: Checkpoint, vocab: int) -> list[int] | None:
    from ruvllm_jax.calibrate import CALIBRATION_TEXT

    try:
        ids = checkpoint.tokenizer().encode(CALIBRATION_TEXT)
    except RuvllmError as exc:
        log.warning("w8a8: no tokenizer to calibrate with; activations quantized without smoothing", error=str(exc))
        return None
    return [i for i in ids if 0 <= i < vocab] or None


class WeightLoader:
    """Reads one checkpoint's tensors in the form the options ask for."""

    def __init__(self, checkpoint: Checkpoint, spec: ModelSpec, quantization: str, keep_gguf_blocks: bool) -> None:
        self.ckpt = checkpoint
        self.spec = spec
        self.quantization = quantization
        self.keep_gguf_blocks = keep_gguf_blocks and checkpoint.format == "gguf"

    def _direct(self, name: str) -> QuantArray | None:
        wxa8 = self.quantization == "w4a8"
        if not (self.keep_gguf_blocks or (wxa8 and self.ckpt.format == "gguf")):
            return None
        raw = self.ckpt.raw_tensor(name)
        if raw.ggml_type not in (WXA8_GGUF_TYPES if wxa8 else GGUF_DIRECT_TYPES) or len(raw.shape) != 2:
            return None
        try:
            if wxa8:
                return kernel_form(wxa8_from_gguf_blocks(raw.ggml_type, raw.data, raw.shape))
            return from_gguf_blocks(raw.ggml_type, raw.data, raw.shape)
        except ModelFormatError as exc:
            raise ModelFormatError(f"{self.ckpt.path}: tensor {name}: {exc}") from None

    def matrix(self, name: str):
        """One layer's matrix, row-major (:func:`_stack` lays the stacked ones out in panels)."""
        direct = self._direct(name)
        if direct is not None:
            return direct
        w = self.ckpt.tensor(name)
        if self.quantization == "none":
            return _float(w, self.spec.dtype)
        if self.quantization == "w4a8":
            return quantize_wxa8(w, 4)
        return quantize(w, self.quantization)

    def embedding(self, name: str):
        direct = self._direct(name)
        if direct is not None:
            return to_panels(direct)
        w = self.ckpt.tensor(name)
        if self.quantization == "none":
            return _float(w, self.spec.dtype)
        if self.quantization == "w4a8":
            return to_panels(quantize_wxa8(w, 8))
        # int8 for both q8 and q4: the embedding doubles as the output projection when tied,
        # where int4 costs far more accuracy than it saves memory on small models.
        return quantize_int8(w)

    def vector(self, name: str) -> np.ndarray:
        return _float(self.ckpt.tensor(name), self.spec.dtype)

    def load(self) -> Weights:
        if self.quantization == "w8a8":
            return self._load_w8a8()
        return self._load()

    def _load_w8a8(self) -> Weights:
        """Float weights, one calibration pass for the activation ranges, then every matrix
        quantized with SmoothQuant factors for its input (see :mod:`ruvllm_jax.calibrate`)."""
        from ruvllm_jax.calibrate import activation_ranges, smoothing_factors

        self.quantization = "none"
        try:
            w = self._load()
        finally:
            self.quantization = "w8a8"
        ids = _calibration_ids(self.ckpt, self.spec.vocab_size)
        if ids is None:
            r = None
        else:
            r = activation_ranges(w, self.spec, ids)
        lw = w.layers
        groups = {
            "attention_in": ("q_proj", "k_proj", "v_proj"),
            "output_in": ("o_proj",),
            "mlp_in": ("gate_proj", "up_proj"),
            "down_in": ("down_proj",),
        }
        quantized: dict[str, list] = {}
        for point, projs in groups.items():
            for name in projs:
                quantized[name] = []
            for layer in range(self.spec.num_layers):
                mats = [getattr(lw, name)[layer] for name in projs]
                s = None if r is None else smoothing_factors(getattr(r, point)[layer], mats, SMOOTHING_ALPHA[point])
                for name, m in zip(projs, mats, strict=True):
                    quantized[name].append(quantize_w8a8(m, s))
        layers = dataclasses.replace(lw, **{k: _stack(v) for k, v in quantized.items()})
        head = w.embed if w.lm_head is None else w.lm_head
        s_head = None if r is None else smoothing_factors(r.head_in, [head], SMOOTHING_ALPHA["head_in"])
        if w.lm_head is None:
            # Tied: the embedding lookup dequantizes rows with the same factors, so it stays exact.
            return Weights(quantize_w8a8(w.embed, s_head), layers, w.final_norm, None)
        return Weights(quantize_w8a8(w.embed), layers, w.final_norm, quantize_w8a8(w.lm_head, s_head))

    def _load(self) -> Weights:
        spec = self.spec
        names = set(self.ckpt.tensor_names())
        vectors = dict(_VECTORS)
        for wanted, group in (
            (spec.attention_bias, _BIASES),
            (spec.qk_norm, _QK_NORMS),
            (spec.output_norms, _OUTPUT_NORMS),
        ):
            if wanted:
                vectors.update(group)
        per_layer: dict[str, list] = {k: [] for k in (*_MATRICES, *vectors)}
        for i in range(spec.num_layers):
            pre = f"model.layers.{i}."
            for key, suffix in _MATRICES.items():
                per_layer[key].append(self.matrix(pre + suffix))
            for key, suffix in vectors.items():
                if pre + suffix not in names:
                    raise ModelFormatError(f"{self.ckpt.path}: tensor {pre + suffix!r} is missing")
                per_layer[key].append(self.vector(pre + suffix))
        layers = LayerWeights(**{k: _stack(v) for k, v in per_layer.items()})
        self._check_shapes(layers)
        lm_head = None if spec.tie_word_embeddings else self.embedding("lm_head.weight")
        return Weights(
            embed=self.embedding("model.embed_tokens.weight"),
            layers=layers,
            final_norm=self.vector("model.norm.weight"),
            lm_head=lm_head,
        )

    def _check_shapes(self, layers: LayerWeights) -> None:
        s = self.spec
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        want = {
            "q_proj": (q, s.hidden_size),
            "k_proj": (kv, s.hidden_size),
            "v_proj": (kv, s.hidden_size),
            "o_proj": (s.hidden_size, q),
            "gate_proj": (s.intermediate_size, s.hidden_size),
            "up_proj": (s.intermediate_size, s.hidden_size),
            "down_proj": (s.hidden_size, s.intermediate_size),
        }
        if s.qk_norm:
            want.update(q_norm=(s.head_dim,), k_norm=(s.head_dim,))
        if s.output_norms:
            want.update(attn_output_norm=(s.hidden_size,), mlp_output_norm=(s.hidden_size,))
        for key, shape in want.items():
            got = tuple(getattr(layers, key).shape[1:])
            if got != shape:
                raise ModelFormatError(f"{self.ckpt.path}: {key} has shape {got}, the config implies {shape}")
