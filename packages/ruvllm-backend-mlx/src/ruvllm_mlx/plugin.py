"""The ``mlx`` backend, registered through the same entry-point door as any third-party backend
(``[project.entry-points.ruvllm] mlx = "ruvllm_mlx.plugin"``).

``LoadOptions.extra["device"]`` (``auto``, ``gpu``, ``cpu``; default ``RUVLLM_MLX_DEVICE`` or
``auto``) picks where it runs. It wins the default choice only where MLX has a Metal GPU; on a CPU it
is picked by name (``--backend mlx``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from ruvllm.backend import Backend, BackendModel, LoadOptions
from ruvllm.checkpoint import Checkpoint
from ruvllm.errors import BackendError
from ruvllm.hookspecs import hookimpl

BACKEND_NAME = "mlx"
#: Above the jax backend's 100 where Metal runs MLX; below candle-compat's 10 elsewhere.
METAL_PRIORITY, CPU_PRIORITY = 200, 5


class MLXBackend(Backend):
    name = BACKEND_NAME
    description = "MLX: the Apple GPU through Metal (else the CPU), paged KV cache, GGUF blocks kept exactly"

    def __init__(self) -> None:
        self.priority = METAL_PRIORITY if self._metal() else CPU_PRIORITY

    @staticmethod
    def _metal() -> bool:
        try:
            from ruvllm_mlx.device import metal_available
        except ImportError:
            return False
        return metal_available()

    def available(self) -> bool:
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        try:
            import mlx.core  # noqa: F401
        except ImportError as exc:
            return f"MLX is not installed (pip install 'mlx[cpu]' on Linux, 'mlx' on macOS): {exc}"
        return None

    def describe(self, checkpoint: Checkpoint) -> list[tuple[str, str]]:
        from ruvllm_mlx.device import choose_device, device_label
        from ruvllm_mlx.gguf_blocks import EXACT_BITS, NEAREST_FORMS

        try:
            device = device_label(choose_device(os.environ.get("RUVLLM_MLX_DEVICE", "auto")))
        except BackendError as exc:  # RUVLLM_MLX_DEVICE names what this machine lacks: say so, as a row
            device = str(exc)
        rows = [("device", device)]
        if checkpoint.format == "gguf":
            types = checkpoint.matrix_types()
            exact = sorted(t for t in types if t in EXACT_BITS)
            nearest = sorted(f"{t} -> {NEAREST_FORMS[t]}-bit" for t in types if t in NEAREST_FORMS)
            rows.append(("quantization=auto", "the file's blocks: exact " + (", ".join(exact) or "-")
                         + ("; nearest " + ", ".join(nearest) if nearest else "")))  # fmt: skip
        else:
            rows.append(("quantization=auto", "float weights"))
        return rows

    def load(self, checkpoint: Checkpoint, options: LoadOptions) -> BackendModel:
        try:
            from ruvllm_mlx.model import MLXModel
        except ImportError as exc:
            raise BackendError(
                f"the mlx backend needs MLX: pip install 'mlx[cpu]' on Linux, 'mlx' on macOS ({exc})"
            ) from exc
        if "device" not in options.extra and "RUVLLM_MLX_DEVICE" in os.environ:
            extra = {**options.extra, "device": os.environ["RUVLLM_MLX_DEVICE"]}
            options = dataclasses.replace(options, extra=extra)
        return MLXModel.from_checkpoint(checkpoint, options)


@hookimpl
def register_backends(register: Callable[[Backend], None]) -> None:
    register(MLXBackend())
