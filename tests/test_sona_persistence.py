"""SONA's state survives a restart: adapters (safetensors), EWC++ state and the ReasoningBank
(safetensors + JSON manifest) reload to the same numbers; state that does not fit is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _candle_compat_fixtures import write_tiny_hf_checkpoint
from _sona_tiny import drain, random_tokens, serve, tiny_checkpoint, tiny_sona

from ruvllm.checkpoint import open_checkpoint
from ruvllm_sona import Sona, SonaConfig, SonaStateError


def _trained(path, config=None) -> Sona:
    sona = tiny_sona(path / "model", config or SonaConfig(scope="user", boundary_warmup=2))
    for i in range(6):
        serve(sona, f"r{i}", random_tokens(i, 12), random_tokens(100 + i, 6), user="ada" if i % 2 else "bob")
    drain(sona)
    for i in range(6):
        sona.feedback(f"r{i}", 1.0 if i < 3 else 0.2)
    sona.feedback("r1", 0.0, correction=random_tokens(7, 5))
    drain(sona)
    sona.consolidate("user:ada")
    sona.deep_train("user:ada", wait=True)
    sona.bank.cluster()
    return sona


def test_state_round_trips(tmp_path):
    sona = _trained(tmp_path)
    saved = sona.save(tmp_path / "state")
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["format"] == "ruvllm-sona/1"
    # r1's correction taught a cluster of ada's scope (SONA's default), saved beside its scope.
    assert {e["scope"] for e in manifest["scopes"]} == {"global", "user:ada", "user:bob", "user:ada#topic0"}
    assert (saved / "bank.safetensors").is_file() and (saved / "bank.json").is_file()

    again = Sona(tiny_checkpoint(tmp_path / "model"), sona.config, state_dir=saved, start=False)
    for scope in ("global", "user:ada", "user:bob", "user:ada#topic0"):
        a, b = sona._slot(scope), again._slot(scope)
        assert a.cluster_of == b.cluster_of
        assert (a.version, a.feedback_count, a.deep_runs) == (b.version, b.feedback_count, b.deep_runs)
        assert a.baseline == pytest.approx(b.baseline)
        for key in sona.keys:
            np.testing.assert_array_equal(a.params[key][0], b.params[key][0])
            np.testing.assert_array_equal(a.params[key][1], b.params[key][1])
        x = np.random.default_rng(0).standard_normal((3, 48)).astype(np.float32)
        for key in sona.keys:
            da, db = sona.adapter(scope).delta(*key, x), again.adapter(scope).delta(*key, x)
            assert (da is None) == (db is None)
            if da is not None:
                np.testing.assert_array_equal(da, db)
        assert a.ewc.consolidations == b.ewc.consolidations
        assert a.ewc.penalty(a.params) == pytest.approx(b.ewc.penalty(b.params), rel=1e-6, abs=1e-12)
    assert sona._slot("user:ada").ewc.consolidations >= 1
    assert sona.bank.stats() == again.bank.stats()
    probe = np.random.default_rng(1).standard_normal(48)
    assert [(m.pattern.index, round(m.similarity, 6)) for m in sona.bank.search(probe, 3)] == [
        (m.pattern.index, round(m.similarity, 6)) for m in again.bank.search(probe, 3)]


def test_close_saves_to_the_state_directory(tmp_path):
    sona = tiny_sona(tmp_path / "model", state_dir=tmp_path / "state", start=True)
    serve(sona, "r0", random_tokens(0, 10), random_tokens(1, 4))
    sona.close()
    assert (tmp_path / "state" / "manifest.json").is_file()
    again = tiny_sona(tmp_path / "model", state_dir=tmp_path / "state")
    assert again.stats()["adapters"][0]["scope"] == "global"


def test_mismatched_or_corrupt_state_is_refused(tmp_path):
    sona = _trained(tmp_path)
    saved = sona.save(tmp_path / "state")
    ckpt = tiny_checkpoint(tmp_path / "model")
    with pytest.raises(SonaStateError, match="adapts"):
        Sona(ckpt, SonaConfig(scope="user", projections=("q_proj",)), state_dir=saved, start=False)
    # Same shapes, other weights.
    other = open_checkpoint(write_tiny_hf_checkpoint(tmp_path / "seeded", layers=2, hidden=48, vocab=97,
                                                     max_positions=128, seed=9))
    with pytest.raises(SonaStateError, match="another model"):
        Sona(other, sona.config, state_dir=saved, start=False)
    (saved / "adapters" / "0000.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SonaStateError, match="unreadable adapter"):
        Sona(ckpt, sona.config, state_dir=saved, start=False)
    (saved / "manifest.json").write_text("{")
    with pytest.raises(SonaStateError, match="manifest"):
        Sona(ckpt, sona.config, state_dir=saved, start=False)
