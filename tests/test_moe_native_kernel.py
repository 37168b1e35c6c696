"""The native experts' kernel (``ruvllm_experts``): a mixture of experts' (token, expert) rows, sorted
by expert with a size per expert, each multiplied by its own expert's matrix of the stacked
``[layers, experts, out, in]`` weights.

Each row's result is bit for bit the dense kernel's (``kxa8_group``) for that row and that expert's
matrix alone, on every ISA variant this CPU runs: the same panel kernels, handed the expert's
pointer, whatever the group sizes, the other experts' rows or the split across threads (so a token's
experts' outputs are the same alone or batched, as the dense kernels' are). Experts without rows
are never multiplied: their scales are NaN here, and no output sees one.
"""

from __future__ import annotations

import platform

import jax.numpy as jnp
import numpy as np
import pytest

from ruvllm_jax import native
from ruvllm_jax.quant import quantize_wxa8, to_panels

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")

_ARM = platform.machine().lower() in ("aarch64", "arm64")
ISAS = [isa for isa in native.ISAS if isa == "scalar" or isa.startswith("neon") == _ARM]
LAYERS, EXPERTS = 2, 6


def _supported(isa: str) -> None:
    if isa not in native.supported_isas():
        pytest.skip(f"this CPU cannot run {isa} (it runs {', '.join(native.supported_isas())})")


def _plain_stack(rng: np.random.Generator, out: int, cols: int, bits: int) -> list[tuple[np.ndarray, ...]]:
    """``[layers * experts]`` plain w4a8 matrices (4-bit as Q4_1, 8-bit as Q8_0) in panels."""
    mats = [to_panels(quantize_wxa8(rng.standard_normal((out, cols)).astype(np.float32), bits))
            for _ in range(LAYERS * EXPERTS)]  # fmt: skip
    return [(np.asarray(m.quant), np.asarray(m.scale), None if m.offset is None else np.asarray(m.offset))
            for m in mats]  # fmt: skip


def _kquant_stack(rng: np.random.Generator, out: int, cols: int, bits: int, q6k: bool) -> list[tuple[np.ndarray, ...]]:
    from test_cpu_kernel_variants import _kquant_operands, _random_kquant

    return [tuple(np.asarray(a) for a in _kquant_operands(_random_kquant(rng, out, cols, bits, q6k), bits))
            for _ in range(LAYERS * EXPERTS)]  # fmt: skip


def _stacked(mats: list[tuple[np.ndarray, ...]], poison: list[int], layer: int) -> tuple[jnp.ndarray, ...]:
    """The matrices stacked ``[layers, experts, ...]``; experts ``poison`` of ``layer`` get NaN scales."""
    fields = []
    for i, first in enumerate(mats[0]):
        if first is None:
            fields.append(None)
            continue
        a = np.stack([m[i] for m in mats]).reshape(LAYERS, EXPERTS, *first.shape)
        if i == 1:
            a = a.copy()
            a[layer, poison] = np.nan
        fields.append(jnp.asarray(a))
    return tuple(fields)


def _alone(x: np.ndarray, m: tuple[np.ndarray, ...]) -> np.ndarray:
    """The dense kernel's rows for one matrix."""
    ops = tuple(None if a is None else jnp.asarray(a) for a in m)
    ops = ops if len(ops) == 5 else ops[:3]
    return np.asarray(native.kxa8_group(jnp.asarray(x), jnp.int32(0), [ops])[0])


CASES = [("q4_1", 4, None), ("q8_0", 8, None), ("q4_k", 4, False), ("q5_k", 5, False), ("q6_k", 6, True)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("name", "bits", "q6k"), CASES)
def test_each_row_is_its_experts_dense_product(isa, name, bits, q6k):
    _supported(isa)
    rng = np.random.default_rng(bits + 7 * (q6k is None))
    for out, cols in ((48, 512), (768, 512)):  # the second split across threads
        mats = _plain_stack(rng, out, cols, bits) if q6k is None else _kquant_stack(rng, out, cols, bits, q6k)
        layer = 1
        # Decode-like (few rows, few experts), a chunk (ragged groups), and groups with padding rows after.
        for sizes, pad in (([0, 1, 0, 0, 1, 0], 0), ([3, 0, 7, 1, 0, 2], 0), ([5, 2, 0, 9, 4, 1], 3)):
            poison = [e for e in range(EXPERTS) if sizes[e] == 0]
            stack = _stacked(mats, poison, layer)
            rows = sum(sizes) + pad
            x = (rng.standard_normal((rows, cols)) * rng.uniform(0.1, 30, (rows, 1))).astype(np.float32)
            x[0, :32] = 0.0  # an all-zero group
            with native.use_isa(isa):
                (got,) = native.experts_group(jnp.asarray(x), jnp.int32(layer), jnp.asarray(sizes, jnp.int32),
                                              [stack if len(stack) == 5 else stack[:3]])  # fmt: skip
                got = np.asarray(got)
                r = 0
                for e, n in enumerate(sizes):
                    if n:
                        want = _alone(x[r : r + n], mats[layer * EXPERTS + e])
                        np.testing.assert_array_equal(got[r : r + n], want, err_msg=f"{isa} {name} expert {e}")
                        # One row alone: the same bits as in its group (batch invariance).
                        np.testing.assert_array_equal(_alone(x[r : r + 1], mats[layer * EXPERTS + e])[0], got[r])
                    r += n
            assert np.all(got[sum(sizes) :] == 0), "padding rows come out zero"
            assert np.all(np.isfinite(got)), f"{isa} {name}: an expert without rows was read"


@pytest.mark.parametrize("isa", ISAS)
def test_each_w8a8_row_is_its_experts_dense_product(isa):
    """ruvllm_experts_w8a8: each row the dense w8a8 kernel's for its expert's matrix, bit for bit."""
    from ruvllm_jax.quant import quantize_w8a8

    _supported(isa)
    rng = np.random.default_rng(11)
    for out, cols in ((40, 576), (1536, 576)):
        mats = [quantize_w8a8(rng.standard_normal((out, cols)).astype(np.float32)) for _ in range(LAYERS * EXPERTS)]
        q = jnp.asarray(np.stack([np.asarray(m.quant) for m in mats]).reshape(LAYERS, EXPERTS, out, cols))
        s = jnp.asarray(np.stack([np.asarray(m.scale) for m in mats]).reshape(LAYERS, EXPERTS, out, 1))
        for sizes, pad in (([0, 1, 0, 0, 1, 0], 0), ([5, 2, 0, 9, 4, 1], 3)):
            rows = sum(sizes) + pad
            x = (rng.standard_normal((rows, cols)) * rng.uniform(0.1, 30, (rows, 1))).astype(np.float32)
            with native.use_isa(isa):
                (got,) = native.experts_w8a8_group(
                    jnp.asarray(x), jnp.int32(1), jnp.asarray(sizes, jnp.int32), [(q, s)]
                )
                got = np.asarray(got)
                r = 0
                for e, n in enumerate(sizes):
                    m = mats[EXPERTS + e]
                    for i in range(r, r + n):  # each row alone through the dense kernel
                        (want,) = native.w8a8_group(jnp.asarray(x[i : i + 1]), jnp.int32(0), None,
                                                    [(jnp.asarray(m.quant), jnp.asarray(m.scale))])  # fmt: skip
                        np.testing.assert_array_equal(got[i], np.asarray(want)[0], err_msg=f"{isa} expert {e}")
                    r += n
            assert np.all(got[sum(sizes) :] == 0)


def test_bad_group_sizes_are_refused():
    rng = np.random.default_rng(0)
    stack = _stacked(_plain_stack(rng, 16, 64, 4), [], 0)
    x = jnp.zeros((4, 64), jnp.float32)
    with pytest.raises(Exception, match="add up to more rows"):
        native.experts_group(x, jnp.int32(0), jnp.asarray([3, 2, 0, 0, 0, 0], jnp.int32), [stack])
    with pytest.raises(Exception, match="layer is out of range"):
        native.experts_group(x, jnp.int32(2), jnp.asarray([1, 0, 0, 0, 0, 0], jnp.int32), [stack])
