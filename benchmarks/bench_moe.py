"""Mixture-of-experts decode, ruvllm against llama.cpp on one Q4_K_M file: single-stream decode tok/s
and aggregate tok/s at 8 streams, with the bytes a token reads against this machine's measured read
bandwidth (issue 48's speed check).

The model is ``moe_synthetic.py``'s: Qwen3-30B-A3B's layers (hidden 2048, 32/4 heads of 128, QK-norm,
128 experts of 768, 8 a token), 6 of its 48 by default and a vocabulary scaled with them, written
once and kept in ~/.cache/ruvllm-bench; ``--model`` takes any MoE GGUF instead. The engines are
``bench_backends.py``'s (llama.cpp through llama-cpp-python, ruvllm through its plugins, both with
``--threads``, by default every core: llama.cpp's ``n_threads``, ruvllm's ``RUVLLM_THREADS``), run
by it with ``--interleave``: all in one child process, taking turns figure by figure, each cycle a
round, ratios paired by round.

llama.cpp's OpenMP threads wait for each other by spinning at every operation of the graph, so on a
machine whose cores other processes also use its figures fall apart (here, at a load average of 6 on
2 cores: 5-53 tok/s with 2 threads, where 1 thread held 95-100 in the same minutes): run it on a
quiet machine, or compare at ``--threads 1`` too.

A token's bytes are read from the file: every attention matrix, the router, the chosen experts'
blocks (``experts_per_token`` of ``experts`` of each ``ffn_*_exps`` stack), the norms, the LM head
and one embedding row. A step of ``b`` streams reads the experts the ``b`` tokens chose together:
``experts * (1 - (1 - k/experts)**b)`` of them a layer when routing is uniform (about 52 of 128 at
8 streams, so 8 streams read 2.6x a token's bytes, not 8x). The bandwidth is a plain read (numpy
reductions over 1 GiB, in 1 and in ``--threads`` threads, the best), so ``bytes / bandwidth`` is the
fastest a step can be.

Targets: decode >= 1.2x llama.cpp's; aggregate at 8 streams >= 2x llama.cpp's single stream.

    python benchmarks/bench_moe.py
    python benchmarks/bench_moe.py --iterations 9 --json benchmarks/results/<folder>/moe.json
    python benchmarks/bench_moe.py --only llama.cpp --layers 8
    python benchmarks/bench_moe.py --model Qwen3-30B-A3B-Q4_K_M.gguf --only jax-auto,llama.cpp

Nothing here is run by the tests (tests/test_bench_moe_synthetic.py checks the model's writer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: ``bench_backends.py``'s engine names: ``jax-auto`` is the jax backend's own choice of form for the
#: file (its native kernels on the file's blocks where it can).
DEFAULT_ENGINES = "jax-auto,llama.cpp"
TARGET_DECODE = 1.2  # x llama.cpp's single-stream decode
TARGET_AGGREGATE = 2.0  # aggregate at 8 streams, x llama.cpp's single-stream decode


@dataclass
class TokenBytes:
    """The bytes one decode token reads from the weights, by part."""

    attention: int = 0  # q, k, v, o (and their norms and biases)
    router: int = 0  # ffn_gate_inp
    experts: int = 0  # experts_per_token of each layer's expert stacks
    experts_all: int = 0  # every expert of every layer (what a step reads when all are chosen)
    norms: int = 0  # the layers' and the output's RMSNorm weights
    lm_head: int = 0
    embedding_row: int = 0
    num_experts: int = 0
    experts_per_token: int = 0

    @property
    def total(self) -> int:
        return self.attention + self.router + self.experts + self.norms + self.lm_head + self.embedding_row

    def step(self, streams: int) -> float:
        """Expected bytes of one decode step of ``streams`` tokens when each token's experts are
        drawn uniformly: the experts are read once per step however many tokens chose them."""
        if not self.num_experts:
            return float(self.total)
        chosen = self.num_experts * (1 - (1 - self.experts_per_token / self.num_experts) ** streams)
        per_expert = self.experts_all / self.num_experts
        return self.total - self.experts + chosen * per_expert + (streams - 1) * self.embedding_row


def token_bytes(path: Path) -> TokenBytes:
    """What one decode token reads from ``path``'s weights (see :class:`TokenBytes`)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")

    def number(key: str) -> int:
        field = reader.fields.get(f"{arch}.{key}")
        return int(field.parts[field.data[0]][0]) if field is not None else 0

    out = TokenBytes(num_experts=number("expert_count"), experts_per_token=number("expert_used_count"))
    names = {t.name for t in reader.tensors}
    for t in reader.tensors:
        n = int(t.n_bytes)
        if "_exps." in t.name:
            out.experts_all += n
            out.experts += n * out.experts_per_token // max(out.num_experts, 1)
        elif ".ffn_gate_inp." in t.name:
            out.router += n
        elif t.name == "token_embd.weight":
            out.embedding_row += n // int(t.shape[-1])  # shape: [hidden, vocab], GGUF order
            if "output.weight" not in names:  # tied: the LM head is the embedding
                out.lm_head += n
        elif t.name == "output.weight":
            out.lm_head += n
        elif "norm" in t.name and ".attn_" not in t.name:
            out.norms += n
        elif ".attn_" in t.name:
            out.attention += n
        else:  # anything else a layer holds (dense FFN of a leading block, shared experts): read whole
            out.attention += n
    return out


def stored_types(path: Path) -> dict[str, str]:
    """The file's matrices by block type, the expert stacks apart (provenance.gguf_weights counts
    two-dimensional tensors only): ``{"experts": "Q4_K x16, Q6_K x2", "other": "Q4_K x23, ..."}``."""
    import gguf

    counts: dict[str, Counter[str]] = {"experts": Counter(), "other": Counter()}
    for t in gguf.GGUFReader(path).tensors:
        if len(t.shape) >= 2:
            counts["experts" if "_exps." in t.name else "other"][t.tensor_type.name] += 1
    return {k: ", ".join(f"{name} x{n}" for name, n in c.most_common()) for k, c in counts.items()}


def read_bandwidth(threads: int, mib: int = 1024, repeats: int = 5) -> dict[str, float]:
    """Bytes per second of a plain read of ``mib`` MiB (numpy reductions, which release the GIL,
    over equal slices in 1 and in ``threads`` threads): the best of ``repeats`` each, in GB/s."""
    buf = np.ones(mib * 2**20 // 8, np.int64)
    out: dict[str, float] = {}
    for n in sorted({1, threads}):
        parts = np.array_split(buf, n)
        best = float("inf")
        for _ in range(repeats):
            workers = [threading.Thread(target=np.bitwise_or.reduce, args=(p,)) for p in parts]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = min(best, time.perf_counter() - t0)
        out[f"{n}_threads"] = buf.nbytes / best / 1e9
    return out


def fits_in_memory(path: Path, engine: str) -> str | None:
    """Why ``engine`` cannot load ``path`` here, or None: a form that holds the experts in float32
    (``jax``/``jax-none``, ``candle-compat``, ``jax-auto`` where it resolves to ``none``) needs 4 bytes
    a parameter, which a Qwen3-30B-A3B layer's 604 M expert parameters make 2.4 GB a layer."""
    from ruvllm.backend import LoadOptions
    from ruvllm.checkpoint import open_checkpoint

    base = engine.partition("[")[0]
    if base.startswith("jax"):
        parts = base.split("-")
        form = parts[1] if len(parts) > 1 and parts[1] not in ("xla", "hybrid") else "none"
        if form == "auto":
            from ruvllm_jax.options import auto_quantization

            form = auto_quantization(open_checkpoint(path), LoadOptions(quantization="auto"))
    elif base == "candle-compat":
        form = "none"
    else:
        return None
    if form != "none":
        return None
    import gguf

    params = sum(int(np.prod(t.shape)) for t in gguf.GGUFReader(path).tensors)
    available = _memory_available()
    # Half of what is free: the file's pages (llama.cpp maps it) and other processes share the rest.
    if available is not None and 4 * params > 0.5 * available:
        return (
            f"{engine} holds the weights in float32 ({4 * params / 1e9:.1f} GB), more than this machine has "
            f"free ({available / 1e9:.1f} GB)"
        )
    return None


def _memory_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_engines(path: Path, engines: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """``bench_backends.py --interleave`` on ``path``: its JSON (meta, results, rounds, paired ratios)."""
    import bench_backends

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "backends.json"
        argv = [
            *("--model", str(path), "--only", ",".join(engines), "--batches", *map(str, args.batches)),
            *("--prefill-tokens", str(args.prefill_tokens), "--prompt-tokens", str(args.prompt_tokens)),
            *("--decode-steps", str(args.decode_steps), "--iterations", str(args.iterations)),
            *("--rounds", str(args.rounds), "--threads", str(args.threads), "--interleave", "--json", str(out)),
        ]
        bench_backends.main(argv)
        return json.loads(out.read_text())


def moe_report(data: dict[str, Any], tb: TokenBytes, bandwidth: float, batches: list[int]) -> dict[str, Any]:
    """Per engine: each figure's bytes a second against ``bandwidth`` (bytes/s), and the targets
    from the ratios paired by round (the medians' ratios where there was one round)."""
    engines: dict[str, Any] = {}
    paired = data.get("paired_ratios") or {}
    ref = next((r for r in data["results"] if r["engine"] == "llama.cpp"), None)
    for r in data["results"]:
        row: dict[str, Any] = {"decode_tok_s": r["decode_tok_s"], "aggregate_tok_s": r["aggregate_tok_s"]}
        streams = {"1": r["decode_tok_s"], **{str(b): r["aggregate_tok_s"].get(str(b)) for b in batches}}
        row["gb_s"] = {b: v * tb.step(int(b)) / int(b) / 1e9 for b, v in streams.items() if v}
        row["share_of_bandwidth"] = {b: g * 1e9 / bandwidth for b, g in row["gb_s"].items()}
        if r["engine"] != "llama.cpp" and ref is not None:
            ratios = paired.get(r["engine"], {})
            decode = statistics.median(ratios["decode"]) if "decode" in ratios else _ratio(r, ref, None)
            agg8 = statistics.median(ratios["aggregate@8"]) if "aggregate@8" in ratios else _ratio(r, ref, 8)
            row["decode_vs_llama_cpp"] = decode
            row["aggregate8_vs_llama_cpp_decode"] = agg8
            row["meets_decode_target"] = decode is not None and decode >= TARGET_DECODE
            row["meets_aggregate_target"] = agg8 is not None and agg8 >= TARGET_AGGREGATE
        engines[r["engine"]] = row
    return engines


def _ratio(r: dict[str, Any], ref: dict[str, Any], streams: int | None) -> float | None:
    v = r["decode_tok_s"] if streams is None else r["aggregate_tok_s"].get(str(streams))
    return v / ref["decode_tok_s"] if v and ref["decode_tok_s"] else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a MoE GGUF file (default: moe_synthetic.py's, written on first use)")
    ap.add_argument("--layers", type=int, default=6, help="the synthetic model's layers (Qwen3-30B-A3B: 48)")
    ap.add_argument("--only", default=DEFAULT_ENGINES, help="bench_backends.py's engine names, comma separated")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prefill-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=5, help="cycles of turns (each a round)")
    ap.add_argument("--rounds", type=int, default=1, help="child processes, one after another")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if 8 not in args.batches:
        args.batches.append(8)  # the target's figure

    from moe_synthetic import synthetic_q4_k_m
    from provenance import cpu_summary

    path = args.model or synthetic_q4_k_m(args.layers, threads=args.threads)
    engines = [e.strip() for e in args.only.split(",") if e.strip()]
    skipped = {}
    for e in engines:
        if why := fits_in_memory(path, e):
            skipped[e] = why
            print(f"skipped {why}", file=sys.stderr)
    engines = [e for e in engines if e not in skipped]
    if not engines:
        raise SystemExit("no engine left to run")

    # Same threads for both: ruvllm's kernel pool reads RUVLLM_THREADS (the child process inherits it).
    os.environ.setdefault("RUVLLM_THREADS", str(args.threads))
    tb = token_bytes(path)
    types = stored_types(path)
    load_before = os.getloadavg()  # a shared machine: other processes' load moves every figure
    bandwidth = read_bandwidth(args.threads)
    best = max(bandwidth.values()) * 1e9
    data = run_engines(path, engines, args)
    report = moe_report(data, tb, best, args.batches)

    print(f"\ncpu: {cpu_summary()}; load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"file: {path}: experts {types['experts']}; other matrices {types['other']}")
    measured = ", ".join(f"{v:.1f} GB/s ({k.replace('_', ' ')})" for k, v in bandwidth.items())
    print(
        f"read bandwidth: {measured}; a token reads {tb.total / 1e6:.1f} MB (attention {tb.attention / 1e6:.1f}, "
        f"router {tb.router / 1e6:.1f}, {tb.experts_per_token} of {tb.num_experts} experts {tb.experts / 1e6:.1f}, "
        f"LM head {tb.lm_head / 1e6:.1f}, norms and an embedding row {(tb.norms + tb.embedding_row) / 1e6:.2f}); "
        f"a step of 8 streams {tb.step(8) / 1e6:.1f} MB (uniform routing)"
    )
    print(f"bandwidth floor: decode {best / tb.total:.1f} tok/s, aggregate@8 {8 * best / tb.step(8):.1f} tok/s")
    for engine, row in report.items():
        gb = ", ".join(f"{b} stream{'s' * (b != '1')} {g:.1f} GB/s ({100 * row['share_of_bandwidth'][b]:.0f}%)"
                       for b, g in row["gb_s"].items())  # fmt: skip
        line = f"  {engine}: {gb}"
        if "decode_vs_llama_cpp" in row:
            met = {True: "met", False: "not met"}
            line += (
                f"; decode {row['decode_vs_llama_cpp']:.2f}x llama.cpp's (target {TARGET_DECODE}x: "
                f"{met[row['meets_decode_target']]}), aggregate@8 {row['aggregate8_vs_llama_cpp_decode']:.2f}x its "
                f"single stream (target {TARGET_AGGREGATE}x: {met[row['meets_aggregate_target']]})"
            )
        print(line)
    if args.json:
        moe = {
            "token_bytes": {**asdict(tb), "total": tb.total, "step_8_streams": tb.step(8)},
            "read_bandwidth_gb_s": bandwidth,
            "stored_types": types,
            "load_average_before": load_before,
            "engines": report,
            "skipped": skipped,
            "targets": {"decode_vs_llama_cpp": TARGET_DECODE, "aggregate8_vs_llama_cpp_decode": TARGET_AGGREGATE},
        }
        data["meta"]["bench_moe_args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({**data, "moe": moe}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
