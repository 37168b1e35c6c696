"""Engine configuration and the default KV-cache size rule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ruvllm.backend import kv_block_bytes  # part of the backend contract; kept importable here
from ruvllm.block_manager import EVICTION_POLICIES
from ruvllm.errors import RuvllmError
from ruvllm.model_config import ModelConfig

SCHEDULING_POLICIES = ("fcfs", "priority")


class EngineConfigError(RuvllmError):
    """An engine setting is out of range or unknown."""


#: Values of ``EngineConfig.sampling``.
SAMPLING_PLACES = ("auto", "host", "device")


@dataclass
class EngineConfig:
    #: Tokens per KV block.
    block_size: int = 16
    #: KV blocks in the cache; None: see :func:`default_num_blocks`.
    num_blocks: int | None = None
    #: Sequences admitted to run at once (the choices of an ``n > 1`` request count one each).
    max_num_seqs: int = 64
    #: Tokens one forward step may carry (prefill chunks plus one per decoding sequence).
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    #: Which unreferenced cached block to evict first: ``lru``, ``lfu`` or ``fifo``.
    eviction: str = "lru"
    #: ``fcfs`` (order of arrival) or ``priority`` (lower ``GenerationRequest.priority`` first).
    policy: str = "fcfs"
    #: Passed to the backend's ``kv_cache`` hook.
    kv_cache_options: dict[str, Any] = field(default_factory=dict)
    #: Longest sequence (prompt + completion) served; None: the model's context length.
    max_model_len: int | None = None
    #: Memory budget of the KV cache when ``num_blocks`` is None; None: :func:`default_kv_memory`'s
    #: rule, from the memory left once the model is loaded and the model's context.
    kv_cache_memory_bytes: int | None = None
    #: The memory :func:`default_kv_memory`'s rule sizes within (at most what the machine has left);
    #: None: what the machine has left. A server holding several models gives each a share.
    kv_memory_available: int | None = None
    #: Latency target of one step in milliseconds: the prompt tokens a step carries (chunked
    #: prefill) shrink so that decoding streams keep a steady inter-token latency while long prompts
    #: prefill (see :mod:`ruvllm.engine.step_budget`). None: steps carry up to
    #: ``max_num_batched_tokens`` prompt tokens whatever they cost.
    max_step_ms: float | None = None
    #: Latency target relative to the decode-only step of the same sequences: a step that carries
    #: prompt tokens may last at most this many times as long (with ``max_step_ms``, the smaller of
    #: both applies). Bounds the inter-token latency's tail by a multiple of its median. None: off.
    max_step_ratio: float | None = None
    #: Where tokens are sampled: ``host`` (NumPy, every backend), ``device`` (in the backend, after
    #: its step: only token ids and asked-for log-probabilities leave the device; backends with
    #: ``Capabilities.device_sampling``), ``auto``: device where the backend prefers it (GPUs).
    sampling: str = "auto"
    #: Launch the next decoding step before this one's outputs are made (its schedule and inputs
    #: built while this one runs) where the backend runs steps asynchronously
    #: (:class:`ruvllm.backend.PreparesSteps`). Outputs are the same either way.
    pipeline_decode: bool = True
    #: :meth:`LLMEngine.precompile` also compiles the steps that return every position's logits
    #: (prompt logprobs, echo); without it their first steps compile while serving.
    precompile_all_logits: bool = False
    #: Speculative decoding (:mod:`ruvllm.speculative`): ``ngram`` (prompt lookup over each sequence's
    #: own prompt and output), ``draft`` (a draft model), ``ngram+draft`` (the prompt lookup where it
    #: matches and pays, the draft model otherwise, priced step by step); None: off. Greedy output is
    #: unchanged token for token, sampled output keeps the target's distribution.
    speculative: str | None = None
    #: Most draft tokens a sequence offers per step (k); each sequence's own k adapts below it.
    num_speculative_tokens: int = 4
    #: The n-gram proposer's suffix lengths, tried longest first.
    ngram_n_min: int = 2
    ngram_n_max: int = 4
    #: Decoding positions (one per sequence plus its draft) a step may carry: past it sequences
    #: draft less, then nothing (many sequences make a step compute-bound, where drafts cost time).
    speculative_step_tokens: int = 32
    #: A sequence whose acceptance rate stays below this stops drafting.
    speculative_min_acceptance: float = 0.1
    #: What one more position costs a decoding step, relative to the step: a sequence drafts only
    #: as many tokens as its acceptance rate pays for (CPU decoding reads the weights once for all
    #: positions: measured ~0.17 for SmolLM2 on jax w4a8, 2 Zen 5 cores). The prior only: a step's
    #: drafts are then priced by its rows' measured cost (:mod:`ruvllm.speculative.step_cost`).
    speculative_position_cost: float = 0.2
    #: ``speculative="draft"`` or ``"ngram+draft"``: the draft model (a reference ``load_model``
    #: resolves, or ``same``: the target's own checkpoint) and its quantization (e.g. ``w4a8`` under a
    #: float target; None: auto).
    draft_model: str | None = None
    draft_quantization: str | None = None
    #: The draft model drafts only over this many tokens (the lowest ids: a BPE vocabulary's commonest
    #: pieces, plus the special ones), its output head cut to their rows: a cheaper draft step, the
    #: target still verifying over the whole vocabulary (output unchanged). None: every token.
    draft_vocab_size: int | None = None

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise EngineConfigError(msg)

        if self.block_size < 1:
            bad(f"block_size must be at least 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            bad(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.max_num_seqs < 1:
            bad(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            bad(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.eviction not in EVICTION_POLICIES:
            bad(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction!r}")
        if self.policy not in SCHEDULING_POLICIES:
            bad(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            bad(f"max_step_ms must be positive, got {self.max_step_ms}")
        if self.max_step_ratio is not None and not self.max_step_ratio > 1:
            bad(f"max_step_ratio must be above 1, got {self.max_step_ratio}")
        if self.sampling not in SAMPLING_PLACES:
            bad(f"sampling must be one of {', '.join(SAMPLING_PLACES)}, got {self.sampling!r}")
        if self.speculative is not None:
            from ruvllm.speculative import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

            if self.speculative not in SPECULATIVE_METHODS:
                bad(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)} or None, got {self.speculative!r}")
            if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
                bad(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
            if not 1 <= self.ngram_n_min <= self.ngram_n_max:
                bad(f"need 1 <= ngram_n_min <= ngram_n_max, got {self.ngram_n_min} and {self.ngram_n_max}")
            if self.speculative in ("draft", "ngram+draft") and not self.draft_model:
                bad(f"speculative={self.speculative!r} needs draft_model (a model reference, or 'same')")
            if self.speculative_step_tokens < 1:
                bad(f"speculative_step_tokens must be at least 1, got {self.speculative_step_tokens}")
            if not 0.0 <= self.speculative_position_cost <= 1.0:
                bad(f"speculative_position_cost must be in [0, 1], got {self.speculative_position_cost}")
            if not 0.0 <= self.speculative_min_acceptance < 1.0:
                bad(f"speculative_min_acceptance must be in [0, 1), got {self.speculative_min_acceptance}")
        if (self.draft_model or self.draft_quantization or self.draft_vocab_size) and self.speculative not in (
            "draft",
            "ngram+draft",
        ):
            bad("draft_model, draft_quantization and draft_vocab_size are for speculative='draft' or 'ngram+draft'")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 16:
            bad(f"draft_vocab_size must be at least 16, got {self.draft_vocab_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            bad(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")


#: The default KV budget holds this many sequences of the served context (fewer with a smaller
#: ``max_num_seqs``): a full-length conversation with room beside it, as Ollama's default of four
#: parallel requests at ``num_ctx`` reserves.
DEFAULT_KV_SEQUENCES = 4
#: ... within this share of the memory available once the model is loaded (the rest for the steps'
#: activations, the compiled programs, the page cache the weights' file may need, and the system).
DEFAULT_KV_MEMORY_SHARE = 0.5
#: The rule in one line, for the load log and ``--help``.
DEFAULT_KV_RULE = (
    f"room for {DEFAULT_KV_SEQUENCES} sequences of the served context, within "
    f"{DEFAULT_KV_MEMORY_SHARE:.0%} of the memory available once the model is loaded"
)


def default_kv_memory(engine: EngineConfig, wanted_bytes: int, available: int) -> int:
    """The KV cache's budget when neither ``num_blocks`` nor ``kv_cache_memory_bytes`` is given:
    ``wanted_bytes`` (what :data:`DEFAULT_KV_SEQUENCES` sequences of the served context take, the
    backend's blocks as it stores them) up to :data:`DEFAULT_KV_MEMORY_SHARE` of ``available`` (bytes
    the process may still take, after the weights). A 135M model reserves what its context needs,
    not gigabytes; an 8B model on a 16 GiB machine gets what is left beside its weights.

    A share of the available memory is rounded down to its 2 leading bits (1 or 1.5 times a power of
    two: at most 1/3 less): the memory free at a start moves from one start to the next (by the page
    cache a cgroup is charged for, say), and a cache of another size is another set of step shapes,
    so every compiled step (and every one kept on disk) would be compiled again; rounded, restarts on
    the same machine size the cache alike. Four leading bits were too fine: three starts of an 8B
    server under a 16 GiB cgroup got 4,608, 5,120 and 5,632 MiB and compiled every step each time
    (ready in 43-50 s); each is 4,096 MiB now."""
    share = int(DEFAULT_KV_MEMORY_SHARE * available)
    return max(1, wanted_bytes if wanted_bytes <= share else _leading_bits(share, 2))


def _leading_bits(n: int, bits: int) -> int:
    """``n`` with all but its ``bits`` most significant bits cleared."""
    drop = max(0, n.bit_length() - bits)
    return (n >> drop) << drop


def _budget(engine: EngineConfig) -> int:
    if engine.kv_cache_memory_bytes is None:
        raise EngineConfigError("the KV budget is resolved before blocks are counted (plan_kv_cache)")
    return engine.kv_cache_memory_bytes


def default_num_blocks(
    config: ModelConfig, engine: EngineConfig, max_model_len: int, block_bytes: int | None = None
) -> int:
    """KV blocks to allocate when ``EngineConfig.num_blocks`` is None.

    Rule: enough blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens each (of their
    window and one step, when every layer has the same sliding window), capped so
    the cache (``block_bytes`` per block, as the backend stores it; float32 keys and values of every
    layer when not given) stays within ``kv_cache_memory_bytes``;
    at least one block. Requests that could not fit the resulting cache alone are refused when they
    are added; the scheduler preempts when concurrent ones outgrow it.
    """
    per_sequence = -(-max_model_len // engine.block_size)
    if config.uniform_window:  # a sequence holds its window's blocks plus one step's
        per_sequence = min(
            per_sequence, -(-(config.uniform_window - 1 + engine.max_num_batched_tokens) // engine.block_size) + 1
        )
    wanted = engine.max_num_seqs * per_sequence
    per_block = block_bytes if block_bytes else kv_block_bytes(config, engine.block_size)
    affordable = _budget(engine) // per_block
    return max(1, min(wanted, affordable))


def default_hybrid_blocks(
    config: ModelConfig, engine: EngineConfig, max_model_len: int, block_bytes: int
) -> tuple[int, int]:
    """(global, windowed) blocks of a hybrid KV cache (:attr:`ModelConfig.hybrid_window`) when
    ``EngineConfig.num_blocks`` is None: ``max_num_seqs`` sequences of ``max_model_len`` tokens in
    the global layers' pool and of their window plus one step in the windowed layers' pool, scaled
    down together to fit ``kv_cache_memory_bytes``. ``block_bytes`` covers every layer; a block of a
    pool costs its layers' share. With ``num_blocks`` given, both pools get that many."""
    if engine.num_blocks:
        return engine.num_blocks, engine.num_blocks
    layers = config.num_layers
    local = len(config.local_layers)
    per_layer = block_bytes / layers
    full_seq = -(-max_model_len // engine.block_size)
    local_seq = min(full_seq, -(-(config.hybrid_window - 1 + engine.max_num_batched_tokens) // engine.block_size) + 1)
    want_full, want_local = engine.max_num_seqs * full_seq, engine.max_num_seqs * local_seq
    wanted_bytes = per_layer * ((layers - local) * want_full + local * want_local)
    scale = min(1.0, _budget(engine) / wanted_bytes)
    return max(1, int(want_full * scale)), max(1, int(want_local * scale))
