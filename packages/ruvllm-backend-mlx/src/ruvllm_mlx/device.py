"""Where MLX runs: the Metal GPU when MLX reports one, else the CPU; and the memory the KV cache may
take there."""

from __future__ import annotations

import mlx.core as mx

from ruvllm.errors import BackendError

#: ``LoadOptions.extra["device"]`` (or ``RUVLLM_MLX_DEVICE``): ``auto`` picks Metal when present.
DEVICE_CHOICES = ("auto", "gpu", "cpu")


def metal_available() -> bool:
    return bool(mx.metal.is_available())


def choose_device(asked: str) -> mx.Device:
    """The device ``asked`` names; ``gpu`` without Metal is refused in one line."""
    if asked not in DEVICE_CHOICES:
        raise BackendError(f"mlx device {asked!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if asked == "gpu" and not metal_available():
        raise BackendError("mlx device 'gpu' is Metal-only: MLX reports no Metal GPU on this machine (use cpu)")
    return mx.Device(mx.gpu if asked != "cpu" and metal_available() else mx.cpu)


def device_label(device: mx.Device) -> str:
    """What the load log and ``ruvllm info`` say: ``gpu (Metal)`` or ``cpu``."""
    return "gpu (Metal)" if device == mx.gpu else "cpu"


def device_memory(device: mx.Device) -> tuple[int, int] | None:
    """On Metal: MLX's recommended working set (unified memory the GPU may wire) and the bytes MLX
    holds now; on the CPU None, so the server sizes the KV cache from the host's available RAM."""
    if device != mx.gpu:
        return None
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    total = int(info.get("max_recommended_working_set_size", 0))
    return (total, int(mx.get_active_memory())) if total else None
