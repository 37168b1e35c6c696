"""The host side of the backend: turns a core :class:`ForwardBatch` into padded int32 arrays, picks
the compiled step for their shape bucket (compiling it the first time) and unpacks the results."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np
import structlog

from ruvllm.backend import ForwardBatch, ForwardOutput, LoadOptions, SequenceChunk
from ruvllm.checkpoint import Checkpoint
from ruvllm.errors import BackendError, RequestError
from ruvllm_jax import native
from ruvllm_jax.gguf_blocks import WXA8_GGUF_TYPES
from ruvllm_jax.loading import DTYPES, WeightLoader
from ruvllm_jax.lora import ADAPTER_CACHE_SIZE, AdapterCache, plan_adapters
from ruvllm_jax.model import KVState, LoraFactors, ModelSpec, StepInputs, StepPlan, Weights, bucket, forward_step
from ruvllm_jax.quant import QUANTIZATIONS, weight_nbytes
from ruvllm_jax.sharding import empty_cache, make_mesh, replicated, shard_weights

log = structlog.get_logger("ruvllm_jax")

ATTENTION_IMPLS = ("reference", "pallas", "pallas_interpret")
#: Block tables are padded to cover at least this many tokens, so that short contexts do not each
#: compile their own step (attention over a few masked extra blocks costs little).
MIN_TABLE_TOKENS = 128
_KNOWN_EXTRA = {"tensor_parallel", "attention", "keep_gguf_blocks", "native", "threads"}
#: w8a8 steps of at most this many (padded) tokens use the native kernels when they are loaded;
#: larger ones use XLA's integer GEMM, which reuses each weight load across more rows. (w4a8 steps
#: always use the native kernels on CPU: XLA has no fast form of the grouped product.)
NATIVE_MAX_TOKENS = 4


def enable_compilation_cache() -> Path | None:
    """Keep compiled steps on disk so a restarted server does not compile its shapes again: XLA
    compiles each step in 1-4 s on CPU and loads it from this cache in a fraction of that.

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
    # Steps take over a second to compile; smaller programs are not worth the disk.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
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


def on_cuda() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and "cuda" in str(getattr(dev.client, "platform_version", "")).lower()


@dataclass
class JaxKVCache:
    """The paged KV cache of one model. ``state`` is replaced after every step: the step donates the
    old buffers and updates them in place."""

    state: KVState
    num_blocks: int
    block_size: int

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
    #: Device copies of the adapters (LoRA factors) recent steps used.
    adapters: AdapterCache = field(init=False, repr=False)
    #: Whether small steps run the w8a8 products in :mod:`ruvllm_jax.native`'s kernels.
    native: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.native = self._want_native()
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
        attention = str(options.extra.get("attention", "pallas" if on_cuda() else "reference"))
        if attention not in ATTENTION_IMPLS:
            raise BackendError(f"jax backend: unknown attention {attention!r} (known: {', '.join(ATTENTION_IMPLS)})")
        if attention == "pallas" and not on_cuda():
            raise BackendError(
                "jax backend: attention='pallas' needs a CUDA device (use 'pallas_interpret' to test on CPU)"
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
        log.info(
            "weights loaded",
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

    @property
    def compiled_buckets(self) -> int:
        """How many step shapes have been compiled so far (steady state stops this growing)."""
        return len(self._compiled)

    def kv_block_bytes(self, block_size: int) -> int:
        """Keys and values of every layer for ``block_size`` tokens, in the cache's dtype."""
        s = self.spec
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * block_size * np.dtype(DTYPES[s.dtype]).itemsize

    def allocate_cache(self, num_blocks: int, block_size: int, options: dict[str, Any] | None = None) -> JaxKVCache:
        if options:
            raise BackendError(f"jax backend: unknown KV cache option(s) {', '.join(sorted(options))}")
        if num_blocks < 1 or block_size < 1:
            raise BackendError(f"KV cache needs at least one block of one token (got {num_blocks} x {block_size})")
        state = empty_cache(self.spec, self.mesh, num_blocks, block_size, DTYPES[self.spec.dtype])
        return JaxKVCache(state, num_blocks, block_size)

    # -- one step --------------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, cache: JaxKVCache) -> ForwardOutput:
        if not isinstance(cache, JaxKVCache):
            raise BackendError(f"jax backend: the cache is a {type(cache).__name__}, not one this backend allocated")
        if batch.block_size != cache.block_size:
            raise BackendError(f"batch block size {batch.block_size} differs from the cache's {cache.block_size}")
        if batch.block_copies:
            self._copy_blocks(cache, batch.block_copies)
        chunks = batch.chunks
        if not chunks:
            return ForwardOutput(np.zeros((0, self.spec.vocab_size), np.float32))
        inputs, plan, rows, lora = self._prepare(chunks, cache)
        step = self._step_for(plan, cache, inputs, lora)
        logits, hidden, cache.state = step(self.weights, cache.state, inputs, lora)
        logits = np.asarray(logits)
        out = ForwardOutput(np.ascontiguousarray(logits[rows.last]))
        for i, sl in rows.all_logits.items():
            out.all_logits[i] = np.ascontiguousarray(logits[sl])
        if hidden is not None:
            hidden = np.asarray(hidden)
            for i, sl in rows.hidden.items():
                out.hidden_states[i] = np.ascontiguousarray(hidden[sl])
        return out

    def _step_for(self, plan: StepPlan, cache: JaxKVCache, inputs: StepInputs, lora: LoraFactors | None):
        key = (plan, cache.num_blocks, cache.block_size)
        step = self._compiled.get(key)
        if step is None:
            t0 = time.perf_counter()
            fn = jax.jit(partial(forward_step, spec=self.spec, plan=plan), donate_argnums=(1,))
            step = fn.lower(self.weights, cache.state, inputs, lora).compile()
            self._compiled[key] = step
            log.info(
                "step compiled", plan=plan, seconds=round(time.perf_counter() - t0, 2), buckets=len(self._compiled)
            )
        return step

    def _prepare(
        self, chunks: list[SequenceChunk], cache: JaxKVCache
    ) -> tuple[StepInputs, StepPlan, _Rows, LoraFactors | None]:
        bs, nb = cache.block_size, cache.num_blocks
        vocab = self.spec.vocab_size
        lens = [len(c.token_ids) for c in chunks]
        for i, (c, n) in enumerate(zip(chunks, lens, strict=False)):
            if n == 0:
                raise RequestError(f"chunk {i} has no tokens")
            if c.start_pos < 0:
                raise RequestError(f"chunk {i}: start_pos {c.start_pos} is negative")
            need = -(-c.end_pos // bs)
            if len(c.block_table) < need:
                raise RequestError(f"chunk {i}: {len(c.block_table)} blocks cannot hold positions up to {c.end_pos}")
            table = np.asarray(c.block_table[:need])
            if table.size and (table.min() < 0 or table.max() >= nb):
                raise RequestError(f"chunk {i}: block table refers to blocks outside 0..{nb - 1}")
            ids = np.asarray(c.token_ids)
            if ids.min() < 0 or ids.max() >= vocab:
                raise RequestError(f"chunk {i}: token ids must be in 0..{vocab - 1}")

        total = sum(lens)
        t = bucket(total)
        lora_plan, lora_slot, lora = plan_adapters([c.adapter for c in chunks], lens, t, self.adapters)
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        write_block = np.full(t, nb, np.int32)
        write_offset = np.zeros(t, np.int32)
        starts = np.cumsum([0, *lens[:-1]])
        for c, s, n in zip(chunks, starts, lens, strict=False):
            pos = c.start_pos + np.arange(n)
            tokens[s : s + n] = c.token_ids
            positions[s : s + n] = pos
            write_block[s : s + n] = np.asarray(c.block_table)[pos // bs]
            write_offset[s : s + n] = pos % bs

        decode = [i for i, n in enumerate(lens) if n == 1]
        prefill = [i for i, n in enumerate(lens) if n > 1]

        def tables(idx: list[int], width: int) -> np.ndarray:
            out = np.zeros((bucket(len(idx)) if idx else 0, width), np.int32)
            for row, i in enumerate(idx):
                need = -(-chunks[i].end_pos // bs)
                out[row, :need] = chunks[i].block_table[:need]
            return out

        def width(idx: list[int]) -> int:
            # At least MIN_TABLE_TOKENS of context: short sequences share one compiled shape.
            if not idx:
                return 1
            return max(bucket(max(-(-chunks[i].end_pos // bs) for i in idx)), -(-MIN_TABLE_TOKENS // bs))

        sd = bucket(len(decode)) if decode else 0
        decode_token = np.full(sd, t, np.int32)
        decode_context = np.zeros(sd, np.int32)
        for row, i in enumerate(decode):
            decode_token[row] = starts[i]
            decode_context[row] = chunks[i].end_pos
        sp = bucket(len(prefill)) if prefill else 0
        qb = bucket(max(lens[i] for i in prefill)) if prefill else 1
        prefill_token = np.full((sp, qb), t, np.int32)
        prefill_start = np.zeros(sp, np.int32)
        prefill_context = np.zeros(sp, np.int32)
        for row, i in enumerate(prefill):
            prefill_token[row, : lens[i]] = starts[i] + np.arange(lens[i])
            prefill_start[row] = chunks[i].start_pos
            prefill_context[row] = chunks[i].end_pos

        rows = _Rows(last=np.asarray(starts) + np.asarray(lens) - 1)
        logit_rows = list(rows.last)
        for i, c in enumerate(chunks):
            if c.all_logits:
                rows.all_logits[i] = slice(len(logit_rows), len(logit_rows) + lens[i])
                logit_rows.extend(range(starts[i], starts[i] + lens[i]))
            if c.hidden_states:
                rows.hidden[i] = slice(int(starts[i]), int(starts[i]) + lens[i])
        rows.last = np.arange(len(chunks))
        g = bucket(len(logit_rows))
        logit_idx = np.zeros(g, np.int32)
        logit_idx[: len(logit_rows)] = logit_rows

        plan = StepPlan(
            num_tokens=t,
            decode_seqs=sd,
            decode_blocks=width(decode),
            prefill_seqs=sp,
            prefill_len=qb,
            prefill_blocks=width(prefill),
            logit_rows=g,
            return_hidden=bool(rows.hidden),
            attention=self.attention,
            lora=lora_plan,
            native=self.native and (self.options.quantization == "w4a8" or t <= NATIVE_MAX_TOKENS),
        )
        inputs = StepInputs(
            tokens=tokens,
            positions=positions,
            write_block=write_block,
            write_offset=write_offset,
            decode_token=decode_token,
            decode_tables=tables(decode, plan.decode_blocks),
            decode_context=decode_context,
            prefill_token=prefill_token,
            prefill_tables=tables(prefill, plan.prefill_blocks),
            prefill_start=prefill_start,
            prefill_context=prefill_context,
            logit_rows=logit_idx,
            lora_slot=lora_slot,
        )
        if self.mesh.size > 1:
            inputs = jax.device_put(inputs, replicated(self.mesh))
        return inputs, plan, rows, lora

    # -- copy-on-write ---------------------------------------------------------------------------------
    def _copy_blocks(self, cache: JaxKVCache, copies: list[tuple[int, int]]) -> None:
        pairs = np.asarray(copies, np.int64).reshape(-1, 2)
        if pairs.size and (pairs.min() < 0 or pairs.max() >= cache.num_blocks):
            raise RequestError(f"block copy refers to blocks outside 0..{cache.num_blocks - 1}")
        n = bucket(len(pairs))
        src = np.zeros(n, np.int32)
        dst = np.full(n, cache.num_blocks, np.int32)  # padding copies land out of range and are dropped
        src[: len(pairs)], dst[: len(pairs)] = pairs[:, 0], pairs[:, 1]
        key = (n, cache.num_blocks, cache.block_size)
        fn = self._copy_fns.get(key)
        if fn is None:
            fn = jax.jit(_copy_blocks, donate_argnums=(0,))
            self._copy_fns[key] = fn
        cache.state = fn(cache.state, src, dst)


@dataclass
class _Rows:
    """Where each chunk's results sit in the step's outputs."""

    last: np.ndarray
    all_logits: dict[int, slice] = field(default_factory=dict)
    hidden: dict[int, slice] = field(default_factory=dict)


def _copy_blocks(state: KVState, src: jax.Array, dst: jax.Array) -> KVState:
    return KVState(
        state.k.at[:, dst].set(state.k[:, src], mode="drop"),
        state.v.at[:, dst].set(state.v[:, src], mode="drop"),
    )
