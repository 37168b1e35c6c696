"""Embeddings from the generative model: the mean over positions of its final-norm hidden states,
L2-normalised. They run through ``LoadedModel.forward`` on a KV allocation of their own, outside
the engine's scheduler (a prefill-only pass needs neither scheduling nor the shared cache)."""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.errors import RequestError

if TYPE_CHECKING:
    from ruvllm.runtime import LoadedModel

#: How many inputs of the maximum length one forward step may carry.
_BATCH_OF_LONGEST = 2


class Embedder:
    def __init__(self, model: LoadedModel, *, max_tokens: int, block_size: int) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.num_blocks = math.ceil(max_tokens / block_size) * _BATCH_OF_LONGEST
        self._cache: Any = None
        # One pass at a time: the private cache is shared by all embedding requests.
        self._lock = threading.Lock()

    @property
    def dimensions(self) -> int:
        return self.model.config.hidden_size

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """float32 ``[len(inputs), hidden]`` unit vectors (blocking; run it in a worker thread)."""
        for i, ids in enumerate(inputs):
            if not ids:
                raise RequestError(f"input {i} is empty")
            if len(ids) > self.max_tokens:
                raise RequestError(f"input {i} is {len(ids)} tokens, more than the {self.max_tokens} embeddings accept")
        out = np.empty((len(inputs), self.dimensions), dtype=np.float32)
        with self._lock:
            if self._cache is None:
                self._cache = self.model.allocate_cache(self.num_blocks, self.block_size)
            for group in self._pack(inputs):
                chunks = []
                next_block = 0
                for idx in group:
                    n_blocks = math.ceil(len(inputs[idx]) / self.block_size)
                    table = np.arange(next_block, next_block + n_blocks, dtype=np.int32)
                    next_block += n_blocks
                    chunks.append(SequenceChunk(np.asarray(inputs[idx], dtype=np.int32), 0, table, hidden_states=True))
                result = self.model.forward(ForwardBatch(chunks, self.block_size), self._cache)
                for k, idx in enumerate(group):
                    pooled = np.asarray(result.hidden_states[k], dtype=np.float64).mean(axis=0)
                    norm = np.linalg.norm(pooled)
                    out[idx] = pooled / norm if norm > 0 else pooled
        return out

    def _pack(self, inputs: list[list[int]]) -> list[list[int]]:
        """Groups of input indices whose blocks fit in the private cache together."""
        groups: list[list[int]] = [[]]
        used = 0
        for i, ids in enumerate(inputs):
            need = math.ceil(len(ids) / self.block_size)
            if used + need > self.num_blocks:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += need
        return [g for g in groups if g]
