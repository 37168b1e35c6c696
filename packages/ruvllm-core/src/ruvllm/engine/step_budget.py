"""How many prompt tokens the next step may carry so that it stays within a latency target.

Every step is also an inter-token gap for each decoding stream, so a step that prefills a long
prompt in one piece stalls them all. The engine learns what steps cost on this device from the
steps it ran: a linear model of the step's milliseconds,

    ms = a + b * decoding sequences + (c + d * prompt tokens if the step carries prompt tokens)

fitted by least squares over the last :data:`WINDOW` steps (from running sums of the normal
equations, so a step's refit is one 4x4 solve; the sums are rebuilt from the window every
:data:`WINDOW` steps, so rounding cannot build up). The prompt step's own fixed cost ``c``
is only told apart from ``a`` by decode-only steps, so when streams decode but every recent step
also carried prompt tokens, one step in :data:`PROBE_EVERY` is decode-only (a budget of 0). While
some sequence decodes, the prompt budget is the largest power of two of tokens whose predicted step
time fits the target (powers of two: backends pad prompt chunks to them), never below
:data:`MIN_PREFILL_TOKENS` so prompts always progress; while none does, a step takes all the prompt
tokens it can hold.

The target is absolute (``target_ms``), relative to the decode-only step of the same sequences
(``ratio``: a step that carries prompt tokens may last at most ``ratio`` times as long, so the
inter-token latency's tail stays within a multiple of its median whatever the device), or the
smaller of both.
"""

from __future__ import annotations

from collections import deque

import numpy as np

#: Prompt tokens a step may always carry, whatever the target.
MIN_PREFILL_TOKENS = 16
#: Prompt budget before any step with a prompt chunk has been measured.
INITIAL_PREFILL_TOKENS = 256
#: Steps the cost model is fitted on (the most recent ones: costs drift with context lengths).
WINDOW = 128
#: A step slower than this many times its prediction (a compile, a paused process) is not learnt.
OUTLIER = 10.0
#: Steps with prompt tokens in a row after which one decode-only step measures what decoding costs.
PROBE_EVERY = 32
#: Steps observe's outlier test may use one fit for (the budget itself always refits).
REFIT_EVERY = 16
#: The ridge penalty per step in the window, on a, b, c and d.
_PENALTY = np.diag([1e-6, 1e-6, 1e-2, 1e-6])


def _predict(coef: np.ndarray | None, num_decode: int, prompt_tokens: int) -> float:
    """Milliseconds the model ``coef`` (a, b, c, d) predicts for a step (0 without a model)."""
    if coef is None:
        return 0.0
    extra = coef[2] + coef[3] * prompt_tokens if prompt_tokens > 0 else 0.0
    return float(coef[0] + coef[1] * num_decode + extra)


class StepBudget:
    """A cost model of steps, fitted on the steps observed, and the prompt budget it gives."""

    def __init__(self, target_ms: float | None, max_tokens: int, ratio: float | None = None) -> None:
        if target_ms is None and ratio is None:
            raise ValueError("a step budget needs a target: target_ms, ratio or both")
        self.target_ms = target_ms
        self.ratio = ratio
        self.max_tokens = max_tokens
        #: (decoding sequences, prompt tokens, milliseconds) of the recent steps.
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)
        self._coef: np.ndarray | None = None  # a, b, c, d of the module docstring
        self._prompt_steps_in_a_row = 0
        # The normal equations' sums over the window (x'x, x'ms), the window's steps with prompt
        # tokens, and the appends left before the sums are rebuilt from the window.
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        self._prompt_steps = 0
        self._until_rebuild = WINDOW
        # The last fit, and the steps observed since: what observe's outlier test uses.
        self._checked_with: np.ndarray | None = None
        self._since_fit = 0

    @staticmethod
    def _row(num_decode: int, prompt_tokens: int) -> np.ndarray:
        return np.array([1.0, num_decode, 1.0 if prompt_tokens > 0 else 0.0, prompt_tokens])

    def _account(self, step: tuple[int, int, float], sign: float) -> None:
        n, p, ms = step
        x = self._row(n, p)
        self._xtx += sign * np.outer(x, x)
        self._xty += (sign * ms) * x
        self._prompt_steps += int(sign) if p > 0 else 0

    # -- the model -----------------------------------------------------------------------------------
    def _fit(self) -> np.ndarray | None:
        if self._coef is not None or self._prompt_steps == 0:
            return self._coef
        # Ridge, strongest on c: without decode-only steps it is not identifiable from a, and the
        # fit then puts the fixed cost into a (which only makes the decode estimate err high).
        penalty = _PENALTY * len(self._steps)
        coef = np.linalg.solve(self._xtx + penalty, self._xty)
        self._coef = self._checked_with = np.maximum(coef, 0.0)
        self._since_fit = 0
        if self._coef[3] <= 0:  # a prompt token always costs something
            obs = np.array(self._steps, np.float64)
            p, ms = obs[:, 1], obs[:, 2]
            self._coef[3] = max(float(np.median((ms[p > 0]) / p[p > 0])), 1e-6)
        return self._coef

    def decode_estimate(self, num_decode: int) -> float:
        """Milliseconds of a decode-only step of ``num_decode`` sequences (0 before any step ran)."""
        coef = self._fit()
        if num_decode <= 0 or coef is None:
            return 0.0
        return float(coef[0] + coef[1] * num_decode)

    def estimate(self, num_decode: int, prompt_tokens: int) -> float:
        """Predicted milliseconds of a step (0 before a step with prompt tokens ran)."""
        return _predict(self._fit(), num_decode, prompt_tokens)

    @property
    def ms_per_prompt_token(self) -> float | None:
        """The model's milliseconds per prompt token (None until a step with prompt tokens ran)."""
        coef = self._fit()
        return None if coef is None else float(coef[3])

    # -- the budget ----------------------------------------------------------------------------------
    def step_target(self, num_decode: int) -> float:
        """Milliseconds a step with prompt tokens beside ``num_decode`` decoding sequences may take."""
        target = float("inf") if self.target_ms is None else self.target_ms
        decode = self.decode_estimate(num_decode)
        if self.ratio is not None and decode > 0:
            target = min(target, self.ratio * decode)
        return target

    def prefill_budget(self, num_decode: int) -> int:
        """Prompt tokens the next step may carry beside ``num_decode`` decoding sequences (all it
        can hold when nothing decodes: there is no stream to keep moving; 0 for a probe step)."""
        room = self.max_tokens - num_decode
        if num_decode <= 0:
            return room
        if self._prompt_steps_in_a_row >= PROBE_EVERY:
            return 0  # a decode-only step: what decoding alone costs now
        coef = self._fit()
        if coef is None:
            tokens = INITIAL_PREFILL_TOKENS
        else:
            target = self.step_target(num_decode)
            if target == float("inf"):
                tokens = room
            else:
                fixed = coef[0] + coef[1] * num_decode + coef[2]
                tokens = int((target - fixed) / max(coef[3], 1e-6))
        tokens = max(MIN_PREFILL_TOKENS, min(tokens, room))
        return 1 << (tokens.bit_length() - 1)  # a power of two: what the backend pads chunks to

    def observe(self, num_decode: int, prompt_tokens: int, ms: float) -> None:
        """Record a step's cost. Outliers (a shape compiled during the step, a paused process) are
        kept out: a step slower than :data:`OUTLIER` times its prediction is not learnt."""
        prompt_tokens = prompt_tokens if prompt_tokens > 1 else 0
        # Once half a window is in, the outlier test takes a fit up to REFIT_EVERY steps old rather
        # than refitting every step (a stall is ten times its prediction: a few steps' drift cannot
        # hide one, and a fit of half a window no longer swings with each step).
        stale_ok = len(self._steps) >= WINDOW // 2 and self._since_fit < REFIT_EVERY
        if self._coef is None and self._checked_with is not None and stale_ok:
            coef = self._checked_with
        else:
            coef = self._fit()
        self._since_fit += 1
        predicted = _predict(coef, num_decode, prompt_tokens)
        if predicted > 0 and ms > OUTLIER * predicted:
            return
        self._prompt_steps_in_a_row = self._prompt_steps_in_a_row + 1 if prompt_tokens else 0
        step = (num_decode, prompt_tokens, ms)
        if len(self._steps) == WINDOW:
            self._account(self._steps[0], -1.0)
        self._steps.append(step)
        self._until_rebuild -= 1
        if self._until_rebuild <= 0:
            self._xtx[:], self._xty[:], self._prompt_steps = 0.0, 0.0, 0
            for kept in self._steps:
                self._account(kept, 1.0)
            self._until_rebuild = WINDOW
        else:
            self._account(step, 1.0)
        self._coef = None
        if self._prompt_steps == 0:  # no model until a step with prompt tokens is in the window again
            self._checked_with = None
