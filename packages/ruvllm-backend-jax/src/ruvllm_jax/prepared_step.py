"""Decode steps prepared before their tokens are known (:class:`ruvllm.backend.PreparesSteps`): the
engine plans and prepares step N+1 while step N runs, then launches it with step N's sampled tokens.
jax dispatches the compiled step and returns; the host waits only when it reads the logits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ruvllm.backend import ForwardBatch, ForwardOutput
from ruvllm.errors import RequestError
from ruvllm_jax.model import LoraFactors, StepInputs
from ruvllm_jax.step_inputs import check_chunks
from ruvllm_jax.step_outputs import to_host

if TYPE_CHECKING:
    from ruvllm_jax.kv_cache import JaxKVCache
    from ruvllm_jax.runner import JaxModel


@dataclass
class PreparedDecode:
    """A decode step of :func:`prepare_decode`: launched once its tokens are known."""

    model: JaxModel
    cache: JaxKVCache
    inputs: StepInputs
    lora: LoraFactors | None
    step: Any
    rows: int

    def launch(self, tokens: np.ndarray) -> Callable[[], ForwardOutput]:
        tokens = np.asarray(tokens)
        vocab = self.model.spec.vocab_size
        if tokens.shape != (self.rows,) or (self.rows and (tokens.min() < 0 or tokens.max() >= vocab)):
            raise RequestError(f"a prepared step takes {self.rows} token ids in 0..{vocab - 1}")
        self.inputs.tokens[: self.rows] = tokens  # decoding tokens come first, in chunk order
        logits, _, self.cache.state = self.step(self.model.weights, self.cache.state, self.inputs, self.lora)
        rows = self.rows

        def wait() -> ForwardOutput:
            return ForwardOutput(to_host(logits)[:rows])

        return wait


def prepare_decode(model: JaxModel, batch: ForwardBatch, cache: JaxKVCache) -> PreparedDecode | None:
    """``batch`` as :meth:`JaxModel.forward` would run it, for a batch of decoding chunks on one
    device: its inputs and compiled step, built now, its tokens filled in at launch. None where
    ``forward`` has work this form leaves out (several devices, a two-tier cache, device sampling,
    block copies, adapters, all-position logits, hidden states, verification chunks)."""
    chunks = batch.chunks
    if (
        model.mesh.size > 1
        or cache.hot is not None
        or batch.sampling is not None
        or batch.block_copies
        or batch.local_block_copies
        or not chunks
        or batch.block_size != cache.block_size
        or any(
            len(c.token_ids) != 1 or c.all_logits or c.hidden_states or c.verify or c.adapter is not None
            for c in chunks
        )
    ):
        return None
    check_chunks(chunks, cache.block_size, cache.num_blocks, cache.local_blocks, model.spec)
    inputs, plan, _, lora = model._prepare(chunks, cache)
    step = model._step_for(plan, cache, inputs, lora)
    return PreparedDecode(model, cache, inputs, lora, step, len(chunks))
