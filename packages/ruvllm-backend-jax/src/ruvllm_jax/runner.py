"""The host side of the backend: turns a core :class:`ForwardBatch` into padded int32 arrays, picks
the compiled step for their shape (compiling it the first time) and unpacks the results.

Step shapes form a small bounded set (:func:`step_shapes`), so a server compiles all of them before
traffic (:meth:`JaxModel.precompile`) and never while serving:

- block tables are as wide as the longest sequence served; attention loops over the key chunks the
  step's contexts reach (:mod:`ruvllm_jax.attention`), so context length is not part of the shape;
- steps with only decoding sequences pad their count to a power of two;
- a step with prompt chunks runs them as one group of 1 chunk (its length padded to a power of two,
  at least :data:`MIN_PREFILL_LEN`) or of :data:`SHORT_GROUP` chunks of at most :data:`SHORT_PREFILL`
  tokens, beside the decoding sequences padded to a power of four; chunks that fit no group together
  run as further parts of the same call, one forward pass each.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
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
from ruvllm.block_manager import NO_BLOCK
from ruvllm.checkpoint import Checkpoint
from ruvllm.errors import BackendError, RequestError
from ruvllm.sampling import overlay_widths
from ruvllm_jax import native
from ruvllm_jax import sampling as device_sampling
from ruvllm_jax.gguf_blocks import WXA8_GGUF_TYPES
from ruvllm_jax.host_memory import huge_pages, keep_large_buffers
from ruvllm_jax.loading import DTYPES, WeightLoader
from ruvllm_jax.lora import ADAPTER_CACHE_SIZE, AdapterCache, plan_adapters
from ruvllm_jax.model import (
    PROJECTIONS,
    KVState,
    LoraFactors,
    LoraPlan,
    ModelSpec,
    StepInputs,
    StepPlan,
    Weights,
    bucket,
    forward_step,
    gathers_lora,
    kv_scale_groups,
)
from ruvllm_jax.quant import QUANTIZATIONS, weight_nbytes
from ruvllm_jax.sharding import empty_cache, make_mesh, replicated, shard_weights
from ruvllm_jax.two_tier import HotSlots, hot_inputs

log = structlog.get_logger("ruvllm_jax")

ATTENTION_IMPLS = ("reference", "pallas", "pallas_interpret")
#: Prompt chunks are padded to a power of two of at least this many tokens.
MIN_PREFILL_LEN = 16
#: Up to SHORT_GROUP prompt chunks of at most SHORT_PREFILL tokens run together in one group.
SHORT_PREFILL = 128
SHORT_GROUP = 4


def bucket4(n: int) -> int:
    """Decoding sequences beside a prompt group: 0, 1, 4, 16, 64..."""
    return 0 if n <= 0 else 1 if n == 1 else 1 << (2 * (((n - 1).bit_length() + 1) // 2))


@dataclass(frozen=True)
class StepShape:
    """One compiled step's sizes: decoding sequences, prompt-group chunks and their padded length."""

    decode_seqs: int
    prefill_seqs: int = 0
    prefill_len: int = 1

    @property
    def num_tokens(self) -> int:
        return self.decode_seqs + self.prefill_seqs * self.prefill_len

    def __str__(self) -> str:
        if not self.prefill_seqs:
            return f"decode {self.decode_seqs}"
        return f"decode {self.decode_seqs} + prefill {self.prefill_seqs}x{self.prefill_len}"


def step_shapes(max_num_seqs: int, max_num_batched_tokens: int) -> list[StepShape]:
    """Every shape a step within these limits is padded to (see the module docstring)."""
    shapes = []
    sd = 1
    while sd <= bucket(min(max_num_seqs, max_num_batched_tokens)):
        shapes.append(StepShape(sd))
        sd *= 2
    groups = [(1, q) for q in _lengths(MIN_PREFILL_LEN, bucket(max_num_batched_tokens))]
    if max_num_seqs >= 2:
        groups += [(SHORT_GROUP, q) for q in _lengths(MIN_PREFILL_LEN, min(SHORT_PREFILL, max_num_batched_tokens))]
    for sp, qb in groups:
        fewest_chunks = 1 if sp == 1 else 2
        # The longest chunk decides the padded length; the others may have as few as 2 tokens.
        fewest_tokens = (2 if qb == MIN_PREFILL_LEN else qb // 2 + 1) + 2 * (fewest_chunks - 1)
        if fewest_tokens > max_num_batched_tokens:
            continue
        sd = 0
        while True:
            fewest_decodes = 0 if sd == 0 else 1 if sd == 1 else sd // 4 + 1
            if fewest_decodes + fewest_chunks > max_num_seqs or fewest_decodes + fewest_tokens > max_num_batched_tokens:
                break
            shapes.append(StepShape(sd, sp, qb))
            sd = 1 if sd == 0 else sd * 4
    return shapes


def _lengths(lo: int, hi: int) -> list[int]:
    out, q = [], lo
    while q <= max(lo, hi):
        out.append(q)
        q *= 2
    return out


def shape_of(lens: list[int]) -> StepShape:
    """The shape one forward pass over chunks of these lengths (one part of :func:`partition`) is
    padded to."""
    decode = sum(1 for n in lens if n == 1)
    prompts = [n for n in lens if n > 1]
    if not prompts:
        return StepShape(bucket(decode))
    sp = 1 if len(prompts) == 1 else SHORT_GROUP
    qb = max(MIN_PREFILL_LEN, bucket(max(prompts)))
    if len(prompts) > sp or (sp > 1 and qb > SHORT_PREFILL):
        raise BackendError(f"jax backend: prompt chunks of {prompts} tokens fit no step shape")
    return StepShape(bucket4(decode), sp, qb)


def partition(lens: list[int]) -> list[list[int]]:
    """The chunks (indices) each forward pass of a step runs: the first part holds every decoding
    chunk and the first prompt group; long prompt chunks form groups of one, short ones groups of up
    to :data:`SHORT_GROUP` (a lone short chunk is a group of one)."""
    decode = [i for i, n in enumerate(lens) if n == 1]
    prompts = sorted((i for i, n in enumerate(lens) if n > 1), key=lambda i: -lens[i])
    groups = [[i] for i in prompts if lens[i] > SHORT_PREFILL]
    short = [i for i in prompts if lens[i] <= SHORT_PREFILL]
    groups += [short[k : k + SHORT_GROUP] for k in range(0, len(short), SHORT_GROUP)]
    if not groups:
        return [decode]
    return [decode + groups[0], *groups[1:]]


_KNOWN_EXTRA = {
    "tensor_parallel", "attention", "keep_gguf_blocks", "native", "threads", "unroll_layers",
    # Process 0 of a group (``ruvllm serve --coordinator``): see :mod:`ruvllm_jax.distributed`.
    "coordinator", "num_processes",
}  # fmt: skip
#: w8a8 steps of at most this many (padded) tokens use the native kernels when they are loaded;
#: larger ones use XLA's integer GEMM, which reuses each weight load across more rows. (w4a8 steps
#: always use the native kernels on CPU: XLA has no fast form of the grouped product.)
NATIVE_MAX_TOKENS = 4


def enable_compilation_cache() -> Path | None:
    """Keep compiled steps on disk so a restarted server does not compile its shapes again: XLA
    compiles each step in 0.3-4 s on CPU and loads it from this cache in a fraction of that.

    ``RUVLLM_JAX_COMPILATION_CACHE``: a directory, or ``off``; default ``<ruvllm cache>/jax``. A
    directory set through JAX's own ``jax_compilation_cache_dir`` is left as it is."""
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    setting = os.environ.get("RUVLLM_JAX_COMPILATION_CACHE", "")
    if setting.lower() in {"off", "0", "false", "no"}:
        return None
    from ruvllm.resolve import cache_dir

    path = Path(setting).expanduser() if setting else cache_dir() / "jax"
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Every step shape is precompiled at start: all of them are worth keeping (a few dozen KiB each).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def auto_quantization(checkpoint: Checkpoint, options: LoadOptions) -> str:
    """What ``quantization="auto"`` means here: ``w4a8`` for a GGUF whose matrices are mostly blocks
    the ``w4a8`` form holds exactly (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) on one CPU device
    with a vector variant of the native kernels (the file's own weights, multiplied the way
    llama.cpp multiplies them, and this backend's fastest CPU form), else ``none``."""
    tp = str(options.extra.get("tensor_parallel", 1))
    if (
        checkpoint.format == "gguf"
        and checkpoint.quantization in WXA8_GGUF_TYPES
        and options.dtype == "float32"
        and tp == "1"
        and not options.extra.get("keep_gguf_blocks")
        and options.extra.get("native", True) not in (False, "false", "0")
        and jax.devices()[0].platform == "cpu"
        and native.has_vector_path()  # the scalar loops are no faster than float32
    ):
        return "w4a8"
    return "none"


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _shape_chunks(shape: Any, table: np.ndarray, hidden: bool, every: bool = False) -> list[SequenceChunk]:
    """Chunks of one step of ``shape`` (decoding sequences, then prompt chunks), the last asking for
    hidden states when ``hidden`` and for every position's logits when ``every``: what precompiling
    (or lowering) that shape runs."""
    one = SequenceChunk(np.zeros(1, np.int32), 0, table, local_block_table=table)
    chunks = [one] * shape.decode_seqs
    chunks += [dataclasses.replace(one, token_ids=np.zeros(shape.prefill_len, np.int32))] * shape.prefill_seqs
    chunks[-1] = dataclasses.replace(chunks[-1], hidden_states=hidden, all_logits=every)
    return chunks


def default_attention(head_dim: int) -> str:
    """The Pallas kernels on CUDA where they lower (Pallas's Triton lowering needs power-of-two
    array sides: the head dim here, the block size when the cache is allocated), else XLA's
    attention over gathered blocks."""
    return "pallas" if on_cuda() and _pow2(head_dim) else "reference"


def unroll_layers_option(extra: dict[str, Any], platform: str) -> bool:
    """The ``unroll_layers`` option: ``auto`` (the default: unrolled on CUDA, where XLA copies a scanned
    layer's weights before using them; a scan elsewhere, which compiles once per step shape whatever
    the depth), or a boolean."""
    value = extra.get("unroll_layers", "auto")
    text = str(value).strip().lower()
    if text == "auto":
        return platform == "cuda"
    if value is True or text in ("true", "1", "yes", "on"):
        return True
    if value is False or text in ("false", "0", "no", "off"):
        return False
    raise BackendError(f"jax backend: unroll_layers must be auto, true or false, got {value!r}")


def on_cuda() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and "cuda" in str(getattr(dev.client, "platform_version", "")).lower()


#: Full blocks behind a sequence's tail block that an int8 cache keeps in float too (the two tiers).
DEFAULT_RECENT_BLOCKS = 2
#: Sequences a two-tier cache's float slots are sized for when no engine says how many.
DEFAULT_TWO_TIER_SEQS = 64


@dataclass(frozen=True)
class KVLayout:
    """What a cache's options ask for (see :meth:`JaxModel._kv_layout`)."""

    quantized: bool
    dtype: str
    #: Two-tier int8 cache: full blocks behind the tail one read from float slots (0: one tier).
    recent: int = 0
    hot_blocks: int | None = None


@dataclass
class JaxKVCache:
    """The paged KV cache of one model. ``state`` is replaced after every step: the step donates the
    old buffers and updates them in place."""

    state: KVState
    num_blocks: int
    block_size: int
    #: Blocks of the windowed layers' pool of a hybrid cache (0: one pool for every layer).
    local_blocks: int = 0
    #: A two-tier cache's float slots of each pool (see :mod:`ruvllm_jax.two_tier`).
    hot: HotSlots | None = None
    local_hot: HotSlots | None = None

    @property
    def nbytes(self) -> int:
        return weight_nbytes(self.state)


@dataclass
class JaxModel:
    spec: ModelSpec
    weights: Weights
    mesh: jax.sharding.Mesh
    attention: str
    options: LoadOptions
    _compiled: dict[tuple, Any] = field(default_factory=dict, repr=False)
    _copy_fns: dict[tuple, Any] = field(default_factory=dict, repr=False)
    _samplers: dict[tuple, Any] = field(default_factory=dict, repr=False)
    #: The sharding of the steps' logits (from the last step compiled; None before the first).
    _logits_sharding: Any = field(default=None, repr=False)
    _all_allowed: dict[int, Any] = field(default_factory=dict, repr=False)
    #: Device copies of the adapters (LoRA factors) recent steps used.
    adapters: AdapterCache = field(init=False, repr=False)
    #: Whether small steps run the w8a8 products in :mod:`ruvllm_jax.native`'s kernels.
    native: bool = field(init=False, default=False)
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

    def __post_init__(self) -> None:
        self.native = self._want_native()
        self.unroll_layers = unroll_layers_option(self.options.extra, "cuda" if on_cuda() else "cpu")
        sharding = replicated(self.mesh) if self.mesh.size > 1 else None
        capacity = self.options.max_adapters
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise BackendError(f"jax backend: max_adapters must be a positive integer, got {capacity!r}")
        self.adapters = AdapterCache(self.spec, lambda a: jax.device_put(a, sharding), capacity or ADAPTER_CACHE_SIZE)

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def load(cls, checkpoint: Checkpoint, options: LoadOptions) -> JaxModel:
        unknown = set(options.extra) - _KNOWN_EXTRA
        if unknown:
            raise BackendError(
                f"jax backend: unknown option(s) {', '.join(sorted(unknown))} "
                f"(known: {', '.join(sorted(_KNOWN_EXTRA))})"
            )
        if options.dtype == "auto":  # bfloat16 on GPUs (half the bytes, tensor cores), float32 on CPUs
            gpu = jax.devices()[0].platform == "gpu"
            options = dataclasses.replace(options, dtype="bfloat16" if gpu else "float32")
        if options.quantization == "auto":
            options = dataclasses.replace(options, quantization=auto_quantization(checkpoint, options))
        if options.quantization not in QUANTIZATIONS:
            raise BackendError(
                f"jax backend: unknown quantization {options.quantization!r} (known: {', '.join(QUANTIZATIONS)})"
            )
        if options.dtype not in DTYPES:
            raise BackendError(
                f"jax backend: dtype {options.dtype!r} is not supported (supported: {', '.join(DTYPES)})"
            )
        unroll_layers_option(options.extra, "cpu")  # refused before anything loads
        attention = str(options.extra.get("attention", default_attention(checkpoint.config.head_dim)))
        if attention not in ATTENTION_IMPLS:
            raise BackendError(f"jax backend: unknown attention {attention!r} (known: {', '.join(ATTENTION_IMPLS)})")
        if attention == "pallas" and not on_cuda():
            raise BackendError(
                "jax backend: attention='pallas' needs a CUDA device (use 'pallas_interpret' to test on CPU)"
            )
        if attention == "pallas" and not _pow2(checkpoint.config.head_dim):
            raise BackendError(
                f"jax backend: the Pallas attention kernels need a power-of-two head dim "
                f"(this model's is {checkpoint.config.head_dim}); use attention='reference'"
            )
        try:
            tp = int(options.extra.get("tensor_parallel", 1))
        except (TypeError, ValueError):
            raise BackendError(
                f"jax backend: tensor_parallel must be an integer, got {options.extra['tensor_parallel']!r}"
            ) from None
        if "threads" in options.extra:  # the native kernels' pool (XLA keeps its own)
            threads = native.parse_threads(options.extra["threads"], "jax backend: threads")
            if native.available():
                native.set_threads(threads)
        compilation_cache = enable_compilation_cache()
        spec = ModelSpec.from_config(checkpoint.config, options.dtype)
        mesh = make_mesh(tp)
        t0 = time.perf_counter()
        keep = bool(options.extra.get("keep_gguf_blocks", False))
        if keep and options.quantization != "none":
            raise BackendError(
                "jax backend: keep_gguf_blocks keeps the file's quantization; use it with quantization='none'"
            )
        host = WeightLoader(checkpoint, spec, options.quantization, keep).load()
        weights = shard_weights(host, spec, mesh)
        model = cls(spec, weights, mesh, attention, options)
        model.table_tokens = checkpoint.config.max_position_embeddings
        on_cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
        if on_cpu:
            model.huge_pages = huge_pages(jax.tree_util.tree_leaves(weights))
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
            compilation_cache=str(compilation_cache) if compilation_cache else "off",
            seconds=round(time.perf_counter() - t0, 2),
        )
        return model

    def _want_native(self) -> bool:
        wanted = self.options.extra.get("native", True)
        if isinstance(wanted, str) and wanted.lower() in ("true", "1", "false", "0"):
            wanted = wanted.lower() in ("true", "1")
        if not isinstance(wanted, bool):
            raise BackendError(f"jax backend: native must be true or false, got {wanted!r}")
        if not wanted or self.options.quantization not in ("w8a8", "w4a8") or self.mesh.size > 1:
            return False
        if jax.devices()[0].platform != "cpu":
            return False
        if self.options.quantization == "w8a8":
            # XLA's integer GEMM beats the kernels' scalar loops; only the vector path pays.
            return native.has_vector_path()
        return native.available()

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
        return len(self._compiled)

    def kv_block_bytes(self, block_size: int, options: dict[str, Any] | None = None) -> int:
        """Keys and values of every layer for ``block_size`` tokens as the cache stores them: its
        dtype (the model's unless the options name another), or int8 codes plus float32 group
        scales (:class:`ruvllm_jax.model.KVState`). A two-tier cache's float slots are a fixed
        reserve on top (:meth:`kv_reserve`)."""
        s = self.spec
        layout = self._kv_layout(options)
        per_head = s.head_dim * np.dtype(DTYPES[layout.dtype]).itemsize
        if layout.quantized:
            per_head = s.head_dim + 4 * kv_scale_groups(s.head_dim)
        return 2 * s.num_layers * s.num_kv_heads * block_size * per_head

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
        """What the KV cache ``options`` ask for: int8 codes (``quantization``: ``none`` or ``int8``),
        the float dtype (``dtype``: ``auto``, the model's, or one of :data:`DTYPES`), and for int8
        the two tiers: ``recent_blocks`` (default 2; 0: every block int8 only) full blocks behind
        each sequence's tail block read from float slots, ``hot_blocks`` of them (default: sized by
        :meth:`kv_reserve`'s engine, else for 64 sequences)."""
        options = dict(options or {})
        quant = options.pop("quantization", "none")
        dtype = options.pop("dtype", "auto")
        recent = options.pop("recent_blocks", None)
        hot_blocks = options.pop("hot_blocks", None)
        if options:
            raise BackendError(
                f"jax backend: unknown KV cache option(s) {', '.join(sorted(options))} "
                "(it takes quantization, dtype, recent_blocks, hot_blocks)"
            )
        if quant not in ("none", "int8"):
            raise BackendError(f"jax backend: KV cache quantization must be 'none' or 'int8', got {quant!r}")
        if quant == "int8" and self.attention != "reference":
            raise BackendError(
                "jax backend: an int8 KV cache needs attention='reference' (the Pallas kernels read floats)"
            )
        dtype = self.spec.dtype if dtype == "auto" else dtype
        if dtype not in DTYPES:
            raise BackendError(f"jax backend: KV cache dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
        if quant == "int8" and dtype != self.spec.dtype:
            raise BackendError("jax backend: give the KV cache an int8 quantization or a dtype, not both")
        if dtype != self.spec.dtype and self.attention != "reference":
            raise BackendError(
                f"jax backend: a {dtype} KV cache under {self.spec.dtype} compute needs attention='reference'"
            )
        if quant != "int8" and (recent is not None or hot_blocks is not None):
            raise BackendError("jax backend: recent_blocks and hot_blocks are for an int8 KV cache (two tiers)")
        recent = DEFAULT_RECENT_BLOCKS if recent is None and quant == "int8" else recent or 0
        if isinstance(recent, bool) or not isinstance(recent, int) or recent < 0:
            raise BackendError(f"jax backend: recent_blocks must be a whole number >= 0, got {recent!r}")
        if hot_blocks is not None and (
            isinstance(hot_blocks, bool) or not isinstance(hot_blocks, int) or hot_blocks < 1
        ):
            raise BackendError(f"jax backend: hot_blocks must be a whole number >= 1, got {hot_blocks!r}")
        if hot_blocks is not None and not recent:
            raise BackendError("jax backend: hot_blocks needs recent_blocks > 0 (a two-tier cache)")
        return KVLayout(quant == "int8", dtype, recent, hot_blocks)

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

    def allocate_cache(self, num_blocks: int, block_size: int, options: dict[str, Any] | None = None) -> JaxKVCache:
        """``options`` as :meth:`kv_block_bytes` takes them, plus ``local_blocks``: a hybrid cache whose
        windowed layers keep their K/V in a pool of that many blocks (the engine's
        :class:`ruvllm.block_manager.HybridBlockManager` addresses it through the chunks'
        ``local_block_table``)."""
        options = dict(options or {})
        local_blocks = options.pop("local_blocks", 0)
        layout = self._kv_layout(options)
        quantized, dtype = layout.quantized, layout.dtype
        if num_blocks < 1 or block_size < 1:
            raise BackendError(f"KV cache needs at least one block of one token (got {num_blocks} x {block_size})")
        local_layers = len(self.spec.local_layers)
        if not isinstance(local_blocks, int) or local_blocks < 0:
            raise BackendError(f"jax backend: local_blocks must be a non-negative integer, got {local_blocks!r}")
        if local_blocks and not local_layers:
            raise BackendError(
                "jax backend: local_blocks (a hybrid KV cache) needs a model that interleaves windowed and global "
                "layers"
            )
        if self.attention == "pallas" and not _pow2(block_size):
            raise BackendError(
                f"jax backend: the Pallas attention kernels need a power-of-two block size (got {block_size}); "
                "give another block size or attention='reference'"
            )
        hot = (layout.hot_blocks or DEFAULT_TWO_TIER_SEQS * (layout.recent + 1)) if layout.recent else 0
        kw = dict(quantized=quantized, hot_blocks=hot)

        def slots() -> HotSlots | None:
            return HotSlots(hot, layout.recent, block_size) if hot else None

        if not local_blocks:
            state = empty_cache(self.spec, self.mesh, num_blocks, block_size, DTYPES[dtype], **kw)
            return JaxKVCache(state, num_blocks, block_size, hot=slots())
        globals_ = self.spec.num_layers - local_layers
        state = empty_cache(self.spec, self.mesh, num_blocks, block_size, DTYPES[dtype], layers=globals_, **kw)
        local = empty_cache(self.spec, self.mesh, local_blocks, block_size, DTYPES[dtype], layers=local_layers, **kw)
        return JaxKVCache(
            dataclasses.replace(state, local=local), num_blocks, block_size, local_blocks, slots(), slots()
        )

    # -- one step --------------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, cache: JaxKVCache) -> ForwardOutput:
        if not isinstance(cache, JaxKVCache):
            raise BackendError(f"jax backend: the cache is a {type(cache).__name__}, not one this backend allocated")
        if batch.block_size != cache.block_size:
            raise BackendError(f"batch block size {batch.block_size} differs from the cache's {cache.block_size}")
        if batch.local_block_copies and not cache.local_blocks:
            raise RequestError("local_block_copies given to a cache without a windowed layers' pool")
        if batch.block_copies or batch.local_block_copies:
            self._copy_blocks(cache, batch.block_copies, batch.local_block_copies)
        chunks = batch.chunks
        if not chunks:
            return ForwardOutput(np.zeros((0, self.spec.vocab_size), np.float32))
        self._check(chunks, cache)
        vocab = self.spec.vocab_size
        ds = batch.sampling
        if ds is not None and len(ds.greedy) != len(chunks):
            raise BackendError(f"device sampling has {len(ds.greedy)} rows for {len(chunks)} chunks")
        parts = partition([len(c.token_ids) for c in chunks])
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
        fn = self._samplers.get(key)
        if fn is None:
            t0 = time.perf_counter()
            vocab = self.spec.vocab_size
            logits = jax.ShapeDtypeStruct((rows, vocab), np.float32, sharding=sharding)
            abstract = device_sampling.abstract_inputs(rows, vocab, width)
            fn = jax.jit(partial(device_sampling.sample_rows, sort=sort)).lower(logits, abstract).compile()
            self._samplers[key] = fn
            if self.precompiled:
                log.warning("sampling compiled while serving", variant=key, seconds=round(time.perf_counter() - t0, 2))
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
        shapes = step_shapes(max_num_seqs, max_num_batched_tokens)
        copies = _lengths(1, bucket(max_num_seqs))
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
        logit_rows = sorted({shape.decode_seqs + shape.prefill_seqs for shape in shapes}) if samplers else []
        total = len(shapes) * len(variants) + len(copies) + len(logit_rows) * len(samplers)
        table = np.zeros(-(-max_model_len // bs), np.int32)
        for shape in shapes:
            for hidden, fixed, every in variants:
                chunks = _shape_chunks(shape, table, hidden, every)
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
            self._copy_fn(n, cache)
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
        for shape in step_shapes(limits.max_num_seqs, limits.max_num_batched_tokens):
            for hidden in (False, True):
                inputs, plan, _, lora = self._prepare(_shape_chunks(shape, table, hidden), cache, plan_only=True)
                if attention is not None:
                    plan = dataclasses.replace(plan, attention=attention)
                # as the steps would run on that platform (unrolled on CUDA unless the option says not)
                plan = dataclasses.replace(plan, unroll_layers=unroll_layers_option(self.options.extra, platform))
                fn = jax.jit(partial(forward_step, spec=self.spec, plan=plan), donate_argnums=(1,))
                traced = fn.trace(abstract(self.weights), abstract(cache.state), abstract(inputs), abstract(lora))
                traced.lower(lowering_platforms=(platform,))
                done.append(f"{shape}{' hidden' if hidden else ''}")
        return done

    def _step_for(self, plan: StepPlan, cache: JaxKVCache, inputs: StepInputs, lora: LoraFactors | None):
        key = (plan, *_cache_key(cache))
        step = self._compiled.get(key)
        if step is None:
            t0 = time.perf_counter()
            fn = jax.jit(partial(forward_step, spec=self.spec, plan=plan), donate_argnums=(1,))
            step = fn.lower(self.weights, cache.state, inputs, lora).compile()
            self._compiled[key] = step
            self._logits_sharding = step.output_shardings[0]  # what the samplers are compiled for
            seconds = round(time.perf_counter() - t0, 2)
            if self.precompiled:
                # All-position logits, and adapters or hidden states nobody declared (or adapters
                # beyond the declared bounds), are outside the precompiled set.
                log.warning("step compiled while serving", plan=plan, seconds=seconds, buckets=len(self._compiled))
            else:
                log.debug("step compiled", plan=plan, seconds=seconds, buckets=len(self._compiled))
        return step

    def _check(self, chunks: list[SequenceChunk], cache: JaxKVCache) -> None:
        bs, nb, vocab = cache.block_size, cache.num_blocks, self.spec.vocab_size
        for i, c in enumerate(chunks):
            if len(c.token_ids) == 0:
                raise RequestError(f"chunk {i} has no tokens")
            if c.start_pos < 0:
                raise RequestError(f"chunk {i}: start_pos {c.start_pos} is negative")
            need = -(-c.end_pos // bs)
            if len(c.block_table) < need:
                raise RequestError(f"chunk {i}: {len(c.block_table)} blocks cannot hold positions up to {c.end_pos}")
            table = np.asarray(c.block_table[:need])
            if table.size and (table.min() < 0 or table.max() >= nb):
                raise RequestError(f"chunk {i}: block table refers to blocks outside 0..{nb - 1}")
            if cache.local_blocks:
                if c.local_block_table is None or len(c.local_block_table) < need:
                    raise RequestError(
                        f"chunk {i}: a hybrid cache needs a local_block_table up to position {c.end_pos}"
                    )
                local = np.asarray(c.local_block_table[:need])
                live = local[local != NO_BLOCK]
                if live.size and (live.min() < 0 or live.max() >= cache.local_blocks):
                    raise RequestError(
                        f"chunk {i}: local block table refers to blocks outside 0..{cache.local_blocks - 1}"
                    )
                # The chunk writes its tokens' keys there, and its first query reads its window.
                lo = max(0, c.start_pos - max(self.spec.layer_windows) + 1) // bs
                if (local[lo:] == NO_BLOCK).any():
                    raise RequestError(f"chunk {i}: local block table has no block in the window it reads")
            ids = np.asarray(c.token_ids)
            if ids.min() < 0 or ids.max() >= vocab:
                raise RequestError(f"chunk {i}: token ids must be in 0..{vocab - 1}")

    def _prepare(
        self,
        chunks: list[SequenceChunk],
        cache: JaxKVCache,
        force_lora: LoraPlan | None = None,
        plan_only: bool = False,
    ) -> tuple[StepInputs, StepPlan, _Rows, LoraFactors | None]:
        """Inputs of one forward pass over ``chunks`` (one part of :func:`partition`): decoding
        tokens first, then each prompt chunk's, then padding up to the shape's token count.
        ``plan_only``: for compiling (a two-tier cache's slots are left as they are)."""
        bs, nb = cache.block_size, cache.num_blocks
        lens = [len(c.token_ids) for c in chunks]
        decode = [i for i, n in enumerate(lens) if n == 1]
        prefill = [i for i, n in enumerate(lens) if n > 1]
        shape = shape_of(lens)
        sd, sp, qb, t = shape.decode_seqs, shape.prefill_seqs, shape.prefill_len, shape.num_tokens
        # Real tokens first (decoding ones, then each prompt chunk's), padding after: the native
        # kernels skip the padding rows (``live_tokens``).
        starts = np.zeros(len(chunks), np.int64)
        for row, i in enumerate(decode):
            starts[i] = row
        nxt = len(decode)
        for i in prefill:
            starts[i] = nxt
            nxt += lens[i]
        native_step = self.native and (self.options.quantization == "w4a8" or t <= NATIVE_MAX_TOKENS)
        gathered = gathers_lora(native_step, t)
        if force_lora is not None:  # precompiling: the plan with every slot empty
            gathered = gathered and not force_lora.weighted
            lora_plan, lora = force_lora, self.adapters.padding(force_lora, gathered)
            lora_slot, lora_weight = np.full(t, -1, np.int32), None
            if force_lora.weighted:
                layers = (self.spec.num_layers, len(force_lora.projections)) if force_lora.weighted == 2 else ()
                lora_weight = np.zeros((*layers, t, force_lora.slots), np.float32)
        else:
            lora_plan, lora_slot, lora, lora_weight = plan_adapters(
                [c.adapter for c in chunks], lens, t, self.adapters, starts, gathered=gathered, fixed=self.fixed_lora
            )
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        write_block = np.full(t, nb, np.int32)
        write_offset = np.zeros(t, np.int32)
        hybrid = cache.local_blocks > 0
        local_write = np.full(t, cache.local_blocks, np.int32) if hybrid else None
        for c, s0, n in zip(chunks, starts, lens, strict=True):
            pos = c.start_pos + np.arange(n)
            tokens[s0 : s0 + n] = c.token_ids
            positions[s0 : s0 + n] = pos
            write_block[s0 : s0 + n] = np.asarray(c.block_table)[pos // bs]
            write_offset[s0 : s0 + n] = pos % bs
            if hybrid:
                local_write[s0 : s0 + n] = np.asarray(c.local_block_table)[pos // bs]

        # One table width for every step: the longest sequence served (attention loops over the
        # key chunks the contexts reach, so the width costs nothing).
        width = max(-(-self.table_tokens // bs), bucket(max(-(-c.end_pos // bs) for c in chunks)))

        def tables(idx: list[int], rows: int, local: bool = False) -> np.ndarray:
            out = np.zeros((rows, width), np.int32)
            for row, i in enumerate(idx):
                need = -(-chunks[i].end_pos // bs)
                out[row, :need] = (chunks[i].local_block_table if local else chunks[i].block_table)[:need]
            # Blocks released behind a window: any real block, never read (attention starts at the window).
            return np.where(out == NO_BLOCK, 0, out) if local else out

        decode_token = np.full(sd, t, np.int32)
        decode_context = np.zeros(sd, np.int32)
        for row, i in enumerate(decode):
            decode_token[row] = starts[i]
            decode_context[row] = chunks[i].end_pos
        prefill_token = np.full((sp, qb), t, np.int32)
        prefill_start = np.zeros(sp, np.int32)
        prefill_context = np.zeros(sp, np.int32)
        for row, i in enumerate(prefill):
            prefill_token[row, : lens[i]] = starts[i] + np.arange(lens[i])
            prefill_start[row] = chunks[i].start_pos
            prefill_context[row] = chunks[i].end_pos

        logit_rows = [int(starts[i]) + lens[i] - 1 for i in range(len(chunks))]
        rows = _Rows(last=np.arange(len(chunks)))
        for i, c in enumerate(chunks):
            if c.all_logits:
                rows.all_logits[i] = slice(len(logit_rows), len(logit_rows) + lens[i])
                logit_rows.extend(range(int(starts[i]), int(starts[i]) + lens[i]))
            if c.hidden_states:
                rows.hidden[i] = slice(int(starts[i]), int(starts[i]) + lens[i])
        # A step that returns every position's logits returns as many rows as the shape can need (one
        # per chunk and one per token): one such variant per shape, which precompile can compile.
        g = sd + sp if len(logit_rows) <= sd + sp else sd + sp + t
        logit_idx = np.zeros(g, np.int32)
        logit_idx[: len(logit_rows)] = logit_rows

        plan = StepPlan(
            num_tokens=t,
            decode_seqs=sd,
            decode_blocks=width,
            prefill_seqs=sp,
            prefill_len=qb,
            prefill_blocks=width,
            logit_rows=g,
            return_hidden=bool(rows.hidden),
            attention=self.attention,
            lora=lora_plan,
            native=native_step,
            unroll_layers=self.unroll_layers,
        )
        inputs = StepInputs(
            tokens=tokens,
            positions=positions,
            write_block=write_block,
            write_offset=write_offset,
            decode_token=decode_token,
            decode_tables=tables(decode, sd),
            decode_context=decode_context,
            prefill_token=prefill_token,
            prefill_tables=tables(prefill, sp),
            prefill_start=prefill_start,
            prefill_context=prefill_context,
            logit_rows=logit_idx,
            lora_slot=lora_slot,
            lora_weight=lora_weight,
            live_tokens=np.int32(sum(lens)),
            live_logits=np.int32(len(logit_rows)),
            local_write_block=local_write,
            decode_local_tables=tables(decode, sd, local=True) if hybrid else None,
            prefill_local_tables=tables(prefill, sp, local=True) if hybrid else None,
        )
        if cache.hot is not None:  # two tiers: which blocks each token writes and each row reads in float
            pools = [("", cache.hot, [c.block_table for c in chunks])]
            if hybrid:
                pools.append(("local_", cache.local_hot, [c.local_block_table for c in chunks]))
            hot = {}
            for prefix, slots, pool_tables in pools:
                write, (dec, pre) = hot_inputs(
                    slots,
                    pool_tables,
                    [c.start_pos for c in chunks],
                    [c.end_pos for c in chunks],
                    [int(x) for x in starts],
                    [(decode, sd), (prefill, sp)],
                    t,
                    width,
                    plan_only,
                )
                hot |= {
                    f"{prefix}hot_write": write,
                    f"decode_{prefix}hot_tables": dec,
                    f"prefill_{prefix}hot_tables": pre,
                }
            inputs = dataclasses.replace(inputs, **hot)
        if self.mesh.size > 1:
            inputs = jax.device_put(inputs, replicated(self.mesh))
        return inputs, plan, rows, lora

    # -- copy-on-write ---------------------------------------------------------------------------------
    def _copy_blocks(
        self, cache: JaxKVCache, copies: list[tuple[int, int]], local_copies: list[tuple[int, int]] = ()
    ) -> None:
        """Copy-on-write: one compiled copy for every pool (a hybrid cache's two, a two-tier cache's
        float slots), padded to one size."""
        pools = {"main": (copies, cache.num_blocks)}
        if cache.local_blocks:
            pools["local"] = (local_copies, cache.local_blocks)
        for pairs, blocks in pools.values():  # all checked before any slot moves
            pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
            if pairs.size and (pairs.min() < 0 or pairs.max() >= blocks):
                raise RequestError(f"block copy refers to blocks outside 0..{blocks - 1}")
        for name, (pairs, _) in list(pools.items()):
            slots = cache.hot if name == "main" else cache.local_hot
            if slots is not None:
                hot = [slots.copy(int(a), int(b)) for a, b in pairs]
                pools[f"{name}_hot"] = ([h for h in hot if h is not None], slots.slots)
        n = bucket(max(len(pairs) for pairs, _ in pools.values()))
        idx = {}
        for name, (pairs, blocks) in pools.items():
            pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
            src = np.zeros(n, np.int32)
            dst = np.full(n, blocks, np.int32)  # padding copies land out of range and are dropped
            src[: len(pairs)], dst[: len(pairs)] = pairs[:, 0], pairs[:, 1]
            idx[name] = (src, dst)
        cache.state = self._copy_fn(n, cache)(cache.state, idx)

    def _copy_fn(self, n: int, cache: JaxKVCache) -> Any:
        key = (n, *_cache_key(cache))
        fn = self._copy_fns.get(key)
        if fn is None:
            pair = (jax.ShapeDtypeStruct((n,), np.int32),) * 2
            names = ["main"] + (["local"] if cache.local_blocks else [])
            names += [f"{p}_hot" for p in names] if cache.hot is not None else []
            fn = jax.jit(_copy_blocks, donate_argnums=(0,)).lower(cache.state, dict.fromkeys(names, pair)).compile()
            self._copy_fns[key] = fn
        return fn


def _cache_key(cache: JaxKVCache) -> tuple:
    """What a compiled step or copy depends on in the cache."""
    hot = cache.hot.slots if cache.hot is not None else 0
    return cache.num_blocks, cache.local_blocks, hot, cache.block_size, cache.state.quantized, cache.state.k.dtype


def _to_host(a: jax.Array) -> np.ndarray:
    """A step's output on this host: across processes (a mesh spanning several), sharded outputs are
    gathered from all of them (every process runs this, as it runs the step)."""
    if a.is_fully_addressable or a.is_fully_replicated:
        return np.asarray(a)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def _merge_sampled(parts: list[tuple[list[int], SampledRows]], n: int) -> SampledRows:
    if len(parts) == 1 and parts[0][0] == list(range(n)):
        return parts[0][1]
    k = max(p.top_ids.shape[1] for _, p in parts)
    out = SampledRows(
        tokens=np.zeros(n, np.int32),
        logprobs=np.zeros(n, np.float32),
        top_ids=np.zeros((n, k), np.int32),
        top_logprobs=np.full((n, k), -np.inf, np.float32),
        finite=np.zeros(n, bool),
    )
    for idx, p in parts:
        out.tokens[idx], out.logprobs[idx], out.finite[idx] = p.tokens, p.logprobs, p.finite
        out.top_ids[idx, : p.top_ids.shape[1]] = p.top_ids
        out.top_logprobs[idx, : p.top_ids.shape[1]] = p.top_logprobs
    return out


@dataclass
class _Rows:
    """Where each chunk's results sit in the step's outputs."""

    last: np.ndarray
    all_logits: dict[int, slice] = field(default_factory=dict)
    hidden: dict[int, slice] = field(default_factory=dict)


def _copy_blocks(state: KVState, pairs: dict[str, tuple[jax.Array, jax.Array]]) -> KVState:
    """``state`` with whole blocks copied (src -> dst, padding dst past the end is dropped) in each
    pool ``pairs`` names: ``main``, ``local`` (a hybrid cache's windowed layers), ``main_hot`` and
    ``local_hot`` (a two-tier cache's float slots)."""

    def copy(a: jax.Array | None, idx: tuple[jax.Array, jax.Array] | None) -> jax.Array | None:
        if a is None or idx is None:
            return a
        src, dst = idx
        return a.at[:, dst].set(a[:, src], mode="drop")

    def pool(s: KVState, name: str) -> KVState:
        blocks, hot = pairs.get(name), pairs.get(f"{name}_hot")
        return dataclasses.replace(
            s,
            k=copy(s.k, blocks),
            v=copy(s.v, blocks),
            k_scale=copy(s.k_scale, blocks),
            v_scale=copy(s.v_scale, blocks),
            hot_k=copy(s.hot_k, hot),
            hot_v=copy(s.hot_v, hot),
        )

    local = None if state.local is None else pool(state.local, "local")
    return dataclasses.replace(pool(state, "main"), local=local)
