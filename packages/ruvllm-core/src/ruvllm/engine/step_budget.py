"""How many prompt tokens the next step may carry so that it stays within a latency target.

Every step is also an inter-token gap for each decoding stream, so a step that prefills a long
prompt in one piece stalls them all. The engine learns what steps cost on this device: decode-only
steps by their number of sequences, and the extra milliseconds per prompt token of steps that carry
prompt chunks. While some sequence decodes, the prompt budget is the largest power of two of tokens
whose predicted step time fits the target (powers of two: backends pad prompt chunks to them), never
below :data:`MIN_PREFILL_TOKENS` so prompts always progress; while none does, a step takes all the
prompt tokens it can hold.
"""

from __future__ import annotations

#: Prompt tokens a step may always carry, whatever the target.
MIN_PREFILL_TOKENS = 16
#: Prompt budget before any step with a prompt chunk has been measured.
INITIAL_PREFILL_TOKENS = 256
#: Weight of a new observation in the running averages.
ALPHA = 0.3


def _bucket(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class StepBudget:
    """Running estimates of step cost and the prompt budget they give for ``target_ms``."""

    def __init__(self, target_ms: float, max_tokens: int) -> None:
        self.target_ms = target_ms
        self.max_tokens = max_tokens
        #: Decode-only step milliseconds by the power-of-two bucket of its sequence count.
        self.decode_ms: dict[int, float] = {}
        #: Extra milliseconds per prompt token (None until a step with a prompt chunk ran).
        self.ms_per_prompt_token: float | None = None

    def decode_estimate(self, num_decode: int) -> float:
        """Milliseconds of a decode-only step of ``num_decode`` sequences (0 when none has run: the
        prompt rate then carries the whole cost, which errs on the small side of the budget)."""
        if num_decode <= 0 or not self.decode_ms:
            return 0.0
        b = _bucket(num_decode)
        if b in self.decode_ms:
            return self.decode_ms[b]
        # The nearest measured bucket, scaled linearly: decode steps grow slower than that.
        near = min(self.decode_ms, key=lambda k: abs(k.bit_length() - b.bit_length()))
        return self.decode_ms[near] * max(1.0, b / near)

    def prefill_budget(self, num_decode: int) -> int:
        """Prompt tokens the next step may carry beside ``num_decode`` decoding sequences (all it
        can hold when nothing decodes: there is no stream to keep moving)."""
        room = self.max_tokens - num_decode
        if num_decode <= 0:
            return room
        if self.ms_per_prompt_token is None:
            tokens = INITIAL_PREFILL_TOKENS
        else:
            spare = self.target_ms - self.decode_estimate(num_decode)
            tokens = int(spare / max(self.ms_per_prompt_token, 1e-6))
        tokens = max(MIN_PREFILL_TOKENS, min(tokens, room))
        return 1 << (tokens.bit_length() - 1)  # a power of two: what the backend pads chunks to

    def observe(self, num_decode: int, prompt_tokens: int, ms: float) -> None:
        """Record a step's cost. Outliers (a shape compiled during the step, a paused process) are
        kept out: a step slower than 10x its estimate does not move the averages."""
        if prompt_tokens <= 1:
            b = _bucket(num_decode)
            old = self.decode_ms.get(b)
            if old is not None and ms > 10 * old:
                return
            self.decode_ms[b] = ms if old is None else (1 - ALPHA) * old + ALPHA * ms
            return
        rate = max(ms - self.decode_estimate(num_decode), 0.0) / prompt_tokens
        old_rate = self.ms_per_prompt_token
        if old_rate is not None and rate > 10 * old_rate:
            return
        self.ms_per_prompt_token = rate if old_rate is None else (1 - ALPHA) * old_rate + ALPHA * rate
