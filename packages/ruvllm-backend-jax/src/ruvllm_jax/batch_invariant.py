"""The ``batch_invariant`` load option (``ruvllm serve --batch-invariant``): a sequence's tokens the
same whatever else the step runs (issue 44; Thinking Machines, "Defeating Nondeterminism in LLM
Inference", 2025). What a row's result may depend on is fixed apart from the other rows:

- the decode attention's parts: one for every step (:func:`ruvllm_jax.options.decode_splits_option`),
  where ``auto`` would cut a sequence's keys into more parts at small batches on a GPU;
- on a GPU, XLA's choice of algorithm: :data:`GPU_XLA_FLAGS` (deterministic reductions, no
  autotuning, which times candidate kernels and may pick another for the next compile). They are
  read once, when jax's GPU backend starts: :func:`set_xla_flags` adds them to ``XLA_FLAGS`` before
  the load first asks jax for a device, and a process whose backend already started without them
  is refused by name.

- on XLA's path (a GPU, or the CPU with ``native=false``), the products' row count: every step is
  padded to one token count (:func:`step_tokens`), so a matrix-multiply library picks one kernel
  whatever the batch, at the cost of a batch-1 decode computing that many rows.

With the native CPU kernels (``w4a8``, ``w8a8``) the option changes no step: they are batch invariant
by default, at no cost (``tests/test_batch_invariance_default.py``).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from ruvllm.errors import BackendError

#: XLA flags the option needs on a GPU (``XLA_FLAGS``, read when the backend starts).
GPU_XLA_FLAGS = ("--xla_gpu_deterministic_ops=true", "--xla_gpu_autotune_level=0")


def _missing(flags: str) -> list[str]:
    given = {f.split("=", 1)[0] for f in flags.split()}
    return [f for f in GPU_XLA_FLAGS if f.split("=", 1)[0] not in given]


def set_xla_flags(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Add :data:`GPU_XLA_FLAGS` to ``XLA_FLAGS`` in ``environ`` (default ``os.environ``); a flag the
    user set (to any value) is left as set. Returns the flags added."""
    env = os.environ if environ is None else environ
    missing = _missing(env.get("XLA_FLAGS", ""))
    if missing:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *missing]).strip()
    return missing


def prepare(extra: dict[str, object]) -> None:
    """Before a load with ``extra``: with ``batch_invariant`` on, the GPU flags set while jax's
    backends have not started; if they have (something in this process asked jax for a device
    first) and run a GPU without the flags, :class:`BackendError`."""
    from ruvllm_jax.options import bool_option

    if not bool_option(extra, "batch_invariant", False):
        return
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        set_xla_flags()
        return
    import jax

    missing = _missing(os.environ.get("XLA_FLAGS", ""))
    if jax.devices()[0].platform == "gpu" and missing:
        raise BackendError(
            f"jax backend: batch_invariant needs XLA_FLAGS {' '.join(missing)} from the start, and jax's GPU "
            "backend started before this load: set them in the environment before the process starts"
        )


def step_tokens(
    extra: dict[str, object], native: bool, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None
) -> int | None:
    """The one token count every step is padded to with ``batch_invariant`` on XLA's path (a GPU, or
    the CPU without the native kernels, ``native``: they are loaded), so that a matrix-multiply
    library sees the same row count, and picks the same kernel, whatever the batch: the largest
    step shape within the limits (the engine's defaults where None; :meth:`JaxModel.precompile`
    sets the served ones). None: the option is off, or the native kernels run (invariant at every
    row count already)."""
    from ruvllm_jax.options import bool_option
    from ruvllm_jax.step_shapes import fixed_tokens

    if native or not bool_option(extra, "batch_invariant", False):
        return None
    if max_num_seqs is None or max_num_batched_tokens is None:
        from ruvllm.engine.config import EngineConfig

        max_num_seqs, max_num_batched_tokens = EngineConfig.max_num_seqs, EngineConfig.max_num_batched_tokens
    return fixed_tokens(max_num_seqs, max_num_batched_tokens)
