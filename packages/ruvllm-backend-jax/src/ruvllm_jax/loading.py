"""Checkpoint -> :class:`Weights` on host: per-layer tensors stacked on a leading layer axis, matrices
optionally quantized (RTN from float32) or kept in their GGUF blocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import ml_dtypes
import numpy as np
import structlog

from ruvllm.checkpoint import Checkpoint
from ruvllm.errors import BackendError, ModelFormatError, RuvllmError
from ruvllm.modeling import EXPERT_FIELDS, LAYER_TENSORS, PROJECTION_GROUPS, PROJECTIONS, LayerTensor, LayerWeights
from ruvllm_jax.experts import stored_experts
from ruvllm_jax.gguf_blocks import (
    GGUF_DIRECT_TYPES,
    WXA8_GGUF_TYPES,
    common_format,
    from_gguf_blocks,
    kernel_form,
    storage_format,
    wxa8_from_gguf_blocks,
    wxa8_from_mxfp4,
)
from ruvllm_jax.host_memory import drop_file_pages
from ruvllm_jax.model import ModelSpec, Weights
from ruvllm_jax.quant import ROW_FIELDS, QuantArray, quantize, quantize_int8, quantize_w8a8, quantize_wxa8, to_panels
from ruvllm_jax.repack import NATIVE_REPACK_TYPES, native_repack_applies, repack_kquant
from ruvllm_jax.split_stack import SplitStack

log = structlog.get_logger("ruvllm_jax.loading")

#: SmoothQuant's migration strength per projection input (0: none, 1: all onto the weights).
SMOOTHING_ALPHA = {"attention_in": 0.5, "output_in": 0.5, "mlp_in": 0.5, "down_in": 0.5, "head_in": 0.5}

#: Quantizations the experts of a mixture of experts load in (the rest are refused by name).
EXPERT_QUANTIZATIONS = ("none", "w4a8", "w8a8")
#: GGUF types of experts that load in ``w4a8`` exactly (MXFP4 as 5-bit codes, gguf_blocks.wxa8_from_mxfp4).
EXPERT_GGUF_TYPES = WXA8_GGUF_TYPES | {"MXFP4"}

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


#: ``alloc(shape, dtype)``: a writable array for a stacked weight (see :class:`WeightLoader`).
Allocator = Callable[[tuple[int, ...], np.dtype], np.ndarray]


def _empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype)


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


def _w8a8_experts(w: np.ndarray) -> QuantArray:
    """Float experts ``[layers, experts, out, in]`` as int8 per output channel for int8 activations."""
    mats = [quantize_w8a8(m) for m in w.reshape(-1, *w.shape[-2:])]
    return dataclasses.replace(
        mats[0],
        quant=np.stack([m.quant for m in mats]).reshape(w.shape),
        scale=np.stack([m.scale for m in mats]).reshape(*w.shape[:-1], 1),
    )


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

    def __init__(
        self,
        checkpoint: Checkpoint,
        spec: ModelSpec,
        quantization: str,
        keep_gguf_blocks: bool,
        mmap_experts: bool = False,
        alloc: Allocator | None = None,
    ) -> None:
        self.ckpt = checkpoint
        #: Where stacked per-layer arrays are made (default ``np.empty``; the weight cache gives rows
        #: of the file it writes, :mod:`ruvllm_jax.weight_cache`).
        self.alloc: Allocator = alloc or _empty
        #: Drop a converted tensor's file pages from this process (not where the result may be a view
        #: of them: ``keep_gguf_blocks`` keeps blocks as stored).
        self.release_file_pages = quantization == "w4a8" and not keep_gguf_blocks
        self.spec = spec
        self.quantization = quantization
        self.keep_gguf_blocks = keep_gguf_blocks and checkpoint.format == "gguf"
        #: ``w4a8`` experts left in the file's mapping (:class:`ruvllm_jax.experts.StoredExperts`),
        #: checked by :func:`ruvllm_jax.options.load_settings`.
        self.mmap_experts = mmap_experts
        #: GGUF types already logged as not kept (:meth:`_not_kept`).
        self._not_kept_types: set[str] = set()
        #: A weight whose layers the file stores in different k-quant types is held as a
        #: :class:`SplitStack` (each type's layers in its own form; native ``w4a8`` steps only), not
        #: in the one wider form :func:`common_format` gives them.
        self.split_mixed = False

    def _direct(self, name: str) -> QuantArray | None:
        wxa8 = self.quantization == "w4a8"
        if not (self.keep_gguf_blocks or (wxa8 and self.ckpt.format == "gguf")):
            return None
        raw = self.ckpt.raw_tensor(name)
        if raw.ggml_type not in (WXA8_GGUF_TYPES if wxa8 else GGUF_DIRECT_TYPES) or len(raw.shape) != 2:
            self._not_kept(raw.ggml_type, name)
            return None
        try:
            if wxa8:
                out = kernel_form(wxa8_from_gguf_blocks(raw.ggml_type, raw.data, raw.shape))
            else:
                out = from_gguf_blocks(raw.ggml_type, raw.data, raw.shape)
        except ModelFormatError as exc:
            raise ModelFormatError(f"{self.ckpt.path}: tensor {name}: {exc}") from None
        if self.release_file_pages:
            # Converted: its blocks' pages leave this process (the page cache keeps them), so reading
            # the file does not leave all of it mapped beside the converted weights.
            drop_file_pages(raw.data, self.ckpt.mapping())
        return out

    def _not_kept(self, ggml_type: str, name: str) -> None:
        """Log once per type the GGUF blocks this form does not hold (the k-quants under
        keep_gguf_blocks, which keeps Q8_0 / Q4_0 / Q4_1 only): they are dequantized exactly, then held
        in float or rounded to w4a8's groups, so what runs is not the file's quantization."""
        if ggml_type in ("F32", "F16", "BF16") or ggml_type in self._not_kept_types:
            return
        self._not_kept_types.add(ggml_type)
        form = "rounded to w4a8 groups from the exact values" if self.quantization == "w4a8" else self.spec.dtype
        log.info("GGUF blocks not kept", ggml_type=ggml_type, first_tensor=name, loaded_as=form)

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

    def _native_form(self, names: list[str]) -> tuple[int | None] | None:
        """How :func:`~ruvllm_jax.repack.repack_kquant` repacks the matrices ``names`` (one weight's
        layers), as the argument tuple ``(bits,)``: ``(None,)`` where they share one type (its own
        form, the file's bytes), the widest of their types' widths where they do not (the 16-wide
        form :func:`common_format` gives them); None where it does not take them all (another load
        form, a type or shape it does not repack)."""
        if self.quantization != "w4a8" or self.keep_gguf_blocks or self.ckpt.format != "gguf":
            return None
        raws = [self.ckpt.raw_tensor(n) for n in names]
        if any(r.ggml_type not in NATIVE_REPACK_TYPES for r in raws):
            return None
        types = {r.ggml_type for r in raws}
        bits = None if len(types) == 1 else max(NATIVE_REPACK_TYPES[t][1] for t in types)
        return (bits,) if all(native_repack_applies(r.ggml_type, r.shape, bits) for r in raws) else None

    def _repacked(self, name: str, bits: int | None) -> QuantArray:
        """``name``'s GGUF blocks in the kernels' panel form, repacked natively: the type's own form
        (``bits`` None), or the 16-wide one with ``bits``-wide codes (the bytes :meth:`_direct`,
        :func:`common_format` and :func:`to_panels` give)."""
        raw = self.ckpt.raw_tensor(name)
        try:
            out = repack_kquant(raw.ggml_type, raw.data, raw.shape, bits)
        except (ModelFormatError, BackendError) as exc:
            raise type(exc)(f"{self.ckpt.path}: tensor {name}: {exc}") from None
        if self.release_file_pages:
            drop_file_pages(raw.data, self.ckpt.mapping())
        return out

    def embedding(self, name: str):
        form = self._native_form([name])
        if form is not None:
            return self._repacked(name, *form)
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
        if self.spec.num_experts and (self.quantization not in EXPERT_QUANTIZATIONS or self.keep_gguf_blocks):
            self._refuse_experts()
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
        # The calibration's measuring point of each group of projections that share an input.
        groups = dict(zip(("attention_in", "output_in", "mlp_in", "down_in"), PROJECTION_GROUPS, strict=True))
        quantized: dict[str, list] = {}
        for point, projs in groups.items():
            if getattr(lw, projs[0]) is None:  # a mixture of experts' dense MLP (its experts: below)
                continue
            for name in projs:
                quantized[name] = []
            for layer in range(self.spec.num_layers):
                mats = [getattr(lw, name)[layer] for name in projs]
                s = None if r is None else smoothing_factors(getattr(r, point)[layer], mats, SMOOTHING_ALPHA[point])
                for name, m in zip(projs, mats, strict=True):
                    quantized[name].append(quantize_w8a8(m, s))
        layers = dataclasses.replace(lw, **{k: _stack(v) for k, v in quantized.items()})
        if self.spec.num_experts:
            # Experts without smoothing: one input's factors would have to suit every expert.
            layers = dataclasses.replace(
                layers, **{f: _w8a8_experts(getattr(layers, f)) for f in EXPERT_FIELDS.values()}
            )
        head = w.embed if w.lm_head is None else w.lm_head
        s_head = None if r is None else smoothing_factors(r.head_in, [head], SMOOTHING_ALPHA["head_in"])
        if w.lm_head is None:
            # Tied: the embedding lookup dequantizes rows with the same factors, so it stays exact.
            return Weights(quantize_w8a8(w.embed, s_head), layers, w.final_norm, None)
        return Weights(quantize_w8a8(w.embed), layers, w.final_norm, quantize_w8a8(w.lm_head, s_head))

    def _quantized_experts(self, t: LayerTensor) -> bool:
        """Whether ``t`` is an expert matrix this load quantizes (``w4a8``; ``w8a8`` quantizes the float
        ones after calibration); expert biases and float experts are vectors to it."""
        return self.quantization == "w4a8" and t.field in EXPERT_FIELDS.values()

    def _experts(self, t: LayerTensor, layer: int) -> np.ndarray:
        """One layer's float experts of ``t`` (or their biases), ``[experts, out(, in)]``."""
        return np.stack([self.vector(name) for name in t.names(layer, self.spec)])

    def _expert_matrix(self, name: str) -> QuantArray:
        """One expert's matrix in ``w4a8``, row-major: a GGUF's blocks converted exactly, as dense weights
        are (MXFP4 as 5-bit codes); float experts rounded as Q4_1."""
        if self.ckpt.format == "gguf":
            kind = self.ckpt.raw_tensor(name).ggml_type
            if kind == "MXFP4":
                return self._mxfp4(name)
            if kind not in EXPERT_GGUF_TYPES and kind not in ("F32", "F16", "BF16"):
                # Rounding them again to Q4_1 would change the file's weights.
                raise BackendError(
                    f"jax backend: experts in GGUF type {kind} ({name}) have no exact w4a8 form "
                    f"(w4a8 experts: {', '.join(sorted(EXPERT_GGUF_TYPES))}, or float); load with quantization none"
                )
        return self.matrix(name)

    def _matrix_stack(self, t: LayerTensor) -> QuantArray | np.ndarray:
        """Every layer's matrix of ``t``, ``[layers, out, in]`` (``w4a8``: in the kernels' panel layout),
        written layer by layer into arrays made once by :attr:`alloc`: one layer's conversion is the
        only copy beside them (a list of every layer's matrices, then stacked, held the model twice;
        an 8B model peaked at 16.4 GB). Layers the file stores in different types take the one form
        :func:`common_format` gives them together, decided from one matrix of each type."""
        spec = self.spec
        names = [t.name(i) for i in range(spec.num_layers)]
        missing = [n for n in names if n not in self._names]
        if missing:
            raise ModelFormatError(f"{self.ckpt.path}: tensor {missing[0]!r} is missing")
        reps: dict[str, QuantArray] = {}  # one matrix per GGUF type among the layers, where they differ
        repack = self._native_form(names)
        if self.split_mixed and repack is not None and repack[0] is not None:  # several types
            return self._split_stack(names)
        if self.ckpt.format == "gguf" and repack is None:
            kinds = {self.ckpt.raw_tensor(n).ggml_type: n for n in reversed(names)}
            if len(kinds) > 1:
                # In their common form already, so that bringing each layer to it converts that layer
                # only (converting the representatives again for every layer doubled an 8B load).
                found = [self.matrix(n) for n in kinds.values()]
                if all(isinstance(m, QuantArray) for m in found):
                    reps = dict(zip(kinds, common_format(found), strict=True))
        first: QuantArray | np.ndarray | None = None
        out: dict[str, np.ndarray] = {}
        for i, name in enumerate(names):
            m = self.matrix(name) if repack is None else self._repacked(name, *repack)
            if isinstance(m, QuantArray):
                if reps:
                    m = common_format([m, *reps.values()])[0]
                m = to_panels(m)
                fields = [f for f in ("quant", "in_scale", *ROW_FIELDS) if getattr(m, f) is not None]
                parts = {f: np.asarray(getattr(m, f)) for f in fields}
            else:
                parts = {"": m}
            form = (
                storage_format(m) if isinstance(m, QuantArray) else None,
                {f: (a.shape, a.dtype) for f, a in parts.items()},
            )
            if first is None:
                first, first_form = m, form
                out = {f: self.alloc((spec.num_layers, *a.shape), a.dtype) for f, a in parts.items()}
            elif form != first_form:
                raise BackendError(f"layers store {t.field} in different formats; load with quantization q8/q4 or none")
            for f, a in parts.items():
                out[f][i] = a
            del m, parts
        assert first is not None
        if isinstance(first, QuantArray):
            return dataclasses.replace(first, **out)
        return out[""]

    def _split_stack(self, names: list[str]) -> SplitStack:
        """The layers ``names`` of one weight, stored in several k-quant types, as one stack per type
        in the type's own form (the file's bytes), each written layer by layer into arrays made once
        by :attr:`alloc`."""
        types = [self.ckpt.raw_tensor(n).ggml_type for n in names]
        order = sorted(set(types), key=types.index)
        parts = []
        for kind in order:
            chosen = [n for n, t in zip(names, types, strict=True) if t == kind]
            out: dict[str, np.ndarray] = {}
            first = None
            for j, name in enumerate(chosen):
                m = self._repacked(name, None)
                arrays = {f: np.asarray(getattr(m, f)) for f in ("quant", *ROW_FIELDS) if getattr(m, f) is not None}
                if first is None:
                    first = m
                    out = {f: self.alloc((len(chosen), *a.shape), a.dtype) for f, a in arrays.items()}
                for f, a in arrays.items():
                    out[f][j] = a
                del m, arrays
            parts.append(dataclasses.replace(first, **out))
        index = tuple(types[:i].count(t) for i, t in enumerate(types))
        return SplitStack(tuple(parts), tuple(order.index(t) for t in types), index)

    def _expert_stack(self, t: LayerTensor) -> QuantArray:
        """Every layer's ``w4a8`` experts of ``t``, ``[layers, experts, out, in]`` in the kernels' panel
        layout, written layer by layer into arrays allocated once, so one layer's conversion is the only
        copy beside them (stacking per-layer arrays would hold the experts two or three times over,
        more than a 17 GB model leaves on a 24 GB machine). Layers stored in different types take the
        one form :func:`common_format` gives them together, decided from one matrix of each type."""
        spec = self.spec
        reps: dict[str, QuantArray] = {}  # one matrix per GGUF type among the layers
        for i in range(spec.num_layers):
            name = t.names(i, spec)[0]
            kind = self.ckpt.raw_tensor(name).ggml_type
            if kind not in reps:
                reps[kind] = self._expert_matrix(name)
        out: dict[str, np.ndarray] = {}
        first: QuantArray | None = None
        for i in range(spec.num_layers):
            names = t.names(i, spec)
            # With the other types' matrices beside them, the conversion is the whole stack's.
            mats = common_format([self._expert_matrix(n) for n in names] + list(reps.values()))[: len(names)]
            fields = [f for f in ("quant", *ROW_FIELDS) if getattr(mats[0], f) is not None]
            layer = to_panels(
                dataclasses.replace(mats[0], **{f: np.stack([getattr(m, f) for m in mats]) for f in fields})
            )
            del mats
            if first is None:
                first = layer
                out = {
                    f: np.empty((spec.num_layers, *getattr(layer, f).shape), getattr(layer, f).dtype) for f in fields
                }
            elif storage_format(layer) != storage_format(first) or layer.quant.shape != first.quant.shape:
                raise BackendError(
                    f"jax backend: the layers of {t.field} store their experts in forms with no common w4a8 form "
                    f"({', '.join(sorted(reps))}); load with quantization none"
                )
            for f in fields:
                out[f][i] = getattr(layer, f)
        assert first is not None
        return dataclasses.replace(first, **out)

    def _mxfp4(self, name: str) -> QuantArray:
        raw = self.ckpt.raw_tensor(name)
        try:
            return wxa8_from_mxfp4(raw.data, raw.shape)
        except (ModelFormatError, BackendError) as exc:
            raise type(exc)(f"{self.ckpt.path}: tensor {name}: {exc}") from None

    def _refuse_experts(self) -> None:
        form = "keep_gguf_blocks" if self.quantization == "none" else f"quantization {self.quantization}"
        raise BackendError(
            "jax backend: the experts of a mixture of experts (model.layers.{n}.mlp.experts.{e}.*) load in "
            f"float (quantization none), w4a8 or w8a8; {form} has no expert kernels"
        )

    def _load(self) -> Weights:
        spec = self.spec
        names = self._names = set(self.ckpt.tensor_names())
        tensors = [t for t in LAYER_TENSORS if t.present(spec)]
        per_layer: dict[str, list] = {t.field: [] for t in tensors if not self._quantized_experts(t)}
        for i in range(spec.num_layers):
            for t in tensors:
                name = t.name(i)
                if self._quantized_experts(t):
                    continue  # stacked once below
                if t.per_expert:
                    per_layer[t.field].append(self._experts(t, i))
                    continue
                if t.field in PROJECTIONS:
                    continue  # stacked layer by layer below
                if name not in names:
                    raise ModelFormatError(f"{self.ckpt.path}: tensor {name!r} is missing")
                per_layer[t.field].append(self.vector(name))
        stack = (lambda t: stored_experts(self.ckpt, t, spec)) if self.mmap_experts else self._expert_stack
        experts = {t.field: stack(t) for t in tensors if self._quantized_experts(t)}
        projections = {t.field: self._matrix_stack(t) for t in tensors if t.field in PROJECTIONS and not t.per_expert}
        vectors = {k: _stack(v) for k, v in per_layer.items() if k not in projections}
        layers = LayerWeights(**vectors, **projections, **experts)
        self._check_shapes(layers)
        lm_head = None if spec.tie_word_embeddings else self.embedding("lm_head.weight")
        return Weights(
            embed=self.embedding("model.embed_tokens.weight"),
            layers=layers,
            final_norm=self.vector("model.norm.weight"),
            lm_head=lm_head,
        )

    def _check_shapes(self, layers: LayerWeights) -> None:
        for t in LAYER_TENSORS:
            if not t.present(self.spec):
                continue
            key, shape = t.field, t.shape(self.spec)
            if t.per_expert:
                shape = (self.spec.num_experts, *shape)
            got = tuple(getattr(layers, key).shape[1:])
            if got != shape:
                raise ModelFormatError(f"{self.ckpt.path}: {key} has shape {got}, the config implies {shape}")
