"""The jax backend's load options: which ``LoadOptions.extra`` keys it takes, what ``auto`` means for
the dtype, quantization and attention, and the checks that refuse a bad option before anything
loads."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from ruvllm.backend import LoadOptions
from ruvllm.checkpoint import Checkpoint
from ruvllm.errors import BackendError
from ruvllm.mapped_experts import experts_file_bytes, mmap_experts_option
from ruvllm_jax import native
from ruvllm_jax.gguf_blocks import WXA8_GGUF_TYPES
from ruvllm_jax.loading import DTYPES, EXPERT_GGUF_TYPES
from ruvllm_jax.quant import QUANTIZATIONS

ATTENTION_IMPLS = ("reference", "pallas", "pallas_interpret")
KNOWN_EXTRA = {
    "tensor_parallel", "attention", "keep_gguf_blocks", "native", "threads", "unroll_layers", "decode_splits",
    "mmap_experts", "batch_invariant",
    # Process 0 of a group (``ruvllm serve --coordinator``): see :mod:`ruvllm_jax.distributed`.
    "coordinator", "num_processes",
}  # fmt: skip


@dataclass(frozen=True)
class LoadSettings:
    """Load options with ``auto`` resolved and every option checked."""

    options: LoadOptions
    attention: str
    tensor_parallel: int
    keep_gguf_blocks: bool
    #: A mixture of experts' experts left in the GGUF file's mapping (:func:`mmap_experts_setting`).
    mmap_experts: bool = False


def load_settings(checkpoint: Checkpoint, options: LoadOptions) -> LoadSettings:
    """``options`` checked for ``checkpoint`` and their ``auto`` values resolved; raises
    :class:`BackendError` for what this backend does not take."""
    unknown = set(options.extra) - KNOWN_EXTRA
    if unknown:
        raise BackendError(
            f"jax backend: unknown option(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(KNOWN_EXTRA))})"
        )
    if options.dtype == "auto":  # bfloat16 on GPUs (half the bytes, tensor cores), float32 on CPUs
        gpu = jax.devices()[0].platform == "gpu"
        options = dataclasses.replace(options, dtype="bfloat16" if gpu else "float32")
    if options.quantization == "auto":
        options = dataclasses.replace(options, quantization=auto_quantization(checkpoint, options))
    if options.quantization not in QUANTIZATIONS:
        raise BackendError(
            f"jax backend: unknown quantization {options.quantization!r} (known: {', '.join(QUANTIZATIONS)})"
        )
    if options.dtype not in DTYPES:
        raise BackendError(f"jax backend: dtype {options.dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    if options.quantization == "fp8":
        check_fp8_device()
    unroll_layers_option(options.extra, "cpu")  # refused before anything loads
    attention = str(options.extra.get("attention", default_attention(checkpoint.config.head_dim)))
    if attention not in ATTENTION_IMPLS:
        raise BackendError(f"jax backend: unknown attention {attention!r} (known: {', '.join(ATTENTION_IMPLS)})")
    if attention == "pallas" and not on_cuda():
        raise BackendError(
            "jax backend: attention='pallas' needs a CUDA device (use 'pallas_interpret' to test on CPU)"
        )
    if attention == "pallas" and not pow2(checkpoint.config.head_dim):
        raise BackendError(
            f"jax backend: the Pallas attention kernels need a power-of-two head dim "
            f"(this model's is {checkpoint.config.head_dim}); use attention='reference'"
        )
    decode_splits_option(options.extra, attention)  # refused before anything loads
    bool_option(options.extra, "batch_invariant", False)  # refused before anything loads
    try:
        tp = int(options.extra.get("tensor_parallel", 1))
    except (TypeError, ValueError):
        raise BackendError(
            f"jax backend: tensor_parallel must be an integer, got {options.extra['tensor_parallel']!r}"
        ) from None
    if "threads" in options.extra:  # the native kernels' pool (XLA keeps its own)
        threads = native.parse_threads(options.extra["threads"], "jax backend: threads")
        if native.available():
            native.set_threads(threads)
    keep = bool_option(options.extra, "keep_gguf_blocks", False)
    if keep and options.quantization != "none":
        raise BackendError(
            "jax backend: keep_gguf_blocks keeps the file's quantization; use it with quantization='none'"
        )
    mapped = mmap_experts_setting(checkpoint, options, tp)
    if checkpoint.config.num_experts:  # reported as applied
        options = dataclasses.replace(options, extra={**options.extra, "mmap_experts": "true" if mapped else "false"})
    return LoadSettings(options, attention, tp, keep, mapped)


def mmap_experts_setting(checkpoint: Checkpoint, options: LoadOptions, tp: int) -> bool:
    """The ``mmap_experts`` option (:mod:`ruvllm.mapped_experts`) for this backend: experts left in the
    file need the native stored-block kernel, so ``w4a8`` on one CPU device with the native kernels and
    experts in Q4_K, Q6_K or Q8_0; ``true`` without them is refused by name, ``auto`` then copies."""
    # Its copy is the w4a8 form, about the file's bytes (not float32's four bytes a weight).
    copy = experts_file_bytes(checkpoint) if checkpoint.format == "gguf" and checkpoint.config.num_experts else None
    mapped = mmap_experts_option(options.extra.get("mmap_experts", "auto"), checkpoint, "jax backend", copy)
    if not mapped:
        return False
    why = None
    if options.quantization != "w4a8":
        why = f"quantization w4a8 (got {options.quantization})"
    elif tp != 1 or not native_option(options, 1):
        why = "the native CPU kernels on one device"
    else:
        kinds = _expert_types(checkpoint)
        if not kinds <= set(native.STORED_TYPES):
            why = f"experts in {', '.join(native.STORED_TYPES)} (this file's: {', '.join(sorted(kinds))})"
    if why is None:
        return True
    if str(options.extra.get("mmap_experts", "auto")).lower() == "auto":
        return False
    raise BackendError(f"jax backend: mmap_experts=true needs {why}")


def _expert_types(checkpoint: Checkpoint) -> set[str]:
    """The GGUF types of every layer's expert matrices."""
    return {
        checkpoint.raw_tensor(f"model.layers.{layer}.mlp.experts.0.{proj}.weight").ggml_type
        for layer in range(checkpoint.config.num_layers)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }


def bool_option(extra: dict[str, Any], name: str, default: bool) -> bool:
    """A yes/no option given as a bool or as text (``--backend-option keep_gguf_blocks=false`` gives
    the string ``"false"``, which ``bool()`` would read as true); anything else is refused by name."""
    value = extra.get(name, default)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise BackendError(f"jax backend: {name} must be true or false, got {value!r}")


def native_option(options: LoadOptions, devices: int) -> bool:
    """The ``native`` option (default true) as it applies to a model of ``options`` on ``devices``
    devices: whether its steps may run the quantized products in :mod:`ruvllm_jax.native`."""
    if not native_attention_option(options, devices):
        return False
    if options.quantization == "w8a8":
        # XLA's integer GEMM beats the kernels' scalar loops; only the vector path pays.
        return native.has_vector_path()
    return True


def native_attention_option(options: LoadOptions, devices: int) -> bool:
    """Whether a model of ``options`` on ``devices`` devices runs its attention (and RMSNorm's row
    sums) in :mod:`ruvllm_jax.native`'s kernels: a quantized form (``w8a8``, ``w4a8``) on one CPU
    device with the kernels loaded, unless option ``native`` is false. Unlike the products this does
    not depend on a vector variant: the attention is the same arithmetic at every step size, which
    keeps a sequence's logits the same whatever else the step runs."""
    wanted = options.extra.get("native", True)
    if isinstance(wanted, str) and wanted.lower() in ("true", "1", "false", "0"):
        wanted = wanted.lower() in ("true", "1")
    if not isinstance(wanted, bool):
        raise BackendError(f"jax backend: native must be true or false, got {wanted!r}")
    if not wanted or options.quantization not in ("w8a8", "w4a8") or devices > 1:
        return False
    if jax.devices()[0].platform != "cpu":
        return False
    return native.available()


def enable_compilation_cache() -> Path | None:
    """Keep compiled steps on disk so a restarted server does not compile its shapes again: XLA
    compiles each step in 0.3-4 s on CPU and loads it from this cache in a fraction of that.

    ``RUVLLM_JAX_COMPILATION_CACHE``: a directory, or ``off``; default ``<ruvllm cache>/jax``. A
    directory set through JAX's own ``jax_compilation_cache_dir`` is left as it is."""
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    setting = os.environ.get("RUVLLM_JAX_COMPILATION_CACHE", "")
    if setting.lower() in {"off", "0", "false", "no"}:
        return None
    from ruvllm.resolve import cache_dir

    path = Path(setting).expanduser() if setting else cache_dir() / "jax"
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Every step shape is precompiled at start: all of them are worth keeping (a few dozen KiB each).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def auto_quantization(checkpoint: Checkpoint, options: LoadOptions) -> str:
    """What ``quantization="auto"`` means here: ``w4a8`` for a GGUF whose matrices are mostly blocks
    the ``w4a8`` form holds exactly (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K) on one CPU device
    with a vector variant of the native kernels (the file's own weights, multiplied the way
    llama.cpp multiplies them, and this backend's fastest CPU form), else ``none``."""
    tp = str(options.extra.get("tensor_parallel", 1))
    if (
        checkpoint.format == "gguf"
        and checkpoint.quantization in WXA8_GGUF_TYPES
        and options.dtype == "float32"
        and tp == "1"
        and not bool_option(options.extra, "keep_gguf_blocks", False)
        and options.extra.get("native", True) not in (False, "false", "0")
        and jax.devices()[0].platform == "cpu"
        and native.has_vector_path()  # the scalar loops are no faster than float32
        and _experts_in_wxa8(checkpoint)
    ):
        return "w4a8"
    return "none"


def _experts_in_wxa8(checkpoint: Checkpoint) -> bool:
    """Whether a mixture of experts' experts are stored in a type the ``w4a8`` form holds exactly (the
    experts' native kernel multiplies them); true for a dense model."""
    if not checkpoint.config.num_experts:
        return True
    return checkpoint.raw_tensor("model.layers.0.mlp.experts.0.gate_proj.weight").ggml_type in EXPERT_GGUF_TYPES


def pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def default_attention(head_dim: int) -> str:
    """The Pallas kernels on CUDA where they lower (Pallas's Triton lowering needs power-of-two
    array sides: the head dim here, the block size when the cache is allocated), else XLA's
    attention over gathered blocks."""
    return "pallas" if on_cuda() and pow2(head_dim) else "reference"


def unroll_layers_option(extra: dict[str, Any], platform: str) -> bool:
    """The ``unroll_layers`` option: ``auto`` (the default: unrolled on CUDA, where XLA copies a scanned
    layer's weights before using them; a scan elsewhere, which compiles once per step shape whatever
    the depth), or a boolean."""
    value = extra.get("unroll_layers", "auto")
    text = str(value).strip().lower()
    if text == "auto":
        return platform == "cuda"
    if value is True or text in ("true", "1", "yes", "on"):
        return True
    if value is False or text in ("false", "0", "no", "off"):
        return False
    raise BackendError(f"jax backend: unroll_layers must be auto, true or false, got {value!r}")


def decode_splits_option(extra: dict[str, Any], attention: str) -> int | None:
    """The ``decode_splits`` option: ``auto`` (the default, None here: each step's from its decode
    shape and the GPU's SM count, :func:`ruvllm_jax.step_shapes.decode_splits`; 1 on CPU) or a
    positive integer forced on every decode step, which only the Pallas decode kernel takes. Under
    ``batch_invariant`` ``auto`` is one part for every step: a count chosen by the step's decode rows
    would change a row's merge order with the load."""
    value = extra.get("decode_splits", "auto")
    if str(value).strip().lower() == "auto":
        return 1 if bool_option(extra, "batch_invariant", False) else None
    try:
        splits = int(value) if not isinstance(value, bool) and str(value).strip().isdigit() else 0
    except (TypeError, ValueError):
        splits = 0
    if splits < 1:
        raise BackendError(f"jax backend: decode_splits must be auto or a positive integer, got {value!r}")
    if splits > 1 and attention not in ("pallas", "pallas_interpret"):
        raise BackendError(
            f"jax backend: decode_splits={splits} cuts the keys of the Pallas decode kernel; "
            f"attention={attention!r} has none (use attention='pallas' or decode_splits='auto')"
        )
    return splits


#: CUDA compute capability from which GPUs have float8 e4m3 (Ada 8.9, Hopper 9.0 and later).
FP8_MIN_CAPABILITY = (8, 9)


def check_fp8_device() -> None:
    """Refuse ``quantization='fp8'`` on a CUDA GPU before Ada/Hopper, which has no float8 type to
    convert from in its operand loads (CPUs run the form, upcasting in XLA's product, for tests)."""
    dev = jax.devices()[0]
    if not on_cuda():
        return
    text = str(getattr(dev, "compute_capability", "0.0"))
    try:
        major, minor = (int(p) for p in text.split(".")[:2])
    except ValueError:
        major, minor = 0, 0
    if (major, minor) < FP8_MIN_CAPABILITY:
        raise BackendError(
            f"jax backend: quantization='fp8' needs a GPU with float8 (compute capability 8.9 or later: Ada, "
            f"Hopper); {dev.device_kind} is {text}: use q8 (int8 weights, w8a16)"
        )


def on_cuda() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and "cuda" in str(getattr(dev.client, "platform_version", "")).lower()
