"""MicroLoRA adapters as immutable snapshots that backends apply inside their forward pass.

A request keeps the snapshot it started with; learning never edits a snapshot, it publishes a new one.
Both backend protocols are served: ``delta(layer, proj, x)`` (NumPy backend, called per projection)
and ``lora_params()`` (JAX backend, takes the factors once). Entries whose ``B`` is all zero are left
out of both, so an untrained adapter changes nothing, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ruvllm_sona.model import LoraFactors


def _frozen(a: np.ndarray) -> np.ndarray:
    out = np.array(a, dtype=np.float32, copy=True, order="C")
    out.flags.writeable = False
    return out


class SonaAdapter:
    """An immutable set of LoRA factors for one scope at one version."""

    __slots__ = ("_active", "_entries", "_scaled_bt", "scope", "version")

    def __init__(self, scope: str, version: int, entries: Mapping[tuple[int, str], LoraFactors]) -> None:
        self.scope = scope
        self.version = version
        self._entries = {
            key: LoraFactors(_frozen(f.A), _frozen(f.B), float(f.scale)) for key, f in entries.items()
        }
        self._active = {key: f for key, f in self._entries.items() if np.any(f.B)}
        # ``scale * B.T`` once, so ``delta`` is two small matmuls per call.
        self._scaled_bt = {key: _frozen(f.B.T * np.float32(f.scale)) for key, f in self._active.items()}

    @property
    def entries(self) -> Mapping[tuple[int, str], LoraFactors]:
        """Every factor pair of this snapshot, zero ones included (what learning continues from)."""
        return self._entries

    @property
    def is_zero(self) -> bool:
        return not self._active

    def delta(self, layer: int, proj: str, x: np.ndarray) -> np.ndarray | None:
        """The low-rank output to add to projection ``proj`` of ``layer`` for input rows ``x``, or None."""
        bt = self._scaled_bt.get((layer, proj))
        if bt is None:
            return None
        return (x @ self._active[(layer, proj)].A.T) @ bt

    def lora_params(self) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]:
        """``(layer, proj) -> (A [r, in], B [out, r], scale)`` for the non-zero entries."""
        return {key: (f.A, f.B, f.scale) for key, f in self._active.items()}

    def __repr__(self) -> str:
        return f"SonaAdapter(scope={self.scope!r}, version={self.version}, active={sorted(self._active)})"
