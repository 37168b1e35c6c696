"""What runs on the encoder's hidden states, per sequence, in NumPy: sentence-transformers' pooling,
Dense and Normalize, Matryoshka truncation, and a cross-encoder's classifier head."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from ruvllm.embedding.pipeline import Classifier, Dense, Pooling

_blas_lock = threading.Lock()
_blas: list = []  # the one ThreadpoolController, made when first needed


@contextmanager
def _one_blas_thread() -> Iterator[None]:
    """NumPy's BLAS on one thread for the heads' small products: OpenBLAS's workers spin for a while
    after each call, and a pass of the encoder after them ran on what they left of the cores
    (EmbeddingGemma-300M one text at a time on a 2-core Zen 4: 11.0 texts/s, 18.3 with this)."""
    from threadpoolctl import ThreadpoolController

    with _blas_lock:
        if not _blas:
            _blas.append(ThreadpoolController())
    with _blas[0].limit(limits=1, user_api="blas"):
        yield


def _act(x: np.ndarray, name: str) -> np.ndarray:
    if name == "Tanh":
        return np.tanh(x)
    if name == "Sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    return x


def pool(hidden: np.ndarray, pooling: Pooling) -> np.ndarray:
    """One sequence's ``[n, hidden]`` states -> its pooled vector (modes concatenated in order)."""
    parts = []
    for mode in pooling.modes:
        if mode == "cls":
            parts.append(hidden[0])
        elif mode == "max":
            parts.append(hidden.max(axis=0))
        elif mode == "mean":
            parts.append(hidden.sum(axis=0, dtype=np.float32) / np.float32(len(hidden)))
        elif mode == "mean_sqrt_len_tokens":
            parts.append(hidden.sum(axis=0, dtype=np.float32) / np.float32(np.sqrt(len(hidden))))
        else:  # lasttoken
            parts.append(hidden[-1])
    return np.concatenate(parts).astype(np.float32)


def dense(x: np.ndarray, layers: Sequence[Dense]) -> np.ndarray:
    """``x [n, in]`` through the Dense modules in order."""
    with _one_blas_thread():
        for d in layers:
            x = x @ d.weight.T
            if d.bias is not None:
                x = x + d.bias
            x = _act(x, d.activation).astype(np.float32)
    return x


def normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (PyTorch's ``F.normalize``: norms below 1e-12 count as 1e-12)."""
    norms = np.linalg.norm(x.astype(np.float64), axis=-1, keepdims=True)
    return (x / np.maximum(norms, 1e-12)).astype(np.float32)


def truncate(x: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Matryoshka: the first ``dimensions`` of each row, renormalised (as the model's card asks)."""
    if dimensions is None or dimensions == x.shape[-1]:
        return x
    return normalize(x[..., :dimensions])


def classify(hidden_first: np.ndarray, head: Classifier) -> np.ndarray:
    """Scores ``[n, labels]`` from each pair's first-token state ``[n, hidden]``."""
    with _one_blas_thread():
        pooled = np.tanh(hidden_first @ head.pooler_weight.T + head.pooler_bias)
        logits = pooled @ head.weight.T + head.bias
    return _act(logits, head.activation).astype(np.float32)
