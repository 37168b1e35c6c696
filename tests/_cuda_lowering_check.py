"""Run in a subprocess by test_cuda_lowering.py, with jax-cuda12-plugin importable (``PYTHONPATH``)
and no GPU: lowers the Pallas attention kernels and every step shape of a tiny Llama and of SmolLM2
for the CUDA platform, as a GPU user's first steps would, and prints one line per check (``ok ...`` /
``FAIL ...``). ``--control``: the kernels without their Triton compiler params, which must fail."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from ruvllm.backend import LoadOptions, StepLimits
from ruvllm.checkpoint import open_checkpoint
from ruvllm.sampling import overlay_widths
from ruvllm_jax import sampling as device_sampling
from ruvllm_jax.kernels import paged_decode_attention, paged_prefill_attention
from ruvllm_jax.runner import JaxModel


def check(name: str, fn, *args) -> None:
    try:
        what = fn(*args)
        print(f"ok {name}{f' ({what})' if what else ''}", flush=True)
    except Exception as exc:  # reported, the test fails on it
        print(f"FAIL {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)


def kernels(dtype, bs: int, heads: int, kv_heads: int, head_dim: int) -> None:
    s, layers, blocks = 3, 2, 64
    kc = jax.ShapeDtypeStruct((layers, blocks, bs, kv_heads, head_dim), dtype)
    i32 = jnp.int32
    tables, ctx = jax.ShapeDtypeStruct((s, 40), i32), jax.ShapeDtypeStruct((s,), i32)
    layer = jax.ShapeDtypeStruct((), i32)
    q1 = jax.ShapeDtypeStruct((s, heads, head_dim), dtype)
    qn = jax.ShapeDtypeStruct((s, 16, heads, head_dim), dtype)

    def decode(q, k, v, lay, t, c, w):
        return paged_decode_attention(q, k, v, lay, t, c, window=w)

    def prefill(q, k, v, lay, t, st, c, w):
        return paged_prefill_attention(q, k, v, lay, t, st, c, window=w)

    jax.jit(decode).trace(q1, kc, kc, layer, tables, ctx, layer).lower(lowering_platforms=("cuda",))
    for splits in (2, 8):  # flash decoding: each sequence's keys cut into parts, merged after

        def split(q, k, v, lay, t, c, w, splits=splits):
            return paged_decode_attention(q, k, v, lay, t, c, window=w, splits=splits)

        jax.jit(split).trace(q1, kc, kc, layer, tables, ctx, layer).lower(lowering_platforms=("cuda",))
    jax.jit(prefill).trace(qn, kc, kc, layer, tables, ctx, ctx, layer).lower(lowering_platforms=("cuda",))


def steps(path: str, dtype: str, attentions: tuple[str, ...], extra: dict | None = None) -> str:
    """Every step shape lowered with each of ``attentions``; with the Pallas kernels, the decode
    steps cut their keys into parts as on a 132-SM GPU (``decode_splits`` auto) unless ``extra``
    forces a number. Reports the shapes lowered and how many of them split their decode keys."""
    options = LoadOptions(quantization="none", dtype=dtype, extra=extra or {})
    model = JaxModel.load(open_checkpoint(path), options)
    cache = model.allocate_cache(64, 16)
    limits = StepLimits(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512)
    done = [model.lower_steps(cache, limits, "cuda", attention) for attention in attentions]
    split = [sum(1 for s in shapes if " splits " in s) for shapes in done]
    if "pallas" in attentions and not split[attentions.index("pallas")]:
        raise AssertionError("no decode step lowered with its keys split")
    return ", ".join(f"{a}: {len(d)} step shapes, {n} split" for a, d, n in zip(attentions, done, split, strict=True))


def sampling(vocab: int) -> str:
    """Every device-sampling variant (overlay widths, with and without the sort) at 1 and 64 rows."""
    from functools import partial

    n = 0
    for rows in (1, 64):
        for width in overlay_widths(vocab):
            for sort in (False, True):
                fn = jax.jit(partial(device_sampling.sample_rows, sort=sort))
                logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32)
                inputs = device_sampling.abstract_inputs(rows, vocab, width)
                fn.trace(logits, inputs).lower(lowering_platforms=("cuda",))
                n += 1
    return f"{n} variants"


def main() -> None:
    if sys.argv[1:] == ["--control"]:  # the kernels under JAX's default Pallas GPU backend (Mosaic GPU)
        import ruvllm_jax.kernels.paged_attention as kernels_module

        kernels_module.TRITON = None
        check("control: kernels float32 block 16 under Mosaic GPU", kernels, jnp.float32, 16, 9, 3, 64)
        return
    for dtype in (jnp.float32, jnp.bfloat16):
        for bs in (8, 16, 32):
            for heads, kv_heads, head_dim in ((9, 3, 64), (8, 1, 256), (32, 8, 128)):
                name = f"kernels {dtype.__name__} block {bs} heads {heads}/{kv_heads} x {head_dim}"
                check(name, kernels, dtype, bs, heads, kv_heads, head_dim)
    tiny, *real = sys.argv[1:]
    check(f"steps {tiny} float32", steps, tiny, "float32", ("pallas", "reference"))
    forced = {"attention": "pallas_interpret", "decode_splits": 4}  # pallas_interpret: loads on this CPU
    check(f"steps {tiny} float32 decode_splits 4", steps, tiny, "float32", ("pallas",), forced)
    for path in real:  # what `auto` gives a GPU user: bfloat16, the Pallas kernels
        check(f"steps {path} bfloat16", steps, path, "bfloat16", ("pallas", "reference"))
    for vocab in (97, 49152, 128256):  # a tiny model's, SmolLM2's, Llama-3's
        check(f"sampling vocab {vocab}", sampling, vocab)


if __name__ == "__main__":
    main()
