"""Backend throughput on one model: prefill tok/s, single-stream decode tok/s and aggregate decode
tok/s at several batch sizes, for ruvllm's backends and, when installed, llama.cpp (llama-cpp-python,
same GGUF) and Hugging Face transformers (torch, CPU). Medians over iterations; a table on stdout
and the raw figures as JSON and CSV.

    python benchmarks/bench_backends.py --json bench.json --csv bench.csv
    python benchmarks/bench_backends.py --only jax,jax-q8 --batches 1 8
    python benchmarks/bench_backends.py --only jax-w4a8,llama.cpp --isa all --model model.Q4_K_M.gguf
    python benchmarks/bench_backends.py --model gemma3 --only jax-w4a8,llama.cpp --batches 1 32 --rounds 3
    python benchmarks/bench_backends.py --model gemma3 --only jax-w4a8,jax-w4a8-hybrid --rounds 3
    python benchmarks/bench_backends.py --only jax-w4a8,llama.cpp --isa all --interleave --iterations 9

A jax engine's ``-hybrid`` suffix (not in the default list: only models interleaving windowed and
global layers have it) keeps the windowed layers' K/V in a pool of their own, as the engine's hybrid
KV cache does; next to the same engine without it, that is what reading two pools costs a step.

``--isa`` runs the native-kernel engines (jax-w4a8, jax-w8a8) once per ISA variant of the kernels,
each in a child process with ``RUVLLM_CPU_ISA`` set (the variant is chosen once per process), as rows
``jax-w4a8[avx2]``, ``jax-w4a8[avx512vnni]``...; such a name also works in ``--only``. Every report
names the CPU, the ISA variant and weight format each engine ran, and llama.cpp's build.

``--interleave`` runs all the engines in one child process instead, taking turns figure by figure
(ISA variants share one model and switch in place); each cycle of turns is reported as a round, so
the ratios paired by round compare an engine with llama.cpp seconds apart (docs/benchmarks.md).

Every engine runs the same token ids. Warm-up passes (compilation, allocator growth) are run first
and not timed. Nothing here is run by the tests.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from provenance import cpu_summary, gguf_weights, llama_cpp_build, llama_cpp_summary, native_isa, native_isas

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
    "from Mainz, combined movable metal type, oil-based ink and a wooden screw press into a system that could "
    "produce books quickly and cheaply. Before his invention, books were copied by hand, usually by monks, and a "
    "single volume could take months to finish. Within fifty years, printing shops had spread to more than two "
    "hundred cities across Europe, and millions of books were in circulation. "
) * 4


@dataclass
class Result:
    engine: str
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    aggregate_tok_s: dict[int, float] = field(default_factory=dict)
    #: The ISA that ran: ruvllm's native-kernel variant ("xla" without them), llama.cpp's best
    #: compiled-in feature, torch's CPU capability.
    isa: str = "-"
    #: The weights' form in memory as they ran (the file's own types are in the report's header).
    weights: str = "-"
    #: llama.cpp: its CMake arguments and compile-time CPU features.
    build: str = ""
    notes: str = ""


@dataclass
class Workload:
    prefill: list[int]  # one long prompt
    prompts: list[list[int]]  # short prompts, one per sequence of the largest batch
    decode_steps: int
    iterations: int
    batches: list[int]


def median_seconds(fn: Callable[[], float], iterations: int) -> float:
    """Median of ``iterations`` timings; ``fn`` returns the seconds of the part it timed."""
    fn()  # warm-up, untimed
    return statistics.median(fn() for _ in range(iterations))


@dataclass
class Engine:
    """One loaded engine: ``prefill()`` times the long prompt, ``decode(b)`` returns the median
    seconds of one decode step of ``b`` sequences; both run inside ``scope()`` (ruvllm's ISA variant)."""

    result: Result  # name, ISA, weights, build and notes; the figures are filled in by the measurement
    prefill: Callable[[], float]
    decode: Callable[[int], float]
    scope: Callable[[], AbstractContextManager[object]] = nullcontext


def measure(engine: Engine, w: Workload) -> Result:
    """The engine's figures on its own: the median of ``w.iterations`` timings of each."""
    r = replace(engine.result, aggregate_tok_s={})
    with engine.scope():
        r.prefill_tok_s = len(w.prefill) / median_seconds(engine.prefill, w.iterations)
        for b in w.batches:
            step = median_seconds(lambda b=b: engine.decode(b), w.iterations)
            r.aggregate_tok_s[b] = b / step
            if b == 1:
                r.decode_tok_s = 1 / step
    return r


def interleaved(engines: list[Engine], w: Workload, pause: float = 0.05) -> list[list[Result]]:
    """All engines in this one process, taking turns: for each figure (prefill, then decode at each
    batch size), every engine is warmed up once, then each of ``w.iterations`` cycles times every
    engine once, in an order rotated by one per cycle, with ``pause`` seconds before each turn (other
    engines' thread pools spin down). Cycle i's figures make round i's results, so an engine and its
    peer are compared seconds apart, where separate processes minutes apart see the machine's memory
    bandwidth drift."""
    rounds = [[replace(e.result, aggregate_tok_s={}) for e in engines] for _ in range(w.iterations)]
    figures: list[tuple[str, int]] = [("prefill", 0)] + [("decode", b) for b in w.batches]
    for kind, b in figures:

        def once(e: Engine, kind: str = kind, b: int = b) -> float:
            time.sleep(pause)
            with e.scope():
                return e.prefill() if kind == "prefill" else e.decode(b)

        for e in engines:
            once(e)  # warm-up, untimed
        for i in range(w.iterations):
            order = [(j + i) % len(engines) for j in range(len(engines))]
            for j in order:
                seconds = once(engines[j])
                r = rounds[i][j]
                if kind == "prefill":
                    r.prefill_tok_s = len(w.prefill) / seconds
                else:
                    r.aggregate_tok_s[b] = b / seconds
                    if b == 1:
                        r.decode_tok_s = 1 / seconds
    return rounds


# -- ruvllm backends (through the plugin hooks, like the engine) -----------------------------------------


def ruvllm_engine(
    path: Path, backend: str, quantization: str, w: Workload, native: bool = True, hybrid: bool = False
) -> Engine:
    """``hybrid``: the windowed layers of a model interleaving them with global ones keep their K/V in
    a pool of their own (the engine's hybrid KV cache), here as large as the global one and with the
    same tables: what it costs a step to read two pools."""
    from ruvllm.backend import ForwardBatch, LoadOptions, ReportsWeightBytes, SequenceChunk
    from ruvllm.runtime import load_model

    extra = {} if native else {"native": False}
    model = load_model(str(path), backend=backend, options=LoadOptions(quantization=quantization, extra=extra))
    bs = 16
    per_seq = -(-(max(len(w.prefill), max(map(len, w.prompts)) + w.decode_steps) + 1) // bs)
    blocks = per_seq * max(w.batches) + 1
    if hybrid and not model.config.hybrid_window:
        raise SystemExit(f"{path}: a hybrid KV cache needs a model that interleaves windowed and global layers")
    cache = model.allocate_cache(blocks, bs, **({"local_blocks": blocks} if hybrid else {}))
    tables = [np.arange(per_seq, dtype=np.int32) + i * per_seq for i in range(max(w.batches))]

    def chunk(ids: Any, start: int, table: np.ndarray) -> SequenceChunk:
        return SequenceChunk(np.asarray(ids, np.int32), start, table, local_block_table=table if hybrid else None)

    def prefill() -> float:
        one = chunk(w.prefill, 0, tables[0])
        t0 = time.perf_counter()
        model.forward(ForwardBatch([one], bs), cache)
        return time.perf_counter() - t0

    def decode(batch: int) -> float:
        """Prefill ``batch`` prompts (untimed), then the median time of one decode step of all."""
        prompts = w.prompts[:batch]
        chunks = [chunk(p, 0, tables[i]) for i, p in enumerate(prompts)]
        out = model.forward(ForwardBatch(chunks, bs), cache)
        last = out.logits.argmax(-1)
        times = []
        for step in range(w.decode_steps):
            chunks = [chunk([last[i]], len(p) + step, tables[i]) for i, p in enumerate(prompts)]
            t0 = time.perf_counter()
            out = model.forward(ForwardBatch(chunks, bs), cache)
            times.append(time.perf_counter() - t0)
            last = out.logits.argmax(-1)
        return statistics.median(times)

    name = backend if quantization == "none" else f"{backend}-{quantization}"
    r = Result(name + ("" if native else "-xla") + ("-hybrid" if hybrid else ""))
    if backend == "jax":
        r.isa = native_isa() if model.model.native else "xla"
        r.weights = _jax_weights(model.model.weights)
    if backend == "mlx":  # the forms its matrices are held in (Q4_1, Q8_0, Q6_K->8bit, float32...)
        r.weights = ",".join(sorted(model.model.weight_forms()))
    weight_bytes = model.model.weight_bytes if isinstance(model.model, ReportsWeightBytes) else None
    if weight_bytes:
        r.notes = f"weights {weight_bytes / 1e6:.0f} MB"
    return Engine(r, prefill, decode)


def _jax_weights(weights: object) -> str:
    """Each in-memory form's share of the weight bytes: ``int4 g32 asym a8 panel16 67%, ...``
    (asym: a per-group minimum, as GGUF Q4_1; a8: int8 activations; panel16: the kernels' layout)."""
    import jax

    from ruvllm_jax.quant import QuantArray

    sizes: Counter[str] = Counter()
    for leaf in jax.tree_util.tree_leaves(weights, is_leaf=lambda x: isinstance(x, QuantArray)):
        if isinstance(leaf, QuantArray):
            form = [f"int{leaf.bits}", f"g{leaf.group_size}" if leaf.group_size else "per-row"]
            form += ["asym"] * (leaf.offset is not None) + [f"a{leaf.act_bits}"] * bool(leaf.act_bits)
            form += [f"panel{leaf.panel}"] * bool(leaf.panel)
            sizes[" ".join(form)] += leaf.nbytes
        else:
            sizes[str(leaf.dtype)] += leaf.nbytes
    total = sum(sizes.values())
    return ", ".join(f"{k} {100 * n / total:.0f}%" for k, n in sizes.most_common() if n >= total / 200)


# -- llama.cpp ---------------------------------------------------------------------------------------------


def _quiet_llama_cpp() -> object:
    import llama_cpp

    return llama_cpp.llama_log_callback(lambda level, text, user_data: None)


_QUIET_LLAMA_LOG: object = None


def llama_cpp_engine(path: Path, w: Workload, threads: int) -> Engine:
    import llama_cpp

    global _QUIET_LLAMA_LOG
    _QUIET_LLAMA_LOG = _QUIET_LLAMA_LOG or _quiet_llama_cpp()  # ctypes needs the callback kept alive

    n_seq = max(w.batches)
    n_ctx = max(len(w.prefill), n_seq * (max(map(len, w.prompts)) + w.decode_steps)) + 64
    llama_cpp.llama_log_set(_QUIET_LLAMA_LOG, None)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    # The high-level Llama class has one sequence; batched decoding needs a context of our own.
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, 512, 512
    cparams.n_seq_max, cparams.kv_unified = n_seq, True
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    mem = llama_cpp.llama_get_memory(ctx)

    def run(batch_tokens: list[tuple[int, int, int, bool]]) -> None:
        """Decode (token, position, sequence, want_logits) entries in one llama_decode call."""
        b = llama_cpp.llama_batch_init(len(batch_tokens), 0, 1)
        try:
            b.n_tokens = len(batch_tokens)
            for i, (tok, pos, seq, logits) in enumerate(batch_tokens):
                b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
                b.seq_id[i][0] = seq
                b.logits[i] = logits
            if llama_cpp.llama_decode(ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
        finally:
            llama_cpp.llama_batch_free(b)

    def prefill() -> float:
        llama_cpp.llama_memory_clear(mem, True)
        t0 = time.perf_counter()
        run([(t, i, 0, i == len(w.prefill) - 1) for i, t in enumerate(w.prefill)])
        return time.perf_counter() - t0

    def decode(batch: int) -> float:
        llama_cpp.llama_memory_clear(mem, True)
        prompts = w.prompts[:batch]
        run([(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)])
        times = []
        for step in range(w.decode_steps):
            toks = [(int(p[-1]), len(p) + step, s, True) for s, p in enumerate(prompts)]
            t0 = time.perf_counter()
            run(toks)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    build = llama_cpp_build()
    assert build is not None  # llama_cpp imported above
    r = Result("llama.cpp", isa=build["isa"], weights="as stored", build=llama_cpp_summary(build))
    r.notes = f"llama-cpp-python {llama_cpp.__version__}, n_threads={threads}"
    return Engine(r, prefill, decode)


# -- Hugging Face transformers -------------------------------------------------------------------------------


def transformers_engine(path: Path, w: Workload, threads: int) -> Engine:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    @torch.no_grad()
    def prefill() -> float:
        ids = torch.tensor([w.prefill])
        t0 = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t0

    @torch.no_grad()
    def decode(batch: int) -> float:
        # Equal-length prompts: no padding, so every row does exactly the work of its own sequence.
        n = min(len(p) for p in w.prompts[:batch])
        ids = torch.tensor([p[:n] for p in w.prompts[:batch]])
        out = model(ids, use_cache=True, logits_to_keep=1)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(w.decode_steps):
            t0 = time.perf_counter()
            out = model(nxt, past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - t0)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return statistics.median(times)

    r = Result("transformers", notes=f"torch {torch.__version__} CPU float32, {threads} threads")
    r.isa, r.weights = torch.backends.cpu.get_cpu_capability().lower(), "float32"
    return Engine(r, prefill, decode)


def _child_argv(args: argparse.Namespace) -> list[str]:
    """This run's workload options, for a child process that measures one engine of it."""
    return [
        *("--model", str(args.model), "--batches", *map(str, args.batches)),
        *("--prefill-tokens", str(args.prefill_tokens), "--prompt-tokens", str(args.prompt_tokens)),
        *("--decode-steps", str(args.decode_steps), "--iterations", str(args.iterations)),
        *("--threads", str(args.threads)),
    ]


def _in_child(engine: str, args: argparse.Namespace, env: dict[str, str] | None = None) -> list[list[Result]]:
    """Run one engine in a child process: a native crash (llama.cpp built with CPU features the
    machine advertises but cannot run, such as AMX under some hypervisors) then costs only its row,
    and ``env`` can set what a process reads once (``RUVLLM_CPU_ISA`` for ``jax-w4a8[avx2]``)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        cmd = [sys.executable, __file__, *_child_argv(args), "--only", engine, "--json", str(out), "--in-child"]
        cmd += ["--interleave"] * args.interleave
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        if proc.returncode != 0 or not out.exists():
            hint = ""
            if "llama.cpp" in engine.split(","):
                hint = (
                    "; if it crashed in its AMX kernels (a CPU whose AMX the hypervisor does not enable), build "
                    "llama-cpp-python with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 in CMAKE_C_FLAGS and "
                    "CMAKE_CXX_FLAGS (nox -s bench does where /proc/cpuinfo lists amx flags)"
                )
            print(f"    {engine} failed (exit status {proc.returncode}){hint}", file=sys.stderr)
            return [[]]
        data = json.loads(out.read_text())
    rounds = data["rounds"] or [data["results"]]
    return [[Result(**{**r, "aggregate_tok_s": {int(k): v for k, v in r["aggregate_tok_s"].items()}}) for r in got]
            for got in rounds]  # fmt: skip


# -- driver ------------------------------------------------------------------------------------------------------


ENGINES = [
    "jax",
    "jax-q8",
    "jax-q4",
    "jax-w8a8",
    "jax-w8a8-xla",
    "jax-w4a8",
    "jax-w4a8-xla",
    "candle-compat",
    "mlx",
    "llama.cpp",
    "transformers",
]
#: The engines whose native kernels come in ISA variants (``jax-w4a8[avx2]``).
NATIVE_ENGINES = ("jax-w8a8", "jax-w4a8")


def split_isa(engine: str) -> tuple[str, str | None]:
    """``jax-w4a8[avx2]`` -> ``("jax-w4a8", "avx2")``; ``llama.cpp`` -> ``("llama.cpp", None)``."""
    base, bracket, rest = engine.partition("[")
    return base, rest.removesuffix("]") if bracket else None


def expand_isas(engines: list[str], spec: str | None) -> list[str]:
    """Each native-kernel engine once per variant in ``spec`` (``all``: every one this CPU runs)."""
    if not spec:
        return engines
    isas = native_isas() if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    out: list[str] = []
    for e in engines:
        out += [f"{e}[{isa}]" for isa in isas] if e in NATIVE_ENGINES else [e]
    return out


def table(results: list[Result], batches: list[int]) -> str:
    ref = next((r for r in results if r.engine == "llama.cpp"), None)
    head = ["engine", "isa", "weights", "prefill tok/s", "decode tok/s"] + [f"aggregate@{b} tok/s" for b in batches]
    rows = [head]

    def cell(v: float | None, base: float | None) -> str:
        if v is None:
            return "-"
        return f"{v:,.1f}" + (f" ({v / base:.2f}x)" if base and ref is not None else "")

    for r in results:
        row = [
            r.engine,
            r.isa,
            r.weights,
            cell(r.prefill_tok_s, ref and ref.prefill_tok_s),
            cell(r.decode_tok_s, ref and ref.decode_tok_s),
        ]
        row += [cell(r.aggregate_tok_s.get(b), ref and ref.aggregate_tok_s.get(b)) for b in batches]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(wd) for c, wd in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (wd + 2) for wd in widths) + "|")
    return "\n".join(lines)


def write_csv(out: Path, results: list[Result], batches: list[int], meta: dict[str, object]) -> None:
    """One row per engine; the CPU and model columns repeat so that every row stands alone."""
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["engine", "isa", "weights", "prefill_tok_s", "decode_tok_s"]
            + [f"aggregate@{b}_tok_s" for b in batches]
            + ["cpu", "model", "model_weights", "build", "notes"]
        )
        for r in results:
            w.writerow(
                [r.engine, r.isa, r.weights, r.prefill_tok_s, r.decode_tok_s]
                + [r.aggregate_tok_s.get(b) for b in batches]
                + [meta["cpu"], meta["model"], meta["model_weights"], r.build, r.notes]
            )


def load_engine(engine: str, path: Path, w: Workload, args: argparse.Namespace, loaded: dict[str, Engine]) -> Engine:
    """``engine`` loaded in this process. A native-kernel engine's ISA variant (``jax-w4a8[avx2]``)
    shares ``loaded``'s model of its base engine and runs that variant inside its ``scope``."""
    base, isa = split_isa(engine)
    if isa is not None and args.interleave:
        from ruvllm_jax import native

        if base not in loaded:
            loaded[base] = load_engine(base, path, w, args, loaded)
        shared = loaded[base]
        if shared.result.isa == "xla":
            raise SystemExit(f"{engine}: this quantization does not run the native kernels' variants")
        with native.use_isa(isa):  # an unsupported variant: BackendError, before anything is timed
            got = native_isa()
        if got != isa:
            raise SystemExit(f"{engine}: asked for {isa}, the kernels run {got}")
        r = replace(shared.result, engine=engine, isa=isa)
        return Engine(r, shared.prefill, shared.decode, lambda: native.use_isa(isa))
    if base.startswith("jax"):
        # jax, jax-q8, jax-w8a8, ...; a trailing -xla turns the native CPU kernels off, -hybrid keeps the
        # windowed layers' K/V in a pool of their own (-xla-hybrid both).
        parts = base.split("-")
        hybrid = parts[-1] == "hybrid"
        parts = parts[:-1] if hybrid else parts
        xla = parts[-1] == "xla"
        quant = parts[1] if len(parts) > 1 and parts[1] != "xla" else "none"
        e = ruvllm_engine(path, "jax", quant, w, native=not xla, hybrid=hybrid)
        if isa is not None:
            if e.result.isa not in (isa, "xla"):  # "xla": this quantization does not use the kernels' variant
                raise SystemExit(f"{engine}: RUVLLM_CPU_ISA={isa} but the kernels ran {e.result.isa}")
            e.result.engine = engine
        return e
    if base == "candle-compat":
        return ruvllm_engine(path, "candle-compat", "none", w)
    if base in ("mlx", "mlx-none"):  # mlx: the file's blocks (auto); mlx-none: float weights
        e = ruvllm_engine(path, "mlx", "auto" if base == "mlx" else "none", w)
        e.result.engine = base
        return e
    if base == "llama.cpp":
        return llama_cpp_engine(path, w, args.threads)
    if base == "transformers":
        return transformers_engine(path, w, args.threads)
    raise SystemExit(f"unknown engine {engine!r} (known: {', '.join(ENGINES)}, or jax-w4a8[ISA] ...)")


def run_engine(engine: str, path: Path, w: Workload, args: argparse.Namespace) -> list[Result]:
    base, isa = split_isa(engine)
    if not args.in_child and (isa is not None or base == "llama.cpp"):
        return _in_child(engine, args, {"RUVLLM_CPU_ISA": isa} if isa else None)[0]
    return [measure(load_engine(engine, path, w, args, {}), w)]


def run_interleaved(wanted: list[str], path: Path, w: Workload, args: argparse.Namespace) -> list[list[Result]]:
    """Every engine in one process (a child, unless this is it), taking turns (see :func:`interleaved`)."""
    if not args.in_child:
        return _in_child(",".join(wanted), args)
    loaded: dict[str, Engine] = {}
    engines = [load_engine(e, path, w, args, loaded) for e in wanted]
    return interleaved(engines, w)


def median_of_rounds(rounds: list[list[Result]]) -> list[Result]:
    """Per engine, each figure's median over the rounds (one round: as it is); the notes list the
    single-stream decode figure of every round."""
    if len(rounds) == 1:
        return rounds[0]
    out = []
    for first in rounds[0]:
        runs = [r for got in rounds for r in got if r.engine == first.engine]

        def med(values: list[float | None]) -> float | None:
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else None

        decode = [r.decode_tok_s for r in runs]
        aggregate = {b: med([r.aggregate_tok_s.get(b) for r in runs]) for b in first.aggregate_tok_s}
        out.append(
            Result(
                first.engine,
                prefill_tok_s=med([r.prefill_tok_s for r in runs]),
                decode_tok_s=med(decode),
                aggregate_tok_s={b: v for b, v in aggregate.items() if v is not None},
                isa=first.isa,
                weights=first.weights,
                build=first.build,
                notes="; ".join(
                    x for x in (first.notes, "decode per round " + ", ".join(f"{v:.1f}" for v in decode if v)) if x
                ),
            )
        )
    return out


def paired_ratios(rounds: list[list[Result]], batches: list[int]) -> list[tuple[str, dict[str, list[float]]]]:
    """Per engine other than llama.cpp, each figure over llama.cpp's in the same round: prefill and
    decode over llama.cpp's own, aggregate@b over llama.cpp's single-stream decode (the targets'
    terms). The engines of a round run back to back, so a round's ratio compares them under the same
    conditions even when a shared VM's memory bandwidth drifts between rounds; the median of these
    ratios is the comparison that drift moves least (the table's ratios are of medians)."""
    out: dict[str, dict[str, list[float]]] = {}
    for got in rounds:
        ref = next((r for r in got if r.engine == "llama.cpp"), None)
        if ref is None:
            continue
        for r in got:
            if r is ref:
                continue
            keep = out.setdefault(r.engine, {})
            pairs = [("prefill", r.prefill_tok_s, ref.prefill_tok_s), ("decode", r.decode_tok_s, ref.decode_tok_s)]
            pairs += [(f"aggregate@{b}", r.aggregate_tok_s.get(b), ref.decode_tok_s) for b in batches]
            for name, v, base in pairs:
                if v is not None and base:
                    keep.setdefault(name, []).append(v / base)
    return list(out.items())


def paired_table(paired: list[tuple[str, dict[str, list[float]]]]) -> str:
    lines = []
    for engine, figures in paired:
        cells = []
        for name, ratios in figures.items():
            each = ", ".join(f"{x:.2f}" for x in ratios)
            cells.append(f"{name} {statistics.median(ratios):.2f}x ({each})")
        lines.append(f"  {engine}: " + "; ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="model reference or GGUF path (llama.cpp, transformers: GGUF)")
    ap.add_argument("--only", default=",".join(ENGINES), help=f"comma list from {', '.join(ENGINES)}")
    ap.add_argument(
        "--isa",
        help=f"run {', '.join(NATIVE_ENGINES)} once per native-kernel ISA variant: 'all' (every one this CPU "
        "runs) or a comma list such as avx2,avx512vnni",
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prefill-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the engine list this many times, alternating, and report each figure's median over the "
        "rounds (a shared VM's memory bandwidth drifts over minutes: alternating puts every engine in the same "
        "conditions)",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="run every engine in one process, taking turns figure by figure (ISA variants share one model and "
        "switch in place): each of --iterations cycles is a round of its own, paired with llama.cpp's turn in it",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--csv", type=Path, help="write the figures here, one row per engine")
    ap.add_argument("--in-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    from ruvllm.checkpoint import open_checkpoint
    from ruvllm.resolve import resolve

    path = resolve(args.model)
    ids = open_checkpoint(path).tokenizer().encode(TEXT)
    if len(ids) < args.prefill_tokens + max(args.batches):
        raise SystemExit("the benchmark text is too short for these sizes")
    w = Workload(
        prefill=ids[: args.prefill_tokens],
        prompts=[ids[i : i + args.prompt_tokens] for i in range(max(args.batches))],
        decode_steps=args.decode_steps,
        iterations=args.iterations,
        batches=args.batches,
    )
    wanted = expand_isas([e.strip() for e in args.only.split(",") if e.strip()], args.isa)
    if odd := [e for e in wanted if split_isa(e)[1] is not None and split_isa(e)[0] not in NATIVE_ENGINES]:
        raise SystemExit(f"{', '.join(odd)}: only {', '.join(NATIVE_ENGINES)} take an ISA variant")
    if args.rounds < 1:
        raise SystemExit("--rounds must be 1 or more")
    rounds: list[list[Result]] = []
    for n in range(args.rounds if args.interleave else 0):
        if not args.in_child:
            of = f" (round {n + 1} of {args.rounds})" if args.rounds > 1 else ""
            print(f"... {', '.join(wanted)} interleaved{of}", file=sys.stderr, flush=True)
        rounds += run_interleaved(wanted, path, w, args)
    for n in range(0 if args.interleave else args.rounds):
        got: list[Result] = []
        for engine in wanted:
            if not args.in_child:  # the parent said it
                print(f"... {engine}" + (f" (round {n + 1} of {args.rounds})" if args.rounds > 1 else ""),
                      file=sys.stderr, flush=True)  # fmt: skip
            try:
                got.extend(run_engine(engine, path, w, args))
            except ImportError as exc:
                print(f"    skipped {engine}: {exc}", file=sys.stderr)
        rounds.append(got)
    results = median_of_rounds(rounds)
    meta = {
        "model": str(path),
        "model_weights": gguf_weights(path),
        "cpu": cpu_summary(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "load_average": os.getloadavg(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    print(f"model: {path} ({meta['model_weights']})\ncpu: {meta['cpu']}")
    for r in results:
        if r.build:
            print(f"{r.engine}: {r.build}")
    print(table(results, args.batches))
    for r in results:
        if r.notes:
            print(f"  {r.engine}: {r.notes}")
    several = len(rounds) > 1
    paired = paired_ratios(rounds, args.batches) if several else []
    if paired:
        print("paired by round, over llama.cpp in the same round (aggregate: over its single stream);")
        print("median of the rounds, then each round's ratio:")
        print(paired_table(paired))
    if args.json:
        per_round = [[asdict(r) for r in got] for got in rounds] if several else None
        args.json.write_text(
            json.dumps(
                {
                    "meta": meta,
                    "results": [asdict(r) for r in results],
                    "rounds": per_round,
                    "paired_ratios": {engine: figures for engine, figures in paired} or None,
                },
                indent=2,
            )
        )
    if args.csv:
        write_csv(args.csv, results, args.batches, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
