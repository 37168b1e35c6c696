"""EWC++ on LoRA factors: the Kronecker-factored penalty and its gradient against float64 autograd of
the dense formula, EWC++'s decayed consolidation, and task-boundary detection on gradient statistics."""

from __future__ import annotations

import numpy as np
import pytest

from ruvllm_sona.ewc import EwcPlusPlus, TrajectoryFisher

SCALE = 2.0
KEYS = [(0, "q_proj"), (0, "v_proj"), (1, "o_proj")]
DIMS = {"q_proj": (12, 10), "v_proj": (6, 10), "o_proj": (10, 12)}  # (out, in)


def _params(rng, rank=2, size=1.0):
    return {k: ((rng.standard_normal((rank, DIMS[k[1]][1])) * size).astype(np.float32),
                (rng.standard_normal((DIMS[k[1]][0], rank)) * size).astype(np.float32)) for k in KEYS}


def _fisher(rng, shift=0.0):
    f = {k: (rng.uniform(0.5, 1.5, DIMS[k[1]][0]) * np.exp(shift)).astype(np.float32) for k in KEYS}
    sigma = {}
    for li, group, d in ((0, "attn", 10), (1, "o", 12)):
        x = rng.standard_normal((20, d))
        sigma[(li, group)] = (x.T @ x / 20).astype(np.float32)
    return TrajectoryFisher(f, sigma)


def _ewc(initial, **kw):
    kw = {"lam": 3.0, "decay": 0.9, "threshold": 2.0, "patience": 2, "warmup": 4} | kw
    return EwcPlusPlus(initial, SCALE, **kw)


def test_penalty_and_gradient_match_dense_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    anchor, params = _params(rng), _params(rng)
    ewc = _ewc(anchor)
    ewc.consolidate(anchor)  # no task statistics yet: nothing to fold in, anchor set
    ewc.task.add(_fisher(rng))
    ewc.consolidate(anchor)
    assert ewc.consolidations == 1 and ewc.active

    total = torch.zeros((), dtype=torch.float64)
    leaves = {}
    for k in KEYS:
        a = torch.tensor(params[k][0], dtype=torch.float64, requires_grad=True)
        b = torch.tensor(params[k][1], dtype=torch.float64, requires_grad=True)
        leaves[k] = (a, b)
        a0, b0 = (torch.tensor(x, dtype=torch.float64) for x in anchor[k])
        d = SCALE * (b @ a - b0 @ a0)  # dense weight update difference [out, in]
        f = torch.tensor(ewc.consolidated.f[k], dtype=torch.float64)
        sigma = torch.tensor(ewc.consolidated.sigma[(k[0], "attn" if k[1] != "o_proj" else "o")], dtype=torch.float64)
        total = total + 0.5 * ewc.lam * torch.trace(torch.diag(f) @ d @ sigma @ d.T)
    total.backward()
    assert ewc.penalty(params) == pytest.approx(float(total.detach()), rel=1e-5)
    grads = ewc.penalty_grad(params, KEYS)
    for k in KEYS:
        np.testing.assert_allclose(grads[k][0], leaves[k][0].grad.numpy(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(grads[k][1], leaves[k][1].grad.numpy(), rtol=1e-4, atol=1e-6)
    zero = ewc.penalty_grad(anchor, KEYS)
    assert ewc.penalty(anchor) == pytest.approx(0.0, abs=1e-9)
    assert all(np.abs(g).max() < 1e-5 for pair in zero.values() for g in pair)


def test_consolidation_is_a_decayed_average():
    rng = np.random.default_rng(1)
    p = _params(rng)
    ewc = _ewc(p)
    first, second = _fisher(rng), _fisher(rng)
    ewc.task.add(first)
    ewc.consolidate(p)
    ewc.task.add(second)
    ewc.consolidate(p)
    k = KEYS[0]
    np.testing.assert_allclose(ewc.consolidated.f[k], 0.9 * first.f[k] + 0.1 * second.f[k], rtol=1e-6)
    np.testing.assert_allclose(ewc.consolidated.sigma[(0, "attn")],
                               0.9 * first.sigma[(0, "attn")] + 0.1 * second.sigma[(0, "attn")], rtol=1e-5)
    assert ewc.consolidations == 2


def test_boundary_fires_on_a_shift_and_not_on_stationary_traffic():
    rng = np.random.default_rng(2)
    p = _params(rng)
    ewc = _ewc(p)
    assert not any(ewc.observe(_fisher(rng), p) for _ in range(200))
    assert ewc.consolidations == 0
    moved = {k: (a + 1.0, b + 1.0) for k, (a, b) in p.items()}
    fired = [ewc.observe(_fisher(rng, shift=1.0), moved) for _ in range(2)]
    assert fired.count(True) == 1
    assert ewc.consolidations == 1
    # The anchor is the adapter as it was before the shifted trajectories arrived.
    np.testing.assert_array_equal(ewc.anchor[KEYS[0]][0], p[KEYS[0]][0])
    # Only stationary trajectories were consolidated; the new task starts with those in the window.
    assert ewc.consolidated.count + ewc.task.count + len(ewc._window) == 202
    assert ewc.consolidated.count >= 198


def test_detection_restarts_after_a_boundary():
    """The shifted traffic becomes the new task: no second boundary while it stays as it is."""
    rng = np.random.default_rng(3)
    p = _params(rng)
    ewc = _ewc(p)
    for _ in range(100):
        ewc.observe(_fisher(rng), p)
    fired = [ewc.observe(_fisher(rng, shift=1.0), p) for _ in range(100)]
    assert fired.count(True) == 1 and ewc.consolidations == 1
