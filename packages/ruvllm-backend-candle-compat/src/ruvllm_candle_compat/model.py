"""The decoder forward pass of every family in :mod:`ruvllm.architectures` (Llama incl. llama3 RoPE,
Mistral, Qwen2, Qwen3, Gemma-3, Phi-3, SmolLM2, and the mixtures of experts Qwen3-MoE, Mixtral and gpt-oss)
in NumPy float32 over a paged KV cache. The layer is
:func:`ruvllm.modeling.decoder_layer`, the one every backend runs; this module gives it NumPy's ways
to project (fused BLAS calls), attend (the paged cache) and adapt (``adapter.delta``).

Every token of every chunk in a step goes through the projections and the MLP as one ``[T, hidden]``
matrix, so the matmuls are a handful of BLAS calls per layer whatever the batch looks like; only
attention runs per chunk, over that sequence's cached positions ``0 .. end_pos``. In a mixture of
experts each chosen expert multiplies its group of the step's tokens in one BLAS call (experts no
token chose are not read). With ``mmap_experts`` (:mod:`ruvllm.mapped_experts`) a GGUF file's experts
stay as its memory-mapped blocks and each step decodes only the chosen experts' matrices, by the same
dequantizers as a load, before that call: the logits are the copied form's, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ruvllm.backend import (
    Capabilities,
    ForwardBatch,
    ForwardOutput,
    LoadOptions,
    SequenceChunk,
    StepLimits,
    chunk_block_table,
    kv_block_bytes,
)
from ruvllm.checkpoint import Checkpoint, RawTensor
from ruvllm.errors import BackendError, ModelFormatError, RequestError
from ruvllm.mapped_experts import mmap_experts_option
from ruvllm.model_config import ModelConfig, Rope
from ruvllm.modeling import (
    ACTIVATION_NAMES,
    PROJECTIONS,  # noqa: F401 (importable from here as before)
    LayerWeights,
    attention_mask,
    decoder_layer,
    group_queries,
    load_layer,
    projection_shape,
    rms_norm,
    softcap,
    softmax_,
    ungroup,
)
from ruvllm_candle_compat.kv_cache import (
    ChunkPlan,
    FloatOverlay,
    KVCache,
    PagedKVCache,
    SequenceKV,
    TwoTierKVCache,
    make_kv_cache,
)

#: Most attention scores (floats) one tile holds: long prefills run in query tiles under this bound.
SCORE_TILE_FLOATS = 1 << 24

def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for ``x [T, in]`` and a C-contiguous ``w [out, in]``, by the faster BLAS call.

    With a few rows OpenBLAS's gemm spends its time packing the big operand; ``w @ x.T`` takes the
    other path and measured about 2x faster for 2..64 rows (batched decode), equal or slower above.
    """
    if 1 < x.shape[0] <= 64:
        return np.ascontiguousarray((w @ x.T).T)
    return x @ w.T


class MappedExperts:
    """A layer's experts of one product kept as the file's blocks (``mmap_experts``): ``[e]`` decodes
    expert ``e``'s matrix to float32 (its parts, e.g. gate and up, stacked on the output axis as the
    copied form fuses them), so a step holds only the chosen experts in float, one at a time."""

    def __init__(self, parts: Sequence[Sequence[RawTensor]]) -> None:
        self.parts = [list(p) for p in parts]  # parts[j][e]: part j of expert e, as stored
        first = [p[0].shape for p in self.parts]
        self.shape = (len(self.parts[0]), sum(s[0] for s in first), first[0][1])

    def __getitem__(self, e: int) -> np.ndarray:
        mats = [p[e].dequantize() for p in self.parts]
        return mats[0] if len(mats) == 1 else np.concatenate(mats)


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer: the schema's weights (Hugging Face layout ``[out, in]``) where q/k/v and
    gate/up are views into the fused matrices that share an input, so each group is one BLAS call."""

    weights: LayerWeights[np.ndarray, np.ndarray]
    qkv: np.ndarray  # [q_dim + 2 * kv_dim, hidden]: q_proj, k_proj, v_proj stacked
    #: [2 * intermediate, hidden]: gate_proj, up_proj stacked (a mixture of experts: per expert,
    #: [experts, 2 * expert_intermediate, hidden]; with ``mmap_experts``, a :class:`MappedExperts`).
    gate_up: np.ndarray | MappedExperts
    window: int = 0  # sliding window (0: every position)
    rope: Rope | None = None  # this layer's rotary embedding


class CandleCompatModel:
    """Float32 weights of a Llama-family checkpoint and the forward pass over them (a
    :class:`ruvllm.backend.BackendModel`)."""

    capabilities = Capabilities(
        dtypes=("float32",),
        quantizations=("none", "auto"),
        adapters=True,
        adapter_mix=True,
        hidden_states=True,
        all_logits=True,
        hybrid_kv=True,
    )
    #: As applied: ``auto`` is float32, this backend's only form.
    options = LoadOptions()

    def __init__(
        self,
        config: ModelConfig,
        embed: np.ndarray,
        layers: Sequence[FusedLayer],
        final_norm: np.ndarray,
        lm_head: np.ndarray,
    ) -> None:
        self.config = config
        self.embed = embed  # [vocab, hidden]
        self.layers = list(layers)
        self.final_norm = final_norm
        self.lm_head = lm_head  # [vocab, hidden]; embed itself when tied
        #: Distinct rotary embeddings (global, local) and their inverse frequencies.
        self._ropes = {layer.rope or config.global_rope for layer in self.layers}

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, options: LoadOptions) -> CandleCompatModel:
        if options.quantization not in ("none", "auto"):  # auto: float32 is this backend's only form
            raise BackendError(
                f"candle-compat keeps weights in float32 (asked for quantization {options.quantization!r}); "
                "use the jax backend for q8/q4"
            )
        if options.dtype not in ("float32", "auto"):  # auto: float32 is this backend's only dtype
            raise BackendError(f"candle-compat computes in float32 only (asked for dtype {options.dtype!r})")
        unknown = set(options.extra) - {"mmap_experts"}
        if unknown:
            # threads included: NumPy's BLAS fixes its pool at import (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS).
            raise BackendError(
                f"candle-compat takes no backend options (got {', '.join(sorted(unknown))}) other than mmap_experts; "
                "set OPENBLAS_NUM_THREADS for its BLAS threads"
            )
        mapped = mmap_experts_option(options.extra.get("mmap_experts", "auto"), checkpoint, "candle-compat")
        cfg = checkpoint.config
        if cfg.activation not in ACTIVATION_NAMES:
            raise BackendError(f"candle-compat has no activation {cfg.activation!r} ({', '.join(ACTIVATION_NAMES)})")
        if cfg.num_heads % cfg.num_kv_heads or cfg.head_dim % 2:
            raise BackendError(
                f"unsupported attention shape: {cfg.num_heads} heads over {cfg.num_kv_heads} KV heads, "
                f"head_dim {cfg.head_dim}"
            )

        def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
            t = checkpoint.tensor(name)
            if t.shape != shape:
                raise ModelFormatError(f"tensor {name} has shape {t.shape}, the config implies {shape}")
            return t

        def get_mapped(name: str, shape: tuple[int, ...]) -> np.ndarray | RawTensor:
            if ".mlp.experts." not in name or not name.endswith(".weight"):
                return get(name, shape)  # expert biases and everything else copied as floats
            raw = checkpoint.raw_tensor(name)  # views of the file's mapping: nothing read yet
            if raw.shape != shape:
                raise ModelFormatError(f"tensor {name} has shape {raw.shape}, the config implies {shape}")
            return raw

        def stack_mapped(items: list[Any]) -> np.ndarray | MappedExperts:
            return MappedExperts([items]) if isinstance(items[0], RawTensor) else np.stack(items)

        layers = []
        for n in range(cfg.num_layers):
            if mapped:
                lw = LayerWeights(**load_layer(cfg, n, get_mapped, stack_mapped))
            else:
                lw = LayerWeights(**load_layer(cfg, n, get))
            # Fused copies of the groups that share an input; the schema's fields become views of them.
            qkv = np.concatenate([lw.q_proj, lw.k_proj, lw.v_proj])
            (q_dim, _), (kv_dim, _) = projection_shape(cfg, "q_proj"), projection_shape(cfg, "k_proj")
            lw.q_proj, lw.k_proj, lw.v_proj = qkv[:q_dim], qkv[q_dim : q_dim + kv_dim], qkv[q_dim + kv_dim :]
            if mapped:
                gate_up = MappedExperts([*lw.expert_gate.parts, *lw.expert_up.parts])
            elif cfg.num_experts:
                gate_up = np.concatenate([lw.expert_gate, lw.expert_up], axis=1)
                i = cfg.expert_intermediate_size
                lw.expert_gate, lw.expert_up = gate_up[:, :i], gate_up[:, i:]
            else:
                gate_up = np.concatenate([lw.gate_proj, lw.up_proj])
                lw.gate_proj, lw.up_proj = gate_up[: cfg.intermediate_size], gate_up[cfg.intermediate_size :]
            layers.append(FusedLayer(lw, qkv, gate_up, window=cfg.layer_window(n), rope=cfg.layer_rope(n)))
        h = cfg.hidden_size
        embed = get("model.embed_tokens.weight", (cfg.vocab_size, h))
        lm_head = embed if cfg.tie_word_embeddings else get("lm_head.weight", (cfg.vocab_size, h))
        model = cls(cfg, embed, layers, get("model.norm.weight", (h,)), lm_head)
        #: The options as applied (``auto`` resolved), which core reports.
        extra = {**options.extra, "mmap_experts": "true" if mapped else "false"} if cfg.num_experts else options.extra
        model.options = dataclasses.replace(options, quantization="none", dtype="float32", extra=extra)
        return model

    # -- building blocks ------------------------------------------------------------------------
    def _rope_tables(self, positions: np.ndarray) -> dict[Rope, tuple[np.ndarray, np.ndarray]]:
        """cos and sin ``[T, head_dim // 2]`` per rotary embedding (angles in float64: at positions
        in the thousands float32 would lose ~1e-3 rad)."""
        tables = {}
        for rope in self._ropes:
            cos, sin = rope.cos_sin(positions, self.config.head_dim)
            tables[rope] = (cos, sin)
        return tables

    def _attend(
        self, q: np.ndarray, kv: SequenceKV, start_pos: int, window: int = 0, sinks: np.ndarray | None = None
    ) -> np.ndarray:
        """Causal GQA attention of ``q [n, heads, hd]`` (positions ``start_pos..``) over
        ``kv.k, kv.v [end_pos, kv_heads, hd]`` (with ``sinks`` ``[heads]``, gpt_oss's extra logit per
        head in each softmax); returns ``[n, heads * hd]``."""
        n, k, v, overlay = q.shape[0], kv.k, kv.v, kv.overlay
        rows = max(1, SCORE_TILE_FLOATS // (q.shape[1] * k.shape[0]))
        if n <= rows:
            return self._attend_tile(q, k, v, start_pos, overlay, window, sinks)
        out = np.empty((n, q.shape[1] * q.shape[2]), np.float32)
        for i in range(0, n, rows):
            j = min(n, i + rows)
            # A tile's last query sits at start_pos + j - 1, so later keys are never needed.
            tile_overlay = None if overlay is None else overlay.rows(i, j)
            out[i:j] = self._attend_tile(
                q[i:j], k[: start_pos + j], v[: start_pos + j], start_pos + i, tile_overlay, window, sinks
            )
        return out

    def _attend_tile(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        start_pos: int,
        overlay: FloatOverlay | None = None,
        window: int = 0,
        sinks: np.ndarray | None = None,
    ) -> np.ndarray:
        cfg = self.config
        n, end, kv_heads = q.shape[0], k.shape[0], cfg.num_kv_heads
        qg = group_queries(q, kv_heads, cfg.attention_scale)  # [kv_heads, group * n, hd]
        scores = (qg @ k.transpose(1, 2, 0)).reshape(kv_heads, -1, n, end)
        # Two-tier cache: queries that precede a block's quantization read its float values instead.
        lo, hi = (0, 0) if overlay is None else (overlay.lo, min(end, overlay.lo + len(overlay.k)))
        use_float = None
        if overlay is not None and hi > lo:
            use_float = np.arange(lo, hi)[None, :] >= overlay.quantized_until[:, None]  # [n, hi - lo]
            float_scores = (qg @ overlay.k[: hi - lo].transpose(1, 2, 0)).reshape(kv_heads, -1, n, hi - lo)
            scores[..., lo:hi] = np.where(use_float, float_scores, scores[..., lo:hi])
        masked = attention_mask(n, end, start_pos, window)
        if masked is not None:
            scores[..., masked] = -np.inf
        if sinks is None:
            softmax_(scores)
        else:  # the sink joins each row's softmax as one more logit, with no value
            sink = sinks.reshape(kv_heads, -1, 1, 1).astype(np.float32)
            top = np.maximum(scores.max(axis=-1, keepdims=True), sink)
            scores -= top
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True) + np.exp(sink - top)
        out = scores.reshape(kv_heads, qg.shape[1], end) @ v.transpose(1, 0, 2)
        if overlay is not None and use_float is not None:
            float_probs = (scores[..., lo:hi] * use_float).reshape(kv_heads, qg.shape[1], hi - lo)
            out += float_probs @ (overlay.v[: hi - lo] - v[lo:hi]).transpose(1, 0, 2)
        return ungroup(out, n)

    # -- the forward step -----------------------------------------------------------------------
    def _plan(self, batch: ForwardBatch, cache: KVCache, local: bool = False) -> list[ChunkPlan]:
        """Each chunk's slots in the global pool, or (``local``) in the windowed layers' pool of a
        hybrid cache, through ``local_block_table``."""
        cfg, bs = self.config, cache.block_size
        if batch.block_size != bs:
            raise BackendError(f"batch block_size {batch.block_size} does not match the cache's {bs}")
        pool = cache.local_blocks if local else cache.num_blocks
        for src, dst in batch.local_block_copies if local else batch.block_copies:
            if not (0 <= src < pool and 0 <= dst < pool):
                raise RequestError(f"block copy {src} -> {dst} names a block outside 0..{pool - 1}")
        # Where every layer of this pool is windowed, a chunk never reads blocks before its first
        # query's window (the engine may have released them: they read as block 0).
        window = cfg.hybrid_window if local else cfg.uniform_window
        plans, row = [], 0
        for idx, chunk in enumerate(batch.chunks):
            n, start, end = len(chunk.token_ids), chunk.start_pos, chunk.end_pos
            table = chunk_block_table(idx, chunk, local=local, block_size=bs, max_positions=cfg.max_position_embeddings)
            used = table[: -(-end // bs)]
            if used.min() < 0 or used.max() >= pool:
                raise RequestError(f"chunk {idx} names a block outside 0..{pool - 1}")
            ids = np.asarray(chunk.token_ids)
            if ids.min() < 0 or ids.max() >= cfg.vocab_size:
                raise RequestError(f"chunk {idx} has a token id outside 0..{cfg.vocab_size - 1}")
            if chunk.adapter is not None and not callable(getattr(chunk.adapter, "delta", None)):
                raise RequestError(
                    f"chunk {idx}'s adapter {type(chunk.adapter).__name__} has no delta(layer, proj, x) method"
                )
            pos = np.arange(end)
            slots = used[pos // bs] * bs + pos % bs
            live_from = max(0, start - window + 1) // bs if window else 0
            plans.append(
                ChunkPlan(slice(row, row + n), start, end, used, slots[start:], slots, chunk.adapter, live_from)
            )
            row += n
        return plans

    @staticmethod
    def _add_delta(plans: Sequence[ChunkPlan], layer: int, proj: str, y: np.ndarray, x: np.ndarray) -> np.ndarray:
        """``y`` (projection ``proj``'s output for input ``x``) plus each adapter's low-rank update on its
        own rows, added in place."""
        for plan in plans:
            x_rows = x[plan.rows]
            delta = plan.adapter.delta(layer, proj, x_rows)
            if delta is None:
                continue
            delta = np.asarray(delta, dtype=np.float32)
            if delta.shape != (x_rows.shape[0], y.shape[1]):
                raise BackendError(
                    f"adapter delta for layer {layer} {proj} has shape {delta.shape}, "
                    f"expected {(x_rows.shape[0], y.shape[1])}"
                )
            y[plan.rows] += delta
        return y

    def kv_cache(self, num_blocks: int, block_size: int, options: dict[str, Any]) -> KVCache:
        """Options: ``quantize_old`` (``"int8"`` / ``"int4"``: the two-tier cache), ``recent_blocks``
        (full blocks kept float32 behind each sequence's tail, default 2), ``dtype`` (``"float32"``)."""
        return make_kv_cache(self.config, num_blocks, block_size, options)

    def kv_rewrites_positions(self, cache: Any) -> bool:
        """The float32 cache stores each position as written; the two-tier cache quantizes blocks by
        how far a chunk's last query reaches, which a dropped speculative draft would have moved."""
        return isinstance(cache, PagedKVCache) and not isinstance(cache, TwoTierKVCache)

    def restrict_head(self, token_ids: np.ndarray) -> None:
        """:class:`ruvllm.backend.RestrictsHead`: the output rows of ``token_ids`` (a copy; the
        embedding stays whole), so a step reads only those rows."""
        self.lm_head = np.ascontiguousarray(self.lm_head[np.asarray(token_ids, dtype=np.int64)])

    def kv_block_bytes(self, block_size: int, options: dict[str, Any]) -> int:
        """float32 keys and values of every layer (a two-tier cache's blocks start float32 too)."""
        return kv_block_bytes(self.config, block_size)

    def precompile(
        self, cache: Any, limits: StepLimits, progress: Callable[[int, int, str, float], None]
    ) -> list[tuple[str, float]]:
        return []  # NumPy compiles nothing

    def forward(self, batch: ForwardBatch, cache: KVCache) -> ForwardOutput:
        if not isinstance(cache, (PagedKVCache, TwoTierKVCache)):
            raise BackendError(f"candle-compat needs a cache it allocated, got {type(cache).__name__}")
        if cache.layout != (len(self.layers), self.config.num_kv_heads, self.config.head_dim):
            raise BackendError("the KV cache was allocated for a model of another shape")
        cfg = self.config
        plans = self._plan(batch, cache)  # validates everything before the cache is touched
        local_plans = self._plan(batch, cache, local=True) if cache.local_blocks else plans
        for src, dst in batch.block_copies:
            cache.copy_block(src, dst)
        for src, dst in batch.local_block_copies:
            if not cache.local_blocks:
                raise RequestError("local_block_copies given to a cache without a windowed layers' pool")
            cache.copy_block(src, dst, local=True)
        if not batch.chunks:
            return ForwardOutput(logits=np.zeros((0, len(self.lm_head)), np.float32))
        with_adapters = [p for p in plans if p.adapter is not None]
        tokens = np.concatenate([np.asarray(c.token_ids, dtype=np.int64) for c in batch.chunks])
        positions = np.concatenate([np.arange(p.start_pos, p.start_pos + (p.rows.stop - p.rows.start)) for p in plans])
        rope_tables = self._rope_tables(positions)
        q_dim, kv_dim, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        attn = np.empty((len(tokens), q_dim), np.float32)  # every layer's attention output, in turn

        x = self.embed[tokens]
        if cfg.embedding_scale != 1.0:
            x = x * np.float32(cfg.embedding_scale)
        for li, layer in enumerate(self.layers):
            def project(h: np.ndarray, group: tuple[str, ...], layer: FusedLayer = layer) -> list[np.ndarray]:
                if group[0] == "q_proj":
                    qkv = linear(h, layer.qkv)
                    return [qkv[:, :q_dim], qkv[:, q_dim : q_dim + kv_dim], qkv[:, q_dim + kv_dim :]]
                if group[0] == "router":
                    return [linear(h, layer.weights.router)]
                if group[0] == "gate_proj":
                    gate_up = linear(h, layer.gate_up)
                    return [gate_up[:, :inter], gate_up[:, inter:]]
                return [linear(h, getattr(layer.weights, group[0]))]

            def project_experts(
                x: np.ndarray, sizes: np.ndarray, group: tuple[str, ...], layer: FusedLayer = layer
            ) -> list[np.ndarray]:
                # One product per chosen expert over its rows; experts with no rows are never read.
                fused = group[0] == "gate_proj"
                mats = layer.gate_up if fused else layer.weights.expert_down
                y = np.empty((x.shape[0], mats.shape[1]), np.float32)
                end = 0
                for e, n in enumerate(sizes.tolist()):
                    if n:
                        y[end : end + n] = linear(x[end : end + n], mats[e])
                        end += n
                i = cfg.expert_intermediate_size
                return [y[:, :i], y[:, i:]] if fused else [y]

            def attend(
                q: np.ndarray,
                k: np.ndarray,
                v: np.ndarray,
                li: int = li,
                window: int = layer.window,
                sinks: np.ndarray | None = layer.weights.sinks,
            ):
                for plan in local_plans if cache.is_local[li] else plans:
                    seq_kv = cache.store_and_read(li, plan, k[plan.rows], v[plan.rows])
                    attn[plan.rows] = self._attend(q[plan.rows], seq_kv, plan.start_pos, window, sinks)
                return attn

            def adapt(y: np.ndarray, y_in: np.ndarray, proj: str, li: int = li) -> np.ndarray:
                return self._add_delta(with_adapters, li, proj, y, y_in) if with_adapters else y

            cos, sin = rope_tables[layer.rope or cfg.global_rope]
            x, _ = decoder_layer(
                x,
                layer.weights,
                cfg,
                cos,
                sin,
                project=project,
                attend=attend,
                adapt=adapt,
                project_experts=project_experts,
            )

        x = rms_norm(x, self.final_norm, cfg.rms_norm_eps)
        return self._outputs(batch.chunks, plans, x)

    def _head(self, x: np.ndarray) -> np.ndarray:
        return softcap(linear(x, self.lm_head), self.config.final_logit_softcap)

    def _outputs(self, chunks: Sequence[SequenceChunk], plans: Sequence[ChunkPlan], x: np.ndarray) -> ForwardOutput:
        pairs = list(enumerate(zip(chunks, plans, strict=True)))
        all_logits = {i: self._head(x[p.rows]) for i, (c, p) in pairs if c.all_logits}
        hidden = {i: x[p.rows].copy() for i, (c, p) in pairs if c.hidden_states}
        last_rows = [p.rows.stop - 1 for i, p in enumerate(plans) if i not in all_logits]
        logits = np.empty((len(plans), len(self.lm_head)), np.float32)
        if last_rows:
            logits[[i for i in range(len(plans)) if i not in all_logits]] = self._head(x[last_rows])
        for i, rows in all_logits.items():
            logits[i] = rows[-1]  # the same numbers the chunk's all_logits carry
        return ForwardOutput(logits=logits, all_logits=all_logits, hidden_states=hidden)
