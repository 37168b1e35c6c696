"""SONA comes in through the ``ruvllm`` entry-point group like any third-party plugin; attach() wires
it to a loaded model so the engine's requests get its adapters, and detach() unwires it."""

from __future__ import annotations

import pytest
from _candle_compat_fixtures import write_tiny_hf_checkpoint

from ruvllm.backend import AdapterLimits
from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.plugins import load_plugins
from ruvllm.runtime import load_model
from ruvllm.sampling import SamplingParams
from ruvllm_sona import SonaConfig, plugin


def test_entry_point_is_found_with_its_hooks():
    host = load_plugins()
    record = {r.name: r for r in host.records}["sona"]
    assert record.error is None
    assert record.module == "ruvllm_sona.plugin"
    assert {"pre_inference", "post_inference"} <= set(record.hooks)


def test_attach_serves_adapters_to_engine_requests(tmp_path):
    path = write_tiny_hf_checkpoint(tmp_path / "m", layers=2, hidden=48, vocab=97, max_positions=128)
    _write_word_tokenizer(path, 97)
    model = load_model(str(path), backend="candle-compat")
    sona = plugin.attach(model, SonaConfig(background_interval=0.02), state_dir=tmp_path / "state")
    assert model.step_needs == {"hidden_states"}  # the gate routes on them: precompile covers those steps
    # and steps carry its adapters: rank 2 on q and v, up to one per sequence
    assert model.adapter_limits == AdapterLimits(2, ("q_proj", "v_proj"), None)
    try:
        engine = LLMEngine(model, EngineConfig(num_blocks=16))
        engine.generate([GenerationRequest([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0),
                                           request_id="q1")])
        assert sona.stats()["counters"]["trajectories"] == 1
        import time

        deadline = time.monotonic() + 60
        while sona.feedback("q1", 1.0).status != "applied":  # the background thread captures it
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not sona.adapter().is_zero
    finally:
        plugin.detach()
    assert plugin.active() is None
    assert model.adapter_limits is None  # detach withdrew the declaration
    assert (tmp_path / "state" / "manifest.json").is_file()
    # Detached: the hooks are inert again.
    engine.generate([GenerationRequest([5, 6], SamplingParams(max_tokens=2, temperature=0.0), request_id="q2")])
    assert sona.stats()["counters"]["trajectories"] == 1


def test_two_models_on_one_host_each_learn_from_their_own_requests(tmp_path):
    """Two models loaded through one plugin host, each with its learner: the shared hooks send every
    request to the learner of the model that served it; detaching one leaves the other working."""
    from ruvllm.plugins import load_plugins

    path = write_tiny_hf_checkpoint(tmp_path / "m", layers=2, hidden=48, vocab=97, max_positions=128)
    _write_word_tokenizer(path, 97)
    host = load_plugins()
    a, b = (load_model(str(path), backend="candle-compat", host=host) for _ in range(2))
    sa = plugin.attach(a, SonaConfig(background_interval=0.02, gate=False))
    sb = plugin.attach(b, SonaConfig(background_interval=0.02, gate=False))
    try:
        with pytest.raises(Exception, match="already attached to this model"):
            plugin.attach(a, SonaConfig())
        assert plugin.active(a) is sa and plugin.active(b) is sb and plugin.active() is None
        engines = {id(m): LLMEngine(m, EngineConfig(num_blocks=16)) for m in (a, b)}

        def run(model, rid: str) -> None:
            params = SamplingParams(max_tokens=2, temperature=0.0)
            engines[id(model)].generate([GenerationRequest([5, 6, 7], params, request_id=rid)])

        run(a, "a1")
        run(a, "a2")
        run(b, "b1")
        assert sa.stats()["counters"]["trajectories"] == 2
        assert sb.stats()["counters"]["trajectories"] == 1
        plugin.detach(a)
        assert plugin.active(a) is None and plugin.active() is sb
        run(a, "a3")
        run(b, "b2")
        assert sa.stats()["counters"]["trajectories"] == 2
        assert sb.stats()["counters"]["trajectories"] == 2
    finally:
        plugin.detach()
    assert plugin.attached_models() == 0


def _write_word_tokenizer(path, vocab: int) -> None:
    """A word-level tokenizer.json ("w0" .. "w96") so the engine can run the tiny checkpoint."""
    import tokenizers

    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    inner.save(str(path / "tokenizer.json"))


def test_plugin_options_set_sona_config_fields_by_name_and_type():
    from ruvllm_sona.errors import SonaError
    from ruvllm_sona.plugin import _enabled, config_from_options

    opts = {"sona": {"enabled": "true", "scope": "user", "gate": "false", "gate_threshold": "0.7",
                     "deep_max_samples": "256", "state_dir": "/tmp/x"}}  # fmt: skip
    mine = _enabled(opts)
    cfg = config_from_options(mine)
    assert (cfg.scope, cfg.gate, cfg.gate_threshold, cfg.deep_max_samples) == ("user", False, 0.7, 256)
    assert (cfg.clusters, cfg.clustered) == (None, False)  # clusters follow the gate unless set
    assert config_from_options({}).clustered
    assert config_from_options({"clusters": "false"}).clusters is False
    cfg = config_from_options({"clusters": "true", "cluster_by": "prompt", "max_clusters": "8"})
    assert (cfg.clusters, cfg.cluster_by, cfg.max_clusters) == (True, "prompt", 8)
    with pytest.raises(SonaError, match=r"sona\.clusters="):
        config_from_options({"clusters": "auto"})
    assert _enabled({"sona": {"enabled": "false", "gate": "true"}}) is None
    with pytest.raises(SonaError, match=r"sona\.gait"):
        _enabled({"sona": {"enabled": "true", "gait": "on"}})
    with pytest.raises(SonaError, match=r"sona\.gate="):
        config_from_options({"gate": "maybe"})
    with pytest.raises(SonaError, match=r"sona\.deep_epochs="):
        config_from_options({"deep_epochs": "many"})
    with pytest.raises(SonaError, match=r"sona\.layers"):
        _enabled({"sona": {"enabled": "true", "layers": "1,2"}})
