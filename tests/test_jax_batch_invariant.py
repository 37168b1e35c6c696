"""The jax backend's ``batch_invariant`` option (``--batch-invariant``) on XLA's path (what runs on a
GPU; on this CPU ``native=false``, float32): 24 greedy prompts alone and together give the same
tokens with it; a bad value is refused by name; it fixes the decode attention's parts; its XLA flags
are added to ``XLA_FLAGS``; and the CLI's flag (``generate``, ``benchmark``, ``serve``) reaches
``LoadOptions.extra``."""

from __future__ import annotations

import pytest
from test_batch_invariance_default import PROMPTS, _tokens
from test_cli_errors import assert_one_line_error, run_cli
from test_speculative_engine import PROMPTS as SPEC_PROMPTS

from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.errors import BackendError
from ruvllm.sampling import SamplingParams


def test_xla_path_one_token_count_and_greedy_answers_do_not_change_under_load(smollm2_path):
    """Every step compiled before traffic has one token count (the products' row count: a GPU's
    matrix-multiply library picks one kernel for every batch), none compiles while serving, and
    greedy answers alone equal those together. Small limits: every step computes the largest
    shape's rows (here 68), slow on a CPU."""
    from ruvllm.backend import LoadOptions
    from ruvllm.runtime import load_model

    extra = {"native": "false", "batch_invariant": "true"}
    llm = load_model(str(smollm2_path), backend="jax", options=LoadOptions(quantization="none", extra=extra))
    assert llm.options.dtype == "float32"
    engine = LLMEngine(llm, EngineConfig(num_blocks=128, max_num_seqs=4, max_num_batched_tokens=16))
    engine.precompile()
    model = llm.model
    plans = model.compiled_steps.stats.plans
    assert len(plans) > 1 and {p.num_tokens for p in plans} == {model.step_tokens} == {68}
    compiled = len(model.compiled_steps)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:4]]
    alone = [_tokens(engine.generate([GenerationRequest(p, params)])[0]) for p in prompts]
    together = [_tokens(o) for o in engine.generate([GenerationRequest(p, params) for p in prompts])]
    assert alone == together and all(len(a) == 8 for a in alone)
    assert len(model.compiled_steps) == compiled  # prompts of 2 chunks, 4 sequences: all precompiled


def test_xla_path_speculation_and_device_sampling_keep_one_token_count(smollm2_path):
    """With the option on XLA's path, an n-gram speculation engine sampling on the device
    precompiles one token count (its verification rows counted in), compiles nothing while it runs,
    and gives the plain engine's greedy tokens."""
    from ruvllm.backend import LoadOptions
    from ruvllm.runtime import load_model

    extra = {"native": "false", "batch_invariant": "true"}
    llm = load_model(str(smollm2_path), backend="jax", options=LoadOptions(quantization="none", extra=extra))
    cfg = dict(max_num_seqs=2, max_num_batched_tokens=32, num_blocks=64, max_model_len=512, sampling="device")
    prompt = llm.tokenizer.encode(SPEC_PROMPTS[0])  # code to rewrite: n-grams of the prompt come back
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(llm, EngineConfig(**cfg))
    plain.precompile()
    plain_tokens = llm.model.step_tokens
    want = _tokens(plain.generate([GenerationRequest(prompt, params)])[0])
    model = llm.model
    before = len(model.compiled_steps.stats.plans)
    engine = LLMEngine(llm, EngineConfig(speculative="ngram", num_speculative_tokens=4, **cfg))
    done = engine.precompile()
    assert any(name.startswith("sampling") for name, _ in done)
    assert model.step_tokens > plain_tokens  # the verification rows counted in
    assert {p.num_tokens for p in model.compiled_steps.stats.plans[before:]} == {model.step_tokens}
    compiled = len(model.compiled_steps), len(model.compiled_samplers)
    assert _tokens(engine.generate([GenerationRequest(prompt, params)])[0]) == want
    assert engine.stats().spec_accepted_tokens > 0
    assert (len(model.compiled_steps), len(model.compiled_samplers)) == compiled


def test_bad_value_is_refused_by_name(smollm2_path):
    proc = run_cli(
        "generate", str(smollm2_path), "hi", "--backend", "jax", "--quantization", "none",
        "--backend-option", "batch_invariant=maybe",
    )  # fmt: skip
    assert_one_line_error(proc, "batch_invariant must be true or false")


def test_option_fixes_the_decode_attention_parts():
    from ruvllm_jax.options import decode_splits_option

    assert decode_splits_option({}, "pallas") is None  # auto: chosen per step shape
    assert decode_splits_option({"batch_invariant": "true"}, "pallas") == 1
    assert decode_splits_option({"batch_invariant": "false"}, "pallas") is None
    # a forced count is already fixed: kept
    assert decode_splits_option({"batch_invariant": "true", "decode_splits": "4"}, "pallas") == 4
    with pytest.raises(BackendError, match="batch_invariant must be true or false"):
        decode_splits_option({"batch_invariant": "2"}, "pallas")


def test_xla_flags_are_added_once_and_a_users_value_kept():
    from ruvllm_jax.batch_invariant import GPU_XLA_FLAGS, set_xla_flags

    env: dict[str, str] = {}
    assert set_xla_flags(env) == list(GPU_XLA_FLAGS)
    assert env["XLA_FLAGS"].split() == list(GPU_XLA_FLAGS)
    assert set_xla_flags(env) == [] and env["XLA_FLAGS"].split() == list(GPU_XLA_FLAGS)
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_gpu_autotune_level=2"}
    assert set_xla_flags(env) == ["--xla_gpu_deterministic_ops=true"]
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_autotune_level=2 --xla_gpu_deterministic_ops=true"


def test_cli_flag_reaches_load_options(monkeypatch):
    import ruvllm.runtime
    import ruvllm_server.state
    from ruvllm.cli import _load, build_parser
    from ruvllm.plugins import load_plugins
    from ruvllm_server.settings import ServerConfigError

    seen: list = []

    class Loaded(Exception):
        pass

    def load_model(model, *, options, **kw):
        seen.append(options.extra)
        raise Loaded

    monkeypatch.setattr(ruvllm.runtime, "load_model", load_model)
    host = load_plugins()
    parser = build_parser(host)
    for command in (["generate", "m", "hi"], ["chat", "m"], ["benchmark", "m"]):
        with pytest.raises(Loaded):
            _load(parser.parse_args([*command, "--batch-invariant", "--backend-option", "native=false"]), host)
        with pytest.raises(Loaded):
            _load(parser.parse_args(command), host)
    assert seen == [{"native": "false", "batch_invariant": "true"}, {}] * 3

    def server_load(settings):
        seen.append(settings.backend_options)
        raise Loaded

    monkeypatch.setattr(ruvllm_server.state, "load_model", server_load)
    monkeypatch.setattr("ruvllm.log_setup.configure_logging", lambda **kw: None)
    args = parser.parse_args(["serve", "m", "--batch-invariant"])
    with pytest.raises(ServerConfigError, match="failed to load: Loaded"):
        args.func(args, host)
    assert seen[-1] == {"batch_invariant": "true"}
