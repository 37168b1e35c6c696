"""Tensor parallelism: one table from logical axes to mesh axes, applied to weights and KV cache.

Changing the strategy means changing :data:`SHARDING_RULES`. A logical axis whose size does not
divide by the mesh axis stays replicated (SmolLM2's 9 heads on 2 devices, say): the result is the
same, only less of the work is split.
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields

import jax
import numpy as np
import structlog
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ruvllm.errors import BackendError
from ruvllm_jax.experts import StoredExperts
from ruvllm_jax.kv_state import KVState, kv_scale_groups
from ruvllm_jax.model import LayerWeights, ModelSpec, Weights
from ruvllm_jax.quant import KQ_BLOCK, QuantArray
from ruvllm_jax.split_stack import SplitStack

log = structlog.get_logger("ruvllm_jax.sharding")

TP_AXIS = "tp"

#: Logical axis -> mesh axis (None: replicated). Megatron-style: attention split by heads, the MLP by
#: its hidden (ffn) features, embeddings and the output projection by vocabulary.
SHARDING_RULES: dict[str, str | None] = {
    "vocab": TP_AXIS,
    "heads": TP_AXIS,
    "kv_heads": TP_AXIS,
    "ffn": TP_AXIS,
    "embed": None,
    "head_dim": None,
}

#: Logical axes of each weight's dims (``[out, in]`` for matrices), without the stacked layer axis.
WEIGHT_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("vocab", "embed"),
    "final_norm": ("embed",),
    "input_norm": ("embed",),
    "post_attention_norm": ("embed",),
    "q_proj": ("heads", "embed"),
    "k_proj": ("kv_heads", "embed"),
    "v_proj": ("kv_heads", "embed"),
    "o_proj": ("embed", "heads"),
    "gate_proj": ("ffn", "embed"),
    "up_proj": ("ffn", "embed"),
    "down_proj": ("embed", "ffn"),
    "q_bias": ("heads",),
    "k_bias": ("kv_heads",),
    "v_bias": ("kv_heads",),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "attn_output_norm": ("embed",),
    "mlp_output_norm": ("embed",),
    # A mixture of experts: replicated (its axes have no rule; splitting experts is not implemented).
    "router": ("experts", "embed"),
    "expert_gate": ("experts", "expert_ffn", "embed"),
    "expert_up": ("experts", "expert_ffn", "embed"),
    "expert_down": ("experts", "embed", "expert_ffn"),
    "o_bias": ("embed",),
    "sinks": ("heads",),
    "router_bias": ("experts",),
    "expert_gate_bias": ("experts", "expert_ffn"),
    "expert_up_bias": ("experts", "expert_ffn"),
    "expert_down_bias": ("experts", "embed"),
}


def make_mesh(size: int) -> Mesh:
    devices = jax.devices()
    if size < 1 or size > len(devices):
        raise BackendError(
            f"tensor_parallel={size} needs {size} devices, this machine has {len(devices)} "
            f"({devices[0].platform}); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={size}"
        )
    return Mesh(np.array(devices[:size]), (TP_AXIS,))


def _logical_sizes(spec: ModelSpec) -> dict[str, int]:
    return {
        "vocab": spec.vocab_size,
        "embed": spec.hidden_size,
        "heads": spec.num_heads,
        "kv_heads": spec.num_kv_heads,
        "ffn": spec.intermediate_size,
    }


def _mesh_axis(axis: str | None, spec: ModelSpec, mesh: Mesh) -> str | None:
    target = SHARDING_RULES.get(axis) if axis else None
    if target is None:
        return None
    return target if _logical_sizes(spec)[axis] % mesh.shape[target] == 0 else None


def _spec_for(axes: tuple[str | None, ...], spec: ModelSpec, mesh: Mesh, stacked: bool) -> PartitionSpec:
    parts = tuple(_mesh_axis(a, spec, mesh) for a in axes)
    return PartitionSpec(*(((None,) if stacked else ()) + parts))


def _place(value, axes: tuple[str, ...], spec: ModelSpec, mesh: Mesh, stacked: bool):
    if value is None:
        return None
    if isinstance(value, StoredExperts):  # experts left in the file: only where they lie (one device)
        return dataclasses.replace(value, table=jax.device_put(value.table))
    if isinstance(value, SplitStack):  # native kernels only (one device): each part as a stack
        return dataclasses.replace(value, parts=tuple(_place(p, axes, spec, mesh, stacked) for p in value.parts))
    if isinstance(value, QuantArray):
        *lead, out_axis, in_axis = axes  # lead: a mixture of experts' expert axis
        cols = value.shape[-1]
        in_mesh = _mesh_axis(in_axis, spec, mesh)
        # A group (a k-quant's super-block) must not straddle two shards.
        block = KQ_BLOCK if value.sub_group else value.group_size
        if in_mesh is not None and (cols // mesh.shape[in_mesh]) % block:
            in_axis = None
        if value.panel:
            # Panel layout: a stored row is not an output row; only whole panels may be split.
            in_axis = None
            out_mesh = _mesh_axis(out_axis, spec, mesh)
            if out_mesh is not None and (value.shape[-2] // mesh.shape[out_mesh]) % value.panel:
                out_axis = None
        mat = _spec_for((*lead, out_axis, in_axis), spec, mesh, stacked)
        scale_in = in_axis if value.scale.shape[-1] > 1 else None
        sc = _spec_for((*lead, out_axis, scale_in), spec, mesh, stacked)
        put = lambda x, p: None if x is None else jax.device_put(x, NamedSharding(mesh, p))  # noqa: E731
        vec = _spec_for((in_axis,), spec, mesh, stacked)
        return dataclasses.replace(
            value,
            quant=put(value.quant, mat),
            scale=put(value.scale, sc),
            offset=put(value.offset, sc),
            sub_scale=put(value.sub_scale, sc),
            sub_offset=put(value.sub_offset, sc),
            in_scale=put(value.in_scale, vec),
        )
    return jax.device_put(value, NamedSharding(mesh, _spec_for(axes, spec, mesh, stacked)))


def shard_weights(weights: Weights, spec: ModelSpec, mesh: Mesh) -> Weights:
    """Place host weights on the mesh following :data:`SHARDING_RULES`."""
    layers = LayerWeights(
        **{
            f.name: _place(getattr(weights.layers, f.name), WEIGHT_AXES[f.name], spec, mesh, True)
            for f in fields(LayerWeights)
        }
    )
    placed = Weights(
        embed=_place(weights.embed, WEIGHT_AXES["embed"], spec, mesh, False),
        layers=layers,
        final_norm=_place(weights.final_norm, WEIGHT_AXES["final_norm"], spec, mesh, False),
        lm_head=_place(weights.lm_head, WEIGHT_AXES["lm_head"], spec, mesh, False),
    )
    if mesh.size > 1:
        split = sorted(a for a in ("vocab", "heads", "kv_heads", "ffn") if _mesh_axis(a, spec, mesh))
        kept = sorted(a for a in ("vocab", "heads", "kv_heads", "ffn") if not _mesh_axis(a, spec, mesh))
        log.info("tensor parallel", devices=mesh.size, sharded_axes=split, replicated_axes=kept)
    return placed


def cache_sharding(spec: ModelSpec, mesh: Mesh) -> NamedSharding:
    """KV cache ``[layers, blocks, block_size, kv_heads, head_dim]``: split by kv heads like k/v_proj."""
    return NamedSharding(mesh, PartitionSpec(None, None, None, _mesh_axis("kv_heads", spec, mesh), None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def empty_cache(
    spec: ModelSpec,
    mesh: Mesh,
    num_blocks: int,
    block_size: int,
    dtype,
    *,
    quantized: bool = False,
    layers: int | None = None,
    hot_blocks: int = 0,
) -> KVState:
    """A zeroed cache of ``layers`` layers (the model's by default); ``quantized``: int8 codes plus
    float32 scales per (token, kv head), and with ``hot_blocks`` that many float slots (two tiers)."""
    shape = (spec.num_layers if layers is None else layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)

    def zeros(shape: tuple[int, ...], dtype) -> jax.Array:
        return jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=cache_sharding(spec, mesh))()

    if not quantized:
        return KVState(zeros(shape, dtype), zeros(shape, dtype))
    scale_shape = (*shape[:-1], kv_scale_groups(spec.head_dim))
    f32 = jax.numpy.float32
    state = KVState(
        zeros(shape, jax.numpy.int8), zeros(shape, jax.numpy.int8), zeros(scale_shape, f32), zeros(scale_shape, f32)
    )
    if hot_blocks:
        hot = (shape[0], hot_blocks, *shape[2:])
        state = dataclasses.replace(state, hot_k=zeros(hot, dtype), hot_v=zeros(hot, dtype))
    return state
