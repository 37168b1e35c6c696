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

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ruvllm.block_manager import BlockManager
from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.engine.scheduler import Scheduler
from ruvllm.engine.sequence import RequestState, Sequence
from ruvllm.engine.step_budget import MIN_PREFILL_TOKENS, StepBudget
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
    compiled, copies = set(jm._compiled), set(jm._copy_fns)
    together = engine.generate(_requests())
    assert set(jm._compiled) == compiled and set(jm._copy_fns) == copies
    for req, outs in zip(_requests("alone-"), together, strict=True):
        alone = LLMEngine(tiny_jax, EngineConfig(num_blocks=64)).generate([req])[0]
        assert _tokens(outs) == _tokens(alone), req.request_id
    assert engine.block_manager.num_used_blocks == 0 or engine.config.enable_prefix_caching


# ---------------------------------------------------------------------------- step budget


def test_the_prompt_budget_follows_the_measured_step_cost():
    b = StepBudget(target_ms=100.0, max_tokens=2048)
    assert b.prefill_budget(8) == 256  # nothing measured yet
    b.observe(8, 0, 20.0)  # decode-only step of 8: 20 ms
    b.observe(8, 256, 20.0 + 256 * 1.0)  # 1 ms per prompt token
    assert b.decode_estimate(8) == pytest.approx(20.0)
    assert b.ms_per_prompt_token == pytest.approx(1.0)
    assert b.prefill_budget(8) == 64  # (100 - 20) / 1 = 80 -> a power of two below
    b.observe(8, 64, 20.0 + 64 * 10.0)  # the device got slower: the budget shrinks
    assert b.prefill_budget(8) < 64
    b.observe(8, 64, 1e6)  # a stall (a compile) is an outlier and does not count
    assert b.prefill_budget(8) >= MIN_PREFILL_TOKENS
    slow = StepBudget(target_ms=1.0, max_tokens=2048)
    slow.observe(1, 100, 1000.0)
    assert slow.prefill_budget(1) == MIN_PREFILL_TOKENS  # prompts always progress
    assert StepBudget(target_ms=1e6, max_tokens=100).prefill_budget(10) == 64  # within the token budget
    assert slow.prefill_budget(0) == 2048  # nothing decodes: no stream to keep moving


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
        compiled = set(jm._compiled)

        def ask(n: int) -> int:
            prompt = " ".join(f"w{(n * 7 + j) % 90 + 1}" for j in range(n))
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1 + n % 7, "temperature": 0}
            return httpx.post(srv.url("/v1/completions"), json=body, timeout=60).status_code

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(ask, [1, 2, 9, 30, 60, 100, 3, 45, 70, 12]))
        assert codes == [200] * 10
        assert set(jm._compiled) == compiled


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
