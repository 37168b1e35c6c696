"""A mixture of experts' step is batch invariant and routes no padding row.

- Routing (:func:`ruvllm.modeling.route`): a row's weights and experts are the same bits alone as in a
  step of many rows, compiled by XLA (whose reductions pick their order from the whole shape).
- The router's product on jax's CPU path (``ruvllm_float_product``): each row the same bits whatever
  the number of rows, within float rounding of float64 NumPy.
- Padding rows (``live_rows``): none of their (token, expert) pairs is counted in a group, so the
  experts' kernels read no expert for them, and the live rows' groups and outputs are the same bits
  as without the padding, in NumPy and in a compiled jax step.

A MoE GGUF's logits alone and beside other sequences, prefill and decode rows, bit for bit:
tests/test_moe_native.py (experts copied) and tests/test_moe_mmap_jax.py (experts mapped, every ISA
variant); greedy tokens through the engine alone and batched: the same files.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ruvllm.modeling import LayerWeights, expert_groups, moe_mlp, route
from ruvllm_jax import native

E, K, HIDDEN, INTER = 16, 4, 64, 32


@dataclasses.dataclass(frozen=True)
class _Shape:
    """The fields of :class:`ruvllm.modeling.LayerShape` a mixture of experts reads."""

    routing: str = "softmax_topk"
    num_experts: int = E
    experts_per_token: int = K
    norm_topk_prob: bool = True
    activation: str = "silu"


def _shape(routing: str = "softmax_topk", experts: int = E, k: int = K) -> _Shape:
    return _Shape(routing, experts, k)


@pytest.mark.parametrize("routing", ["softmax_topk", "topk_softmax"])
def test_a_rows_routing_is_the_same_alone_and_in_a_compiled_batch(routing):
    shape = _shape(routing, 128, 8)  # Qwen3-30B-A3B's: XLA sums 128 values of 64 rows in another order
    logits = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32) * 3
    run = jax.jit(lambda z: route(z, shape))
    alone = [run(logits[i : i + 1]) for i in range(8)]
    for rows in (2, 3, 8, 64):
        weights, experts = run(logits[:rows])
        for i in range(min(rows, 8)):
            np.testing.assert_array_equal(np.asarray(weights[i]), np.asarray(alone[i][0][0]), err_msg=f"{rows} rows")
            np.testing.assert_array_equal(np.asarray(experts[i]), np.asarray(alone[i][1][0]))


@pytest.mark.skipif(not native.available(), reason="native kernels not built")
def test_the_native_float_product_is_batch_invariant_and_exact_to_rounding():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((128, 2048)).astype(np.float32)
    x = rng.standard_normal((300, 2048)).astype(np.float32)  # 300 rows: split across threads
    run = jax.jit(native.float_product)
    alone = np.concatenate([np.asarray(run(x[i : i + 1], w)) for i in range(5)])
    for rows in (1, 2, 5, 17, 300):
        got = np.asarray(run(x[:rows], w))
        np.testing.assert_array_equal(got[:5], alone[:rows], err_msg=f"{rows} rows")
    want = x.astype(np.float64) @ w.astype(np.float64).T
    got = np.asarray(run(x, w))
    for isa in [i for i in native.ISAS if i in native.supported_isas()]:  # each variant's build: same bits
        with native.use_isa(isa):
            np.testing.assert_array_equal(np.asarray(jax.jit(native.float_product)(x, w)), got, err_msg=isa)
    bound = 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
    assert np.all(np.abs(got - want) <= bound)


def test_padding_rows_join_no_group_and_leave_the_live_groups_as_they_were():
    experts = np.random.default_rng(2).integers(0, E, (7, K))
    whole = expert_groups(experts[:5], E)
    padded = expert_groups(experts, E, live_rows=5)
    np.testing.assert_array_equal(padded.sizes, whole.sizes)
    live = 5 * K
    np.testing.assert_array_equal(padded.rows[:live], whole.rows)
    np.testing.assert_array_equal(padded.experts[:live], whole.experts)
    np.testing.assert_array_equal(padded.inverse[:live], whole.inverse)
    assert np.all(padded.inverse[live:] >= live) and np.all(padded.experts < E)
    jgroups = jax.jit(lambda e, n: expert_groups(e, E, n))(jnp.asarray(experts, jnp.int32), jnp.int32(5))
    for got, want in zip(jgroups, padded, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def _moe_weights(rng: np.random.Generator) -> LayerWeights:
    fields = {f.name: None for f in dataclasses.fields(LayerWeights)}
    fields.update(
        router=rng.standard_normal((E, HIDDEN)).astype(np.float32),
        expert_gate=rng.standard_normal((E, INTER, HIDDEN)).astype(np.float32) * 0.1,
        expert_up=rng.standard_normal((E, INTER, HIDDEN)).astype(np.float32) * 0.1,
        expert_down=rng.standard_normal((E, HIDDEN, INTER)).astype(np.float32) * 0.1,
    )
    return LayerWeights(**fields)


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_padding_rows_read_no_expert_and_live_rows_keep_their_bits(xp):
    rng = np.random.default_rng(3)
    lw = _moe_weights(rng)
    shape = _shape()
    h = rng.standard_normal((6, HIDDEN)).astype(np.float32)
    read: list[set[int]] = []

    # Products row by row (one shape each), so the test's own arithmetic is batch invariant too.
    def project(x, group):
        return [xp.stack([xp.asarray(lw.router) @ x[r] for r in range(x.shape[0])])]

    def project_experts(x, sizes, group):
        if xp is np:
            read.append({int(e) for e in np.flatnonzero(sizes)})
        first = np.concatenate([[0], np.cumsum(np.asarray(sizes))]) if xp is np else None
        mats = {"gate_proj": lw.expert_gate, "up_proj": lw.expert_up, "down_proj": lw.expert_down}
        out = []
        for p in group:
            w = xp.asarray(mats[p])
            if xp is jnp:  # traced sizes: padding rows past the groups take the last expert
                expert_of_row = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=x.shape[0])
                out.append(jnp.stack([w[expert_of_row[r]] @ x[r] for r in range(x.shape[0])]))
                continue
            y = np.zeros((x.shape[0], w.shape[1]), np.float32)  # rows past the groups: no expert
            for e in range(E):
                for r in range(first[e], first[e + 1]):
                    y[r] = w[e] @ x[r]
            out.append(y)
        return out

    def run(x, live):
        return moe_mlp(x, lw, shape, project=project, project_experts=project_experts, live_rows=live)[0]

    if xp is jnp:
        run = jax.jit(run)
    want = np.asarray(run(xp.asarray(h[:2]), None))
    got = np.asarray(run(xp.asarray(h), 2))  # 2 live rows, 4 of padding
    np.testing.assert_array_equal(got[:2], want)
    if xp is np:  # the padded step's groups name exactly the live rows' experts
        _, chosen = route(h[:2] @ lw.router.T, shape)
        _, padding = route(h[2:] @ lw.router.T, shape)
        assert read[-2] == {int(e) for e in chosen.ravel()}
        assert set(padding.ravel().tolist()) - read[-2]  # routed, the padding rows would read more
