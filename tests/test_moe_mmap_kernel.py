"""The stored-block experts' kernel (``ruvllm_experts_stored``): a mixture of experts' (token, expert)
rows, sorted by expert with a size per expert, each multiplied by its own expert's matrix read as the
GGUF file stores it (Q4_K, Q6_K, Q8_0, MXFP4 rows of blocks, in a registered region such as the file's
memory map), activations int8 per block of 256 (k-quants) or 32 (Q8_0, MXFP4).

Each row is checked against float64 NumPy of the dequantized blocks (the ``gguf`` library's) times the
int8-rounded activations, within ``1e-5`` of the sum of the terms' magnitudes (float32 sums per block,
added in block order); the variants this CPU runs agree bit for bit (integer sums, one float order),
and a row's result is the same alone or beside other rows and experts.
"""

from __future__ import annotations

import platform

import gguf
import numpy as np
import pytest
from _kquant_files import quantize

from ruvllm_jax import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")

_ARM = platform.machine().lower() in ("aarch64", "arm64")
ISAS = [isa for isa in native.ISAS if isa == "scalar" or isa.startswith("neon") == _ARM]
LAYERS, EXPERTS, OUT, K = 2, 5, 48, 512
BLOCK = {"Q8_0": 32, "Q4_K": 256, "Q6_K": 256, "MXFP4": 32}


def _stack(rng: np.random.Generator, ggml_type: str) -> np.ndarray:
    """``[layers, experts, OUT, row bytes]`` blocks of random matrices."""
    mats = [quantize(rng.standard_normal((OUT, K)).astype(np.float32), ggml_type) for _ in range(LAYERS * EXPERTS)]
    return np.stack(mats).reshape(LAYERS, EXPERTS, OUT, -1)


def _region(*stacks: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """The stacks one after the other in one byte buffer, and each one's offset in it."""
    flat = [s.reshape(-1) for s in stacks]
    offsets = np.cumsum([0] + [f.size for f in flat[:-1]]).tolist()
    return np.concatenate(flat), offsets


def _table(handle: int, offset: int, stack: np.ndarray, ggml_type: str) -> np.ndarray:
    """int32 [layers, 5]: (handle, offset low, offset high, type id, row bytes) of each layer's stack."""
    rows = []
    for layer in range(LAYERS):
        off = offset + layer * stack[0].nbytes
        rows.append([handle, np.uint32(off & 0xFFFFFFFF).view(np.int32), off >> 32, native.STORED_TYPES[ggml_type],
                     stack.shape[-1]])  # fmt: skip
    return np.asarray(rows, np.int32)


def _quantized(x: np.ndarray, block: int) -> np.ndarray:
    """x's activations as the kernel rounds them, in float64: int8 codes per block times the block's
    float32 ``max|x| / 127``."""
    xb = x.reshape(x.shape[0], -1, block)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    q = np.clip(np.rint(np.divide(xb, d, out=np.zeros_like(xb), where=d > 0)), -127, 127)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def _reference(x: np.ndarray, sizes: list[int], stack: np.ndarray, ggml_type: str, layer: int) -> np.ndarray:
    xs = _quantized(x, BLOCK[ggml_type])
    out, bound = np.zeros((x.shape[0], OUT)), np.zeros((x.shape[0], OUT))
    r = 0
    for e, n in enumerate(sizes):
        w = gguf.quants.dequantize(stack[layer, e], gguf.GGMLQuantizationType[ggml_type]).astype(np.float64)
        out[r : r + n] = xs[r : r + n] @ w.T
        bound[r : r + n] = np.abs(xs[r : r + n]) @ np.abs(w).T
        r += n
    return out, bound


@pytest.fixture(scope="module")
def weights() -> dict:
    rng = np.random.default_rng(0)
    stacks = {t: _stack(rng, t) for t in BLOCK}
    region, offsets = _region(*stacks.values())
    handle = native.register_region(region)
    tables = {t: _table(handle, off, stacks[t], t) for t, off in zip(stacks, offsets, strict=True)}
    return {"stacks": stacks, "region": region, "tables": tables}


def _run(weights: dict, x: np.ndarray, sizes: list[int], layer: int, types: list[str]) -> list[np.ndarray]:
    tables = [(weights["tables"][t], OUT) for t in types]
    return [np.asarray(y) for y in native.experts_stored_group(x, np.int32(layer), np.asarray(sizes, np.int32), tables)]


@pytest.mark.parametrize("isa", ISAS)
def test_rows_match_float64_of_the_dequantized_blocks(weights, isa) -> None:
    if isa not in native.supported_isas():
        pytest.skip(f"this CPU cannot run {isa}")
    rng = np.random.default_rng(1)
    sizes = [3, 0, 1, 4, 0]  # experts 1 and 4 get no rows
    x = rng.standard_normal((sum(sizes) + 2, K)).astype(np.float32)  # 2 rows of padding
    x[0, :256] = 0  # an all-zero block
    with native.use_isa(isa):
        for layer in range(LAYERS):
            got = _run(weights, x, sizes, layer, list(BLOCK))
            for t, y in zip(BLOCK, got, strict=True):
                ref, bound = _reference(x, sizes, weights["stacks"][t], t, layer)
                live = sum(sizes)
                assert np.all(np.abs(y[:live] - ref[:live]) <= 1e-5 * bound[:live] + 1e-30), (t, layer)
                assert not y[live:].any()


def test_every_variant_gives_the_same_bits_and_rows_are_batch_invariant(weights) -> None:
    rng = np.random.default_rng(2)
    sizes = [2, 3, 0, 1, 2]
    x = rng.standard_normal((sum(sizes), K)).astype(np.float32)
    runs = []
    for isa in [i for i in ISAS if i in native.supported_isas()]:
        with native.use_isa(isa):
            runs.append(_run(weights, x, sizes, 1, list(BLOCK)))
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            np.testing.assert_array_equal(a, b)
    # Row 5 (expert 3's only row) alone in the step: the same bits as beside the others.
    alone = _run(weights, x[5:6], [0, 0, 0, 1, 0], 1, list(BLOCK))
    for a, b in zip(runs[0], alone, strict=True):
        np.testing.assert_array_equal(a[5:6], b)


def test_blocks_outside_the_region_or_unknown_types_are_refused(weights) -> None:
    x = np.ones((1, K), np.float32)
    bad = weights["tables"]["Q4_K"].copy()
    bad[:, 1] = weights["region"].nbytes - 10  # the stack would run past the region's end
    with pytest.raises(Exception, match="outside the registered region"):
        native.experts_stored_group(x, np.int32(0), np.asarray([1, 0, 0, 0, 0], np.int32), [(bad, OUT)])
    bad = weights["tables"]["Q4_K"].copy()
    bad[:, 3] = 2  # Q4_0: not read as stored
    with pytest.raises(Exception, match="ggml type 2 is not read as stored"):
        native.experts_stored_group(x, np.int32(0), np.asarray([1, 0, 0, 0, 0], np.int32), [(bad, OUT)])


def test_output_rows_past_the_eight_row_blocks_give_the_same_bits_on_every_variant() -> None:
    """20 Q4_K outputs (not a whole number of 8- or 16-row blocks, as kernels split them)
    against float64 and the same bits on every variant."""
    rng = np.random.default_rng(3)
    out = 20
    stack = np.stack([quantize(rng.standard_normal((out, K)).astype(np.float32), "Q4_K") for _ in range(2)])
    region = np.ascontiguousarray(stack.reshape(-1))
    handle = native.register_region(region)
    table = np.asarray([[handle, 0, 0, native.STORED_TYPES["Q4_K"], stack.shape[-1]]], np.int32)
    x = rng.standard_normal((3, K)).astype(np.float32)
    sizes = np.asarray([2, 1], np.int32)
    xs = _quantized(x, 256)
    runs = []
    for isa in [i for i in ISAS if i in native.supported_isas()]:
        with native.use_isa(isa):
            (y,) = native.experts_stored_group(x, np.int32(0), sizes, [(table, out)])
        runs.append(np.asarray(y))
    for r, e in ((0, 0), (1, 0), (2, 1)):
        w = gguf.quants.dequantize(stack[e], gguf.GGMLQuantizationType.Q4_K).astype(np.float64)
        bound = np.abs(xs[r]) @ np.abs(w).T
        assert np.all(np.abs(runs[0][r] - xs[r] @ w.T) <= 1e-5 * bound + 1e-30)
    for other in runs[1:]:
        np.testing.assert_array_equal(other, runs[0])
