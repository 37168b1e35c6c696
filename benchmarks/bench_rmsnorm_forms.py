"""RMSNorm's mean of squares in three forms, on SmolLM2 w4a8 (jax, CPU): XLA's own reduce (before
batch invariance; its order moves with the row count), the fixed-order XLA tree, and the native
fixed-order pass (the default). Raw forward: a 512-token prefill chunk, decode at batch 1 and 32.

Each form runs in a process of its own (the model's primitives are registered at import), the forms
alternating for ``--rounds`` rounds; prints each run as JSON and the medians per form.

    python benchmarks/bench_rmsnorm_forms.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

FORMS = ("xla", "tree", "native")


def run_form(form: str) -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from ruvllm.modeling import register_primitives
    from ruvllm_jax import model as _jax_model  # noqa: F401  (registers the default primitives first)
    from ruvllm_jax import row_sums

    if form == "xla":
        register_primitives(jnp, sigmoid=jax.nn.sigmoid, rsqrt=lax.rsqrt, mean_square=None)
    elif form == "tree":
        register_primitives(
            jnp, sigmoid=jax.nn.sigmoid, rsqrt=lax.rsqrt, mean_square=lambda x: row_sums.tree_row_mean(x * x)
        )
    from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
    from ruvllm.resolve import resolve
    from ruvllm.runtime import load_model

    model = load_model(str(resolve("smollm2")), backend="jax", options=LoadOptions(quantization="w4a8"))
    bs, per_seq, batch_max = 16, 40, 32
    cache = model.allocate_cache(per_seq * batch_max + 1, bs)
    tables = [np.arange(per_seq, dtype=np.int32) + i * per_seq for i in range(batch_max)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20000, 40).tolist() for _ in range(batch_max)]
    long = rng.integers(100, 20000, 512).astype(np.int32)

    def prefill(n: int) -> float:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            model.forward(ForwardBatch([SequenceChunk(long, 0, tables[0])], bs), cache)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    def decode(batch: int, steps: int) -> float:
        chunks = [SequenceChunk(np.asarray(p, np.int32), 0, tables[i]) for i, p in enumerate(prompts[:batch])]
        last = model.forward(ForwardBatch(chunks, bs), cache).logits.argmax(-1)
        times = []
        for s in range(steps):
            chunks = [SequenceChunk(np.asarray([last[i]], np.int32), 40 + s, tables[i]) for i in range(batch)]
            t = time.perf_counter()
            out = model.forward(ForwardBatch(chunks, bs), cache)
            times.append(time.perf_counter() - t)
            last = out.logits.argmax(-1)
        return statistics.median(times) * 1e3

    prefill(2), decode(1, 10), decode(32, 3)  # compile
    return {"prefill512_ms": prefill(9), "b1_ms": decode(1, 150), "b32_ms": decode(32, 40)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--form", choices=FORMS, help=argparse.SUPPRESS)  # one child process
    args = p.parse_args()
    if args.form:
        print(json.dumps({"form": args.form, **run_form(args.form)}))
        return 0
    runs: dict[str, list[dict[str, float]]] = {f: [] for f in FORMS}
    for _ in range(args.rounds):
        for form in FORMS:
            out = subprocess.run([sys.executable, __file__, "--form", form], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            runs[form].append(row)
    for form, rows in runs.items():
        med = {k: round(statistics.median(r[k] for r in rows), 3) for k in ("prefill512_ms", "b1_ms", "b32_ms")}
        print(f"median {form}: {json.dumps(med)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
