"""Load time, resident memory, weight bytes and speed at 8B scale, ruvllm against llama.cpp on one GGUF
(issue 60): by default the Llama-3.1-8B-shaped Q4_K_M file of ``dense_synthetic.py``.

Every figure comes from a fresh child process, the engines taking turns (ruvllm, then llama.cpp),
``--rounds`` times:

    generate    load and generate 8 tokens (greedy): ruvllm's CLI (``ruvllm generate FILE PROMPT
                --max-tokens 8 --temperature 0``), llama.cpp's ``llama_cpp.Llama(n_ctx=512)`` streaming
                a completion. Wall time from the process's start to its first token on stdout
                (``load_to_first_token_s``) and to its exit; peak RSS (the child's ``ru_maxrss`` from
                ``wait4``, and its RssAnon / RssFile sampled every 0.1 s: RssFile is the mapped
                file's pages, clean and shared with the page cache; llama.cpp's RssAnon is mostly
                the tensors its CPU backend repacks); the bytes of weights each holds (ruvllm's load
                log's ``weight_bytes``, llama.cpp's ``llama_model_size``) and its KV cache (ruvllm's
                load log, or its default rule computed here where the log does not say; llama.cpp's
                n_ctx x layers x K and V in float16). A KV cache's pages count in RSS once written,
                so ``peak RSS / (weights + KV)`` flatters a large cache that 8 tokens leave untouched.
    speed       ``bench_backends.py``'s engines (``jax-auto``: the jax backend's own form of the file,
                and llama.cpp with ``--threads``), the same token ids: prefill tok/s of a
                ``--prefill`` token prompt (each length once untimed, then ``--iterations`` timed),
                decode tok/s at batch 1 (the median step of ``--decode-steps`` after a 16-token prompt).

ruvllm's caches (its compiled steps, and whatever else it keeps under ``RUVLLM_CACHE_DIR``) start
empty in a directory of this run's own: round 1 is ruvllm's cold start on a new file, reported
apart; the later rounds' medians are its warm start. The file's pages in the page cache before each
child are measured (``fincore``) and reported; ``--drop-caches`` drops the page cache (root:
``sync; echo 1 > /proc/sys/vm/drop_caches``) before every ``generate`` child, so each reads the file
from disk. This machine's read bandwidth (``bench_moe.read_bandwidth``) gives the fastest decode can
be: the bytes a token reads (every tensor but the embedding, which it reads one row of) over it.

A ruvllm child of the 8B file peaked at 19.6 GB (14.8 GB anonymous) at commit a6eca18: each one waits
(every 30 s, up to 10 minutes) until ``--min-available-gb`` is free. To measure another commit than
the checkout's, put an exported tree's ``packages/*/src`` on PYTHONPATH (with the built
``_cpu_kernels*.so`` copied in) and a ``COMMIT`` file at its root: the children inherit it, and the
JSON names the tree and commit that ran.

    python benchmarks/bench_scale.py --rounds 3                       # the 8B file, written on first use
    python benchmarks/bench_scale.py --layers 2 --rounds 1            # the 2-layer one, for trying things
    python benchmarks/bench_scale.py --file qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --rounds 3
    python benchmarks/bench_scale.py --drop-caches --rounds 3 --json-dir benchmarks/results/<folder>

The JSON goes to ``--json-dir`` (default ``benchmarks/results/<cpu>-<date>-scale/``) as
``<file>-<commit>-<rounds>rounds[-dropped].json``: the summary, every round's figures, and each child's
raw record (its RSS every half second, the page cache before it, ruvllm's load log's fields).

Run it from the ``bench`` session's venv (llama-cpp-python); ruvllm's CLI is that venv's unless
``--ruvllm`` names another. Nothing here is run by the tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROMPT = "The history of the printing press begins in the fifteenth century, when"
GENERATE_TOKENS = 8
#: llama.cpp's context in the generate child (llama_cpp.Llama's default) and in the speed child (its own).
LLAMA_N_CTX = 512
#: What a ruvllm child of the 8B file held at its peak today (issue 60), in GB.
DEFAULT_MIN_AVAILABLE_GB = 18.0


# -- the machine and the file ------------------------------------------------------------------------------


def cpu_tag() -> str:
    """A short name of this CPU for the results folder: ``zen4`` / ``zen5`` for AMD's families 25 (with
    AVX-512) and 26, else the machine's architecture."""
    from provenance import _cpuinfo, cpu_flags

    info = _cpuinfo()
    if info.get("vendor_id") == "AuthenticAMD":
        family = info.get("cpu family")
        if family == "26":
            return "zen5"
        if family == "25":
            return "zen4" if "avx512f" in cpu_flags() else "zen3"
    return platform.machine()


def tensor_bytes(path: Path) -> int:
    """The bytes of the file's tensor data (what llama.cpp maps and reads)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def page_cache_bytes(path: Path) -> int | None:
    """How many of the file's bytes are in the page cache now (``fincore``), None where it cannot tell."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True, text=True
    )
    try:
        return int(out.stdout.split()[0])
    except (IndexError, ValueError):
        return None


def drop_page_cache() -> bool:
    """``sync; echo 1 > /proc/sys/vm/drop_caches`` (root only); whether it worked."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


def memory_available() -> int | None:
    from bench_moe import _memory_available

    return _memory_available()


def wait_for_memory(gb: float, poll_s: float = 30, patience_s: float = 600) -> float | None:
    """Wait until ``gb`` GB are available (MemAvailable); the GB available when it went on."""
    t0 = time.monotonic()
    while True:
        avail = memory_available()
        if avail is None or avail >= gb * 1e9:
            return None if avail is None else avail / 1e9
        if time.monotonic() - t0 > patience_s:
            raise SystemExit(f"only {avail / 1e9:.1f} GB available after {patience_s:.0f} s; need {gb} GB")
        print(f"    waiting: {avail / 1e9:.1f} GB available, {gb} GB wanted", file=sys.stderr, flush=True)
        time.sleep(poll_s)


# -- child processes ---------------------------------------------------------------------------------------


def _status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, VmHWM of ``pid`` in bytes (empty once it has gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def run_child(cmd: list[str], env: dict[str, str], timeout: float, sample_s: float = 0.1) -> dict[str, Any]:
    """Run ``cmd`` to its end: wall seconds from its start to its first byte on stdout and to its exit,
    its peak RSS (``wait4``'s ``ru_maxrss``), the peaks of RssAnon and RssFile sampled every
    ``sample_s`` and the RSS every half second, its stdout and stderr."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first: list[float] = []
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}

    def read(stream: Any, key: str) -> None:
        while data := stream.read1(65536):
            if key == "out" and not first:
                first.append(time.perf_counter() - t0)
            chunks[key].append(data)

    readers = [
        threading.Thread(target=read, args=(proc.stdout, "out"), daemon=True),
        threading.Thread(target=read, args=(proc.stderr, "err"), daemon=True),
    ]
    for r in readers:
        r.start()
    peaks = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
    timeline: list[tuple[float, int]] = []
    done = threading.Event()

    def sample() -> None:
        next_mark = 0.0
        while not done.is_set():
            s = _status(proc.pid)
            now = time.perf_counter() - t0
            for k in peaks:
                peaks[k] = max(peaks[k], s.get(k, 0))
            if s and now >= next_mark:
                timeline.append((round(now, 1), s.get("VmRSS", 0)))
                next_mark = now + 0.5
            done.wait(sample_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
        done.set()
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    for r in readers:
        r.join()
    sampler.join()
    return {
        "rc": proc.returncode,
        "wall_s": wall,
        "first_output_s": first[0] if first else None,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "peak_rss_anon_bytes": peaks["RssAnon"],
        "peak_rss_file_bytes": peaks["RssFile"],
        "rss_timeline": timeline,
        "stdout": b"".join(chunks["out"]).decode(errors="replace"),
        "stderr": b"".join(chunks["err"]).decode(errors="replace"),
    }


def _log_events(stderr: str) -> dict[str, dict[str, Any]]:
    """ruvllm's JSON log lines by event (the last of each)."""
    events: dict[str, dict[str, Any]] = {}
    for line in stderr.splitlines():
        if line.startswith("{"):
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            events[e.get("event", "")] = e
    return events


def _checked(kind: str, got: dict[str, Any]) -> dict[str, Any]:
    if got["rc"] != 0:
        tail = "\n".join(got["stderr"].splitlines()[-15:])
        raise RuntimeError(f"{kind} child failed (exit {got['rc']}):\n{tail}")
    return got


def ruvllm_generate(path: Path, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    cmd = [
        *(args.ruvllm, "generate", str(path), PROMPT, "--max-tokens", str(GENERATE_TOKENS)),
        *("--temperature", "0", "--threads", str(args.threads)),
    ]
    got = _checked("ruvllm generate", run_child(cmd, {**env, "RUVLLM_LOG": "info"}, args.timeout))
    events = _log_events(got.pop("stderr"))
    loaded = events.get("weights loaded", {})
    kv = events.get("kv cache sized by the default rule", {})
    got.update(
        weight_bytes=loaded.get("weight_bytes"),
        decode_weight_bytes=loaded.get("decode_weight_bytes"),
        weights_loaded_s=loaded.get("seconds"),
        quantization=loaded.get("quantization"),
        native_kernels=loaded.get("native_kernels"),
        huge_pages=loaded.get("huge_pages"),
        kv_cache_bytes=int(kv["kv_cache_mib"] * 2**20) if "kv_cache_mib" in kv else ruvllm_kv_bytes(path),
        kv_cache_source="load log" if "kv_cache_mib" in kv else "EngineConfig's default rule, computed here",
        kv_tokens=kv.get("kv_tokens"),
    )
    return got


def llama_generate(path: Path, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "bench_scale.py"), "--child", "llama-generate", "--file", str(path)]
    got = _checked("llama.cpp generate", run_child([*cmd, "--threads", str(args.threads)], env, args.timeout))
    got.update(json.loads(got.pop("stderr").strip().splitlines()[-1]))
    return got


def speed(engine: str, path: Path, ids_file: Path, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [
        *(sys.executable, str(HERE / "bench_scale.py"), "--child", f"{engine}-speed", "--file", str(path)),
        *("--ids", str(ids_file), "--out", str(out), "--threads", str(args.threads)),
        *("--prefill", *map(str, args.prefill), "--decode-steps", str(args.decode_steps)),
        *("--iterations", str(args.iterations)),
    ]
    try:
        got = _checked(f"{engine} speed", run_child(cmd, env, args.timeout))
        got.pop("stdout")
        got.pop("stderr")
        got.update(json.loads(out.read_text()))
    finally:
        out.unlink(missing_ok=True)
    return got


# -- inside the children -----------------------------------------------------------------------------------


def child_llama_generate(args: argparse.Namespace) -> int:
    """Load the file with llama_cpp.Llama and stream ``GENERATE_TOKENS`` greedy tokens to stdout; a JSON
    line on stderr: the weights' bytes, the KV cache's, the tokens."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(args.file), n_ctx=LLAMA_N_CTX, n_threads=args.threads, n_threads_batch=args.threads,
        verbose=False,
    )  # fmt: skip
    chunks = 0
    for chunk in llm.create_completion(PROMPT, max_tokens=GENERATE_TOKENS, temperature=0.0, stream=True):
        chunks += 1
        sys.stdout.write(chunk["choices"][0]["text"] or "\u00b7")  # something on stdout at the first token
        sys.stdout.flush()
    model = llm._model.model
    layers, kv_heads = llama_cpp.llama_model_n_layer(model), llama_cpp.llama_model_n_head_kv(model)
    head_dim = llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)
    info = {
        "weight_bytes": int(llama_cpp.llama_model_size(model)),
        "kv_cache_bytes": LLAMA_N_CTX * layers * 2 * kv_heads * head_dim * 2,  # K and V, float16
        "kv_tokens": LLAMA_N_CTX,
        # The last token is sampled, not evaluated: n_tokens holds the prompt and the others.
        "tokens": llm.n_tokens - len(llm.tokenize(PROMPT.encode())) + 1,
        "stream_chunks": chunks,  # more than the tokens where a token's text is part of a character
    }
    print(json.dumps(info), file=sys.stderr)
    return 0


def child_speed(args: argparse.Namespace, engine: str) -> int:
    """``bench_backends.py``'s engine (``jax-auto`` or ``llama.cpp``) on the ids: prefill of each length,
    decode at batch 1; the figures as JSON in ``--out``."""
    import bench_backends
    from bench_backends import Workload

    ids = json.loads(args.ids.read_text())
    longest = max(args.prefill)
    # The engines' closures read the workload when called: its prefill is set to each length in turn
    # (allocated for the longest).
    batches = sorted({1, args.streams})
    prompts = [ids[16 * i : 16 * (i + 1)] for i in range(max(batches))]  # a 16-token prompt each
    w = Workload(ids[:longest], prompts, args.decode_steps, args.iterations, batches)
    t0 = time.perf_counter()
    e = bench_backends.load_engine(engine, args.file, w, args, {})
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "prefill_tok_s": {}, "prefill_s": {}}
    with e.scope():
        for n in args.prefill:
            w.prefill = ids[:n]
            e.prefill()  # warm-up: compiles the shape
            times = [e.prefill() for _ in range(args.iterations)]
            out["prefill_s"][str(n)] = times
            out["prefill_tok_s"][str(n)] = n / statistics.median(times)
        step = e.decode(1)  # the median of decode_steps steps; the first (which compiles) among them
        out["decode_tok_s"] = 1 / step
        if args.streams > 1:  # every sequence of the batch gets a token a step
            out["decode_tok_s_streams"] = args.streams / e.decode(args.streams)
    out.update(isa=e.result.isa, weights=e.result.weights, notes=e.result.notes, build=e.result.build)
    args.out.write_text(json.dumps(out))
    return 0


# -- the report --------------------------------------------------------------------------------------------


def _median(values: list[Any]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


#: (key, label, unit scale, format) of the table's rows: generate's figures, then speed's.
ROWS = (
    ("load_to_first_token_s", "load to first token (s)", 1, "{:.1f}"),
    ("wall_s", "load + 8 tokens, to exit (s)", 1, "{:.1f}"),
    ("weights_loaded_s", "ruvllm: load log's seconds", 1, "{:.1f}"),
    ("peak_rss_gb", "peak RSS (GB)", 1, "{:.2f}"),
    ("peak_rss_anon_gb", "  of it anonymous, peak (GB)", 1, "{:.2f}"),
    ("peak_rss_file_gb", "  of it file pages, peak (GB)", 1, "{:.2f}"),
    ("weight_mib", "weights held (MiB)", 1, "{:,.0f}"),
    ("decode_weight_mib", "weights a decode token reads (MiB)", 1, "{:,.0f}"),
    ("kv_cache_mib", "KV cache (MiB)", 1, "{:,.0f}"),
    ("rss_over_weights", "peak RSS / weights", 1, "{:.2f}"),
    ("rss_over_weights_kv", "peak RSS / (weights + KV)", 1, "{:.2f}"),
    ("decode_tok_s", "decode tok/s, batch 1", 1, "{:.2f}"),
    ("decode_tok_s_streams", "decode tok/s, all streams (--streams)", 1, "{:.2f}"),
)


def figures(gen: dict[str, Any], spd: dict[str, Any] | None) -> dict[str, Any]:
    """One round's figures of one engine."""
    f: dict[str, Any] = {
        "load_to_first_token_s": gen["first_output_s"],
        "wall_s": gen["wall_s"],
        "weights_loaded_s": gen.get("weights_loaded_s"),
        "peak_rss_gb": gen["peak_rss_bytes"] / 1e9,
        "peak_rss_anon_gb": gen["peak_rss_anon_bytes"] / 1e9,
        "peak_rss_file_gb": gen["peak_rss_file_bytes"] / 1e9,
        "weight_mib": gen["weight_bytes"] / 2**20 if gen.get("weight_bytes") else None,
        "decode_weight_mib": gen["decode_weight_bytes"] / 2**20 if gen.get("decode_weight_bytes") else None,
        "kv_cache_mib": gen["kv_cache_bytes"] / 2**20 if gen.get("kv_cache_bytes") else None,
    }
    if gen.get("weight_bytes"):
        f["rss_over_weights"] = gen["peak_rss_bytes"] / gen["weight_bytes"]
    if gen.get("weight_bytes") and gen.get("kv_cache_bytes"):
        # A KV cache's pages count only once written: a large one mostly untouched flatters this ratio.
        f["rss_over_weights_kv"] = gen["peak_rss_bytes"] / (gen["weight_bytes"] + gen["kv_cache_bytes"])
    if spd is not None:
        f["decode_tok_s"] = spd["decode_tok_s"]
        if "decode_tok_s_streams" in spd:
            f["decode_tok_s_streams"] = spd["decode_tok_s_streams"]
        for n, v in spd["prefill_tok_s"].items():
            f[f"prefill_tok_s@{n}"] = v
        f["speed_child_peak_rss_gb"] = spd["peak_rss_bytes"] / 1e9
        f["speed_child_load_s"] = spd["load_s"]
    return f


def table(summary: dict[str, dict[str, Any]], prefill: list[int], rounds: int) -> str:
    rows = [*ROWS, *((f"prefill_tok_s@{n}", f"prefill tok/s, {n} tokens", 1, "{:.1f}") for n in prefill)]
    rows += [
        ("speed_child_load_s", "speed child: load (s)", 1, "{:.1f}"),
        ("speed_child_peak_rss_gb", "speed child: peak RSS (GB)", 1, "{:.2f}"),
    ]
    cols = ["ruvllm cold (round 1)", f"ruvllm warm (median of {rounds - 1})", f"llama.cpp (median of {rounds})"]
    keys = ["ruvllm_cold", "ruvllm_warm", "llama.cpp"]
    ours = "ruvllm_warm" if rounds > 1 else "ruvllm_cold"
    lines = [f"{'':34}" + "".join(f"{c:>28}" for c in cols) + f"{ours.replace('_', ' ') + ' / llama.cpp':>26}"]
    for key, label, _, fmt in rows:
        if all(summary.get(k, {}).get(key) is None for k in keys):
            continue  # not measured (--no-speed)
        cells = []
        for k in keys:
            v = summary.get(k, {}).get(key)
            cells.append(f"{fmt.format(v) if v is not None else '-':>28}")
        a, b = summary.get(ours, {}).get(key), summary.get("llama.cpp", {}).get(key)
        ratio = f"{a / b:.2f}x" if a is not None and b else "-"
        lines.append(f"{label:34}" + "".join(cells) + f"{ratio:>26}")
    return "\n".join(lines)


def summarize(per_round: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Round 1's ruvllm figures (cold), the medians of its later rounds (warm; none with one round),
    llama.cpp's medians over every round."""

    def med(engine: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
        keys = {k for r in rounds for k in r[engine]}
        return {k: _median([r[engine].get(k) for r in rounds]) for k in sorted(keys)}

    return {
        "ruvllm_cold": dict(per_round[0]["ruvllm"]),
        "ruvllm_warm": med("ruvllm", per_round[1:]) if len(per_round) > 1 else {},
        "llama.cpp": med("llama.cpp", per_round),
    }


def code_state() -> str:
    """Which ruvllm ran: the tree its ``ruvllm_jax`` was imported from (PYTHONPATH may name another than
    this checkout) and that tree's commit: git's, or a ``COMMIT`` file's in an exported tree."""
    import ruvllm_jax

    root = Path(ruvllm_jax.__file__).resolve().parents[4]  # <root>/packages/ruvllm-backend-jax/src/ruvllm_jax
    if (root / "COMMIT").is_file():
        return f"{root}: {(root / 'COMMIT').read_text().strip()} (an exported tree)"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "packages"], cwd=root, capture_output=True,
                               text=True)  # fmt: skip
    except OSError:
        return f"{root}: unknown"
    changed = " with uncommitted changes under packages/" if dirty.stdout.strip() else ""
    return f"{root}: {head.stdout.strip() or 'unknown'}{changed}"


def ruvllm_kv_bytes(path: Path) -> int | None:
    """The KV cache ``ruvllm generate`` allocates by its default rule (one sequence of the model's
    context, float32, capped by ``EngineConfig.kv_cache_memory_bytes``), for a ruvllm whose load log
    does not say; None where the rule's functions are not there."""
    try:
        from ruvllm.checkpoint import open_checkpoint
        from ruvllm.engine.config import EngineConfig, default_num_blocks, kv_block_bytes

        config = open_checkpoint(path).config
        engine = EngineConfig(max_num_seqs=1)
        blocks = default_num_blocks(config, engine, config.max_position_embeddings)
        return int(blocks * kv_block_bytes(config, engine.block_size))
    except (ImportError, TypeError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, help="a GGUF file (default: dense_synthetic.py's, written on first use)")
    ap.add_argument("--layers", type=int, default=32, help="the synthetic file's layers (Llama-3.1-8B: 32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", type=int, nargs="+", default=[256, 512], help="prefill lengths (tokens)")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8, help="decode tok/s of this many sequences at once too")
    ap.add_argument("--iterations", type=int, default=1, help="timed prefills of each length (after one untimed)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ruvllm", default=str(Path(sys.executable).with_name("ruvllm")), help="ruvllm's CLI")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before every generate child")
    ap.add_argument("--no-speed", action="store_true", help="only the generate children (load, memory)")
    ap.add_argument("--min-available-gb", type=float, default=DEFAULT_MIN_AVAILABLE_GB,
                    help="wait for this much free memory before each ruvllm child")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a child may run")
    ap.add_argument("--json-dir", type=Path, help="default: benchmarks/results/<cpu>-<date>-scale")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--ids", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "llama-generate":
        return child_llama_generate(args)
    if args.child in ("jax-auto-speed", "llama.cpp-speed"):
        args.interleave = False  # bench_backends.load_engine reads it
        return child_speed(args, args.child.removesuffix("-speed"))

    from bench_moe import read_bandwidth, token_bytes
    from provenance import cpu_summary, gguf_weights, llama_cpp_build, llama_cpp_summary

    if args.file is None:
        from dense_synthetic import synthetic_q4_k_m

        args.file = synthetic_q4_k_m(args.layers, threads=args.threads)
    path = args.file.resolve()
    from bench_backends import TEXT

    from ruvllm.checkpoint import open_checkpoint

    ids = open_checkpoint(path).tokenizer().encode(TEXT * 4)
    if len(ids) < max(args.prefill):
        raise SystemExit(f"the text gives {len(ids)} tokens, fewer than {max(args.prefill)}")
    work = Path(tempfile.mkdtemp(prefix="bench_scale-"))
    ids_file = work / "ids.json"
    ids_file.write_text(json.dumps(ids[: max(args.prefill)]))
    # ruvllm's caches start empty: round 1 is its cold start on this file.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RUVLLM_CACHE_DIR": str(work / "ruvllm-cache")}
    env["RUVLLM_THREADS"] = str(args.threads)
    env.pop("RUVLLM_JAX_COMPILATION_CACHE", None)

    file_bytes, weights_in_file = path.stat().st_size, tensor_bytes(path)
    tb = token_bytes(path)
    print(f"file: {path} ({file_bytes / 1e9:.2f} GB, tensors {weights_in_file / 2**20:,.0f} MiB): "
          f"{gguf_weights(path)}", flush=True)  # fmt: skip
    load_before = os.getloadavg()
    bandwidth = read_bandwidth(args.threads)
    best = max(bandwidth.values()) * 1e9
    floor = {
        "file_tensor_bytes_s_per_token": weights_in_file / best,
        "token_bytes": tb.total,
        "token_bytes_s_per_token": tb.total / best,
        "decode_tok_s_ceiling": best / tb.total,
    }
    print(f"read bandwidth: {', '.join(f'{v:.1f} GB/s ({k})' for k, v in bandwidth.items())}; "
          f"file tensors / bandwidth = {floor['file_tensor_bytes_s_per_token'] * 1e3:.0f} ms a token; a token "
          f"reads {tb.total / 1e9:.2f} GB: at most {floor['decode_tok_s_ceiling']:.2f} tok/s", flush=True)  # fmt: skip

    per_round: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    for n in range(args.rounds):
        got: dict[str, Any] = {}
        for engine, gen in (("ruvllm", ruvllm_generate), ("llama.cpp", llama_generate)):
            avail = wait_for_memory(args.min_available_gb) if engine == "ruvllm" else memory_available()
            dropped = drop_page_cache() if args.drop_caches else False
            cached = page_cache_bytes(path)
            print(f"... round {n + 1}/{args.rounds}: {engine} generate (page cache: "
                  f"{'?' if cached is None else f'{cached / file_bytes:.0%}'} of the file"
                  f"{', dropped' if dropped else ''})", file=sys.stderr, flush=True)  # fmt: skip
            g = gen(path, args, env)
            g.update(page_cache_before=cached, dropped_caches=dropped, memory_available_gb_before=avail)
            if engine == "llama.cpp":  # its CPU backend multiplies the file's tensors (repacked, same size)
                g["decode_weight_bytes"] = tb.total
            got[engine] = {"generate": g}
        if not args.no_speed:
            for engine, name in (("ruvllm", "jax-auto"), ("llama.cpp", "llama.cpp")):
                if engine == "ruvllm":
                    wait_for_memory(args.min_available_gb)
                print(f"... round {n + 1}/{args.rounds}: {engine} speed", file=sys.stderr, flush=True)
                got[engine]["speed"] = speed(name, path, ids_file, args, env)
        raw.append(got)
        per_round.append({e: figures(v["generate"], v.get("speed")) for e, v in got.items()})
        for e, f in per_round[-1].items():
            shown = ", ".join(f"{k} {v:.3g}" for k, v in f.items() if isinstance(v, float))
            print(f"    {e}: {shown}", file=sys.stderr, flush=True)

    summary = summarize(per_round)
    build = llama_cpp_build()
    meta = {
        "file": str(path),
        "file_bytes": file_bytes,
        "file_tensor_bytes": weights_in_file,
        "model_weights": gguf_weights(path),
        "cpu": cpu_summary(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "code": code_state(),
        "ruvllm_cli": args.ruvllm,
        "llama_cpp": llama_cpp_summary(build) if build else None,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "page_cache": "dropped before every generate child"
        if args.drop_caches
        else "as the previous child left it (bytes resident before each: raw[].*.generate.page_cache_before)",
        "ruvllm_caches": "empty at round 1 (RUVLLM_CACHE_DIR of this run's own), kept for the later rounds",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }  # fmt: skip
    print(f"\ncpu: {meta['cpu']}; load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"ruvllm: {args.ruvllm}, code {meta['code']}; llama.cpp: {meta['llama_cpp']}")
    cold = raw[0]["ruvllm"]["generate"]
    print(f"ruvllm's form: {cold.get('quantization')}, kernels {cold.get('native_kernels')}, "
          f"huge pages {cold.get('huge_pages')}")  # fmt: skip
    print(table(summary, args.prefill, args.rounds))
    print(f"bandwidth floor: {floor['file_tensor_bytes_s_per_token'] * 1e3:.0f} ms a token on the file's tensors "
          f"({best / weights_in_file:.2f} tok/s), {floor['token_bytes_s_per_token'] * 1e3:.0f} ms on what a token "
          f"reads ({floor['decode_tok_s_ceiling']:.2f} tok/s)")  # fmt: skip

    out_dir = args.json_dir or HERE / "results" / f"{cpu_tag()}-{datetime.date.today().isoformat()}-scale"
    out_dir.mkdir(parents=True, exist_ok=True)
    for got in raw:  # the rest of stdout is the generated text
        for v in got.values():
            v["generate"]["stdout"] = v["generate"]["stdout"][:200]
    commit = re.search(r": ([0-9a-f]{7})", meta["code"])
    tag = f"-{commit.group(1)}" if commit else ""
    out = out_dir / f"{path.stem}{tag}-{args.rounds}rounds{'-dropped' if args.drop_caches else ''}.json"
    out.write_text(json.dumps({
        "meta": meta, "read_bandwidth_gb_s": bandwidth, "floor": floor, "summary": summary,
        "rounds": per_round, "raw": raw,
    }, indent=2))  # fmt: skip
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
