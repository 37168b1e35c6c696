"""The jax backend's encoder pass: :func:`ruvllm.modeling.encode_hidden` jitted once per padded shape
(rows by :func:`padded_rows`, length by :func:`padded_length`, so a server meets a bounded set of
shapes), float32 weights on the default device, no KV cache."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ruvllm.backend import LoadOptions
from ruvllm.checkpoint import Checkpoint
from ruvllm.encoder import EncodeBatch, length_groups, padded_batch
from ruvllm.errors import BackendError, ModelFormatError
from ruvllm.modeling.encoder import EncoderWeights, check_encoder, encode_hidden, load_encoder_weights

#: Padded positions one jitted pass holds (rows x length): all-MiniLM-L6-v2 on a 2-core Zen 4 ran 256
#: texts of 10-55 tokens at 127 texts/s in passes of 16,384, 185 at 2,048 (the activations stay in
#: cache); 1,024 split batches of 32 into passes too small.
_TOKENS_PER_PASS = 2048
_MIN_LENGTH = 8


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def padded_rows(n: int) -> int:
    """The rows a pass of ``n`` sequences is padded to: 1, 2, 4, 8, then the next multiple of 8 (a
    power of two padded 17 sequences to 32)."""
    return _pow2(n) if n <= 8 else -(-n // 8) * 8


def padded_length(n: int) -> int:
    """The length a sequence of ``n`` tokens is padded to: 8 or 16, then the next multiple of 16 up to
    128, of 64 up to 512, of 256 beyond: fewer than 16 padding positions up to 128 tokens (a power of
    two pads up to half the pass), at 15 lengths up to 512 to compile (powers of two: 7)."""
    if n <= 16:
        return _pow2(n, _MIN_LENGTH)
    step = 16 if n <= 128 else 64 if n <= 512 else 256
    return -(-n // step) * step


class JaxEncoder:
    """An encoder's weights as jax arrays and its jitted pass."""

    def __init__(self, checkpoint: Checkpoint, options: LoadOptions) -> None:
        import jax
        import jax.numpy as jnp

        import ruvllm_jax.model  # noqa: F401 (registers jax's primitives with ruvllm.modeling)

        if options.quantization not in ("none", "auto"):
            raise BackendError(f"the jax encoder runs float weights only: quantization {options.quantization!r}")
        if options.dtype not in ("auto", "float32"):
            raise BackendError(f"the jax encoder runs float32 only: dtype {options.dtype!r}")
        if options.extra:
            raise BackendError(f"the jax encoder takes no extra options (got {', '.join(sorted(options.extra))})")
        self.options = LoadOptions(quantization="none", dtype="float32")
        cfg = self.config = checkpoint.config
        check_encoder(cfg, str(getattr(checkpoint, "path", "")))

        def read(name: str, shape: tuple[int, ...]) -> Any:
            t = np.asarray(checkpoint.tensor(name), dtype=np.float32)
            if t.shape != shape:
                raise ModelFormatError(f"tensor {name} has shape {t.shape}, the config implies {shape}")
            return jnp.asarray(t)

        w = load_encoder_weights(cfg, read)
        self._tree = (w.globals, w.layers)

        def run(tree: Any, ids: Any, types: Any, valid: Any) -> Any:
            return encode_hidden(EncoderWeights(tree[0], tree[1]), cfg, ids, types, valid)

        self._run = jax.jit(run)
        self._lock = threading.Lock()  # one pass at a time: XLA's CPU threads are the machine's already

    def _length(self, n: int) -> int:
        return min(padded_length(n), max(n, self.config.max_position_embeddings))

    def encode(self, batch: EncodeBatch) -> list[np.ndarray]:
        lengths = [len(t) for t in batch.token_ids]
        out: list[np.ndarray] = [np.empty((0, self.config.hidden_size), np.float32)] * len(lengths)
        for group in length_groups(lengths, _TOKENS_PER_PASS, self._length):
            length = self._length(lengths[group[0]])
            ids, types, valid = padded_batch(batch, group, length, padded_rows(len(group)))
            with self._lock:
                hidden = np.asarray(self._run(self._tree, ids, types, valid))
            for r, i in enumerate(group):
                out[i] = hidden[r, : lengths[i]]
        return out
