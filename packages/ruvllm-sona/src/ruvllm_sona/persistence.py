"""SONA's state on disk: one safetensors file per scope (its factors and EWC++ state), the
ReasoningBank, and ``manifest.json`` written last (a crash mid-save leaves the previous manifest)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ruvllm.model_config import ModelConfig
from ruvllm_sona.bank import ReasoningBank
from ruvllm_sona.config import SonaConfig
from ruvllm_sona.errors import SonaStateError
from ruvllm_sona.model import LoraLlama
from ruvllm_sona.params import Key
from ruvllm_sona.scopes import GateCenter, Slot, new_ewc

STATE_FORMAT = "ruvllm-sona/1"


def fingerprint(mc: ModelConfig, net: LoraLlama) -> dict[str, Any]:
    """What a saved state must match to be loaded: the model's shape and a digest of its weights."""
    digest = hashlib.sha256(net.final_norm.tobytes() + net.embed[:8].tobytes()).hexdigest()
    return {"name": mc.name, "hidden_size": mc.hidden_size, "num_layers": mc.num_layers,
            "vocab_size": mc.vocab_size, "weights_sha256": digest}


def save_state(
    target: Path, slots: Sequence[Slot], config: SonaConfig, keys: Sequence[Key], mc: ModelConfig, net: LoraLlama
) -> Path:
    """Write ``slots`` (each under its own lock) and the manifest to ``target`` (the bank is saved by
    the caller, under its lock, before)."""
    from safetensors.numpy import save_file

    (target / "adapters").mkdir(parents=True, exist_ok=True)
    scopes = []
    for i, s in enumerate(sorted(slots, key=lambda s: s.scope)):
        with s.lock:
            tensors = {}
            for (li, proj), (a, b) in s.params.items():
                tensors[f"layers.{li}.{proj}.lora_A"] = np.ascontiguousarray(a)
                tensors[f"layers.{li}.{proj}.lora_B"] = np.ascontiguousarray(b)
            tensors.update({k: np.ascontiguousarray(v) for k, v in s.ewc.state_arrays().items()})
            if s.taught_keys:
                tensors["gate.taught_keys"] = np.stack(s.taught_keys).astype(np.float32)
            entry: dict[str, Any] = {
                "scope": s.scope, "file": f"adapters/{i:04d}.safetensors", "version": s.version,
                "baseline": s.baseline, "feedback_count": s.feedback_count, "instant_updates": s.instant_updates,
                "deep_runs": s.deep_runs, "ewc_consolidations": s.ewc.consolidations,
                "ewc_consolidated_samples": s.ewc.consolidated.count, "routed_from": s.routed_from,
                "cluster_of": s.cluster_of,
            }
            if s.taught_answers:
                entry["taught_answers"] = [sorted(a) for a in s.taught_answers]
        tmp = target / (entry["file"] + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": STATE_FORMAT, "scope": s.scope,
                                                "scale": repr(s.scale), "rank": str(config.rank)})
        os.replace(tmp, target / entry["file"])
        scopes.append(entry)
    manifest = {"format": STATE_FORMAT, "model": fingerprint(mc, net), "config": config.to_json(),
                "adapted": [[li, p] for li, p in keys], "scopes": scopes, "bank": ["bank.safetensors", "bank.json"]}
    tmp = target / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, target / "manifest.json")
    return target


def save_gate_center(target: Path, center: GateCenter) -> None:
    from safetensors.numpy import save_file

    tmp = target / "gate.safetensors.tmp"
    save_file({"mean": center.mean.astype(np.float64)}, str(tmp), metadata={"count": str(center.count)})
    os.replace(tmp, target / "gate.safetensors")


def load_gate_center(d: Path, size: int) -> GateCenter:
    """The gate's centre saved in ``d`` (a fresh one for states saved before the gate existed)."""
    from safetensors import safe_open

    center = GateCenter(size)
    path = d / "gate.safetensors"
    if not path.is_file():
        return center
    try:
        with safe_open(str(path), "numpy") as f:
            mean, count = f.get_tensor("mean"), int((f.metadata() or {}).get("count", "0"))
    except Exception as exc:
        raise SonaStateError(f"{path}: unreadable gate centre ({exc})") from exc
    if mean.shape != (size,):
        raise SonaStateError(f"{path}: gate centre has shape {mean.shape}, expected ({size},)")
    center.mean, center.count = mean.astype(np.float64), count
    return center


def load_state(
    d: Path, config: SonaConfig, keys: Sequence[Key], mc: ModelConfig, net: LoraLlama
) -> tuple[dict[str, Slot], ReasoningBank]:
    """The scopes and bank saved in ``d``, checked against this model and configuration."""
    try:
        manifest = json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise SonaStateError(f"{d}: no readable SONA manifest.json ({exc})") from exc
    if manifest.get("format") != STATE_FORMAT:
        raise SonaStateError(f"{d}: state format {manifest.get('format')!r} is not {STATE_FORMAT!r}")
    if manifest.get("model") != fingerprint(mc, net):
        raise SonaStateError(f"{d}: state was saved for another model ({manifest.get('model', {}).get('name')!r})")
    saved_keys = [(int(li), str(p)) for li, p in manifest.get("adapted", [])]
    if saved_keys != list(keys):
        raise SonaStateError(f"{d}: state adapts {saved_keys}, this configuration adapts {list(keys)}")
    try:
        slots = {e["scope"]: _load_slot(d, e, config, keys, net) for e in manifest["scopes"]}
    except (KeyError, TypeError, ValueError) as exc:
        raise SonaStateError(f"{d}: manifest.json is malformed ({type(exc).__name__}: {exc})") from exc
    bank = ReasoningBank(mc.hidden_size, max_entries=config.bank_max_entries,
                         num_patterns=config.bank_patterns, seed=config.seed)
    bank.load(d)
    return slots, bank


def _load_slot(d: Path, entry: dict[str, Any], config: SonaConfig, keys: Sequence[Key], net: LoraLlama) -> Slot:
    from safetensors.numpy import load_file

    try:
        arrays = load_file(str(d / entry["file"]))
    except Exception as exc:  # safetensors raises its own SafetensorError for bad headers
        raise SonaStateError(f"{d / entry['file']}: unreadable adapter ({exc})") from exc
    try:
        params = {(li, p): (arrays[f"layers.{li}.{p}.lora_A"].astype(np.float32),
                            arrays[f"layers.{li}.{p}.lora_B"].astype(np.float32)) for li, p in keys}
    except KeyError as exc:
        raise SonaStateError(f"{d / entry['file']}: tensor {exc} is missing") from exc
    for (li, p), (a, b) in params.items():
        want = ((config.rank, net.in_features(p)), (net.out_features(p), config.rank))
        if (a.shape, b.shape) != want:
            raise SonaStateError(f"{d / entry['file']}: layers.{li}.{p} has shapes {a.shape}, {b.shape}; "
                                 f"expected {want}")
    slot = Slot(entry["scope"], params, config.scale, new_ewc(config, params), float(entry["baseline"]))
    try:
        slot.ewc.load_arrays(arrays, int(entry["ewc_consolidations"]), int(entry["ewc_consolidated_samples"]))
    except KeyError as exc:
        raise SonaStateError(f"{d / entry['file']}: EWC++ state {exc} is missing") from exc
    slot.version = int(entry["version"])
    slot.feedback_count = int(entry["feedback_count"])
    slot.instant_updates = int(entry["instant_updates"])
    slot.deep_runs = int(entry["deep_runs"])
    slot.routed_from = entry.get("routed_from")
    slot.cluster_of = entry.get("cluster_of")
    slot.taught_answers = [frozenset(int(t) for t in a) for a in entry.get("taught_answers", [])]
    if "gate.taught_keys" in arrays:
        slot.taught_keys = list(arrays["gate.taught_keys"].astype(np.float32))
    slot.snapshot = slot._make_snapshot()
    return slot
