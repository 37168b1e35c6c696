"""candle-compat's encoder pass: :func:`ruvllm.modeling.encode_hidden` on NumPy arrays, sequences
packed into rows (no KV cache: an encoder reads each sequence whole, once)."""

from __future__ import annotations

import numpy as np

from ruvllm.backend import LoadOptions
from ruvllm.checkpoint import Checkpoint
from ruvllm.encoder import EncodeBatch, packed_passes
from ruvllm.errors import BackendError, ModelFormatError
from ruvllm.modeling.encoder import EncoderWeights, check_encoder, encode_hidden, load_encoder_weights

#: Positions one NumPy pass holds (rows x row length): bounds the attention scores' memory.
_TOKENS_PER_PASS = 8192
#: Short sequences share rows of this many positions (a row's attention scores are its length squared).
_PACK_LENGTH = 128


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
        for p in packed_passes(batch, _TOKENS_PER_PASS, pack_length=_PACK_LENGTH):
            hidden = encode_hidden(self.weights, self.config, p.ids, p.types, p.segments, p.positions)
            hidden = np.asarray(hidden, dtype=np.float32)
            for i, row, start in p.places:
                out[i] = hidden[row, start : start + lengths[i]]
        return out
