"""EWC++ over LoRA adapters: online Fisher with decay, task boundaries from a shift in gradient
statistics, and the quadratic penalty that keeps the adapter near its value at the last boundary in
the directions earlier traffic is sensitive to.

The Fisher is taken over the effective weight update ``dW = scale * B @ A`` of each adapted
projection, not over the factors: the factors' diagonal Fisher is degenerate (exactly zero for ``A``
while ``B = 0``, so ``A`` would be free to grow) and depends on how ``dW`` happens to be factored. It
is Kronecker-factored as in K-FAC / online structured Laplace (Ritter et al., 2018): for the
projection ``y = x @ W.T`` the Fisher of ``W`` is approximated by ``diag(f) (x) Sigma``, with
``f_i = sum_t dy_ti^2`` the output-gradient energy of a trajectory's mean log-likelihood and
``Sigma = mean_t x_t x_t^T`` the input covariance, both averaged over the captured trajectories.
The penalty ``lambda/2 * tr(diag(f) D Sigma D^T)`` with ``D = dW - dW_anchor`` then only costs
``r x r`` cores and one ``A @ Sigma`` per projection.

Task boundaries: each trajectory contributes the vector of its ``log f`` (gradient statistics);
when the mean of the last ``patience`` vectors lies further from the current task's running mean
than ``threshold`` times the squared distance expected without a shift (pooled variance), the
traffic shifted:
the task's statistics fold into the consolidated ones (``F <- decay F + (1 - decay) F_task``) and the
anchor moves to the adapter as it was before the shifted trajectories arrived.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from ruvllm_sona.params import Key, Params, copy_params

#: Projections that read the same input share one covariance.
INPUT_GROUP = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp",
               "up_proj": "mlp", "down_proj": "down"}

Group = tuple[int, str]


def group_of(key: Key) -> Group:
    return (key[0], INPUT_GROUP[key[1]])


@dataclass(frozen=True)
class TrajectoryFisher:
    """One trajectory's Fisher factors: output-gradient energy per adapted projection and input
    covariance per input group."""

    f: Mapping[Key, np.ndarray]  # [out]
    sigma: Mapping[Group, np.ndarray]  # [in, in]

    def signature(self, keys: Collection[Key]) -> np.ndarray:
        return np.concatenate([np.log(self.f[k].astype(np.float64) + 1e-30) for k in keys])


@dataclass
class _Observation:
    fisher: TrajectoryFisher
    signature: np.ndarray
    params: Params  # the adapter when it arrived: the anchor if a shift starts here


class _Factors:
    """Running means of ``f`` and ``Sigma``."""

    def __init__(self, keys: Collection[Key], out_dims: Mapping[Key, int], in_dims: Mapping[Group, int]) -> None:
        self.f = {k: np.zeros(out_dims[k], np.float32) for k in keys}
        self.sigma = {g: np.zeros((d, d), np.float32) for g, d in in_dims.items()}
        self.count = 0

    def add(self, t: TrajectoryFisher) -> None:
        self.count += 1
        w = np.float32(1.0 / self.count)
        for k, f in self.f.items():
            f += (t.f[k] - f) * w
        for g, s in self.sigma.items():
            s += (t.sigma[g] - s) * w


class EwcPlusPlus:
    def __init__(
        self, initial: Params, scale: float, *, lam: float, decay: float, threshold: float, patience: int,
        warmup: int,
    ) -> None:
        self.keys = list(initial)
        self.scale = scale
        self.lam = lam
        self.decay = decay
        self.threshold = threshold
        self.patience = patience
        self.warmup = warmup
        self._out = {k: b.shape[0] for k, (_, b) in initial.items()}
        self._in = {group_of(k): a.shape[1] for k, (a, _) in initial.items()}
        self.consolidated = _Factors(self.keys, self._out, self._in)
        self.consolidations = 0
        self.task = _Factors(self.keys, self._out, self._in)
        self._window: deque[_Observation] = deque()
        self._n = 0
        self._mean: np.ndarray | None = None
        self._m2: np.ndarray | None = None
        self.last_shift: float | None = None
        self.set_anchor(initial)

    # -- anchor -----------------------------------------------------------------------------------
    def set_anchor(self, params: Params) -> None:
        self.anchor = copy_params(params)
        self._anchor_a_sigma = {k: a @ self.consolidated.sigma[group_of(k)] for k, (a, _) in self.anchor.items()}

    # -- observation ------------------------------------------------------------------------------
    def observe(self, t: TrajectoryFisher, params: Params) -> bool:
        """Record one captured trajectory; True when it completes a task boundary (consolidated)."""
        obs = _Observation(t, t.signature(self.keys), copy_params(params))
        self._window.append(obs)
        if len(self._window) < self.patience:
            return False
        if self._n >= self.warmup:
            assert self._mean is not None and self._m2 is not None
            # Squared distance of the window's mean from the task's mean, over the variance that
            # distance has under no shift (pooled over coordinates: per-coordinate variances from a
            # handful of trajectories are too noisy). About 1 for stationary traffic.
            pooled_var = float(np.mean(self._m2)) / (self._n - 1)
            window_mean = np.mean([o.signature for o in self._window], axis=0)
            expected = max(pooled_var, 1e-12) * (1.0 / len(self._window) + 1.0 / self._n)
            shift = float(np.mean((window_mean - self._mean) ** 2)) / expected
            self.last_shift = shift
            if shift > self.threshold:
                shifted = list(self._window)
                self._consolidate(shifted[0].params)
                self._window.clear()
                for o in shifted:  # the shifted trajectories open the new task
                    self._accumulate(o)
                return True
        self._accumulate(self._window.popleft())
        return False

    def consolidate(self, params: Params) -> None:
        """Declare a task boundary now (an operator knows the traffic changed)."""
        for o in self._window:
            self._accumulate(o)
        self._window.clear()
        self._consolidate(copy_params(params))

    def _consolidate(self, anchor: Params) -> None:
        if self.task.count:
            c, t = self.consolidated, self.task
            first = self.consolidations == 0
            for k in c.f:
                c.f[k][...] = t.f[k] if first else self.decay * c.f[k] + (1 - self.decay) * t.f[k]
            for g in c.sigma:
                c.sigma[g][...] = t.sigma[g] if first else self.decay * c.sigma[g] + (1 - self.decay) * t.sigma[g]
            c.count += t.count
            self.consolidations += 1
        self.task = _Factors(self.keys, self._out, self._in)
        self._n, self._mean, self._m2 = 0, None, None
        self.set_anchor(anchor)

    def _accumulate(self, o: _Observation) -> None:
        self.task.add(o.fisher)
        x = o.signature
        self._n += 1
        if self._mean is None or self._m2 is None:
            self._mean, self._m2 = x.copy(), np.zeros_like(x)
            return
        d = x - self._mean
        self._mean += d / self._n
        self._m2 += d * (x - self._mean)

    # -- penalty ----------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.lam > 0 and self.consolidations > 0

    def penalty_grad(self, params: Params, keys: Collection[Key]) -> Params:
        """Gradient of ``lambda/2 * tr(diag(f) D Sigma D^T)`` w.r.t. the factors of ``keys``."""
        c = np.float32(self.scale * self.scale * self.lam)
        out: Params = {}
        for k in keys:
            a, b = params[k]
            b0 = self.anchor[k][1]
            f = self.consolidated.f[k][:, None]
            a_sigma = a @ self.consolidated.sigma[group_of(k)]
            a0_sigma = self._anchor_a_sigma[k]
            grad_b = c * f * (b @ (a_sigma @ a.T) - b0 @ (a0_sigma @ a.T))
            grad_a = c * ((b.T @ (f * b)) @ a_sigma - (b.T @ (f * b0)) @ a0_sigma)
            out[k] = (grad_a, grad_b)
        return out

    def penalty(self, params: Params) -> float:
        total = 0.0
        for k in self.keys:
            a, b = params[k]
            a0, b0 = self.anchor[k]
            f = self.consolidated.f[k][:, None]
            sigma = self.consolidated.sigma[group_of(k)]
            a_sigma, a0_sigma = a @ sigma, a0 @ sigma
            total += float(np.trace((b.T @ (f * b)) @ (a_sigma @ a.T)))
            total -= 2.0 * float(np.trace((b.T @ (f * b0)) @ (a0_sigma @ a.T)))
            total += float(np.trace((b0.T @ (f * b0)) @ (a0_sigma @ a0.T)))
        return 0.5 * self.scale * self.scale * self.lam * total

    def stats(self) -> dict[str, object]:
        return {
            "lambda": self.lam,
            "consolidations": self.consolidations,
            "task_samples": self.task.count + len(self._window),
            "consolidated_samples": self.consolidated.count,
            "last_shift": None if self.last_shift is None else round(self.last_shift, 4),
        }

    # -- persistence ------------------------------------------------------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for (li, proj) in self.keys:
            out[f"ewc.f.layers.{li}.{proj}"] = self.consolidated.f[(li, proj)]
            out[f"ewc.anchor.layers.{li}.{proj}.lora_A"] = self.anchor[(li, proj)][0]
            out[f"ewc.anchor.layers.{li}.{proj}.lora_B"] = self.anchor[(li, proj)][1]
        for (li, g), s in self.consolidated.sigma.items():
            out[f"ewc.sigma.layers.{li}.{g}"] = s
        return out

    def load_arrays(self, arrays: Mapping[str, np.ndarray], consolidations: int, consolidated_samples: int) -> None:
        for (li, proj) in self.keys:
            self.consolidated.f[(li, proj)][...] = arrays[f"ewc.f.layers.{li}.{proj}"]
        for (li, g), s in self.consolidated.sigma.items():
            s[...] = arrays[f"ewc.sigma.layers.{li}.{g}"]
        self.consolidated.count = consolidated_samples
        self.consolidations = consolidations
        self.set_anchor({k: (arrays[f"ewc.anchor.layers.{k[0]}.{k[1]}.lora_A"],
                             arrays[f"ewc.anchor.layers.{k[0]}.{k[1]}.lora_B"]) for k in self.keys})
