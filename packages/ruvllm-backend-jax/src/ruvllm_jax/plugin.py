"""The ruvllm plugin: registers the ``jax`` backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ruvllm import hookimpl
from ruvllm.backend import Backend, LoadOptions
from ruvllm.checkpoint import Checkpoint

if TYPE_CHECKING:
    from ruvllm_jax.runner import JaxModel

NAME = "jax"


class JaxBackend(Backend):
    name = NAME
    description = (
        "JAX: one jitted step per shape bucket, paged KV cache on device, int8/int4 weights, "
        "tensor parallelism; Pallas attention kernels on CUDA"
    )
    priority = 100

    def available(self) -> bool:
        try:
            import jax  # noqa: F401
        except Exception:  # a broken jaxlib install raises more than ImportError
            return False
        return True

    def describe(self, checkpoint: Checkpoint) -> list[tuple[str, str]]:
        """What ``ruvllm info`` says of this backend here: the form ``auto`` loads the weights in and
        the CPU kernels (ISA variant, threads) that would multiply them."""
        from ruvllm_jax import native
        from ruvllm_jax.runner import auto_quantization

        rows = [("quantization auto", auto_quantization(checkpoint, LoadOptions(quantization="auto")))]
        if native.available():
            rows.append(("cpu kernels", f"{native.isa()} (this CPU runs: {', '.join(native.supported_isas())})"))
        else:
            rows.append(("cpu kernels", f"none: {native.unavailable_reason()}"))
        return rows

    def load(self, checkpoint: Checkpoint, options: LoadOptions) -> JaxModel:
        # Importing the runner imports jax: only a chosen jax backend pays for it.
        from ruvllm_jax import distributed
        from ruvllm_jax.runner import JaxModel

        model = JaxModel.load(checkpoint, options)
        if distributed.rank() == 0:  # process 0 of a group: the others run what it runs
            return distributed.Leader(model)  # type: ignore[return-value]
        return model


@hookimpl
def register_backends(register: Callable[[Backend], None]) -> None:
    register(JaxBackend())
