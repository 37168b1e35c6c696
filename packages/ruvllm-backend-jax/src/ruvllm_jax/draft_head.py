"""An output projection cut to some tokens' rows (:class:`ruvllm.backend.RestrictsHead`): a draft
model that scores only its most frequent tokens reads a fraction of its head's weights per step (the
0.5B Qwen's head is 151,936 x 896, a fifth of its weights). The rows are taken from the head as
loaded, panel layout and all, so each kept token's logit is the full head's, bit for bit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ruvllm.errors import BackendError
from ruvllm_jax.quant import PANEL, QuantArray, _map_rows, from_panels, to_panels
from ruvllm_jax.step_types import Weights


def restricted_head(weights: Weights, token_ids: np.ndarray) -> Weights:
    """``weights`` with an output projection of ``token_ids``' rows only (the embedding stays whole).
    Quantized heads in the native panel layout keep it: their row count must then be a multiple of
    16, so that many rows are asked for."""
    ids = np.asarray(token_ids, dtype=np.int64)
    head = weights.embed if weights.lm_head is None else weights.lm_head
    if isinstance(head, QuantArray):
        if head.panel and len(ids) % PANEL:
            raise BackendError(f"jax backend: a reduced head in panel layout needs a multiple of {PANEL} rows")
        rows = from_panels(head) if head.panel else head
        cut = _map_rows(rows, lambda a: np.asarray(a)[ids])
        cut = to_panels(cut) if head.panel else cut
        cut = jax.tree_util.tree_map(jnp.asarray, cut)
    else:
        cut = jnp.asarray(np.asarray(head)[ids])
    return dataclasses.replace(weights, lm_head=cut)
