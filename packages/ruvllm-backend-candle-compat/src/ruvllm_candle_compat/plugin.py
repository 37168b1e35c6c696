"""The ``candle-compat`` backend: it comes in through the same entry-point door as any third-party
backend (``[project.entry-points.ruvllm] candle-compat = "ruvllm_candle_compat.plugin"``).

It takes no ``LoadOptions.extra`` (``threads`` included, refused by name): NumPy's BLAS takes its
thread count from ``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS`` at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ruvllm.backend import Backend, LoadOptions
from ruvllm.checkpoint import Checkpoint
from ruvllm.hookspecs import hookimpl
from ruvllm_candle_compat.model import CandleCompatModel

if TYPE_CHECKING:
    from ruvllm_candle_compat.encoder import NumpyEncoder

BACKEND_NAME = "candle-compat"


class CandleCompatBackend(Backend):
    name = BACKEND_NAME
    description = "NumPy float32 reference backend: every family of ruvllm.architectures, paged KV cache"
    priority = 10

    def load(self, checkpoint: Checkpoint, options: LoadOptions) -> CandleCompatModel:
        return CandleCompatModel.from_checkpoint(checkpoint, options)

    def load_encoder(self, checkpoint: Checkpoint, options: LoadOptions) -> NumpyEncoder:
        from ruvllm_candle_compat.encoder import NumpyEncoder

        return NumpyEncoder(checkpoint, options)


@hookimpl
def register_backends(register: Callable[[Backend], None]) -> None:
    register(CandleCompatBackend())
