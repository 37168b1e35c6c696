"""GPU benchmark of the JAX backend: the Pallas paged-attention kernels against the jax.numpy path
and the memory-bandwidth floor, then whole-model decode throughput against the floor and against HF
transformers on the same GPU.

On a machine with a CUDA GPU (``pip install "ruvllm-backend-jax[cuda]"``, plus torch and
transformers for the peer):

    python benchmarks/bench_gpu.py --json bench_gpu.json
    # within a short device lease, one model and the batches that matter:
    python benchmarks/bench_gpu.py --attn-shapes llama3-8b --dtypes bfloat16 --models llama3-8b \
        --attentions pallas --model-batches 1 32 256 --peer-batches 1 256

Attention part: one layer of paged attention at SmolLM2's shapes (9 query heads, 3 kv heads, head
dim 64) and Llama-3-8B's (32, 8, 128), blocks of 16 tokens, block tables in random order, bfloat16
and float32 caches, for decode (batch 1, 8, 32, 64 x context 512, 2048, 4096, 8192) and prefill
(one sequence, 512 and 2048 query tokens). ``paged_attention`` runs under ``jax.jit`` with
``impl="pallas"`` (the kernels compiled through Triton) and ``impl="reference"`` (jax.numpy, XLA).
The floor is the bytes the attention must move (K and V of every context token of every sequence,
plus q and the output) divided by the device's copy bandwidth, which the script measures first (a
jitted elementwise pass over a 1 GiB array, bytes read + bytes written over time); "% HBM" is floor
over the kernel's time. Each run checks the kernel's output against the jax.numpy path (max abs
difference relative to the largest output: 2e-2 for bfloat16, 1e-4 for float32) and exits non-zero
when it does not match.

Model part: decode steps (bfloat16 weights and cache) at batch 1, 8, 32, 128, 256 after prompts of
512 random tokens, for SmolLM2 (the bundled GGUF) and for a Llama-3-8B-shaped model whose random
weights are made on the device (speed does not depend on the values). ruvllm runs each attention
path and samples greedily on the device (only token ids come back, as when serving on a GPU); the
peer is HF transformers on torch, bfloat16, static KV cache, ``torch.compile(mode="reduce-overhead")``,
in the same run on the same GPU. Medians of per-step times; tok/s = batch / step time; the floor is
(the weight bytes a step reads + the KV bytes it reads) / the measured bandwidth.

Issue 42's runs (``gpu_lease.sh``'s ``splits`` and ``forms`` parts): ``--quantizations none q8 fp8``
makes the 8B weights in each weight-only form on the device (each form's floor from its own bytes);
``--model-decode-splits auto 1 16`` adds bf16 runs with the decode kernel's parts forced (each row
records the parts its decode steps ran with); ``--verify-tokens 5`` also times steps of 5 tokens a
sequence, what speculative decoding's verification of 4 drafts runs.

Without a CUDA device the script says so and measures nothing (exit status 0: ``nox -s bench`` runs
it on CPU). ``--interpret`` runs everything on any device at tiny sizes (the kernels in Pallas
interpret mode, a tiny random Llama, transformers eager): that exercises this script and checks the
kernels' outputs, and its timings say nothing about speed.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ruvllm_jax.attention import paged_attention

#: Attention shapes (query heads, kv heads, head dim) of the two models measured.
ATTN_SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}
BLOCK_SIZE = 16
#: Llama-3-8B's shapes (random bfloat16 weights made on the device: speed does not depend on values).
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
#: A tiny Llama for ``--interpret`` (checks the script's model part on any device).
TINY_LLAMA = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rope_theta=10000.0,
)
#: The jax backend's weight-only forms a GPU runs (``none``: the compute dtype itself; ``q8``: int8
#: weights, bf16 activations (w8a16); ``fp8``: float8 e4m3 per channel). ``q8-channel`` is a measurement
#: only, no load form: q8's int8 codes with one float32 scale per output channel (``quantize_int8(w,
#: None)``), which ``quant.linear`` applies after the product as fp8's, against q8's scale per group of
#: 32 inside it: whether XLA on CUDA fuses the group dequantization into its GEMM shows as the two apart.
WEIGHT_FORMS = ("none", "q8", "fp8", "q8-channel")
#: Pallas output vs the jax.numpy output: max abs difference / max abs reference output.
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
T = TypeVar("T")


@dataclass(frozen=True)
class AttnConfig:
    kind: str  # decode | prefill
    batch: int  # sequences
    q_tokens: int  # new tokens per sequence (1 for decode)
    context: int  # tokens each sequence attends over, the new ones included
    dtype: str
    shape: str = "smollm2"  # a key of ATTN_SHAPES
    splits: int = 1  # decode: parts each sequence's keys are cut into (flash decoding), one program each

    @property
    def heads(self) -> tuple[int, int, int]:
        return ATTN_SHAPES[self.shape]

    @property
    def label(self) -> str:
        if self.kind == "decode":
            split = f" splits={self.splits}" if self.splits > 1 else ""
            return f"{self.shape} decode b={self.batch} ctx={self.context}{split} {self.dtype}"
        return f"{self.shape} prefill b={self.batch} q={self.q_tokens} ctx={self.context} {self.dtype}"

    def bytes_moved(self) -> int:
        """What any implementation must read and write: K and V of every context token of every
        sequence, the queries and the output."""
        heads, kv_heads, head_dim = self.heads
        item = jnp.dtype(DTYPES[self.dtype]).itemsize
        kv = 2 * self.batch * self.context * kv_heads * head_dim * item
        q_and_out = 2 * self.batch * self.q_tokens * heads * head_dim * item
        return kv + q_and_out

    def bytes_needed(self) -> int:
        """Rough device memory the jax.numpy path needs: the cache, its gathered copy (K and V,
        twice for the prefill transposes) and a few float32 score arrays."""
        heads, kv_heads, head_dim = self.heads
        keys = -(-self.context // BLOCK_SIZE) * BLOCK_SIZE
        item = jnp.dtype(DTYPES[self.dtype]).itemsize
        cache = 2 * self.batch * keys * kv_heads * head_dim * item
        scores = self.batch * heads * self.q_tokens * keys * 4
        return 3 * cache + 4 * scores


@dataclass
class AttnRow:
    config: str
    kind: str
    batch: int
    q_tokens: int
    context: int
    dtype: str
    bytes_moved: int
    pallas_impl: str
    pallas_ms: float | None = None
    jnp_ms: float | None = None
    floor_ms: float | None = None
    calls_per_iteration: tuple[int, int] | None = None  # (pallas, jnp)
    rel_error: float | None = None
    tolerance: float | None = None
    ok: bool | None = None
    skipped: str | None = None
    error: str | None = None


# -- timing ------------------------------------------------------------------------------------------------


def time_call(fn: Callable[[], jax.Array], iterations: int, min_iter_s: float) -> tuple[float, int, jax.Array]:
    """Median seconds per call of ``fn`` after a compiling warm-up. One iteration runs ``k`` calls
    back to back and waits for the last, with ``k`` picked so an iteration lasts ``min_iter_s``:
    host dispatch then overlaps device work, which a single short call cannot show."""
    out = fn().block_until_ready()  # compile
    t0 = time.perf_counter()
    fn().block_until_ready()
    single = time.perf_counter() - t0
    k = max(1, min(200, math.ceil(min_iter_s / max(single, 1e-9))))
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        for _ in range(k):
            out = fn()
        out.block_until_ready()
        times.append((time.perf_counter() - t0) / k)
    return statistics.median(times), k, out


def copy_bandwidth(nbytes: int, iterations: int, min_iter_s: float) -> float:
    """Bytes per second of a jitted elementwise pass (read ``nbytes``, write ``nbytes``)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    step = jax.jit(lambda a: a + 1.0)  # a plain copy could be elided by XLA; an add cannot
    seconds, _, _ = time_call(lambda: step(x), iterations, min_iter_s)
    return 2 * x.size * 4 / seconds


# -- attention ---------------------------------------------------------------------------------------------


def attention_inputs(cfg: AttnConfig, seed: int) -> tuple[jax.Array, ...]:
    """One layer of cache holding exactly the sequences' blocks, handed out in random order."""
    dtype = DTYPES[cfg.dtype]
    heads, kv_heads, head_dim = cfg.heads
    blocks_per_seq = -(-cfg.context // BLOCK_SIZE)
    num_blocks = cfg.batch * blocks_per_seq
    kk, kv, kq = jax.random.split(jax.random.key(seed), 3)
    shape = (1, num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = jax.random.normal(kk, shape, dtype)
    v_cache = jax.random.normal(kv, shape, dtype)
    q = jax.random.normal(kq, (cfg.batch, cfg.q_tokens, heads, head_dim), dtype)
    rng = np.random.default_rng(seed)
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(cfg.batch, blocks_per_seq)
    context = np.full((cfg.batch,), cfg.context, np.int32)
    # The new tokens are the last q_tokens of the context (for prefill from scratch: all of it).
    first = cfg.context - cfg.q_tokens
    q_pos = np.tile(first + np.arange(cfg.q_tokens, dtype=np.int32), (cfg.batch, 1))
    return q, k_cache, v_cache, jnp.int32(0), jnp.asarray(tables), jnp.asarray(q_pos), jnp.asarray(context)


def attempt(row: AttnRow, what: str, fn: Callable[[], T]) -> T | None:
    """``fn()``; on failure the row records why: skipped when the device ran out of memory (the
    config does not fit), an error otherwise (reported, and the script then exits non-zero)."""
    try:
        return fn()
    except Exception as exc:
        text = str(exc).strip()
        if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
            row.skipped = f"{what}: out of device memory"
        else:
            row.error = f"{what}: {first_line(exc)}"
        return None


def report(row: AttnRow | ModelRow) -> None:
    """One finished row on stderr as it lands, so a run cut off by a device lease keeps what it measured."""
    print("row", json.dumps(asdict(row)), file=sys.stderr, flush=True)


def first_line(exc: Exception) -> str:
    """``Type: the first line of the message`` (at most 120 characters of it)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:120] if lines else ''}"


def bench_attention(
    cfg: AttnConfig,
    pallas_impl: str,
    bandwidth: float,
    iterations: int,
    min_iter_s: float,
    memory_limit: int | None,
) -> AttnRow:
    row = AttnRow(cfg.label, cfg.kind, cfg.batch, cfg.q_tokens, cfg.context, cfg.dtype, cfg.bytes_moved(), pallas_impl)
    if memory_limit is not None and cfg.bytes_needed() > 0.6 * memory_limit:
        row.skipped = f"needs ~{cfg.bytes_needed() / 2**30:.1f} GiB of {memory_limit / 2**30:.1f} GiB"
        return row
    seed = cfg.batch * 131 + cfg.context + cfg.q_tokens
    args = attempt(row, "inputs", lambda: attention_inputs(cfg, seed))
    timed = {}
    for name, impl in (("pallas", pallas_impl), ("jnp", "reference")):
        if row.skipped or row.error:
            return row
        splits = cfg.splits if name == "pallas" else 1
        run = jax.jit(lambda *a, impl=impl, splits=splits: paged_attention(*a, impl=impl, decode_splits=splits))
        timed[name] = attempt(row, name, lambda run=run: time_call(lambda: run(*args), iterations, min_iter_s))
    if row.skipped or row.error:
        return row
    (pallas_s, pallas_k, got), (jnp_s, jnp_k, want) = timed["pallas"], timed["jnp"]
    got32 = np.asarray(got.astype(jnp.float32))
    want32 = np.asarray(want.astype(jnp.float32))
    row.rel_error = float(np.max(np.abs(got32 - want32)) / np.max(np.abs(want32)))
    row.tolerance = TOLERANCE[cfg.dtype]
    row.ok = bool(np.isfinite(row.rel_error) and row.rel_error <= row.tolerance)
    row.pallas_ms, row.jnp_ms = pallas_s * 1e3, jnp_s * 1e3
    row.floor_ms = cfg.bytes_moved() / bandwidth * 1e3
    row.calls_per_iteration = (pallas_k, jnp_k)
    return row


def attention_configs(
    interpret: bool, dtypes: list[str], shapes: list[str], splits: tuple[int, ...] = (1,)
) -> list[AttnConfig]:
    if interpret:  # only exercises the code path and checks outputs
        decode = [(b, c) for b in (1, 2) for c in (64, 128)]
        prefill = [(64, 64), (32, 128)]
    else:
        decode = [(b, c) for b in (1, 8, 32, 64) for c in (512, 2048, 4096, 8192)]
        prefill = [(512, 512), (2048, 2048), (512, 2048)]
    out = []
    for shape in shapes:
        for dt in dtypes:
            out += [AttnConfig("decode", b, 1, c, dt, shape, n) for b, c in decode for n in splits]
            out += [AttnConfig("prefill", 1, q, c, dt, shape) for q, c in prefill]
    return out


def markdown(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def attention_table(rows: list[AttnRow]) -> str:
    out = [["config", "pallas ms", "jnp ms", "floor ms", "pallas/floor", "jnp/pallas", "pallas % HBM", "rel err"]]
    for r in rows:
        if r.skipped or r.error:
            out.append(
                [r.config, f"skipped: {r.skipped}" if r.skipped else f"ERROR {r.error[:80]}", "", "", "", "", "", ""]
            )
            continue
        assert r.pallas_ms is not None and r.jnp_ms is not None and r.floor_ms is not None
        err = f"{r.rel_error:.1e}" + ("" if r.ok else " FAIL")
        out.append(
            [
                r.config,
                f"{r.pallas_ms:.4f}",
                f"{r.jnp_ms:.4f}",
                f"{r.floor_ms:.4f}",
                f"{r.pallas_ms / r.floor_ms:.1f}x",
                f"{r.jnp_ms / r.pallas_ms:.2f}x",
                f"{100 * r.floor_ms / r.pallas_ms:.0f}%",
                err,
            ]
        )
    return markdown(out)


# -- model ---------------------------------------------------------------------------------------------------


def random_llama(
    shape: dict,
    dtype: str,
    attention: str,
    seed: int = 0,
    unroll_layers: str = "auto",
    quantization: str = "none",
    decode_splits: str = "auto",
):
    """A :class:`ruvllm_jax.runner.JaxModel` of Llama ``shape`` with random weights made on the device
    (normal * 0.02, norms 1): decode speed does not depend on the values, and 16 GB of 8B weights
    never cross the host. ``quantization`` (one of :data:`WEIGHT_FORMS`) rounds them there, as the
    loader would: the layers' projections to the form, the embedding and output projection to int8
    groups (``ruvllm_jax.loading``'s ``embedding``)."""
    from ruvllm.backend import LoadOptions
    from ruvllm.model_config import ModelConfig
    from ruvllm_jax.model import LayerWeights, ModelSpec, Weights
    from ruvllm_jax.quant import quantize_fp8, quantize_int8
    from ruvllm_jax.runner import JaxModel
    from ruvllm_jax.sharding import make_mesh

    per_channel = functools.partial(quantize_int8, group_size=None)
    layer_form = {"none": None, "q8": quantize_int8, "fp8": quantize_fp8, "q8-channel": per_channel}[quantization]

    spec = ModelSpec.from_config(ModelConfig(architecture="llama", **shape), dtype)
    dt = DTYPES[dtype]
    L, h, v = spec.num_layers, spec.hidden_size, spec.vocab_size

    def make(key: jax.Array) -> Weights:
        keys = iter(jax.random.split(key, 16))

        def normal(*dims: int) -> jax.Array:
            return (0.02 * jax.random.normal(next(keys), dims, jnp.float32)).astype(dt)

        def matrix(*dims: int, form=None):
            w = normal(*dims)
            return w if form is None else form(w)

        projections = {p: matrix(L, *spec.projection_shape(p), form=layer_form) for p in (
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
        )}  # fmt: skip
        layers = LayerWeights(input_norm=jnp.ones((L, h), dt), post_attention_norm=jnp.ones((L, h), dt), **projections)
        table = None if layer_form is None else quantize_int8
        return Weights(
            embed=matrix(v, h, form=table),
            layers=layers,
            final_norm=jnp.ones((h,), dt),
            lm_head=matrix(v, h, form=table),
        )

    weights = jax.jit(make)(jax.random.key(seed))
    extra = {"attention": attention, "unroll_layers": unroll_layers, "decode_splits": decode_splits}
    options = LoadOptions(dtype=dtype, quantization="q8" if quantization == "q8-channel" else quantization, extra=extra)
    model = JaxModel(spec, weights, make_mesh(1), attention, options)
    model.table_tokens = spec_context(shape)
    return model


def spec_context(shape: dict) -> int:
    return int(shape["max_position_embeddings"])


def weights_read(model) -> int:
    """Bytes a decode step must read: every weight but an untied embedding table (a decode step
    gathers ``batch`` rows of it)."""
    from ruvllm_jax.quant import weight_nbytes

    untied = model.weights.lm_head is not None
    return model.weight_bytes - (weight_nbytes(model.weights.embed) if untied else 0)


@dataclass
class ModelRow:
    model: str
    engine: str  # "ruvllm <attention>" or "transformers"
    batch: int
    context_start: int
    step_ms: float
    tok_s: float
    #: (weight bytes + the KV bytes a step reads) / measured bandwidth.
    floor_ms: float | None = None
    skipped: str | None = None
    #: The weight bytes a decode step reads (this form's own) and the decode attention's parts.
    weight_bytes: int | None = None
    decode_splits: int | None = None


def greedy_rows(batch: int, vocab: int):
    """Device-sampling rows of ``batch`` greedy sequences (what a server on a GPU samples with)."""
    from ruvllm.sampling import Sampler, SamplingParams, device_sampling

    return device_sampling([Sampler(SamplingParams(temperature=0.0)) for _ in range(batch)], vocab)


def bench_ruvllm(
    name: str,
    model,
    batches: list[int],
    prompt_tokens: int,
    steps: int,
    bandwidth: float,
    form: str = "",
    verify_tokens: int = 0,
) -> list[ModelRow]:
    """Decode steps of the whole model: prompts of ``prompt_tokens`` random ids prefilled (untimed), two
    warm-up steps, then the median of ``steps`` timed steps, each sampling greedily on the device (only
    the token ids come back, as when serving). tok/s = batch / step time; the floor is this model's own
    weight bytes (a quantized form's, ``form`` naming it in the engine) plus its KV over the bandwidth.
    Each row names the decode attention's parts its steps ran with (``decode_splits``).

    ``verify_tokens`` N > 1: then as many steps of N new tokens per sequence, what a speculative step
    verifying N - 1 drafts runs (a 16-token prompt-chunk shape; one logit row sampled per sequence,
    where the engine's verification reads N rows of the output projection: N - 1 GEMV rows more). A
    row "verify N" of its own: tok/s counts N tokens a sequence (every draft accepted), so its step
    time against the decode row's says what speculation must accept to pay on this device."""
    from ruvllm.backend import ForwardBatch, SequenceChunk

    rows = []
    warm = 2
    spec = model.spec
    per_seq = -(-(prompt_tokens + (warm + steps) * (1 + verify_tokens) + 1) // BLOCK_SIZE)
    kv_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * jnp.dtype(DTYPES[spec.dtype]).itemsize
    model.table_tokens = per_seq * BLOCK_SIZE
    cache = None
    for b in sorted(batches):
        print(f"... {name} ruvllm {model.attention}{form} batch {b}", file=sys.stderr, flush=True)
        row = ModelRow(name, f"ruvllm {model.attention}{form}", b, prompt_tokens, 0.0, 0.0)
        try:
            del cache
            cache = model.allocate_cache(per_seq * b + 1, BLOCK_SIZE)
            tables = [np.arange(per_seq, dtype=np.int32) + i * per_seq for i in range(b)]
            rng = np.random.default_rng(b)
            prompts = rng.integers(0, spec.vocab_size, size=(b, prompt_tokens), dtype=np.int32)
            last: list[int] = []
            for g in range(0, b, 8):  # prefill a few sequences per step: bounded activation memory
                chunks = [SequenceChunk(prompts[i], 0, tables[i]) for i in range(g, min(b, g + 8))]
                out = model.forward(
                    ForwardBatch(chunks, BLOCK_SIZE, sampling=greedy_rows(len(chunks), spec.vocab_size)), cache
                )
                last.extend(out.sampled.tokens.tolist())
            times = []
            for step in range(warm + steps):
                pos = prompt_tokens + step
                chunks = [SequenceChunk(np.asarray([last[i]], np.int32), pos, tables[i]) for i in range(b)]
                batch = ForwardBatch(chunks, BLOCK_SIZE, sampling=greedy_rows(b, spec.vocab_size))
                t0 = time.perf_counter()
                out = model.forward(batch, cache)
                times.append(time.perf_counter() - t0)
                last = out.sampled.tokens.tolist()
            verify = []
            pos = prompt_tokens + warm + steps
            for _ in range(warm + steps if verify_tokens > 1 else 0):
                chunks = [SequenceChunk(np.full(verify_tokens, last[i], np.int32), pos, tables[i]) for i in range(b)]
                batch = ForwardBatch(chunks, BLOCK_SIZE, sampling=greedy_rows(b, spec.vocab_size))
                t0 = time.perf_counter()
                out = model.forward(batch, cache)
                verify.append(time.perf_counter() - t0)
                last, pos = out.sampled.tokens.tolist(), pos + verify_tokens
            decode_plans = [p for p in model.compiled_steps.stats.plans if not p.prefill_seqs and p.decode_seqs >= b]
            row.decode_splits = min(decode_plans, key=lambda p: p.decode_seqs).decode_splits
            row.weight_bytes = weights_read(model)
        except Exception as exc:  # out of memory at a large batch: reported, the rest goes on
            row.skipped = first_line(exc)
            rows.append(row)
            report(row)
            continue
        row.step_ms = statistics.median(times[warm:]) * 1e3
        row.tok_s = b / (row.step_ms / 1e3)
        kv_read = b * (prompt_tokens + warm + steps // 2) * kv_token
        row.floor_ms = (weights_read(model) + kv_read) / bandwidth * 1e3
        rows.append(row)
        report(row)
        if verify:
            v_ms = statistics.median(verify[warm:]) * 1e3
            engine = f"{row.engine} verify {verify_tokens}"
            rows.append(ModelRow(name, engine, b, prompt_tokens, v_ms, b * verify_tokens / (v_ms / 1e3), row.floor_ms))
            report(rows[-1])
    del cache
    return rows


def bench_transformers(
    name: str, source: str | dict, batches: list[int], prompt_tokens: int, steps: int, compile: bool
) -> list[ModelRow]:
    """The peer: HF transformers on torch on the same device, bfloat16, greedy ``generate`` with a static
    KV cache and (on CUDA) ``torch.compile(mode="reduce-overhead")``. A decode step's time is the
    difference of two generate calls (2 and 2 + ``steps`` new tokens) divided by ``steps``, median of 3."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(source, dict):
        cfg = LlamaConfig(
            vocab_size=source["vocab_size"],
            hidden_size=source["hidden_size"],
            intermediate_size=source["intermediate_size"],
            num_hidden_layers=source["num_layers"],
            num_attention_heads=source["num_heads"],
            num_key_value_heads=source["num_kv_heads"],
            head_dim=source["head_dim"],
            max_position_embeddings=source["max_position_embeddings"],
            rope_theta=source["rope_theta"],
        )
        with torch.device(device):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    else:
        path = Path(source)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16)
        model = model.to(device)
    model.eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.pad_token_id = 0
    eager_forward = model.forward
    if compile:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    rows = []
    vocab = model.config.vocab_size
    for b in sorted(batches):
        print(f"... {name} transformers batch {b}", file=sys.stderr, flush=True)
        ids = torch.randint(0, vocab, (b, prompt_tokens), device=device)

        def generate(n: int, ids=ids) -> float:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        row = ModelRow(name, "transformers", b, prompt_tokens, 0.0, 0.0)
        try:
            try:
                generate(2 + steps)  # compiles (the static cache's shapes are those of the longest run)
            except Exception as exc:
                if not compile or model.forward is eager_forward:
                    raise
                # transformers' own compile of the static-cache decode step (generate compiles it
                # itself when the cache is static) instead of torch.compile around the forward
                print(f"transformers: torch.compile(forward) failed ({first_line(exc)}); using generate's own compile",
                      file=sys.stderr, flush=True)  # fmt: skip
                model.forward = eager_forward
                generate(2 + steps)
            per_step = [(generate(2 + steps) - generate(2)) / steps for _ in range(3)]
        except Exception as exc:
            row.skipped = first_line(exc)
            rows.append(row)
            report(row)
            continue
        row.step_ms = max(statistics.median(per_step), 1e-9) * 1e3
        row.tok_s = b / (row.step_ms / 1e3)
        rows.append(row)
        report(row)
    model.to("meta")  # frees the device memory before the next model loads
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def model_table(rows: list[ModelRow]) -> str:
    engines = list(dict.fromkeys(r.engine for r in rows))
    by = {(r.engine, r.batch): r for r in rows}
    ours = [e for e in engines if e.startswith("ruvllm")]
    head = ["batch", *[f"{e} tok/s" for e in engines], *[f"{e} % of floor" for e in ours]]
    if "transformers" in engines:
        head += [f"{e} / transformers" for e in ours]
    out = [head]

    def ok(r: ModelRow | None) -> bool:
        return r is not None and r.skipped is None and r.tok_s > 0

    for b in sorted({r.batch for r in rows}):
        cells = [str(b)]
        for e in engines:
            r = by.get((e, b))
            cells.append(f"{r.tok_s:,.1f}" if ok(r) else ("skipped" if r else ""))
        for e in ours:
            r = by.get((e, b))
            cells.append(f"{100 * r.floor_ms / r.step_ms:.0f}%" if ok(r) and r.floor_ms else "")
        if "transformers" in engines:
            peer = by.get(("transformers", b))
            for e in ours:
                r = by.get((e, b))
                cells.append(f"{r.tok_s / peer.tok_s:.2f}x" if ok(r) and ok(peer) else "")
        out.append(cells)
    return markdown(out)


# -- driver ------------------------------------------------------------------------------------------------


def run_models(args: argparse.Namespace, cuda: bool, bw: float) -> list[ModelRow]:
    """Decode throughput of each model: ruvllm (bfloat16, each attention path, device sampling) and
    the transformers peer, in this run. Interpreted: a tiny random Llama on any device, reference
    attention, transformers eager (the script's check; the figures mean nothing)."""
    from ruvllm.resolve import resolve

    rows: list[ModelRow] = []
    if args.interpret:
        models: list[tuple[str, str | dict]] = [("tiny-llama", TINY_LLAMA)]
        # XLA's attention unless the Pallas kernels alone are asked for (then interpreted)
        attentions = ["pallas_interpret"] if args.attentions == ["pallas"] else ["reference"]
        batches, prompt, steps = [1, 4], 32, 4
    else:
        models = [(m, LLAMA3_8B if m == "llama3-8b" else str(resolve(m))) for m in args.models]
        attentions, batches, prompt, steps = (
            args.attentions,
            args.model_batches,
            args.model_prompt_tokens,
            args.model_steps,
        )
    # Each weight form with the decode kernel's automatic parts, then bf16 with each forced number.
    variants = [(q, "auto") for q in args.quantizations]
    variants += [("none", str(n)) for n in args.model_decode_splits if str(n) != "auto"]
    for name, source in models:
        for attention in attentions:
            for quantization, splits in variants:
                if splits not in ("auto", "1") and not attention.startswith("pallas"):
                    continue  # parts of the Pallas decode kernel: nothing to force in XLA's attention
                if quantization == "q8-channel" and not isinstance(source, dict):
                    print(f"{name}: q8-channel is made for the random 8B shape only (no load form)", file=sys.stderr)
                    continue
                if isinstance(source, dict):
                    model = random_llama(
                        source, "bfloat16", attention, unroll_layers=args.unroll_layers,
                        quantization=quantization, decode_splits=splits,
                    )  # fmt: skip
                else:
                    from ruvllm.backend import LoadOptions
                    from ruvllm.checkpoint import open_checkpoint
                    from ruvllm_jax.runner import JaxModel

                    extra = {"attention": attention, "unroll_layers": args.unroll_layers, "decode_splits": splits}
                    options = LoadOptions(dtype="bfloat16", quantization=quantization, extra=extra)
                    model = JaxModel.load(open_checkpoint(source), options)
                form = (f" {quantization}" if quantization != "none" else "") + (
                    f" splits {splits}" if splits != "auto" else ""
                )
                verify = args.verify_tokens if (quantization, splits) == variants[0] else 0
                rows += bench_ruvllm(name, model, batches, prompt, steps, bw, form, verify)
                del model
        if not args.no_peer:
            peer_batches = [b for b in batches if args.peer_batches is None or b in args.peer_batches]
            rows += bench_transformers(name, source, peer_batches, prompt, steps, compile=cuda and not args.interpret)
        print()
        print(
            f"{name} decode, bfloat16, prompts of {prompt} tokens, median of {steps} steps; floor = (weights a "
            "step reads + its KV) / measured bandwidth"
        )
        print(model_table([r for r in rows if r.model == name]))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interpret", action="store_true", help="tiny sizes, kernels interpreted, any device")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=sorted(DTYPES))
    ap.add_argument("--iterations", type=int, help="timed iterations per measurement, median (20; 3 interpreted)")
    ap.add_argument(
        "--min-iter-ms", type=float, default=2.0, help="calls run back to back until an iteration lasts this"
    )
    ap.add_argument(
        "--copy-mib", type=int, default=None, help="array size of the bandwidth pass (1024; 64 interpreted)"
    )
    ap.add_argument(
        "--decode-splits", type=int, nargs="+", default=[1], help="decode kernel parts per sequence, each measured"
    )
    ap.add_argument("--no-model", action="store_true", help="skip the model part")
    ap.add_argument(
        "--models", nargs="+", default=["smollm2", "llama3-8b"], help="smollm2 (or another reference) and/or llama3-8b"
    )
    ap.add_argument(
        "--attn-shapes",
        nargs="*",
        default=["smollm2", "llama3-8b"],
        choices=sorted(ATTN_SHAPES),
        help="attention part's shapes (none: skip the attention part)",
    )
    ap.add_argument("--model-batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    ap.add_argument(
        "--quantizations", nargs="+", default=["none"], choices=WEIGHT_FORMS, help="weight forms of the model part"
    )
    ap.add_argument(
        "--verify-tokens",
        type=int,
        default=0,
        help="N > 1: the first variant also times steps of N tokens a sequence (speculation's verification)",
    )
    ap.add_argument(
        "--model-decode-splits",
        nargs="+",
        default=["auto"],
        help="the model's decode_splits: each value but auto adds a bf16 run with it forced (auto runs always)",
    )
    ap.add_argument("--model-prompt-tokens", type=int, default=512)
    ap.add_argument("--model-steps", type=int, default=32)
    ap.add_argument(
        "--attentions", nargs="*", default=["pallas", "reference"], help="ruvllm attention paths (none: the peer only)"
    )
    ap.add_argument(
        "--unroll-layers", default="auto", choices=["auto", "true", "false"], help="the jax backend's option"
    )
    ap.add_argument("--no-peer", action="store_true", help="skip HF transformers")
    ap.add_argument("--peer-batches", type=int, nargs="+", default=None, help="transformers batches (default: all)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)

    from ruvllm_jax.runner import on_cuda

    cuda = on_cuda()
    if not cuda and not args.interpret:
        platforms = ", ".join(sorted({d.platform for d in jax.devices()}))
        forced = os.environ.get("JAX_PLATFORMS")
        hint = f", JAX_PLATFORMS={forced}" if forced else ""
        print(f"bench_gpu: no CUDA device found (JAX sees: {platforms}{hint}); nothing was measured.")
        return 0

    device = jax.devices()[0]
    pallas_impl = "pallas" if cuda and not args.interpret else "pallas_interpret"
    if cuda and not args.interpret:
        from ruvllm_jax.options import enable_compilation_cache

        # Steps that lower to the same program (a prompt's prefill under each decode_splits, the
        # lease's rerun) load from the cache instead of compiling again: lease minutes go to measuring.
        enable_compilation_cache()
    stats = device.memory_stats() or {}
    memory_limit = stats.get("bytes_limit")
    copy_mib = args.copy_mib or (64 if args.interpret else 1024)
    iterations = args.iterations or (3 if args.interpret else 20)
    cores = getattr(device, "core_count", None)  # the SMs decode_splits=auto fills (132 assumed when unknown)
    print(f"device: {device.device_kind} ({device.platform}), {cores} cores, jax {jax.__version__}")
    if args.interpret:
        print(
            "INTERPRET MODE: the kernels run in the Pallas interpreter; this checks the script and the kernels' "
            "outputs, and the timings below mean nothing about the kernels' speed."
        )
    bw = copy_bandwidth(copy_mib * 2**20, iterations, args.min_iter_ms / 1e3)
    print(
        f"measured copy bandwidth: {bw / 1e9:,.1f} GB/s (jitted x + 1 over {copy_mib} MiB float32, "
        "bytes read + written per second, median); floor = bytes moved / this"
    )

    attn_rows = []
    for cfg in attention_configs(args.interpret, args.dtypes, args.attn_shapes, tuple(args.decode_splits)):
        print(f"... {cfg.label}", file=sys.stderr, flush=True)
        attn_rows.append(bench_attention(cfg, pallas_impl, bw, iterations, args.min_iter_ms / 1e3, memory_limit))
        report(attn_rows[-1])
    if attn_rows:
        print()
        print(f"Paged attention, one layer, block {BLOCK_SIZE}; shapes (q heads, kv heads, head dim): {ATTN_SHAPES}")
        print(f"pallas = impl {pallas_impl!r}, jnp = impl 'reference'; ms = median per call, both under jax.jit")
        print(attention_table(attn_rows))
        print(
            "bytes moved = K and V of every context token of every sequence + q + output; % HBM = floor / pallas time; "
            "prefill is compute-bound, so its floor is a loose bound. rel err = max |pallas - jnp| / max |jnp|, "
            "tolerance " + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items())
        )

    model_rows: list[ModelRow] = []
    if not args.no_model:
        model_rows = run_models(args, cuda, bw)

    failed = [r for r in attn_rows if r.ok is False or r.error]
    if args.json:
        meta = {
            "device": f"{device.device_kind} ({device.platform})",
            "core_count": cores,
            "jax": jax.__version__,
            "machine": f"{platform.machine()}, {platform.platform()}",
            "interpret": args.interpret,
            "copy_bandwidth_gb_s": bw / 1e9,
            "copy_mib": copy_mib,
            "iterations": iterations,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        }
        doc = {
            "meta": meta,
            "attention": [asdict(r) for r in attn_rows],
            "model": [asdict(r) for r in model_rows],
        }
        args.json.write_text(json.dumps(doc, indent=2))
    if failed:
        print(f"FAILED: {len(failed)} config(s) errored or did not match the jnp path:", file=sys.stderr)
        for r in failed:
            why = r.error or f"rel err {r.rel_error:.2e} > {r.tolerance:g}"
            print(f"  {r.config}: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
