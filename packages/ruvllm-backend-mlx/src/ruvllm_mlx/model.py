"""The decoder of every family in :mod:`ruvllm.architectures` on MLX, over the paged cache of
:mod:`ruvllm_mlx.kv_cache`.

The layer is :func:`ruvllm.modeling.decoder_layer`, the one every backend runs, over ``mlx.core``
arrays (MLX arrays speak the array API); this module gives it MLX's ways to project (a matmul, or
``mx.quantized_matmul`` over GGUF blocks kept in MLX's affine form), to attend (gather a chunk's
slots, then ``mx.fast.scaled_dot_product_attention`` with grouped-query heads and the chunk's causal
and window mask) and to adapt (the adapter's ``delta``, LoRA and X-LoRA mixes alike).

Every token of every chunk goes through the projections and the MLP as one ``[T, hidden]`` matrix;
attention runs per chunk over that sequence's positions ``0 .. end_pos``. A step is one lazy MLX graph
evaluated once at its end, on the Metal GPU where MLX reports one, else on the CPU.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import structlog

from ruvllm.backend import Capabilities, ForwardBatch, ForwardOutput, LoadOptions, StepLimits, kv_block_bytes
from ruvllm.checkpoint import Checkpoint
from ruvllm.errors import BackendError, ModelFormatError, RequestError, UnsupportedQuantizationError
from ruvllm.model_config import ModelConfig, Rope
from ruvllm.modeling import (
    ACTIVATIONS,
    LayerWeights,
    attention_mask,
    decoder_layer,
    load_layer,
    projection_shape,
    register_primitives,
    rms_norm,
    softcap,
)
from ruvllm_mlx.device import choose_device, device_label, device_memory
from ruvllm_mlx.gguf_blocks import EXACT_BITS, GROUP, NEAREST_FORMS, affine_from_gguf, nearest_affine
from ruvllm_mlx.kv_cache import ChunkPlan, MLXPagedKVCache, make_kv_cache, plan_step
from ruvllm_mlx.lora import AdapterFactors, is_mix, on_device

log = structlog.get_logger("ruvllm_mlx")

# MLX's own elementwise forms for the layer's formulas (ruvllm.modeling's generic ones go through tanh),
# and mx.compile for the layer's elementwise chains: MLX runs operation by operation, and fusing them
# took 3% (the file's blocks) to 7% (float) off a one-row decode step on the CPU build, the same bits
# (benchmarks/bench_mlx_compile.py, docs/mlx-backend.md).
register_primitives(mx, sigmoid=mx.sigmoid, rsqrt=mx.rsqrt, compile=mx.compile)

#: ``LoadOptions.quantization`` values: ``auto`` keeps a GGUF file's blocks (float weights otherwise),
#: ``gguf`` insists on them, ``q8`` / ``q4`` round float weights at load (MLX's affine form, group 32).
QUANTIZATIONS = ("none", "auto", "gguf", "q8", "q4")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
#: ``LoadOptions.extra`` keys mlx takes.
EXTRA_OPTIONS = ("device",)


@dataclass(frozen=True)
class Linear:
    """A projection's weight ``[out, in]``: float, or quantized (MLX's affine form) when ``bits``."""

    weight: mx.array  # float [out, in] ([in, out] when ``transposed``), or packed uint32 [out, in * bits / 32]
    scales: mx.array | None = None
    biases: mx.array | None = None
    bits: int = 0
    #: The stored form, for ``ruvllm info`` and the load log (``float32``, ``Q4_K``, ``q8``...).
    form: str = "float"
    #: Float weights stored ``[in, out]``: MLX's CPU product of ``x @ w`` measured 1.5-2x faster than
    #: ``x @ w.T`` over ``[out, in]`` (x86, 16-128 rows); the tied head keeps the embedding's layout.
    transposed: bool = False

    def __call__(self, x: mx.array) -> mx.array:
        if self.scales is None:
            return x @ self.weight if self.transposed else x @ self.weight.T
        return mx.quantized_matmul(
            x, self.weight, self.scales, self.biases, transpose=True, group_size=GROUP, bits=self.bits
        )

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.weight, self.scales, self.biases) if a is not None)


@dataclass(frozen=True)
class MLXLayer:
    weights: LayerWeights[Linear, mx.array]
    #: q/k/v and gate/up stacked into one product where their forms agree (float weights), else None.
    qkv: Linear | None
    gate_up: Linear | None
    window: int
    rope: Rope


def _fuse(parts: Sequence[Linear]) -> Linear | None:
    """One product for projections sharing an input, when all are float (quantized ones may differ in
    type within a layer, as Q4_K_M's attn_v)."""
    if any(p.bits for p in parts):
        return None
    if any(p.transposed != parts[0].transposed for p in parts):
        return None
    axis = 1 if parts[0].transposed else 0
    return Linear(
        mx.concatenate([p.weight for p in parts], axis=axis), form=parts[0].form, transposed=parts[0].transposed
    )


def _views(fused: Linear, sizes: Sequence[int]) -> list[Linear]:
    """The parts of a fused float product as views of its weight (no second copy kept)."""
    out, lo = [], 0
    for n in sizes:
        w = fused.weight[:, lo : lo + n] if fused.transposed else fused.weight[lo : lo + n]
        out.append(Linear(w, form=fused.form, transposed=fused.transposed))
        lo += n
    return out


class MLXModel:
    """A checkpoint loaded on MLX (a :class:`ruvllm.backend.BackendModel`)."""

    capabilities = Capabilities(
        dtypes=tuple(DTYPES),
        quantizations=QUANTIZATIONS,
        adapters=True,
        adapter_mix=True,
        hidden_states=True,
        all_logits=True,
        hybrid_kv=True,
    )

    def __init__(
        self,
        config: ModelConfig,
        options: LoadOptions,
        device: mx.Device,
        embed: mx.array,
        layers: Sequence[MLXLayer],
        final_norm: mx.array,
        lm_head: Linear,
    ) -> None:
        self.config, self.options, self.device = config, options, device
        self.dtype = DTYPES[options.dtype]
        self.embed, self.layers, self.final_norm, self.lm_head = embed, list(layers), final_norm, lm_head
        self._ropes = {layer.rope for layer in self.layers}
        self.adapter_factors = AdapterFactors(
            config.num_layers, lambda proj: projection_shape(config, proj), self.dtype, options.max_adapters
        )
        # MLX's graph building and evaluation are not safe from two threads at once (the server's
        # engine and its embeddings endpoint): steps take turns.
        self._lock = threading.Lock()

    # -- loading ----------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, options: LoadOptions) -> MLXModel:
        unknown = sorted(set(options.extra) - set(EXTRA_OPTIONS))
        if unknown:
            # threads included: MLX sizes its CPU pool itself.
            raise BackendError(
                f"mlx takes no backend option {', '.join(unknown)} (it takes: {', '.join(EXTRA_OPTIONS)})"
            )
        device = choose_device(str(options.extra.get("device", "auto")))
        if options.quantization not in QUANTIZATIONS:
            raise BackendError(
                f"mlx has no quantization {options.quantization!r} (it takes {', '.join(QUANTIZATIONS)})"
            )
        dtype = "float32" if options.dtype == "auto" else options.dtype
        if dtype not in DTYPES:
            raise BackendError(f"mlx computes in {', '.join(DTYPES)}, not {options.dtype!r}")
        cfg = checkpoint.config
        if getattr(cfg, "num_experts", 0):
            raise BackendError(f"mlx has no mixture-of-experts layers yet (num_experts {cfg.num_experts})")
        if cfg.activation not in ACTIVATIONS:
            raise BackendError(f"mlx has no activation {cfg.activation!r} ({', '.join(ACTIVATIONS)})")
        if cfg.num_heads % cfg.num_kv_heads or cfg.head_dim % 2:
            raise BackendError(
                f"unsupported attention shape: {cfg.num_heads} heads over {cfg.num_kv_heads} KV heads, "
                f"head_dim {cfg.head_dim}"
            )
        quant = options.quantization
        blocks = quant in ("auto", "gguf") and checkpoint.format == "gguf"
        if quant == "gguf" and not blocks:
            raise BackendError(f"mlx quantization 'gguf' keeps a GGUF file's blocks; {checkpoint.path} is not GGUF")
        mx_dtype = DTYPES[dtype]
        if blocks and mx_dtype != mx.float32:
            # Scales and biases must be in the activations' dtype; a 16-bit scale would lose exactness.
            raise BackendError(f"mlx keeps GGUF blocks exactly with float32 activations only (asked for {dtype})")

        def array(name: str, shape: tuple[int, ...]) -> mx.array:
            t = checkpoint.tensor(name)
            if t.shape != shape:
                raise ModelFormatError(f"tensor {name} has shape {t.shape}, the config implies {shape}")
            return mx.array(t, dtype=mx_dtype)

        def linear(name: str, shape: tuple[int, ...]) -> Linear:
            if blocks:
                return _gguf_linear(checkpoint, name, shape)
            w = array(name, shape)
            if quant in ("q8", "q4"):
                if shape[1] % GROUP:
                    raise BackendError(
                        f"mlx {quant} quantizes rows in groups of {GROUP}; {name} has {shape[1]} columns"
                    )
                packed, scales, biases = mx.quantize(w, group_size=GROUP, bits=8 if quant == "q8" else 4)
                return Linear(packed, scales, biases, 8 if quant == "q8" else 4, form=quant)
            return Linear(mx.contiguous(w.T), form=dtype, transposed=True)

        projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        with mx.stream(device):
            layers = []
            for n in range(cfg.num_layers):

                def tensor(name: str, shape: tuple[int, ...]) -> Any:
                    module, kind = name.rsplit(".", 2)[-2:]
                    return linear(name, shape) if module in projections and kind == "weight" else array(name, shape)

                lw = LayerWeights(**load_layer(cfg, n, tensor))
                qkv, gate_up = _fuse([lw.q_proj, lw.k_proj, lw.v_proj]), _fuse([lw.gate_proj, lw.up_proj])
                if qkv is not None:
                    q_out, kv_out = projection_shape(cfg, "q_proj")[0], projection_shape(cfg, "k_proj")[0]
                    lw.q_proj, lw.k_proj, lw.v_proj = _views(qkv, [q_out, kv_out, kv_out])
                if gate_up is not None:
                    lw.gate_proj, lw.up_proj = _views(gate_up, [cfg.intermediate_size] * 2)
                layers.append(MLXLayer(lw, qkv, gate_up, cfg.layer_window(n), cfg.layer_rope(n)))
                # One layer at a time: float copies of the file's tensors are freed as we go.
                mx.eval(lw, *(f.weight for f in (qkv, gate_up) if f is not None))
            h = cfg.hidden_size
            embed = array("model.embed_tokens.weight", (cfg.vocab_size, h))
            lm_head = (
                Linear(embed, form=dtype) if cfg.tie_word_embeddings else linear("lm_head.weight", (cfg.vocab_size, h))
            )
            final_norm = array("model.norm.weight", (h,))
            mx.eval(embed, lm_head.weight, final_norm)
        applied_quant = "gguf" if blocks else ("none" if quant == "auto" else quant)
        applied = dataclasses.replace(options, quantization=applied_quant, dtype=dtype)
        model = cls(cfg, applied, device, embed, layers, final_norm, lm_head)
        log.info("mlx model loaded", device=device_label(device), dtype=dtype, quantization=applied.quantization,
                 weight_forms=model.weight_forms(), weight_bytes=model.weight_bytes)  # fmt: skip
        return model

    def weight_forms(self) -> dict[str, int]:
        """How many projection matrices are held in each form."""
        forms: dict[str, int] = {}
        for layer in self.layers:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
                form = getattr(layer.weights, proj).form
                forms[form] = forms.get(form, 0) + 1
        return forms

    @property
    def weight_bytes(self) -> int:
        total = self.embed.nbytes + self.final_norm.nbytes
        if self.lm_head.weight is not self.embed:
            total += self.lm_head.nbytes
        for layer in self.layers:
            fused = {"q_proj", "k_proj", "v_proj"} if layer.qkv is not None else set()
            fused |= {"gate_proj", "up_proj"} if layer.gate_up is not None else set()
            for f in dataclasses.fields(layer.weights):
                v = getattr(layer.weights, f.name)
                total += 0 if v is None or f.name in fused else v.nbytes  # views of a fused product
            total += sum(g.nbytes for g in (layer.qkv, layer.gate_up) if g is not None)
        return total

    # -- the protocol -------------------------------------------------------------------------------
    def kv_cache(self, num_blocks: int, block_size: int, options: dict[str, Any]) -> MLXPagedKVCache:
        """Options: ``dtype`` (default the model's), ``local_blocks`` (the windowed layers' own pool);
        ``quantization`` other than ``none`` (the two-tier cache) is refused by name."""
        with mx.stream(self.device):
            return make_kv_cache(self.config, num_blocks, block_size, options, self.options.dtype)

    def kv_rewrites_positions(self, cache: Any) -> bool:
        """The cache stores each position as written, so a speculative draft's refused positions are
        simply written again (``ruvllm.backend.RewritesKVPositions``)."""
        return isinstance(cache, MLXPagedKVCache)

    def kv_block_bytes(self, block_size: int, options: dict[str, Any]) -> int:
        dtype = options.get("dtype", "auto")
        dtype = self.options.dtype if dtype == "auto" else dtype
        return kv_block_bytes(self.config, block_size, 4 if dtype == "float32" else 2)

    def device_memory(self) -> tuple[int, int] | None:
        """MLX's recommended working set on Metal (unified memory) and what it holds now; None on the
        CPU, where the server sizes the cache from the host's available memory."""
        return device_memory(self.device)

    def precompile(
        self, cache: Any, limits: StepLimits, progress: Callable[[int, int, str, float], None]
    ) -> list[tuple[str, float]]:
        return []  # MLX builds each step's graph as it runs; nothing to compile ahead

    def forward(self, batch: ForwardBatch, cache: MLXPagedKVCache) -> ForwardOutput:
        if not isinstance(cache, MLXPagedKVCache):
            raise BackendError(f"mlx needs a cache it allocated, got {type(cache).__name__}")
        cfg = self.config
        if cache.layout != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise BackendError("the KV cache was allocated for a model of another shape")
        plans, writes = plan_step(cfg, batch, cache)  # checks everything before the cache is touched
        local_plans, local_writes = plan_step(cfg, batch, cache, local=True) if cache.local_blocks else (plans, writes)
        if batch.local_block_copies and not cache.local_blocks:
            raise RequestError("local_block_copies given to a cache without a windowed layers' pool")
        with self._lock, mx.stream(self.device):
            self._check_adapters(batch)
            cache.copy_blocks(batch.block_copies)
            cache.copy_blocks(batch.local_block_copies, local=True)
            if not batch.chunks:
                mx.eval(cache.k, cache.v)
                return ForwardOutput(logits=np.zeros((0, cfg.vocab_size), np.float32))
            x = self._layers(batch, cache, plans, writes, local_plans, local_writes)
            return self._outputs(batch, plans, x, cache)

    # -- the step -----------------------------------------------------------------------------------
    def _layers(
        self,
        batch: ForwardBatch,
        cache: MLXPagedKVCache,
        plans: list[ChunkPlan],
        writes: mx.array,
        local_plans: list[ChunkPlan],
        local_writes: mx.array,
    ) -> mx.array:
        cfg = self.config
        tokens = np.concatenate([np.asarray(c.token_ids, np.int64) for c in batch.chunks])
        positions = np.concatenate([np.arange(c.start_pos, c.end_pos) for c in batch.chunks])
        tables = {}
        for rope in self._ropes:  # angles in float64 on the host: float32 loses ~1e-3 rad at long positions
            cos, sin = rope.cos_sin(positions, cfg.head_dim)
            tables[rope] = (mx.array(cos, dtype=mx.float32), mx.array(sin, dtype=mx.float32))
        masks = {}  # (chunk, window) -> the chunk's mask, shared by the layers of one window
        q_dim, kv_dim, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        with_adapters = [p for p in plans if p.adapter is not None]

        x = self.embed[mx.array(tokens.astype(np.uint32))]
        if cfg.embedding_scale != 1.0:
            x = x * mx.array(cfg.embedding_scale, dtype=x.dtype)
        for li, layer in enumerate(self.layers):

            def project(h: mx.array, group: tuple[str, ...], layer: MLXLayer = layer) -> list[mx.array]:
                if group[0] == "q_proj" and layer.qkv is not None:
                    qkv = layer.qkv(h)
                    return [qkv[:, :q_dim], qkv[:, q_dim : q_dim + kv_dim], qkv[:, q_dim + kv_dim :]]
                if group[0] == "gate_proj" and layer.gate_up is not None:
                    gate_up = layer.gate_up(h)
                    return [gate_up[:, :inter], gate_up[:, inter:]]
                return [getattr(layer.weights, p)(h) for p in group]

            def attend(q: mx.array, k: mx.array, v: mx.array, li: int = li, window: int = layer.window) -> mx.array:
                local = cache.is_local[li]
                kc, vc = cache.store(li, local_writes if local else writes, k, v)
                outs = []
                for ci, plan in enumerate(local_plans if local else plans):
                    n = plan.rows.stop - plan.rows.start
                    key = (ci, local, window)
                    if key not in masks:
                        masked = attention_mask(n, plan.end_pos, plan.start_pos, window)
                        masks[key] = None if masked is None else mx.array(~masked[:, plan.read_from :])
                    ks = kc[plan.read_slots].astype(q.dtype).transpose(1, 0, 2)[None]
                    vs = vc[plan.read_slots].astype(q.dtype).transpose(1, 0, 2)[None]
                    qs = q[plan.rows].transpose(1, 0, 2)[None]
                    o = mx.fast.scaled_dot_product_attention(qs, ks, vs, scale=cfg.attention_scale, mask=masks[key])
                    outs.append(o[0].transpose(1, 0, 2).reshape(n, q_dim))
                return outs[0] if len(outs) == 1 else mx.concatenate(outs)

            def adapt(y: mx.array, y_in: mx.array, proj: str, li: int = li) -> mx.array:
                return self._adapt(with_adapters, li, proj, y, y_in) if with_adapters else y

            cos, sin = tables[layer.rope]
            x, _ = decoder_layer(x, layer.weights, cfg, cos, sin, project=project, attend=attend, adapt=adapt)
        return rms_norm(x, self.final_norm, cfg.rms_norm_eps)

    def _check_adapters(self, batch: ForwardBatch) -> None:
        """Every chunk's adapter can be applied (its factors checked and uploaded now), before the
        cache is touched."""
        for idx, chunk in enumerate(batch.chunks):
            adapter = chunk.adapter
            if adapter is None:
                continue
            if on_device(adapter):
                for part in adapter.components if is_mix(adapter) else (adapter,):
                    self.adapter_factors.get(part)
            elif not callable(getattr(adapter, "delta", None)):
                raise RequestError(
                    f"chunk {idx}'s adapter {type(adapter).__name__} has neither lora_params() nor "
                    "delta(layer, proj, x)"
                )

    def _adapt(self, plans: Sequence[ChunkPlan], layer: int, proj: str, y: mx.array, x: mx.array) -> mx.array:
        """``y`` plus each chunk's adapter update on its own rows: on the device from the adapter's
        factors, or through its ``delta`` on the host where it has none."""
        host = [p for p in plans if not on_device(p.adapter)]
        if host:
            y = self._add_delta(host, layer, proj, y, x)
        for p in plans:
            if not on_device(p.adapter):
                continue
            d = self.adapter_factors.update(p.adapter, layer, proj, x[p.rows])
            if d is not None:
                y = y.at[mx.arange(p.rows.start, p.rows.stop)].add(d.astype(y.dtype))
        return y

    @staticmethod
    def _add_delta(plans: Sequence[ChunkPlan], layer: int, proj: str, y: mx.array, x: mx.array) -> mx.array:
        """``y`` plus each chunk's adapter update on its own rows (the adapter computes on the host)."""
        x_host = np.asarray(x.astype(mx.float32))
        add = np.zeros(y.shape, np.float32)
        touched = False
        for plan in plans:
            delta = plan.adapter.delta(layer, proj, x_host[plan.rows])
            if delta is None:
                continue
            delta = np.asarray(delta, dtype=np.float32)
            if delta.shape != (plan.rows.stop - plan.rows.start, y.shape[1]):
                raise BackendError(
                    f"adapter delta for layer {layer} {proj} has shape {delta.shape}, "
                    f"expected {(plan.rows.stop - plan.rows.start, y.shape[1])}"
                )
            add[plan.rows] += delta
            touched = True
        return y + mx.array(add, dtype=y.dtype) if touched else y

    def _head(self, x: mx.array) -> mx.array:
        return softcap(self.lm_head(x).astype(mx.float32), self.config.final_logit_softcap)

    def _outputs(
        self, batch: ForwardBatch, plans: list[ChunkPlan], x: mx.array, cache: MLXPagedKVCache
    ) -> ForwardOutput:
        chunks = batch.chunks
        all_rows = {
            i: self._head(x[p.rows]) for i, (c, p) in enumerate(zip(chunks, plans, strict=True)) if c.all_logits
        }
        hidden = {i: x[p.rows].astype(mx.float32) for i, (c, p) in enumerate(zip(chunks, plans, strict=True))
                  if c.hidden_states}  # fmt: skip
        last = [i for i in range(len(plans)) if i not in all_rows]
        last_logits = self._head(x[mx.array([plans[i].rows.stop - 1 for i in last])]) if last else None
        mx.eval(cache.k, cache.v, all_rows, hidden, last_logits)
        logits = np.empty((len(plans), self.config.vocab_size), np.float32)
        if last_logits is not None:
            logits[last] = np.asarray(last_logits)
        all_logits = {i: np.asarray(v) for i, v in all_rows.items()}
        for i, rows in all_logits.items():
            logits[i] = rows[-1]  # the same numbers the chunk's all_logits carry
        return ForwardOutput(
            logits=logits, all_logits=all_logits, hidden_states={i: np.asarray(v) for i, v in hidden.items()}
        )


def _gguf_linear(checkpoint: Checkpoint, name: str, shape: tuple[int, ...]) -> Linear:
    """A projection from a GGUF file: its blocks kept exactly where MLX's form holds them, rounded to
    the nearest form where it does not (Q6_K, Q2_K), float where the file stores floats."""
    raw = checkpoint.raw_tensor(name)
    if tuple(raw.shape) != shape:
        raise ModelFormatError(f"tensor {name} has shape {tuple(raw.shape)}, the config implies {shape}")
    try:
        if raw.ggml_type in EXACT_BITS:
            a = affine_from_gguf(raw.ggml_type, raw.data, shape)
            return Linear(mx.array(a.packed), mx.array(a.scales), mx.array(a.biases), a.bits, form=raw.ggml_type)
        if raw.ggml_type in NEAREST_FORMS:
            a = nearest_affine(checkpoint.tensor(name), NEAREST_FORMS[raw.ggml_type])
            form = f"{raw.ggml_type}->{a.bits}bit"
            return Linear(mx.array(a.packed), mx.array(a.scales), mx.array(a.biases), a.bits, form=form)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{checkpoint.path}: tensor {name}: {exc}") from exc
    if raw.ggml_type in ("F32", "F16", "BF16"):
        return Linear(mx.array(np.ascontiguousarray(checkpoint.tensor(name).T)), form=raw.ggml_type, transposed=True)
    raise UnsupportedQuantizationError(f"mlx has no form for GGUF type {raw.ggml_type} (tensor {name})")
