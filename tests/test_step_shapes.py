"""Serving without compile stalls or prefill stalls (issue 14, items 1 and 2).

- Every step the scheduler can produce within its limits is padded into the bounded set of shapes
  the JAX backend precompiles (property-checked over random steps), and after ``precompile`` a mixed
  workload (prompt lengths from 1 token to the batch budget, n > 1, shared prefixes, preemption-free)
  compiles nothing more, with the same greedy tokens as each request run alone.
- The prompt budget of a step follows the measured step cost: decoding streams advance every step
  while a long prompt prefills in chunks no larger than the budget.
- A server started with precompilation compiles nothing while serving.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ruvllm.block_manager import BlockManager
from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.engine.config import EngineConfigError
from ruvllm.engine.scheduler import Scheduler
from ruvllm.engine.sequence import RequestState, Sequence
from ruvllm.engine.step_budget import INITIAL_PREFILL_TOKENS, MIN_PREFILL_TOKENS, PROBE_EVERY, WINDOW, StepBudget
from ruvllm.engine.types import RequestMetrics
from ruvllm.inference import InferenceRequest
from ruvllm.sampling import Sampler, SamplingParams
from ruvllm_jax.runner import partition, shape_of, step_shapes

LIMITS = [(64, 2048), (8, 256), (4, 64), (1, 32), (32, 512)]


@st.composite
def steps(draw):
    max_seqs, budget = draw(st.sampled_from(LIMITS))
    n = draw(st.integers(1, max_seqs))
    lens = []
    left = budget
    for _ in range(n):
        if left < 1:
            break
        lens.append(draw(st.one_of(st.just(1), st.integers(1, left))))
        left -= lens[-1]
    return max_seqs, budget, lens


@settings(max_examples=400, deadline=None)
@given(steps())
def test_every_step_within_the_limits_pads_into_the_precompiled_set(step):
    max_seqs, budget, lens = step
    allowed = set(step_shapes(max_seqs, budget))
    parts = partition(lens)
    assert sorted(i for p in parts for i in p) == list(range(len(lens)))  # each chunk runs once
    for part in parts:
        shape = shape_of([lens[i] for i in part])
        assert shape in allowed, (lens, part, shape)
        assert shape.num_tokens >= sum(lens[i] for i in part)
    # More than one forward pass only for several long prompts or many short ones.
    long_prompts = sum(1 for n in lens if n > 128)
    short_prompts = sum(1 for n in lens if 1 < n <= 128)
    assert len(parts) <= max(1, long_prompts + -(-short_prompts // 4))


def test_the_shape_set_stays_small():
    assert len(step_shapes(64, 2048)) == 67
    assert len(step_shapes(8, 256)) == 40


# ---------------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def tiny_jax(tmp_path_factory):
    from _jax_fixtures import write_tiny_hf_model
    from _tiny_served_fixtures import write_word_tokenizer

    from ruvllm.runtime import load_model

    path = write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    write_word_tokenizer(path)
    return load_model(str(path), backend="jax")


def _requests(prefix: str = "") -> list[GenerationRequest]:
    lens = [1, 3, 17, 40, 64, 100, 130, 5, 200, 2]
    out = []
    for i, n in enumerate(lens):
        prompt = [(7 * i + 3 * j) % 90 + 1 for j in range(n)]
        if i in (3, 4):  # a shared prefix: the prefix cache serves the second
            prompt = [11] * 33 + prompt
        params = SamplingParams(max_tokens=3 + (i * 5) % 11, temperature=0.0, n=2 if i == 5 else 1, ignore_eos=True)
        out.append(GenerationRequest(prompt, params, request_id=f"{prefix}{i}"))
    return out


def _tokens(outputs):
    by_choice: dict[int, list[int]] = {}
    for out in outputs:
        for d in out.deltas:
            by_choice.setdefault(d.index, []).extend(d.token_ids)
    return [by_choice[k] for k in sorted(by_choice)]


def test_after_precompile_a_mixed_workload_compiles_nothing_and_matches_requests_alone(tiny_jax):
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, num_blocks=256, max_step_ms=50.0)
    engine = LLMEngine(tiny_jax, config)
    shapes = engine.precompile()
    jm = tiny_jax.model
    assert len(shapes) == len(step_shapes(4, 128)) + 3  # and block copies of 1, 2, 4 pairs
    compiled, copies = jm.compiled_steps.stats.count, jm.block_copier.programs.stats.count
    together = engine.generate(_requests())
    assert jm.compiled_steps.stats.count == compiled and jm.block_copier.programs.stats.count == copies
    for req, outs in zip(_requests("alone-"), together, strict=True):
        alone = LLMEngine(tiny_jax, EngineConfig(num_blocks=64)).generate([req])[0]
        assert _tokens(outs) == _tokens(alone), req.request_id
    assert engine.block_manager.num_used_blocks == 0 or engine.config.enable_prefix_caching


def test_device_sampling_functions_are_precompiled_and_sample_like_the_host(tiny_jax):
    """With ``sampling="device"`` precompile also compiles the sampling functions (each step's row
    count, every overlay width, with and without the sort); a workload with penalties, bias, top_p
    and seeds then compiles nothing more and gives the host sampler's tokens."""
    from ruvllm.sampling import overlay_widths

    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, num_blocks=256, sampling="device")
    engine = LLMEngine(tiny_jax, config)
    shapes = engine.precompile()
    jm = tiny_jax.model
    rows = {s.decode_seqs + s.prefill_seqs for s in step_shapes(4, 128)}
    sampling = [name for name, _ in shapes if name.startswith("sampling")]
    assert len(sampling) == len(rows) * len(overlay_widths(tiny_jax.config.vocab_size)) * 2
    compiled, samplers = jm.compiled_steps.stats.count, jm.compiled_samplers.stats.count

    def requests(prefix: str) -> list[GenerationRequest]:
        out = []
        for i, req in enumerate(_requests(prefix)):
            p = req.sampling
            p.temperature, p.top_p, p.seed = 0.9, 0.8 if i % 2 else 1.0, i
            p.repetition_penalty = 1.2 if i % 3 == 0 else 1.0
            p.logit_bias = {5: 3.0} if i % 4 == 1 else {}
            p.n = 1
            out.append(req)
        return out

    got = engine.generate(requests("device-"))
    assert jm.compiled_steps.stats.count == compiled and jm.compiled_samplers.stats.count == samplers
    want = LLMEngine(
        tiny_jax, EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, num_blocks=256, sampling="host")
    ).generate(requests("host-"))
    assert [_tokens(o) for o in got] == [_tokens(o) for o in want]


def test_prompt_logprob_steps_are_precompiled_when_asked(tiny_jax):
    """``precompile_all_logits``: every shape once more returning every position's logits; a workload
    of prompt-logprob requests (prompts chunked across steps, beside decoding ones) then compiles
    nothing more, and its prompt logprobs equal those of a request run alone."""
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, num_blocks=256, precompile_all_logits=True)
    engine = LLMEngine(tiny_jax, config)
    shapes = engine.precompile()
    jm = tiny_jax.model
    assert len([n for n, _ in shapes if n.endswith("all logits")]) == len(step_shapes(4, 128))
    compiled = jm.compiled_steps.stats.count

    def requests(prefix: str) -> list[GenerationRequest]:
        out = []
        for i, req in enumerate(_requests(prefix)):
            req.sampling.prompt_logprobs = 2 if i % 2 == 0 else None
            req.sampling.n = 1
            out.append(req)
        return out

    together = engine.generate(requests("all-"))
    assert jm.compiled_steps.stats.count == compiled
    for req, outs in zip(requests("alone-"), together, strict=True):
        if req.sampling.prompt_logprobs is None:
            continue
        (alone,) = LLMEngine(tiny_jax, EngineConfig(num_blocks=64)).generate([req])
        got = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
        want = next(o.prompt_logprobs for o in alone if o.prompt_logprobs is not None)
        assert [e is None for e in got] == [e is None for e in want]
        for a, b in zip(got[1:], want[1:], strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def test_with_an_adapter_router_the_hidden_state_steps_are_precompiled_too(tiny_jax):
    """A plugin that routes on hidden states (SONA's gate) declares it in ``step_needs``: precompile
    compiles every shape twice, and a workload whose every request is routed compiles nothing more."""
    from ruvllm import hookimpl

    class Router:
        def __init__(self) -> None:
            self.asked = 0

        @hookimpl
        def pre_inference(self, request):
            def route(hidden):
                self.asked += 1
                return None

            request.adapter_router = route

    router = Router()
    tiny_jax.step_needs.add("hidden_states")
    tiny_jax.host.register(router)
    try:
        engine = LLMEngine(tiny_jax, EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, num_blocks=256))
        shapes = engine.precompile()
        assert len(shapes) == 2 * len(step_shapes(4, 128)) + 3
        jm = tiny_jax.model
        compiled = jm.compiled_steps.stats.count
        engine.generate(_requests("routed-"))
        assert jm.compiled_steps.stats.count == compiled
        assert router.asked == len(_requests())
    finally:
        tiny_jax.host.pm.unregister(router)
        tiny_jax.step_needs.discard("hidden_states")


def _adapter(spec, name: str, rank: int, projections: tuple[str, ...], seed: int):
    """A random LoRA adapter on every layer's ``projections`` of the jax model ``spec``."""
    from ruvllm.adapters import LoraWeights

    rng = np.random.default_rng(seed)
    params = {}
    for layer in range(spec.num_layers):
        for proj in projections:
            out, inp = spec.projection_shape(proj)
            a = rng.standard_normal((rank, inp)).astype(np.float32) * 0.4
            b = rng.standard_normal((out, rank)).astype(np.float32) * 0.4
            params[(layer, proj)] = (a, b, 1.5)
    return LoraWeights(name, params)


@pytest.mark.slow
def test_declared_adapters_are_precompiled_and_their_padded_steps_give_the_same_tokens(tiny_jax):
    """Adapters declared before precompile (``LoadedModel.expect_adapters``: SONA and the server's
    ``--lora`` do it) get one padded plan per shape: a workload mixing two adapters of different ranks
    and projections with plain requests compiles nothing more, and its greedy tokens equal those of
    plans sized to each step's adapters (compiled as they come)."""
    from ruvllm.backend import AdapterLimits
    from ruvllm_jax.model import LoraPlan

    jm = tiny_jax.model
    adapters = [_adapter(jm.spec, "a", 2, ("q_proj", "v_proj"), 1), _adapter(jm.spec, "b", 3, ("down_proj",), 2)]

    def requests(prefix: str) -> list[GenerationRequest]:
        out = _requests(prefix)
        return [dataclasses.replace(r, adapter=adapters[i % 3]) if i % 3 < 2 else r for i, r in enumerate(out)]

    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, num_blocks=256)
    tiny_jax.expect_adapters("test", AdapterLimits(3, ("q_proj", "v_proj", "down_proj")))
    try:
        engine = LLMEngine(tiny_jax, config)
        shapes = engine.precompile()
        assert len(shapes) == 2 * len(step_shapes(4, 128)) + 3
        assert jm.fixed_lora == LoraPlan(slots=4, rank=4, projections=("q_proj", "v_proj", "down_proj"))
        compiled = jm.compiled_steps.stats.count
        padded = engine.generate(requests("padded-"))
        assert jm.compiled_steps.stats.count == compiled
        jm.fixed_lora = None  # plans sized to each step's adapters from here on
        sized = LLMEngine(tiny_jax, config).generate(requests("sized-"))
        assert jm.compiled_steps.stats.count > compiled  # those steps did need shapes of their own
        base = LLMEngine(tiny_jax, config).generate(_requests("base-"))
    finally:
        tiny_jax.expect_adapters("test", None)
        jm.fixed_lora = None
    for p, s_ in zip(padded, sized, strict=True):
        assert _tokens(p) == _tokens(s_), p[0].request_id
    changed = [i for i, (p, b) in enumerate(zip(padded, base, strict=True)) if _tokens(p) != _tokens(b)]
    assert changed and all(i % 3 < 2 for i in changed)  # the adapters matter, only where attached


def test_adapter_limits_merge_and_refuse_what_no_backend_adapts():
    from ruvllm.backend import AdapterLimits

    a = AdapterLimits(2, ("v_proj", "q_proj"), 4)
    b = AdapterLimits(8, ("down_proj",), 2)
    assert a.merge(b) == AdapterLimits(8, ("q_proj", "v_proj", "down_proj"), 6)
    assert a.merge(AdapterLimits(1, ("q_proj",))).per_step is None  # one side unbounded: unbounded
    assert a.merge(None) is a
    for bad in [(0, ("q_proj",)), (2, ()), (2, ("qkv_proj",)), (2, ("q_proj",), 0)]:
        with pytest.raises(ValueError, match="AdapterLimits"):
            AdapterLimits(*bad)


# ---------------------------------------------------------------------------- step budget


def _steps(budget: StepBudget, rng: np.random.Generator, n: int, *, decode_only: bool = True) -> None:
    """Steps of a device whose cost is 10 ms + 2 ms per decoding sequence, plus 20 ms + 1.5 ms per
    prompt token when the step carries prompt tokens (2% noise)."""
    for _ in range(n):
        d = int(rng.integers(1, 9))
        p = int(rng.choice([0, 16, 32, 64])) if decode_only else int(rng.choice([16, 32, 64]))
        ms = 10 + 2 * d + (20 + 1.5 * p if p else 0)
        budget.observe(d, p, ms * rng.uniform(0.98, 1.02))


def test_the_prompt_budget_follows_the_measured_step_cost():
    b = StepBudget(target_ms=100.0, max_tokens=2048)
    assert b.prefill_budget(8) == INITIAL_PREFILL_TOKENS  # nothing measured yet
    _steps(b, np.random.default_rng(0), 100)
    assert b.decode_estimate(8) == pytest.approx(26.0, rel=0.05)
    assert b.estimate(8, 64) == pytest.approx(26.0 + 20 + 96, rel=0.05)
    assert b.ms_per_prompt_token == pytest.approx(1.5, rel=0.05)
    assert b.prefill_budget(8) == 32  # (100 - 26 - 20) / 1.5 = 36 -> the power of two below
    for i in range(WINDOW):  # the device got slower: the budget shrinks
        b.observe(8, 64 if i % 2 else 32, 26 + 20 + (64 if i % 2 else 32) * 10.0)
        b.observe(8, 0, 26.0)
    assert b.prefill_budget(8) == MIN_PREFILL_TOKENS  # prompts always progress
    before = b.estimate(8, 64)
    b.observe(8, 64, 1e6)  # a stall (a compile) is an outlier and does not count
    assert b.estimate(8, 64) == before
    assert StepBudget(target_ms=1e6, max_tokens=100).prefill_budget(10) == 64  # within the token budget
    assert b.prefill_budget(0) == 2048  # nothing decodes: no stream to keep moving


def test_the_running_fit_equals_a_least_squares_fit_of_the_window():
    """The fit comes from running sums of the normal equations, taken in and out as the window
    moves; checked against the ridge least squares of the window's steps in float64 NumPy, built
    from scratch, at every point of several passes of the window (the sums rebuilt between)."""
    b = StepBudget(target_ms=100.0, max_tokens=2048)
    rng = np.random.default_rng(7)
    seen: list[tuple[int, int, float]] = []
    for i in range(3 * WINDOW + 17):
        d, p = int(rng.integers(0, 33)), int(rng.choice([0, 0, 16, 64, 256]))
        ms = 5 + 0.7 * d + (12 + 0.2 * p if p else 0)
        ms *= rng.uniform(0.9, 1.1)
        b.observe(d, p, ms)
        seen.append((d, p if p > 1 else 0, ms))
        if i < 32 or (i % 29 and i != 3 * WINDOW + 16):  # from a window that determines the fit
            continue
        window = np.array(seen[-WINDOW:], np.float64)
        n, pt, t = window[:, 0], window[:, 1], window[:, 2]
        x = np.stack([np.ones_like(n), n, (pt > 0).astype(np.float64), pt], axis=1)
        ridge = np.sqrt(np.array([1e-6, 1e-6, 1e-2, 1e-6]) * len(t))
        xa = np.vstack([x, np.diag(ridge)])
        ta = np.concatenate([t, np.zeros(4)])
        want = np.maximum(np.linalg.lstsq(xa, ta, rcond=None)[0], 0.0)
        np.testing.assert_allclose(b._fit(), want, rtol=1e-6, atol=1e-9)
    # Between refits the outlier test takes the last fit: a stall is still kept out.
    for _ in range(5):
        b.observe(4, 0, 8.0)
    b.observe(4, 0, 1e6)
    assert b._steps[-1] == (4, 0, 8.0)
    # Once no step with prompt tokens is left in the window there is no model, stale or fresh.
    for _ in range(WINDOW):
        b.observe(4, 0, 8.0)
    assert b.estimate(4, 64) == 0.0
    b.observe(4, 0, 1e6)  # nothing to call it an outlier against: learnt
    assert b._steps[-1] == (4, 0, 1e6)


def test_a_ratio_target_bounds_prompt_steps_by_a_multiple_of_the_decode_step():
    b = StepBudget(target_ms=1000.0, max_tokens=2048, ratio=3.0)
    _steps(b, np.random.default_rng(1), 100)
    # 8 decoding: a decode step costs 26 ms, so a prompt step may take 78: (78 - 46) / 1.5 = 21 -> 16.
    assert b.step_target(8) == pytest.approx(78.0, rel=0.05)
    assert b.prefill_budget(8) == 16
    assert StepBudget(target_ms=60.0, max_tokens=2048, ratio=10.0).step_target(8) == 60.0  # the smaller wins
    with pytest.raises(ValueError, match="needs a target"):
        StepBudget(target_ms=None, max_tokens=2048)
    with pytest.raises(EngineConfigError, match="max_step_ratio must be above 1"):
        EngineConfig(max_step_ratio=0.5).validate()


def test_without_decode_only_steps_one_step_in_a_while_measures_decoding():
    """When every step carries prompt tokens the fixed cost of a prompt step cannot be told from the
    decode cost; the budget asks for one decode-only step after PROBE_EVERY prompt steps."""
    b = StepBudget(target_ms=100.0, max_tokens=2048, ratio=3.0)
    _steps(b, np.random.default_rng(2), PROBE_EVERY - 1, decode_only=False)
    assert b.prefill_budget(4) > 0
    _steps(b, np.random.default_rng(3), 1, decode_only=False)
    assert b.prefill_budget(4) == 0  # a probe
    assert b.prefill_budget(0) == 2048  # not while nothing decodes
    b.observe(4, 0, 18.0)
    assert b.prefill_budget(4) >= MIN_PREFILL_TOKENS


def _seq(i: int, prompt_len: int, sid: int) -> Sequence:
    params = SamplingParams(max_tokens=50)
    prompt = [1000 * (i + 1) + j for j in range(prompt_len)]  # distinct: no prefix-cache hits
    req = GenerationRequest(prompt, params, request_id=str(i))
    inference = InferenceRequest(req.request_id, prompt, params)
    state = RequestState(req, inference, params, prompt, i, RequestMetrics(prompt_tokens=prompt_len))
    seq = Sequence(state, 0, Sampler(params), None)
    seq.seq_id = sid
    return seq


def test_decoding_streams_advance_every_step_while_a_long_prompt_prefills_in_budgeted_chunks():
    sched = Scheduler(BlockManager(512, 16), max_num_seqs=16, max_num_batched_tokens=2048)
    decoders = [_seq(i, 5, i) for i in range(4)]
    for s in decoders:
        sched.add(s)
    out = sched.schedule()
    sched.update_after_forward(out)
    for s in decoders:  # each produced a token: now decoding
        s.token_ids.append(9)
    long = _seq(9, 1500, 99)
    sched.add(long)
    steps_taken = 0
    while long.num_computed < 1500:
        out = sched.schedule(prefill_budget=128)
        sizes = {c.seq.seq_id: c.num_tokens for c in out.chunks}
        assert all(sizes.get(s.seq_id) == 1 for s in decoders), sizes  # no stream stalls
        assert sizes[99] <= 128
        sched.update_after_forward(out)
        for s in decoders:
            s.token_ids.append(9)
        steps_taken += 1
    assert steps_taken == -(-1500 // 128)
    # Without a prompt budget the whole prompt goes at once.
    sched2 = Scheduler(BlockManager(512, 16), max_num_seqs=16, max_num_batched_tokens=2048)
    sched2.add(_seq(10, 1500, 1))
    assert sched2.schedule().chunks[0].num_tokens == 1500


# --------------------------------------------------------------------------------- server


def test_a_precompiled_server_compiles_nothing_while_serving(tmp_path):
    from _candle_compat_fixtures import write_tiny_hf_checkpoint
    from _server_fixtures import live_server
    from _tiny_served_fixtures import write_word_tokenizer

    from ruvllm.runtime import load_model

    write_tiny_hf_checkpoint(tmp_path, layers=2, hidden=48, vocab=97, max_positions=128)
    write_word_tokenizer(tmp_path)
    model = load_model(str(tmp_path), backend="jax")
    with live_server(model, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64) as srv:
        r = httpx.get(srv.url("/ready"), timeout=10)
        assert r.status_code == 200, r.text
        jm = model.model
        assert jm.precompiled
        compiled = jm.compiled_steps.stats.count

        def ask(n: int) -> int:
            prompt = " ".join(f"w{(n * 7 + j) % 90 + 1}" for j in range(n))
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1 + n % 7, "temperature": 0}
            return httpx.post(srv.url("/v1/completions"), json=body, timeout=60).status_code

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(ask, [1, 2, 9, 30, 60, 100, 3, 45, 70, 12]))
        assert codes == [200] * 10
        assert jm.compiled_steps.stats.count == compiled


def test_ready_says_503_compiling_until_every_shape_is_compiled(tmp_path):
    """As ``ruvllm serve`` runs it: listening first, the engine and its step shapes after."""
    import time

    from _candle_compat_fixtures import write_tiny_hf_checkpoint
    from _tiny_served_fixtures import write_word_tokenizer
    from litestar.testing import TestClient

    from ruvllm.runtime import load_model
    from ruvllm_server.app import create_app
    from ruvllm_server.settings import ServerSettings

    write_tiny_hf_checkpoint(tmp_path, layers=2, hidden=48, vocab=97, max_positions=128)
    write_word_tokenizer(tmp_path)
    model = load_model(str(tmp_path), backend="jax")
    settings = ServerSettings(model="tiny", max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=32)
    with TestClient(create_app(settings, model, start_in_background=True)) as client:
        first = client.get("/ready")
        assert first.status_code == 503
        assert "step shapes" in first.json()["detail"] or "loading" in first.json()["detail"]
        seen = {first.json()["detail"]}
        deadline = time.monotonic() + 120
        while (r := client.get("/ready")).status_code != 200:
            assert r.status_code == 503 and time.monotonic() < deadline
            seen.add(r.json()["detail"])
            time.sleep(0.05)
        assert any(d.startswith("compiling step shapes: ") and "/" in d for d in seen), seen
        assert model.model.precompiled
        body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 2, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
