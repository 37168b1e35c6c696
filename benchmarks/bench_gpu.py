"""GPU benchmark of the Pallas paged-attention kernels: their time against the jax.numpy path and
against the memory-bandwidth floor, then SmolLM2 decode throughput with each attention path.

On a machine with a CUDA GPU (``pip install "ruvllm-backend-jax[cuda]"``):

    python benchmarks/bench_gpu.py --json bench_gpu.json

Attention part: one layer of paged attention at SmolLM2's shapes (9 query heads, 3 kv heads, head
dim 64, blocks of 16 tokens, block tables in random order), bfloat16 and float32 caches, for decode
(batch 1, 8, 32, 64 x context 512, 2048, 8192) and prefill (one sequence, 512 and 2048 query tokens).
``paged_attention`` runs under ``jax.jit`` with ``impl="pallas"`` (the kernels compiled through
Triton) and ``impl="reference"`` (jax.numpy, XLA). The floor is the bytes the attention must move
(K and V of every context token of every sequence, plus q and the output) divided by the device's
copy bandwidth, which the script measures first (a jitted elementwise pass over a 1 GiB array,
bytes read + bytes written over time). Each run checks the kernel's output against the jax.numpy
path (max abs difference relative to the largest output: 2e-2 for bfloat16, 1e-4 for float32) and
exits non-zero when it does not match.

Model part: SmolLM2 decode steps (bfloat16 weights and cache) at batch 1, 8, 32 with attention
``pallas`` and ``reference`` in one run; medians of per-step times, tok/s = batch / step time.

Without a CUDA device the script says so and measures nothing (exit status 0: ``nox -s bench`` runs
it on CPU). ``--interpret`` runs the attention part on any device at tiny sizes with the kernels in
Pallas interpret mode: that exercises this script and checks the kernels' outputs, and its timings
say nothing about the kernels' speed.
"""

from __future__ import annotations

import argparse
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

# SmolLM2-135M's attention shapes.
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
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

    @property
    def label(self) -> str:
        if self.kind == "decode":
            return f"decode b={self.batch} ctx={self.context} {self.dtype}"
        return f"prefill b={self.batch} q={self.q_tokens} ctx={self.context} {self.dtype}"

    def bytes_moved(self) -> int:
        """What any implementation must read and write: K and V of every context token of every
        sequence, the queries and the output."""
        item = jnp.dtype(DTYPES[self.dtype]).itemsize
        kv = 2 * self.batch * self.context * KV_HEADS * HEAD_DIM * item
        q_and_out = 2 * self.batch * self.q_tokens * HEADS * HEAD_DIM * item
        return kv + q_and_out

    def bytes_needed(self) -> int:
        """Rough device memory the jax.numpy path needs: the cache, its gathered copy (K and V,
        twice for the prefill transposes) and a few float32 score arrays."""
        keys = -(-self.context // BLOCK_SIZE) * BLOCK_SIZE
        item = jnp.dtype(DTYPES[self.dtype]).itemsize
        cache = 2 * self.batch * keys * KV_HEADS * HEAD_DIM * item
        scores = self.batch * HEADS * self.q_tokens * keys * 4
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


@dataclass
class ModelRow:
    attention: str
    batch: int
    context_start: int
    step_ms: float
    tok_s: float


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
    blocks_per_seq = -(-cfg.context // BLOCK_SIZE)
    num_blocks = cfg.batch * blocks_per_seq
    kk, kv, kq = jax.random.split(jax.random.key(seed), 3)
    shape = (1, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = jax.random.normal(kk, shape, dtype)
    v_cache = jax.random.normal(kv, shape, dtype)
    q = jax.random.normal(kq, (cfg.batch, cfg.q_tokens, HEADS, HEAD_DIM), dtype)
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
            row.error = f"{what}: {type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        return None


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
        run = jax.jit(lambda *a, impl=impl: paged_attention(*a, impl=impl))
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


def attention_configs(interpret: bool, dtypes: list[str]) -> list[AttnConfig]:
    if interpret:  # only exercises the code path and checks outputs
        decode = [(b, c) for b in (1, 2) for c in (64, 128)]
        prefill = [(64, 64), (32, 128)]
    else:
        decode = [(b, c) for b in (1, 8, 32, 64) for c in (512, 2048, 8192)]
        prefill = [(512, 512), (2048, 2048), (512, 2048)]
    out = []
    for dt in dtypes:
        out += [AttnConfig("decode", b, 1, c, dt) for b, c in decode]
        out += [AttnConfig("prefill", 1, q, c, dt) for q, c in prefill]
    return out


def markdown(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def attention_table(rows: list[AttnRow]) -> str:
    out = [["config", "pallas ms", "jnp ms", "floor ms", "pallas/floor", "jnp/pallas", "rel err"]]
    for r in rows:
        if r.skipped or r.error:
            out.append(
                [r.config, f"skipped: {r.skipped}" if r.skipped else f"ERROR {r.error[:80]}", "", "", "", "", ""]
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
                err,
            ]
        )
    return markdown(out)


# -- model ---------------------------------------------------------------------------------------------------


def bench_model(
    ref: str, impls: list[str], batches: list[int], prompt_tokens: int, steps: int, dtype: str
) -> list[ModelRow]:
    """Decode steps of the whole model: prompts of ``prompt_tokens`` random ids prefilled (untimed),
    two warm-up steps, then the median of ``steps`` timed steps, per attention implementation."""
    from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
    from ruvllm.runtime import load_model

    rows = []
    warm = 2
    per_seq = -(-(prompt_tokens + warm + steps + 1) // BLOCK_SIZE)
    for impl in impls:
        model = load_model(ref, backend="jax", options=LoadOptions(dtype=dtype, extra={"attention": impl}))
        cache = model.allocate_cache(per_seq * max(batches) + 1, BLOCK_SIZE)
        tables = [np.arange(per_seq, dtype=np.int32) + i * per_seq for i in range(max(batches))]
        rng = np.random.default_rng(0)
        for b in batches:
            print(f"... model {impl} batch {b}", file=sys.stderr, flush=True)
            prompts = rng.integers(0, model.config.vocab_size, size=(b, prompt_tokens), dtype=np.int32)
            last = []
            for g in range(0, b, 8):  # prefill a few sequences per step: bounded activation memory
                chunks = [SequenceChunk(prompts[i], 0, tables[i]) for i in range(g, min(b, g + 8))]
                last.extend(model.forward(ForwardBatch(chunks, BLOCK_SIZE), cache).logits.argmax(-1))
            times = []
            for step in range(warm + steps):
                pos = prompt_tokens + step
                chunks = [SequenceChunk(np.asarray([last[i]], np.int32), pos, tables[i]) for i in range(b)]
                t0 = time.perf_counter()
                out = model.forward(ForwardBatch(chunks, BLOCK_SIZE), cache)
                times.append(time.perf_counter() - t0)
                last = list(out.logits.argmax(-1))
            step_s = statistics.median(times[warm:])
            rows.append(ModelRow(impl, b, prompt_tokens, step_s * 1e3, b / step_s))
        del model, cache
    return rows


def model_table(rows: list[ModelRow], impls: list[str]) -> str:
    by = {(r.attention, r.batch): r for r in rows}
    batches = sorted({r.batch for r in rows})
    head = ["batch", *[f"{i} tok/s" for i in impls], *[f"{i} ms/step" for i in impls]]
    if len(impls) == 2:
        head.append(f"{impls[0]}/{impls[1]}")
    out = [head]
    for b in batches:
        cells = [str(b)]
        cells += [f"{by[(i, b)].tok_s:,.1f}" for i in impls]
        cells += [f"{by[(i, b)].step_ms:.2f}" for i in impls]
        if len(impls) == 2:
            cells.append(f"{by[(impls[0], b)].tok_s / by[(impls[1], b)].tok_s:.2f}x")
        out.append(cells)
    return markdown(out)


# -- driver ------------------------------------------------------------------------------------------------


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
    ap.add_argument("--no-model", action="store_true", help="skip the model part")
    ap.add_argument("--model", default="smollm2", help="model reference for the model part")
    ap.add_argument("--model-batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--model-prompt-tokens", type=int, default=512)
    ap.add_argument("--model-steps", type=int, default=32)
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
    stats = device.memory_stats() or {}
    memory_limit = stats.get("bytes_limit")
    copy_mib = args.copy_mib or (64 if args.interpret else 1024)
    iterations = args.iterations or (3 if args.interpret else 20)
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
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
    for cfg in attention_configs(args.interpret, args.dtypes):
        print(f"... {cfg.label}", file=sys.stderr, flush=True)
        attn_rows.append(bench_attention(cfg, pallas_impl, bw, iterations, args.min_iter_ms / 1e3, memory_limit))
    print()
    print(f"Paged attention, one layer: {HEADS} q heads, {KV_HEADS} kv heads, head dim {HEAD_DIM}, block {BLOCK_SIZE}")
    print(f"pallas = impl {pallas_impl!r}, jnp = impl 'reference'; ms = median per call, both under jax.jit")
    print(attention_table(attn_rows))
    print(
        "bytes moved = K and V of every context token of every sequence + q + output; prefill is compute-bound, "
        "so its floor is a loose bound. rel err = max |pallas - jnp| / max |jnp|, tolerance "
        + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items())
    )

    model_rows: list[ModelRow] = []
    impls = ["pallas", "reference"]
    if cuda and not args.interpret and not args.no_model:
        model_rows = bench_model(
            args.model, impls, args.model_batches, args.model_prompt_tokens, args.model_steps, "bfloat16"
        )
        print()
        print(
            f"{args.model} decode, bfloat16, prompts of {args.model_prompt_tokens} tokens, "
            f"median of {args.model_steps} steps (attention 'pallas' vs 'reference')"
        )
        print(model_table(model_rows, impls))

    failed = [r for r in attn_rows if r.ok is False or r.error]
    if args.json:
        meta = {
            "device": f"{device.device_kind} ({device.platform})",
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
