"""The ruvllm plugin: registers the ``jax`` backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ruvllm import hookimpl
from ruvllm.backend import Backend, LoadOptions
from ruvllm.checkpoint import Checkpoint
from ruvllm.errors import BackendError

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
        from ruvllm_jax.options import auto_quantization

        rows = [("quantization auto", auto_quantization(checkpoint, LoadOptions(quantization="auto")))]
        if native.available():
            rows.append(("cpu kernels", f"{native.isa()} (this CPU runs: {', '.join(native.supported_isas())})"))
        else:
            rows.append(("cpu kernels", f"none: {native.unavailable_reason()}"))
        return rows

    def load_encoder(self, checkpoint: Checkpoint, options: LoadOptions) -> Any:
        """An encoder model (embeddings, cross-encoders): :class:`ruvllm_jax.encoder.JaxEncoder`."""
        from ruvllm_jax.encoder import JaxEncoder

        return JaxEncoder(checkpoint, options)

    def load(self, checkpoint: Checkpoint, options: LoadOptions) -> JaxModel:
        # Importing the runner imports jax: only a chosen jax backend pays for it.
        from ruvllm_jax import batch_invariant, distributed

        batch_invariant.prepare(options.extra)  # its XLA flags, before anything starts jax's backends
        from ruvllm_jax.runner import JaxModel

        if "coordinator" in options.extra and distributed.rank() is None:  # `ruvllm serve --coordinator`
            try:
                size = int(options.extra.get("num_processes", 0))
            except (TypeError, ValueError):
                given = options.extra["num_processes"]
                raise BackendError(f"num_processes must be an integer, got {given!r}") from None
            distributed.initialize(str(options.extra["coordinator"]), size, 0)
        model = JaxModel.load(checkpoint, options)
        if distributed.rank() == 0:  # process 0 of a group: the others run what it runs
            return distributed.Leader(model)  # type: ignore[return-value]
        return model


@hookimpl
def register_backends(register: Callable[[Backend], None]) -> None:
    register(JaxBackend())


@hookimpl
def model_unloading(model: Any) -> None:
    """A group's process 0 releases the others (they exit 0) when its model is unloaded."""
    from ruvllm_jax import distributed

    inner = getattr(model, "model", None)
    if isinstance(inner, distributed.Leader):
        inner.close()


@hookimpl
def register_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "follow",
        help="run as process I > 0 of a group serving one model with process 0 (jax backend; docs/scaling.md)",
    )
    p.add_argument("model", help="the model process 0 serves (alias, GGUF file, HF directory)")
    p.add_argument("--coordinator", required=True, help="HOST:PORT of process 0 (`ruvllm serve --coordinator`)")
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--tensor-parallel", type=int, required=True, help="as process 0's (devices of every process)")
    p.add_argument("--quantization", default="auto", help="as process 0's")
    p.add_argument("--dtype", default="auto", help="as process 0's")
    p.set_defaults(func=_follow)


def _follow(args: Any, host: Any) -> int:
    import os
    import sys

    from ruvllm.checkpoint import open_checkpoint
    from ruvllm.errors import RuvllmError
    from ruvllm.resolve import file_form, select
    from ruvllm_jax import distributed

    try:
        if args.process_id < 1:
            raise BackendError("--process-id of a follower is 1 or more (process 0 runs `ruvllm serve`)")
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        path, form = select(args.model, args.quantization)  # the file process 0 picks, by the same rule
        if form in ("q4k", "f16"):
            form = file_form(open_checkpoint(path), form)
        options = LoadOptions(quantization=form, dtype=args.dtype, extra={"tensor_parallel": args.tensor_parallel})
        distributed.follow(str(path), options)
    except RuvllmError as exc:
        print(f"ruvllm follow: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    else:
        print("ruvllm follow: process 0 closed the group", file=sys.stderr, flush=True)
        code = 0
    if distributed.rank() is not None:
        # Not a normal exit: the distributed runtime's shutdown barrier would wait for process 0, which
        # is gone or going, then abort.
        os._exit(code)
    return code
