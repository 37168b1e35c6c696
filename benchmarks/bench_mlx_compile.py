"""Does ``mx.compile`` pay in the mlx backend's step? The step with the layer's elementwise chains
compiled, as the backend runs it (``ruvllm_mlx.model`` registers ``mx.compile`` with MLX's
primitives, and :func:`ruvllm.modeling.decoder_layer` runs RMSNorm, RoPE and ``silu(gate) * up``
each as one compiled call; ``shapeless=False``: MLX traces once per input shape and caches it),
against the same step with them run operation by operation (registered without ``compile`` for the
duration of a timed call).

Workloads, SmolLM2 from its GGUF file with the file's blocks (``quantization="auto"``): decode at
batch 1 and 16 (each row one token after 128 cached positions) and a 32-token prefill chunk. The two
variants alternate within each round; a figure is the median over rounds of each round's median.
The logits of the two variants are compared too (max |difference|).

    python benchmarks/bench_mlx_compile.py --rounds 7 --iterations 5
    python benchmarks/bench_mlx_compile.py --model path/to/model.gguf --quantization none

Nothing here is run by the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np

from ruvllm import modeling
from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
from ruvllm.runtime import load_model

BLOCK = 16
CONTEXT = 128  # cached positions before each decode row
PREFILL = 32  # tokens of the prefill chunk (MLX's CPU product makes 128 cost ~15 s a call here)


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """The layer's elementwise chains run operation by operation while inside (MLX's primitives
    registered without ``compile``)."""
    modeling.register_primitives(mx, sigmoid=mx.sigmoid, rsqrt=mx.rsqrt)
    try:
        yield
    finally:
        modeling.register_primitives(mx, sigmoid=mx.sigmoid, rsqrt=mx.rsqrt, compile=mx.compile)


def workloads(vocab: int, per_seq: int) -> dict[str, ForwardBatch]:
    rng = np.random.default_rng(0)
    tables = [np.arange(per_seq, dtype=np.int32) + i * per_seq for i in range(16)]

    def decode(n: int) -> ForwardBatch:
        # The cache's contents do not change the work: rows read CONTEXT + 1 slots whatever they hold.
        ids = rng.integers(0, vocab, n)
        return ForwardBatch([SequenceChunk(np.int32([ids[i]]), CONTEXT, tables[i]) for i in range(n)], BLOCK)

    prefill = ForwardBatch([SequenceChunk(rng.integers(0, vocab, PREFILL).astype(np.int32), 0, tables[0])], BLOCK)
    return {"decode b1": decode(1), "decode b16": decode(16), f"prefill {PREFILL}": prefill}


def elementwise_alone(cfg: Any, rows: int, compiled: bool) -> Callable[[], None]:
    """One step's elementwise chains alone at ``rows`` tokens (per layer two RMSNorms, RoPE of q and
    k, the gated activation), inputs made beforehand: the most compiling them could save a step."""
    x, w = mx.random.normal((rows, cfg.hidden_size)), mx.random.normal((cfg.hidden_size,))
    q, k = (
        mx.random.normal((rows, cfg.num_heads, cfg.head_dim)),
        mx.random.normal((rows, cfg.num_kv_heads, cfg.head_dim)),
    )
    cos, sin = mx.random.normal((rows, cfg.head_dim // 2)), mx.random.normal((rows, cfg.head_dim // 2))
    gate, up = mx.random.normal((rows, cfg.intermediate_size)), mx.random.normal((rows, cfg.intermediate_size))
    mx.eval(x, w, q, k, cos, sin, gate, up)
    with contextlib.nullcontext() if compiled else eager():
        norm, rope, act = modeling._elementwise(mx, cfg.rms_norm_eps, cfg)

    def step() -> None:
        outs = []
        for _ in range(cfg.num_layers):
            outs += [norm(x, w), norm(x, w), rope(q, cos, sin), rope(k, cos, sin), act(gate, up)]
        mx.eval(outs)

    return step


def timed(fn: Callable[[], Any], iterations: int) -> float:
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iterations", type=int, default=5, help="timed decode-b1 calls per variant and round")
    args = p.parse_args()

    model = load_model(args.model, backend="mlx", options=LoadOptions(quantization=args.quantization))
    backend = model.model
    per_seq = -(-(max(CONTEXT + 1, PREFILL)) // BLOCK)
    cache = model.allocate_cache(per_seq * 16 + 1, BLOCK)
    batches = workloads(model.config.vocab_size, per_seq)
    variants: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
        "eager": eager,
        "compiled": contextlib.nullcontext,
    }

    def run(variant: str, batch: ForwardBatch) -> np.ndarray:
        with variants[variant]():
            return backend.forward(batch, cache).logits

    for name, batch in batches.items():  # warm-up (compiled: one trace per shape) and the logits check
        got = {v: np.array(run(v, batch)) for v in variants}
        diff = float(np.max(np.abs(got["eager"] - got["compiled"])))
        print(f"{name}: max |logits eager - compiled| = {diff:.3g}")

    per_round: dict[tuple[str, str], list[float]] = {(w, v): [] for w in batches for v in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name, batch in batches.items():
            for v in order:
                n = args.iterations if len(batch.chunks) == 1 and name.startswith("decode") else 1
                per_round[name, v].append(timed(lambda v=v, batch=batch: run(v, batch), n))

    print(
        f"\nmlx {mx.__version__} on {mx.default_device()}, {cpu_name()}, {args.model} quantization "
        f"{backend.options.quantization}; medians of {args.rounds} rounds (decode b1: of {args.iterations} calls each)"
    )
    print(f"{'workload':<14}{'eager ms':>10}{'compiled ms':>13}{'compiled/eager':>16}   per-round ratios")
    for name in batches:
        e, c = (statistics.median(per_round[name, v]) for v in variants)
        ratios = " ".join(
            f"{b / a:.3f}" for a, b in zip(per_round[name, "eager"], per_round[name, "compiled"], strict=True)
        )
        print(f"{name:<14}{e * 1e3:>10.2f}{c * 1e3:>13.2f}{c / e:>16.3f}   {ratios}")

    print("\nthe elementwise chains of one step alone (same variants, medians of alternating calls)")
    for rows in (1, 16, PREFILL):
        steps = {v: elementwise_alone(model.config, rows, v == "compiled") for v in variants}
        for fn in steps.values():
            fn()  # warm-up: the compiled forms trace these shapes
        alone: dict[str, list[float]] = {v: [] for v in variants}
        for i in range(4 * args.iterations):
            for v in variants if i % 2 == 0 else reversed(variants):
                alone[v].append(timed(steps[v], 1))
        e, c = (statistics.median(alone[v]) for v in variants)
        print(f"{rows:>4} rows     {e * 1e3:>10.2f}{c * 1e3:>13.2f}{c / e:>16.3f}")


if __name__ == "__main__":
    main()
