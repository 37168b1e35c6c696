"""What core and backends exchange: the backend and model protocols, load options, one forward
step's batch.

A plugin registers :class:`Backend` objects (hook ``register_backends``); core picks one, calls its
:meth:`Backend.load` once and then calls the returned :class:`BackendModel`'s methods directly, every
step, with no plugin dispatch in between.

The engine speaks block ids and token ids; backends own the tensors. A forward step gets a ragged
batch of sequence chunks. Each chunk carries the new tokens of one sequence, how many of its tokens
are already in the KV cache (``start_pos``) and its block table; the backend writes the chunk's keys
and values into the cache slots ``start_pos .. start_pos + len(token_ids)`` (slot ``p`` lives in block
``block_table[p // block_size]`` at offset ``p % block_size``) and attends over positions
``0 .. start_pos + len(token_ids)`` only. Nothing outside those positions is ever read, so what an
earlier request left in a reused block cannot leak into a later one. A chunk may carry an adapter
(:class:`LoraAdapter`) that the backend applies to that sequence's tokens only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from ruvllm.errors import BackendError
from ruvllm.modeling import PROJECTIONS

if TYPE_CHECKING:
    from ruvllm.checkpoint import Checkpoint
    from ruvllm.model_config import ModelConfig


@dataclass(frozen=True)
class LoadOptions:
    #: ``none`` keeps the checkpoint's precision; ``q8`` / ``q4`` quantize weights at load (RTN);
    #: ``auto`` lets the backend pick its fastest form that keeps the checkpoint's weights (backends
    #: without such a form treat it as ``none``). Others are backend-specific (see each backend).
    quantization: str = "none"
    #: Compute dtype (``float32``, ``bfloat16``, ``float16``; backends refuse what they cannot do, by
    #: name); ``auto``: the backend's choice for its device (bfloat16 on GPUs, float32 on CPUs).
    dtype: str = "float32"
    #: Backend-specific extras (thread counts, device, tensor-parallel size, ...).
    extra: dict[str, Any] = field(default_factory=dict)
    #: Adapters a backend keeps on its device at once (least recently used ones are dropped and
    #: uploaded again when next used); None: the backend's default. Host backends have no device
    #: copies and ignore it.
    max_adapters: int | None = None


#: What ``LoadOptions.dtype`` (``--dtype``) may name; a backend runs some of the concrete ones.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")

#: Projections an adapter may adapt, in Hugging Face naming (:data:`ruvllm.modeling.PROJECTIONS`).
LORA_PROJECTIONS = PROJECTIONS

#: Block-table entry (``SequenceChunk.local_block_table``) of a block the sequence no longer holds: it
#: fell out of the sliding window. Backends never read through it.
NO_BLOCK = -1


def kv_block_bytes(config: ModelConfig, block_size: int, bytes_per_value: int = 4) -> int:
    """Bytes of keys plus values of one block across all layers, stored densely with
    ``bytes_per_value`` bytes each (float32 unless told): what a backend keeping plain floats reports
    from :meth:`BackendModel.kv_block_bytes`, and the engine's size when none is given."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * block_size * bytes_per_value


class LoraAdapter(Protocol):
    """What a plugin attaches to a sequence as ``SequenceChunk.adapter`` (SONA's ``SonaAdapter``).

    Projection ``proj`` (one of :data:`LORA_PROJECTIONS`) of decoder layer ``layer`` computes
    ``x @ W.T + bias + scale * (x @ A.T) @ B.T`` for that sequence's tokens (the update is added after
    the bias). Backends read an adapter in one of two ways, so one meant to run on every backend
    provides both:

    * :meth:`delta`: host backends (NumPy, candle-compat) ask per projection;
    * :meth:`lora_params`: device backends (jax) take all factors at once and apply them in their
      compiled step.

    An adapter is an immutable snapshot: device backends keep what they uploaded per adapter object
    (and its ``version`` attribute, where it has one), so a changed adapter must be a new object. An
    adapter whose ``lora_params()`` is empty (and whose ``delta`` always returns None) is a no-op:
    backends then run exactly the step they run without it. A backend raises ``BackendError`` for an
    adapter it cannot apply (missing method, a layer or projection the model lacks, wrong shapes).
    """

    def delta(self, layer: int, proj: str, x: np.ndarray) -> np.ndarray | None:
        """The ``[n, out]`` float32 update for input rows ``x`` ``[n, in]``, or None for none."""
        ...

    def lora_params(self) -> Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]:
        """``(layer, proj) -> (A [r, in], B [out, r], scale)``; entries that add nothing may be left out."""
        ...


@dataclass
class SequenceChunk:
    """New tokens of one sequence in a forward step."""

    token_ids: np.ndarray  # int32 [n]
    start_pos: int
    block_table: np.ndarray  # int32 [num_blocks_of_this_sequence]
    #: Return logits for every new token (prompt logprobs, perplexity), not only the last one.
    all_logits: bool = False
    #: Return final-norm hidden states for every new token (embeddings, SONA's ReasoningBank).
    hidden_states: bool = False
    #: A :class:`LoraAdapter` a plugin attached to this sequence (SONA's MicroLoRA), or None.
    adapter: Any = None
    #: Hybrid KV cache (``Capabilities.hybrid_kv``, a model interleaving windowed and global layers):
    #: the sequence's table in the windowed layers' own block pool (entries before the window point
    #: at block 0 and are never read); ``block_table`` then serves the global layers only. None:
    #: every layer reads ``block_table``.
    local_block_table: np.ndarray | None = None
    #: A speculative draft's verification (the sequence's next token, then the draft): its positions
    #: may each be computed as a decoding token is (a backend whose prompt path sums in another order
    #: than its decode path then gives the token-at-a-time numbers). Asks for ``all_logits`` too.
    verify: bool = False

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class AdapterLimits:
    """What adapters steps may carry, declared before traffic by whoever attaches them (SONA, the
    server's ``--lora``), so a backend that compiles per shape can compile the adapter variants of
    its steps beforehand (one per shape: slots, rank and projections padded to these bounds)."""

    #: Largest adapter rank.
    max_rank: int
    #: Projections (of :data:`LORA_PROJECTIONS`) any adapter adapts.
    projections: tuple[str, ...]
    #: Most distinct adapters in one step; None: one per sequence (``max_num_seqs``).
    per_step: int | None = None
    #: Steps may carry adapter mixes (X-LoRA, :class:`ruvllm.adapters.AdapterMix`): 0 none, 1 with
    #: weights per token, 2 per token and module (layerwise scalings). Their scaling passes ask for
    #: hidden states.
    mixes: int = 0

    def __post_init__(self) -> None:
        if self.max_rank < 1:
            raise ValueError(f"AdapterLimits.max_rank must be positive, got {self.max_rank}")
        unknown = [p for p in self.projections if p not in LORA_PROJECTIONS]
        if unknown or not self.projections:
            raise ValueError(f"AdapterLimits.projections must be some of {LORA_PROJECTIONS}, got {self.projections}")
        if self.per_step is not None and self.per_step < 1:
            raise ValueError(f"AdapterLimits.per_step must be positive or None, got {self.per_step}")
        if self.mixes not in (0, 1, 2):
            raise ValueError(f"AdapterLimits.mixes must be 0, 1 or 2, got {self.mixes}")

    def merge(self, other: AdapterLimits | None) -> AdapterLimits:
        """Bounds that cover both (the larger rank, every projection, the sum of adapters per step,
        the finer mixes)."""
        if other is None:
            return self
        per_step = None if self.per_step is None or other.per_step is None else self.per_step + other.per_step
        projections = tuple(p for p in LORA_PROJECTIONS if p in self.projections or p in other.projections)
        return AdapterLimits(max(self.max_rank, other.max_rank), projections, per_step, max(self.mixes, other.mixes))


@dataclass(frozen=True)
class StepLimits:
    """Bounds every step the engine schedules stays within; a backend that compiles per shape
    compiles all the shapes such steps need before traffic (the ``precompile`` hook)."""

    #: Chunks (sequences) in one step.
    max_num_seqs: int
    #: Tokens in one step, all chunks together.
    max_num_batched_tokens: int
    #: Longest sequence (prompt plus output) in tokens.
    max_model_len: int
    #: Steps may ask for final hidden states (a plugin routes on them, see
    #: ``InferenceRequest.adapter_router``): compile those variants of every shape too.
    hidden_states: bool = False
    #: Steps may carry adapters within these bounds: compile those variants of every shape too.
    adapters: AdapterLimits | None = None
    #: Steps may ask for device sampling (``ForwardBatch.sampling``): compile its functions too.
    device_sampling: bool = False
    #: Steps may ask for every position's logits (``SequenceChunk.all_logits``: prompt logprobs,
    #: echo): compile those variants of every shape too.
    all_logits: bool = False
    #: Draft tokens one step may carry beside its ``max_num_seqs`` chunks (speculative decoding's
    #: verification chunks, ``SequenceChunk.verify``); 0: none.
    draft_tokens: int = 0


@dataclass
class DeviceSampling:
    """Sampling a backend with ``Capabilities.device_sampling`` runs on its device, after the step,
    on each chunk's last-position logits: only the tokens (and log-probabilities) come back to the
    host. Built by :func:`ruvllm.sampling.device_sampling` from the host samplers' state; one row per
    chunk, in chunk order. The host sampler (:class:`ruvllm.sampling.Sampler`) is the reference.

    Per row, with ``x`` the raw logits: every overlay entry ``(id, rep, add)`` replaces ``x[id]`` by
    ``(rep ? (x[id] > 0 ? x[id] / repetition_penalty : x[id] * repetition_penalty) : x[id]) + add``
    (repetition, presence and frequency penalties, logit bias, ``-inf`` for banned tokens; entries
    with ``id == vocab`` are padding); tokens whose bit in ``allowed`` is 0 become ``-inf``. Then
    ``greedy`` rows take the first argmax. Other rows divide by ``temperature``; rows without top_k,
    top_p or min_p draw over the whole vocabulary in id order, the others over the kept candidates
    in canonical order (adjusted logit descending, id ascending: top_k first, then top_p over the
    renormalised top_k, then min_p), by inverting the CDF at ``uniform * total``."""

    greedy: np.ndarray  # bool [B]
    temperature: np.ndarray  # float32 [B] (1 for greedy rows)
    top_k: np.ndarray  # int32 [B], 0 = off
    top_p: np.ndarray  # float32 [B]
    min_p: np.ndarray  # float32 [B]
    repetition_penalty: np.ndarray  # float32 [B]
    #: The row's draw in [0, 1), from the request's seeded generator (0 for greedy rows).
    uniform: np.ndarray  # float32 [B]
    overlay_ids: np.ndarray  # int32 [B, W]
    overlay_rep: np.ndarray  # bool [B, W]
    overlay_add: np.ndarray  # float32 [B, W]
    #: Allowed tokens as little-endian bits (``np.packbits(..., bitorder="little")``), uint8
    #: ``[B, ceil(vocab / 8)]``; None: every token (no row has a constraint).
    allowed: np.ndarray | None = None
    #: Top log-probabilities any row asked for (0..20).
    top_logprobs: int = 0

    def rows(self, index: list[int]) -> DeviceSampling:
        """The rows ``index`` (a part of the batch the engine retries alone)."""
        take = np.asarray(index, np.int64)
        return DeviceSampling(
            **{
                name: getattr(self, name)[take]
                for name in (
                    "greedy",
                    "temperature",
                    "top_k",
                    "top_p",
                    "min_p",
                    "repetition_penalty",
                    "uniform",
                    "overlay_ids",
                    "overlay_rep",
                    "overlay_add",
                )
            },
            allowed=None if self.allowed is None else self.allowed[take],
            top_logprobs=self.top_logprobs,
        )


@dataclass
class SampledRows:
    """What device sampling returns, one row per chunk."""

    tokens: np.ndarray  # int32 [B]
    #: log-softmax of the raw logits at the token.
    logprobs: np.ndarray  # float32 [B]
    #: The ``DeviceSampling.top_logprobs`` most likely tokens under the raw logits, most likely first.
    top_ids: np.ndarray  # int32 [B, K]
    top_logprobs: np.ndarray  # float32 [B, K]
    #: Whether every raw logit of the row was finite (a row that was not has no valid token).
    finite: np.ndarray  # bool [B]


@dataclass
class ForwardBatch:
    chunks: list[SequenceChunk]
    block_size: int
    #: Whole-block copies ``(src, dst)`` the backend applies to every layer's keys and values, in
    #: order, before running the step (copy-on-write of blocks that sequences shared).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    #: The same for the windowed layers' pool of a hybrid KV cache.
    local_block_copies: list[tuple[int, int]] = field(default_factory=list)
    #: Sample on the device (only for backends with ``Capabilities.device_sampling``): the output's
    #: ``sampled`` holds the tokens and its ``logits`` may be empty.
    sampling: DeviceSampling | None = None


@dataclass
class ForwardOutput:
    #: float32 ``[len(chunks), vocab]``: logits at the last new position of each chunk. A backend may
    #: return a read-only view of its step's output here (no copy); consumers copy before editing.
    logits: np.ndarray
    #: chunk index -> float32 ``[n, vocab]`` for chunks that asked for ``all_logits``.
    all_logits: dict[int, np.ndarray] = field(default_factory=dict)
    #: chunk index -> float32 ``[n, hidden]`` for chunks that asked for ``hidden_states``.
    hidden_states: dict[int, np.ndarray] = field(default_factory=dict)
    #: The tokens device sampling picked, when the batch asked for it.
    sampled: SampledRows | None = None


@dataclass(frozen=True)
class Capabilities:
    """What a loaded model can do; core and the server check requests against it instead of finding
    out from a failed step."""

    #: Compute dtypes the backend runs (``LoadOptions.dtype`` values it accepts).
    dtypes: tuple[str, ...] = ("float32",)
    #: ``LoadOptions.quantization`` values it accepts (``auto`` included where it resolves them).
    quantizations: tuple[str, ...] = ("none",)
    #: Applies ``SequenceChunk.adapter`` (LoRA) per sequence; False: it refuses them.
    adapters: bool = False
    #: Applies an :class:`ruvllm.adapters.AdapterMix` as ``SequenceChunk.adapter`` (several adapters,
    #: weighted per token: X-LoRA); False: the engine refuses X-LoRA requests.
    adapter_mix: bool = False
    #: Fills ``ForwardOutput.hidden_states`` when ``ForwardBatch.return_hidden`` asks.
    hidden_states: bool = False
    #: Fills ``ForwardOutput.all_logits`` when ``ForwardBatch.all_logits`` asks.
    all_logits: bool = False
    #: Most sequences one step may carry; None: no limit of its own.
    max_batch: int | None = None
    #: Samples on its device when ``ForwardBatch.sampling`` asks (see :class:`DeviceSampling`).
    device_sampling: bool = False
    #: The engine's ``sampling="auto"`` picks device sampling (where the logits' trip to the host
    #: costs more than sampling there: GPUs).
    prefers_device_sampling: bool = False
    #: Keeps the windowed layers of a model that interleaves windowed and global layers in a block
    #: pool of their own (kv_cache option ``local_blocks``: its size), read through
    #: ``SequenceChunk.local_block_table``; blocks out of the window are then freed for those layers.
    #: False: the engine gives every layer every block.
    hybrid_kv: bool = False


#: The methods every :class:`BackendModel` has (checked when a backend loads one).
BACKEND_MODEL_METHODS = ("kv_cache", "kv_block_bytes", "precompile", "forward")


@runtime_checkable
class BackendModel(Protocol):
    """A checkpoint loaded by a backend. Core calls these methods directly; ``forward`` may be called
    from two threads at once (the engine's and, with SONA, its learning loop's)."""

    #: What this model can do (see :class:`Capabilities`).
    capabilities: Capabilities
    #: The options as applied (``quantization="auto"`` resolved to the form that was loaded).
    options: LoadOptions

    def kv_cache(self, num_blocks: int, block_size: int, options: dict[str, Any]) -> Any:
        """Allocate paged KV storage of ``num_blocks`` blocks of ``block_size`` tokens; refuse
        ``options`` you do not know with :class:`ruvllm.errors.BackendError`, by name."""
        ...

    def kv_block_bytes(self, block_size: int, options: dict[str, Any]) -> int:
        """Bytes one block of the cache :meth:`kv_cache` allocates with ``options`` takes (the engine
        sizes the cache from it). A cache that also holds a fixed part (the JAX backend's two-tier
        float slots) says so through :class:`ReservesKV`."""
        ...

    def precompile(
        self, cache: Any, limits: StepLimits, progress: Callable[[int, int, str, float], None]
    ) -> list[tuple[str, float]]:
        """Compile, before traffic, every step shape steps within ``limits`` need on ``cache``,
        calling ``progress(done, total, shape, seconds)`` after each; return each shape's name and
        compile seconds. Backends that compile nothing return []."""
        ...

    def forward(self, batch: ForwardBatch, cache: Any) -> ForwardOutput:
        """Run one step over a ragged ``batch``, reading and writing ``cache`` (see the module doc)."""
        ...


# -- optional features of a BackendModel ---------------------------------------------------------------
# A model has these or not; core checks with ``isinstance(model, ReservesKV)`` (never by probing names)
# and a model without one gets the default each documents.


@runtime_checkable
class ReservesKV(Protocol):
    """A KV cache that holds a fixed part besides its blocks (the JAX backend's two-tier float slots).
    Without it: nothing reserved, no extra options."""

    def kv_reserve(self, block_size: int, options: dict[str, Any], max_num_seqs: int) -> tuple[int, dict[str, Any]]:
        """Bytes a cache of ``options`` holds besides its blocks for an engine of ``max_num_seqs``
        sequences, and the extra options :meth:`BackendModel.kv_cache` then takes: the engine takes
        the bytes off its budget before counting blocks."""
        ...


@runtime_checkable
class ReportsHealth(Protocol):
    """A model that can stop being able to run steps (a process of its group is gone). Without it:
    always healthy."""

    def health(self) -> str | None:
        """Why the model can no longer run steps, or None."""
        ...


@runtime_checkable
class ReportsDeviceMemory(Protocol):
    """A model on a device with memory of its own (a GPU). Without it: the host's memory, which the
    server sizes the KV cache from by its own default."""

    def device_memory(self) -> tuple[int, int] | None:
        """``(bytes the model's devices may hold, bytes in use now)``, or None where they say none."""
        ...


@runtime_checkable
class ReportsWeightBytes(Protocol):
    """A model that knows what its weights occupy (reported by ``ruvllm benchmark``). Without it:
    not reported."""

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights occupy where they run."""
        ...


@runtime_checkable
class RewritesKVPositions(Protocol):
    """A KV cache whose positions past a sequence's end may be written and later written again, the
    cache then holding what it would had the first writes never happened (the engine drops a
    speculative draft's refused positions so: it gives back the block table's tail and writes the
    positions again). Without it: the engine refuses speculative decoding."""

    def kv_rewrites_positions(self, cache: Any) -> bool:
        """Whether ``cache`` (as :meth:`BackendModel.kv_cache` allocated it) is such a cache."""
        ...


@runtime_checkable
class RestrictsHead(Protocol):
    """A model whose output projection can be cut to some tokens' rows: its logits then have one
    column per kept token, in the order given (a draft model drafting over its most frequent tokens,
    the target still verifying over the whole vocabulary). Without it: a reduced draft vocabulary is
    refused."""

    def restrict_head(self, token_ids: np.ndarray) -> None:
        """Keep the output rows of ``token_ids`` (int ``[n]``, distinct) only, from now on."""
        ...


class PreparedStep(Protocol):
    """A step of decoding chunks (one token each) built before its tokens are known
    (:class:`PreparesSteps`)."""

    def launch(self, tokens: np.ndarray) -> Callable[[], ForwardOutput]:
        """Start the step with chunk ``i``'s token ``tokens[i]`` (int32 ``[len(chunks)]``) and return at
        once, the step still running; calling what it returns waits for the step's output. Call it once,
        and launch the next step on the cache only after this one's output was asked for."""
        ...


@runtime_checkable
class PreparesSteps(Protocol):
    """A model whose steps run asynchronously on their device, so the engine can build step N+1 (its
    schedule, block tables and inputs) while step N runs and hand it step N's tokens once sampled.
    Without it: every step runs as :meth:`BackendModel.forward` does."""

    def prepare_step(self, batch: ForwardBatch, cache: Any) -> PreparedStep | None:
        """``batch`` (decoding chunks of one token each, their token ids not yet known) ready to
        launch on ``cache``; None for a batch this model runs through :meth:`BackendModel.forward` only
        (block copies, device sampling, adapters, all-position logits or hidden states, several parts)."""
        ...


#: The optional features, for documentation and conformance checks.
OPTIONAL_MODEL_FEATURES: tuple[type, ...] = (
    ReservesKV,
    ReportsHealth,
    ReportsDeviceMemory,
    ReportsWeightBytes,
    RewritesKVPositions,
    RestrictsHead,
    PreparesSteps,
)


@runtime_checkable
class ExplainsUnavailable(Protocol):
    """A backend that can say why it cannot run here (a library missing, no device). Without it, the
    error names the backend only."""

    def unavailable_reason(self) -> str | None:
        """Why :meth:`Backend.available` is false on this machine, in one line, or None."""
        ...


class Backend(Protocol):
    """What ``register_backends`` registers. Subclass it to inherit the defaults of ``priority``,
    :meth:`available` and :meth:`describe`, or provide the same attributes on any object."""

    #: The name users pick it by (``--backend``, ``RUVLLM_BACKEND``).
    name: str
    #: One line for ``ruvllm info``.
    description: str
    #: Higher wins when the user names no backend (among those :meth:`available` here).
    priority: int = 0

    def available(self) -> bool:
        """Can it run on this machine (its libraries import, its device exists)?"""
        return True

    def describe(self, checkpoint: Checkpoint) -> list[tuple[str, str]]:
        """``(label, value)`` rows ``ruvllm info`` prints for this backend, this machine and a
        checkpoint (what ``quantization="auto"`` resolves to, which kernels run...)."""
        return []

    def load(self, checkpoint: Checkpoint, options: LoadOptions) -> BackendModel:
        """Load ``checkpoint``: raise :class:`ruvllm.errors.BackendError` (or a
        :class:`ruvllm.errors.RuvllmError`) naming what you cannot do: an architecture, a dtype, a
        quantization, an option in ``options.extra``."""
        ...


def chunk_block_table(
    idx: int, chunk: SequenceChunk, *, local: bool, block_size: int, max_positions: int
) -> np.ndarray:
    """The block table ``chunk`` (the step's chunk ``idx``) addresses its pool with, int64: its
    ``local_block_table`` for a hybrid cache's windowed pool (``local``), else its ``block_table``.
    A chunk without tokens, starting before 0, reaching past ``max_positions`` or past its table is
    a :class:`~ruvllm.errors.RequestError` naming it; block ids are the backend's to check."""
    from ruvllm.errors import RequestError

    n, start, end = len(chunk.token_ids), chunk.start_pos, chunk.end_pos
    if local and chunk.local_block_table is None:
        raise RequestError(f"chunk {idx} has no local_block_table for the hybrid cache's windowed layers")
    table = np.asarray(chunk.local_block_table if local else chunk.block_table, dtype=np.int64)
    if n == 0:
        raise RequestError(f"chunk {idx} has no tokens")
    if start < 0:
        raise RequestError(f"chunk {idx} has negative start_pos {start}")
    if end > max_positions:
        raise RequestError(f"chunk {idx} reaches position {end}, beyond the model's context of {max_positions}")
    if end > len(table) * block_size:
        raise RequestError(
            f"chunk {idx} reaches position {end} but its block table holds {len(table)} blocks "
            f"of {block_size} ({len(table) * block_size} slots)"
        )
    return table


#: ``LoadOptions.extra`` keys with a flag of their own (``--threads``, ``--device``, ``--tensor-parallel``,
#: a group's ``--coordinator`` / ``--num-processes``): ``--backend-option`` refuses them by name.
OPTIONS_WITH_FLAGS = frozenset({"threads", "device", "tensor_parallel", "coordinator", "num_processes"})


def parse_backend_options(items: Iterable[str] | str | Mapping[str, object] | None) -> dict[str, str]:
    """``KEY=VALUE`` strings (``--backend-option mmap_experts=true``, repeatable; or one comma-separated
    string, or a ``{key: value}`` table) -> ``{key: value}`` for ``LoadOptions.extra``. Values stay
    strings: each backend reads and checks its own options, and refuses a key it does not know by
    name. Raises :class:`BackendError` for an item without ``=`` or a key that has a flag of its own."""
    if items is None:
        return {}
    if isinstance(items, Mapping):
        pairs = [(str(k), str(v)) for k, v in items.items()]
    else:
        pairs = []
        for item in items.split(",") if isinstance(items, str) else items:
            if not str(item).strip():
                continue
            key, eq, value = str(item).strip().partition("=")
            if not eq or not key.strip():
                raise BackendError(f"backend option {item!r} must look like key=value (e.g. mmap_experts=true)")
            pairs.append((key, value))
    out: dict[str, str] = {}
    for key, value in pairs:
        key = key.strip().replace("-", "_")
        if key in OPTIONS_WITH_FLAGS:
            flag = "--" + key.replace("_", "-")
            raise BackendError(f"backend option {key!r} has a flag of its own: use {flag}")
        out[key] = value.strip()
    return out
