"""candle-compat's encoder pass: :func:`ruvllm.modeling.encode_hidden` on NumPy arrays, sequences of
similar length padded together (no KV cache: an encoder reads each sequence whole, once)."""

from __future__ import annotations

import numpy as np

from ruvllm.backend import LoadOptions
from ruvllm.checkpoint import Checkpoint
from ruvllm.encoder import EncodeBatch, length_groups, padded_batch
from ruvllm.errors import BackendError, ModelFormatError
from ruvllm.modeling.encoder import EncoderWeights, check_encoder, encode_hidden, load_encoder_weights

#: Padded positions one NumPy pass holds (rows x longest): bounds the attention scores' memory.
_TOKENS_PER_PASS = 8192


class NumpyEncoder:
    """An encoder's float32 weights and its pass."""

    def __init__(self, checkpoint: Checkpoint, options: LoadOptions) -> None:
        if options.quantization not in ("none", "auto"):
            raise BackendError(f"candle-compat encodes in float32 only: quantization {options.quantization!r}")
        if options.dtype not in ("auto", "float32"):
            raise BackendError(f"candle-compat encodes in float32 only: dtype {options.dtype!r}")
        if options.extra:
            raise BackendError(f"candle-compat takes no extra options (got {', '.join(sorted(options.extra))})")
        self.options = LoadOptions(quantization="none", dtype="float32")
        self.config = checkpoint.config
        check_encoder(self.config, str(getattr(checkpoint, "path", "")))

        def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
            t = np.ascontiguousarray(checkpoint.tensor(name), dtype=np.float32)
            if t.shape != shape:
                raise ModelFormatError(f"tensor {name} has shape {t.shape}, the config implies {shape}")
            return t

        self.weights: EncoderWeights = load_encoder_weights(self.config, read)

    def encode(self, batch: EncodeBatch) -> list[np.ndarray]:
        lengths = [len(t) for t in batch.token_ids]
        out: list[np.ndarray] = [np.empty((0, self.config.hidden_size), np.float32)] * len(lengths)
        for group in length_groups(lengths, _TOKENS_PER_PASS):
            ids, types, valid = padded_batch(batch, group, lengths[group[0]], len(group))
            hidden = np.asarray(encode_hidden(self.weights, self.config, ids, types, valid), dtype=np.float32)
            for r, i in enumerate(group):
                out[i] = hidden[r, : lengths[i]]
        return out
