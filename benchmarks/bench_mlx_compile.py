"""Does ``mx.compile`` pay in the mlx backend's step? The step as it runs (eager: one lazy graph per
step, evaluated once) against the same step with the layer's elementwise chains compiled: RMSNorm
(square, mean, rsqrt, two products: one fused call), RoPE (slices, four products, two sums, a concat)
and the gated activation (``silu(gate) * up``), each ``mx.compile``'d with ``shapeless=False``, so MLX
traces once per input shape and caches it (a step's shapes: rows x hidden, rows x heads x head_dim).

The compiled variant lives here, not in the backend: it is routed into
:func:`ruvllm.modeling.decoder_layer` by swapping that module's ``rms_norm`` / ``apply_rope`` /
``gated_activation`` for dispatchers that send MLX arrays to the compiled forms, for the duration of
a timed call only (the backend kept the eager step: docs/mlx-backend.md has the figures and why).

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
import functools
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


@functools.cache
def _compiled_rms_norm(eps: float) -> Callable[[mx.array, mx.array], mx.array]:
    return mx.compile(lambda x, w: _EAGER["rms_norm"](x, w, eps))


@functools.cache
def _compiled_rope() -> Callable[[mx.array, mx.array, mx.array], mx.array]:
    return mx.compile(lambda x, c, s: _EAGER["apply_rope"](x, c, s))


@functools.cache
def _compiled_activation(shape: Any) -> Callable[[mx.array, mx.array], mx.array]:
    return mx.compile(lambda g, u: _EAGER["gated_activation"](g, u, shape))


_EAGER = {name: getattr(modeling, name) for name in ("rms_norm", "apply_rope", "gated_activation")}


def _rms_norm(x: Any, w: Any, eps: float) -> Any:
    if isinstance(x, mx.array):
        return _compiled_rms_norm(float(eps))(x, w)
    return _EAGER["rms_norm"](x, w, eps)


def _apply_rope(x: Any, cos: Any, sin: Any) -> Any:
    if isinstance(x, mx.array):
        return _compiled_rope()(x, cos, sin)
    return _EAGER["apply_rope"](x, cos, sin)


def _gated_activation(gate: Any, up: Any, shape: Any) -> Any:
    if isinstance(gate, mx.array):
        return _compiled_activation(shape)(gate, up)
    return _EAGER["gated_activation"](gate, up, shape)


@contextlib.contextmanager
def compiled_elementwise() -> Iterator[None]:
    """decoder_layer's elementwise chains through their ``mx.compile``'d forms while inside."""
    swapped = {"rms_norm": _rms_norm, "apply_rope": _apply_rope, "gated_activation": _gated_activation}
    for name, fn in swapped.items():
        setattr(modeling, name, fn)
    try:
        yield
    finally:
        for name, fn in _EAGER.items():
            setattr(modeling, name, fn)


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
    norm, rope, act = (_rms_norm, _apply_rope, _gated_activation) if compiled else _EAGER.values()
    eps = cfg.rms_norm_eps

    def step() -> None:
        outs = []
        for _ in range(cfg.num_layers):
            outs += [norm(x, w, eps), norm(x, w, eps), rope(q, cos, sin), rope(k, cos, sin), act(gate, up, cfg)]
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
        "eager": contextlib.nullcontext,
        "compiled": compiled_elementwise,
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
