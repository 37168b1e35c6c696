"""The jax backend's model: a core :class:`~ruvllm.backend.ForwardBatch` through the step pipeline.

1. :mod:`ruvllm_jax.step_shapes`: which compiled shape each part of a batch is padded to;
2. :mod:`ruvllm_jax.step_inputs`: the padded arrays and :class:`StepPlan` of each part (NumPy only);
3. :mod:`ruvllm_jax.compiled_steps`: the compiled step of each plan (compiled the first time);
4. here, :meth:`JaxModel.forward`: runs them on the cache (:mod:`ruvllm_jax.kv_cache`), samples on
   the device when asked, and unpacks the results.

Load options are checked in :mod:`ruvllm_jax.options`. Step shapes form a small bounded set, so a
server compiles all of them before traffic (:meth:`JaxModel.precompile`) and never while serving.
The names of those modules that this one held before stay importable from here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import numpy as np
import structlog

from ruvllm.backend import (
    Capabilities,
    DeviceSampling,
    ForwardBatch,
    ForwardOutput,
    LoadOptions,
    SampledRows,
    SequenceChunk,
    StepLimits,
)
from ruvllm.checkpoint import Checkpoint
from ruvllm.errors import BackendError, RequestError
from ruvllm.sampling import overlay_widths
from ruvllm_jax import batch_invariant, native, weight_cache
from ruvllm_jax import sampling as device_sampling
from ruvllm_jax.compiled_steps import CompiledCache, CompileStats, compile_step
from ruvllm_jax.draft_head import restricted_head
from ruvllm_jax.host_memory import huge_pages, keep_large_buffers
from ruvllm_jax.kv_cache import (
    DEFAULT_RECENT_BLOCKS,
    DEFAULT_TWO_TIER_SEQS,
    BlockCopier,
    JaxKVCache,
    KVLayout,
    allocate_cache,
    block_bytes,
    kv_layout,
)
from ruvllm_jax.loading import DTYPES
from ruvllm_jax.lora import ADAPTER_CACHE_SIZE, AdapterCache, padding_planner, plan_adapters
from ruvllm_jax.model import (
    PROJECTIONS,
    LoraFactors,
    LoraPlan,
    ModelSpec,
    StepInputs,
    StepPlan,
    Weights,
    bucket,
    forward_step,
)
from ruvllm_jax.options import (
    ATTENTION_IMPLS,
    auto_quantization,
    decode_splits_option,
    default_attention,
    enable_compilation_cache,
    load_settings,
    native_attention_option,
    native_option,
    on_cuda,
    unroll_layers_option,
)
from ruvllm_jax.prepared_step import PreparedDecode, prepare_decode
from ruvllm_jax.quant import QUANTIZATIONS, weight_nbytes
from ruvllm_jax.sharding import make_mesh, replicated, shard_weights
from ruvllm_jax.step_inputs import AdapterPlanner, StepRows, as_decode_rows, check_chunks, step_inputs
from ruvllm_jax.step_outputs import merge_sampled as _merge_sampled
from ruvllm_jax.step_outputs import to_host as _to_host  # a module global: profile_decode_step.py wraps it
from ruvllm_jax.step_shapes import (
    DEFAULT_GPU_CORES,
    MIN_PREFILL_LEN,
    NATIVE_MAX_TOKENS,
    SHORT_GROUP,
    SHORT_PREFILL,
    StepShape,
    bucket4,
    decode_splits,
    partition,
    powers_of_two,
    shape_chunks,
    shape_of,
    step_shapes,
)

__all__ = [
    "ATTENTION_IMPLS",
    "DEFAULT_RECENT_BLOCKS",
    "DEFAULT_TWO_TIER_SEQS",
    "MIN_PREFILL_LEN",
    "NATIVE_MAX_TOKENS",
    "SHORT_GROUP",
    "SHORT_PREFILL",
    "CompileStats",
    "JaxKVCache",
    "JaxModel",
    "KVLayout",
    "StepShape",
    "auto_quantization",
    "bucket4",
    "default_attention",
    "enable_compilation_cache",
    "on_cuda",
    "partition",
    "shape_of",
    "step_shapes",
    "unroll_layers_option",
]

log = structlog.get_logger("ruvllm_jax")


@dataclass
class JaxModel:
    spec: ModelSpec
    weights: Weights
    mesh: jax.sharding.Mesh
    attention: str
    options: LoadOptions
    #: The compiled forward steps, by plan and cache geometry (``.stats``: what compiled, hits, misses).
    compiled_steps: CompiledCache = field(default_factory=CompiledCache, repr=False)
    #: The compiled device-sampling functions (see :mod:`ruvllm_jax.sampling`).
    compiled_samplers: CompiledCache = field(default_factory=CompiledCache, repr=False)
    #: Copy-on-write of the cache's blocks (its compiled copies: ``block_copier.programs``).
    block_copier: BlockCopier = field(default_factory=BlockCopier, repr=False)
    #: The sharding of the steps' logits (from the last step compiled; None before the first).
    _logits_sharding: Any = field(default=None, repr=False)
    _all_allowed: dict[int, Any] = field(default_factory=dict, repr=False)
    #: Device copies of the adapters (LoRA factors) recent steps used.
    adapters: AdapterCache = field(init=False, repr=False)
    #: Whether steps run the quantized products in :mod:`ruvllm_jax.native`'s kernels (w8a8: small
    #: steps only, :func:`ruvllm_jax.step_shapes.runs_native`).
    native: bool = field(init=False, default=False)
    #: Whether steps attend through :mod:`ruvllm_jax.native`'s kernels (every step; see
    #: :func:`ruvllm_jax.options.native_attention_option`).
    native_attention: bool = field(init=False, default=False)
    #: Tokens every step's block tables cover: the model's context until :meth:`precompile` is told
    #: the longest sequence served.
    table_tokens: int = field(init=False, default=1)
    #: Set by :meth:`precompile`: a step compiled later is logged as a warning (a stall while serving).
    precompiled: bool = field(init=False, default=False)
    #: Set by :meth:`precompile` from its limits' adapter bounds: the one adapter plan compiled (its
    #: ``weighted``: the finest adapter-mix weighting compiled too, besides the plain plan).
    fixed_lora: LoraPlan | None = field(init=False, default=None)
    #: Steps run their layers unrolled (see :attr:`ruvllm_jax.model.StepPlan.unroll_layers`): option
    #: ``unroll_layers`` (auto: on CUDA).
    unroll_layers: bool = field(init=False, default=False)
    #: How the weights' host pages were backed at load (:func:`ruvllm_jax.host_memory.huge_pages`).
    huge_pages: str = field(init=False, default="n/a (not on CPU)")
    #: Option ``decode_splits``: a number forced on every decode step of the Pallas kernel, or None
    #: (auto: from each step's shape and :attr:`gpu_cores`, see :meth:`_split_plan`).
    decode_splits: int | None = field(init=False, default=None)
    #: The GPU's streaming multiprocessors (None on CPU, where decode steps keep one part).
    gpu_cores: int | None = field(init=False, default=None)
    #: Option ``batch_invariant`` on XLA's path: every step's tokens (:func:`batch_invariant.step_tokens`).
    step_tokens: int | None = field(init=False, default=None)
    #: The output rows kept by :meth:`restrict_head` (0: the whole vocabulary).
    head_rows: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.native = native_option(self.options, self.mesh.size)
        self.native_attention = native_attention_option(self.options, self.mesh.size)
        self.unroll_layers = unroll_layers_option(self.options.extra, "cuda" if on_cuda() else "cpu")
        self.decode_splits = decode_splits_option(self.options.extra, self.attention)
        self.step_tokens = batch_invariant.step_tokens(self.options.extra, self.native)
        if on_cuda():
            self.gpu_cores = getattr(jax.devices()[0], "core_count", None) or DEFAULT_GPU_CORES
        sharding = replicated(self.mesh) if self.mesh.size > 1 else None
        capacity = self.options.max_adapters
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise BackendError(f"jax backend: max_adapters must be a positive integer, got {capacity!r}")
        self.adapters = AdapterCache(self.spec, lambda a: jax.device_put(a, sharding), capacity or ADAPTER_CACHE_SIZE)

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def load(cls, checkpoint: Checkpoint, options: LoadOptions) -> JaxModel:
        settings = load_settings(checkpoint, options)
        options, attention = settings.options, settings.attention
        compilation_cache = enable_compilation_cache()
        spec = ModelSpec.from_config(checkpoint.config, options.dtype)
        if spec.attention_sinks and attention != "reference":  # at load, not when a step is traced
            raise BackendError(
                f"jax backend: attention={attention!r} has no attention sinks ({checkpoint.config.architecture}); "
                "use attention='reference'"
            )
        mesh = make_mesh(settings.tensor_parallel)
        t0 = time.perf_counter()
        on_cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
        host, cached, pages = weight_cache.host_weights(
            checkpoint, spec, options, settings.keep_gguf_blocks, settings.mmap_experts, on_cpu and mesh.size == 1
        )
        weights = shard_weights(host, spec, mesh)
        model = cls(spec, weights, mesh, attention, options)
        model.table_tokens = checkpoint.config.max_position_embeddings
        if on_cpu:
            model.huge_pages = pages or huge_pages(jax.tree_util.tree_leaves(weights))
        log.info(
            "weights loaded",
            host_buffers=keep_large_buffers() if on_cpu else "n/a (not on CPU)",
            huge_pages=model.huge_pages,
            quantization=options.quantization,
            dtype=options.dtype,
            devices=mesh.size,
            attention=attention,
            native_kernels=native.isa() if model.native else "off",
            weight_bytes=model.weight_bytes,
            decode_weight_bytes=weights.decode_nbytes(),
            compilation_cache=str(compilation_cache) if compilation_cache else "off",
            weight_cache=cached,
            seconds=round(time.perf_counter() - t0, 2),
        )
        return model

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights occupy on device (per replica set: a sharded array counts once)."""
        return weight_nbytes(self.weights)

    def device_memory(self) -> tuple[int, int] | None:
        """``(bytes, in use)``: what the allocators of the model's devices may hold (XLA's GPU
        allocator: 75% of the card unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise) and
        what is allocated now (the weights, once loaded), summed over the mesh; None where the
        devices report no memory (CPU). The server sizes the KV cache from it
        (``--gpu-memory-utilization``)."""
        total = used = 0
        for device in self.mesh.devices.flat:
            stats = device.memory_stats()
            if not stats or stats.get("bytes_limit", -1) <= 0:
                return None
            total += int(stats["bytes_limit"])
            used += max(0, int(stats.get("bytes_in_use", 0)))
        return total, used

    @property
    def compiled_buckets(self) -> int:
        """How many step shapes have been compiled so far (steady state stops this growing)."""
        return len(self.compiled_steps)

    # -- the KV cache (:mod:`ruvllm_jax.kv_cache`) ----------------------------------------------------
    def kv_block_bytes(self, block_size: int, options: dict[str, Any] | None = None) -> int:
        """Keys and values of every layer for ``block_size`` tokens as the cache stores them: its
        dtype (the model's unless the options name another), or int8 codes plus float32 group
        scales (:class:`ruvllm_jax.kv_state.KVState`). A two-tier cache's float slots are a fixed
        reserve on top (:meth:`kv_reserve`)."""
        return block_bytes(self.spec, self._kv_layout(options), block_size)

    def kv_reserve(
        self, block_size: int, options: dict[str, Any] | None, max_num_seqs: int
    ) -> tuple[int, dict[str, Any]]:
        """Bytes a cache of these ``options`` holds besides its blocks, for an engine of
        ``max_num_seqs`` sequences, and the options that size it: a two-tier cache's float slots,
        ``max_num_seqs * (recent_blocks + 1)`` of them (each sequence's recent blocks and the one it
        fills), at the model dtype's bytes per block. (Fewer sequences fit when they are long; slots
        they do not use go to the fresh blocks of others, and a block that finds none is read from
        its codes.)"""
        layout = self._kv_layout(options)
        if not layout.recent:
            return 0, {}
        slots = layout.hot_blocks or max_num_seqs * (layout.recent + 1)
        float_block = self.kv_block_bytes(block_size, {"dtype": layout.dtype})
        return slots * float_block, {"hot_blocks": slots}

    def _kv_layout(self, options: dict[str, Any] | None) -> KVLayout:
        return kv_layout(options, self.spec.dtype, self.attention)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=tuple(DTYPES),
            quantizations=(*QUANTIZATIONS, "auto"),
            adapters=True,
            adapter_mix=True,
            hidden_states=True,
            all_logits=True,
            # On a sharded mesh too: the sampler is compiled for the logits' sharding.
            device_sampling=True,
            # On a CPU the logits are in host memory already, and the NumPy sampler is faster.
            prefers_device_sampling=jax.devices()[0].platform != "cpu",
            hybrid_kv=True,
        )

    def kv_cache(self, num_blocks: int, block_size: int, options: dict[str, Any]) -> JaxKVCache:
        return self.allocate_cache(num_blocks, block_size, options)

    def kv_rewrites_positions(self, cache: Any) -> bool:
        """Keys and values (and an int8 cache's scales) are stored per position, so a position
        written again holds what a single write leaves; a two-tier cache's float slots follow how far
        chunks reach, so a dropped speculative draft would change which blocks read at full precision."""
        return isinstance(cache, JaxKVCache) and cache.hot is None and cache.local_hot is None

    def allocate_cache(self, num_blocks: int, block_size: int, options: dict[str, Any] | None = None) -> JaxKVCache:
        """``options`` as :meth:`kv_block_bytes` takes them, plus ``local_blocks``: a hybrid cache whose
        windowed layers keep their K/V in a pool of that many blocks (the engine's
        :class:`ruvllm.block_manager.HybridBlockManager` addresses it through the chunks'
        ``local_block_table``)."""
        return allocate_cache(self.spec, self.mesh, self.attention, num_blocks, block_size, options)

    def restrict_head(self, token_ids: np.ndarray) -> None:
        """:class:`ruvllm.backend.RestrictsHead` (one device): see :mod:`ruvllm_jax.draft_head`."""
        if self.mesh.size > 1:
            raise BackendError("jax backend: a reduced output head runs on one device only")
        self.weights, self.head_rows = restricted_head(self.weights, token_ids), len(token_ids)

    # -- one step --------------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, cache: JaxKVCache) -> ForwardOutput:
        if not isinstance(cache, JaxKVCache):
            raise BackendError(f"jax backend: the cache is a {type(cache).__name__}, not one this backend allocated")
        if batch.block_size != cache.block_size:
            raise BackendError(f"batch block size {batch.block_size} differs from the cache's {cache.block_size}")
        if batch.local_block_copies and not cache.local_blocks:
            raise RequestError("local_block_copies given to a cache without a windowed layers' pool")
        if batch.block_copies or batch.local_block_copies:
            self.block_copier.copy(cache, batch.block_copies, batch.local_block_copies)
        chunks = batch.chunks
        vocab = self.head_rows or self.spec.vocab_size  # logits' columns
        if not chunks:
            return ForwardOutput(np.zeros((0, vocab), np.float32))
        check_chunks(chunks, cache.block_size, cache.num_blocks, cache.local_blocks, self.spec)
        ds = batch.sampling
        if ds is not None and len(ds.greedy) != len(chunks):
            raise BackendError(f"device sampling has {len(ds.greedy)} rows for {len(chunks)} chunks")
        # Verification chunks join the decoding ones (their positions run as decoding rows).
        parts = partition([1 if as_decode_rows(c, cache.hot) else len(c.token_ids) for c in chunks])
        # One pass over the chunks in order (every decode step): the step's logits are the output as
        # they are, a view of the first rows (copying them costs a fresh buffer per step, and on a
        # CPU a buffer that large - 33 MB for Gemma-3 at 32 sequences - is fresh pages every step).
        whole = len(parts) == 1 and parts[0] == list(range(len(chunks)))
        out = ForwardOutput(np.zeros((0 if ds or whole else len(chunks), vocab), np.float32))
        sampled: list[tuple[list[int], SampledRows]] = []
        for part in parts:
            inputs, plan, rows, lora = self._prepare([chunks[i] for i in part], cache)
            step = self._step_for(plan, cache, inputs, lora)
            logits, hidden, cache.state = step(self.weights, cache.state, inputs, lora)
            if ds is not None:  # only the tokens (and asked-for logprobs) leave the device
                sub = ds.rows(part)
                fn = self._sampler_for(plan.logit_rows, *device_sampling.variant(sub), logits.sharding)
                result = fn(logits, self._sampling_inputs(sub, plan))
                sampled.append((part, device_sampling.to_host(result, len(part), _to_host)))
                if not rows.all_logits:
                    logits = None
            if logits is not None:
                logits = _to_host(logits)
                if ds is None and whole:
                    out.logits = logits[: len(part)]
                elif ds is None:
                    out.logits[part] = logits[rows.last]
            for j, sl in rows.all_logits.items():
                out.all_logits[part[j]] = np.ascontiguousarray(logits[sl])
            if hidden is not None:
                hidden = _to_host(hidden)
                for j, idx in rows.hidden.items():
                    out.hidden_states[part[j]] = np.ascontiguousarray(hidden[idx])
        if ds is not None:
            out.sampled = _merge_sampled(sampled, len(chunks))
        return out

    def prepare_step(self, batch: ForwardBatch, cache: JaxKVCache) -> PreparedDecode | None:
        """:class:`ruvllm.backend.PreparesSteps`: see :func:`ruvllm_jax.prepared_step.prepare_decode`."""
        return prepare_decode(self, batch, cache)

    def _sampling_inputs(self, ds: DeviceSampling, plan: StepPlan) -> device_sampling.SamplingInputs:
        rows, vocab = plan.logit_rows, self.spec.vocab_size
        everything = None
        if ds.allowed is None:  # no grammar: the all-set bits, uploaded once per row count
            everything = self._all_allowed.get(rows)
            if everything is None:
                everything = device_sampling.all_allowed(rows, vocab)
                if self.mesh.size == 1:  # (on a mesh, a host array is replicated to every process's devices)
                    everything = jax.device_put(everything)
                self._all_allowed[rows] = everything
        return device_sampling.pad_inputs(ds, rows, vocab, everything)

    def _sampler_for(self, rows: int, width: int, sort: bool, sharding: Any = None) -> Any:
        """The compiled device-sampling function of one variant (see :mod:`ruvllm_jax.sampling`), for
        logits of ``sharding`` (that of the steps' logits; on one device, None)."""
        if self.mesh.size == 1:
            sharding = None
        key = (rows, width, sort, sharding)
        fn = self.compiled_samplers.get(key)
        if fn is None:
            vocab = self.spec.vocab_size
            logits = jax.ShapeDtypeStruct((rows, vocab), np.float32, sharding=sharding)
            abstract = device_sampling.abstract_inputs(rows, vocab, width)
            jitted = jax.jit(partial(device_sampling.sample_rows, sort=sort))
            fn, seconds = self.compiled_samplers.compile(key, lambda: jitted.lower(logits, abstract).compile())
            if self.precompiled:
                log.warning("sampling compiled while serving", variant=key, seconds=round(seconds, 2))
        return fn

    def precompile(
        self,
        cache: JaxKVCache,
        limits: StepLimits,
        progress: Callable[[int, int, str, float], None] | None = None,
    ) -> list[tuple[str, float]]:
        """Compile every step shape (:func:`step_shapes`) and block-copy size a step within ``limits``
        can need; returns each shape with its compile seconds (a fraction of a second when the
        persistent compilation cache has it). Block tables become ``limits.max_model_len`` tokens wide.
        With ``limits.hidden_states`` every shape is compiled a second time returning hidden states;
        with ``limits.adapters`` once more (twice with hidden states) with adapters in one padded plan
        (slots, rank and projections at the limits' bounds), which every step whose adapters fit it
        then takes. With ``limits.all_logits`` every variant once more returning every position's
        logits (prompt logprobs, echo). With ``limits.device_sampling``, the sampling functions of
        every step's row count, overlay width, with and without the sort."""
        max_num_seqs, max_num_batched_tokens = limits.max_num_seqs, limits.max_num_batched_tokens
        max_model_len = limits.max_model_len
        bs = cache.block_size
        self.table_tokens = max_model_len
        done: list[tuple[str, float]] = []
        # Verification chunks' positions run as decoding rows: up to draft_tokens more of them.
        seqs = max_num_seqs + limits.draft_tokens
        self.step_tokens = batch_invariant.step_tokens(self.options.extra, self.native, seqs, max_num_batched_tokens)
        shapes = step_shapes(seqs, max_num_batched_tokens, self.step_tokens)
        copies = powers_of_two(1, bucket(max_num_seqs))
        self.precompiled = False  # (compiling again, for other limits)
        self.fixed_lora = None
        if limits.adapters is not None:
            a = limits.adapters
            # One adapter per sequence, except a mix's (X-LoRA's) several.
            per_step = (a.per_step or max_num_seqs) if a.mixes else min(a.per_step or max_num_seqs, max_num_seqs)
            projections = tuple(p for p in PROJECTIONS if p in a.projections)
            self.fixed_lora = LoraPlan(
                slots=bucket(per_step), rank=bucket(a.max_rank), projections=projections, weighted=a.mixes
            )
        plans: tuple[LoraPlan | None, ...] = (None,)
        if self.fixed_lora is not None:
            plans = (None, dataclasses.replace(self.fixed_lora, weighted=0))
            if self.fixed_lora.weighted:  # X-LoRA's passes: the same plan with weights per token
                plans += (self.fixed_lora,)
        variants = [
            (hidden, lora, every)
            for lora in plans
            for hidden in ((False, True) if limits.hidden_states else (False,))
            for every in ((False, True) if limits.all_logits else (False,))
        ]
        vocab = self.spec.vocab_size
        samplers = (
            [(w, sort) for w in overlay_widths(vocab) for sort in (False, True)]
            if limits.device_sampling and self.capabilities.device_sampling
            else []
        )
        logit_rows = sorted({self.step_tokens or s.decode_seqs + s.prefill_seqs for s in shapes}) if samplers else []
        total = len(shapes) * len(variants) + len(copies) + len(logit_rows) * len(samplers)
        table = np.zeros(-(-max_model_len // bs), np.int32)
        for shape in shapes:
            for hidden, fixed, every in variants:
                chunks = shape_chunks(shape, table, hidden, every)
                t0 = time.perf_counter()
                inputs, plan, _, lora = self._prepare(chunks, cache, force_lora=fixed, plan_only=True)
                self._step_for(plan, cache, inputs, lora)
                kinds = (
                    (" hidden", hidden),
                    (" adapters", fixed),
                    (" mixed", fixed is not None and fixed.weighted),
                    (" all logits", every),
                )
                name = f"{shape}{''.join(k for k, on in kinds if on)}"
                done.append((name, time.perf_counter() - t0))
                if progress:
                    progress(len(done), total, *done[-1])
        for rows in logit_rows:
            for width, sort in samplers:
                t0 = time.perf_counter()
                self._sampler_for(rows, width, sort, self._logits_sharding)
                name = f"sampling {rows} rows, overlay {width}{', sorted' if sort else ''}"
                done.append((name, time.perf_counter() - t0))
                if progress:
                    progress(len(done), total, *done[-1])
        for n in copies:
            t0 = time.perf_counter()
            self.block_copier.program(n, cache)
            done.append((f"block copies {n}", time.perf_counter() - t0))
            if progress:
                progress(len(done), total, *done[-1])
        self.precompiled = True
        return done

    def lower_steps(
        self, cache: JaxKVCache, limits: StepLimits, platform: str, attention: str | None = None
    ) -> list[str]:
        """Lower, without compiling, every step shape :meth:`precompile` compiles (with and without
        hidden states) for ``platform`` (``"cuda"`` on a machine without a GPU: the proof that the
        steps lower there; their layers unrolled as :attr:`unroll_layers` would be there), with
        ``attention`` in place of the model's; returns the shapes lowered
        and raises what lowering raises."""
        self.table_tokens = limits.max_model_len
        table = np.zeros(-(-limits.max_model_len // cache.block_size), np.int32)

        def abstract(tree: Any) -> Any:
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a, tree)

        done = []
        self.step_tokens = batch_invariant.step_tokens(
            self.options.extra, self.native, limits.max_num_seqs, limits.max_num_batched_tokens
        )
        for shape in step_shapes(limits.max_num_seqs, limits.max_num_batched_tokens, self.step_tokens):
            for hidden in (False, True):
                inputs, plan, _, lora = self._prepare(shape_chunks(shape, table, hidden), cache, plan_only=True)
                if attention is not None:
                    plan = dataclasses.replace(plan, attention=attention)
                # as the steps would run on that platform (unrolled on CUDA unless the option says not)
                plan = dataclasses.replace(plan, unroll_layers=unroll_layers_option(self.options.extra, platform))
                plan = self._split_plan(plan, cache, DEFAULT_GPU_CORES if platform == "cuda" else None)
                fn = jax.jit(partial(forward_step, spec=self.spec, plan=plan), donate_argnums=(1,))
                traced = fn.trace(abstract(self.weights), abstract(cache.state), abstract(inputs), abstract(lora))
                traced.lower(lowering_platforms=(platform,))
                splits = f" splits {plan.decode_splits}" if plan.decode_splits > 1 else ""
                done.append(f"{shape}{' hidden' if hidden else ''}{splits}")
        return done

    def _step_for(self, plan: StepPlan, cache: JaxKVCache, inputs: StepInputs, lora: LoraFactors | None) -> Any:
        """The compiled step of ``plan`` on ``cache`` (compiled now the first time)."""
        key = (plan, *cache.compile_key)
        step = self.compiled_steps.get(key)
        if step is None:
            state = cache.state
            step, seconds = self.compiled_steps.compile(
                key, lambda: compile_step(self.spec, plan, self.weights, state, inputs, lora), plan
            )
            self._logits_sharding = step.output_shardings[0]  # what the samplers are compiled for
            seconds = round(seconds, 2)
            if self.precompiled:
                # All-position logits, and adapters or hidden states nobody declared (or adapters
                # beyond the declared bounds), are outside the precompiled set.
                log.warning("step compiled while serving", plan=plan, seconds=seconds, buckets=len(self.compiled_steps))
            else:
                log.debug("step compiled", plan=plan, seconds=seconds, buckets=len(self.compiled_steps))
        return step

    def _prepare(
        self,
        chunks: Sequence[SequenceChunk],
        cache: JaxKVCache,
        force_lora: LoraPlan | None = None,
        plan_only: bool = False,
    ) -> tuple[StepInputs, StepPlan, StepRows, LoraFactors | None]:
        """:func:`ruvllm_jax.step_inputs.step_inputs` of ``chunks`` for this model and ``cache``, on the
        model's devices. ``force_lora``: precompiling that adapter plan (every slot empty);
        ``plan_only``: for compiling (a two-tier cache's slots are left as they are)."""
        inputs, plan, rows, lora = step_inputs(
            chunks,
            block_size=cache.block_size,
            num_blocks=cache.num_blocks,
            local_blocks=cache.local_blocks,
            table_tokens=self.table_tokens,
            attention=self.attention,
            native=self.native,
            native_attention=self.native_attention,
            quantization=self.options.quantization,
            unroll_layers=self.unroll_layers,
            adapters=self._plan_adapters if force_lora is None else self._padding_adapters(force_lora),
            hot=cache.hot,
            local_hot=cache.local_hot,
            plan_only=plan_only,
            step_tokens=self.step_tokens,
        )
        if self.mesh.size > 1:
            inputs = jax.device_put(inputs, replicated(self.mesh))
        return inputs, self._split_plan(plan, cache, self.gpu_cores), rows, lora

    def _split_plan(self, plan: StepPlan, cache: JaxKVCache, cores: int | None) -> StepPlan:
        """``plan`` with its decode attention's parts: the ``decode_splits`` option when forced, else
        :func:`ruvllm_jax.step_shapes.decode_splits` of its decode shape on ``cores`` SMs (None: not a
        GPU, one part); always one where the Pallas decode kernel does not run."""
        if plan.attention not in ("pallas", "pallas_interpret") or not plan.decode_seqs:
            splits = 1
        elif self.decode_splits is not None:
            splits = self.decode_splits
        elif cores is None:
            splits = 1
        else:
            kv_heads = max(1, self.spec.num_kv_heads // self.mesh.size)  # per device under tensor parallel
            splits = decode_splits(plan.decode_seqs, kv_heads, plan.decode_blocks * cache.block_size, cores)
        return plan if splits == plan.decode_splits else dataclasses.replace(plan, decode_splits=splits)

    def _plan_adapters(
        self, chunks: Sequence[SequenceChunk], lens: list[int], t: int, starts: np.ndarray, gathered: bool
    ) -> tuple[LoraPlan | None, np.ndarray | None, LoraFactors | None, np.ndarray | None]:
        adapters = [c.adapter for c in chunks]
        return plan_adapters(adapters, lens, t, self.adapters, starts, gathered=gathered, fixed=self.fixed_lora)

    def _padding_adapters(self, plan: LoraPlan) -> AdapterPlanner:
        """Adapters of a step precompiled for ``plan``: every slot empty (zero factors)."""
        return padding_planner(plan, self.adapters, self.spec.num_layers)
