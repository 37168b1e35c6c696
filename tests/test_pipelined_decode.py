"""The pipelined decode step (``EngineConfig.pipeline_decode``, on by default): on the jax backend the
engine launches step N+1 before it makes step N's outputs, step N+1 planned while step N ran. It must
change nothing a client sees: the same requests, arriving and aborted at the same calls, get the same
tokens, text, finish reasons and log-probabilities with it on and off (greedy and seeded sampling,
stop strings, penalties, a JSON schema, eos), every block comes back, and a launched step that fails
runs again the usual way."""

from __future__ import annotations

import pytest

from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.sampling import SamplingParams
from ruvllm.structured import StructuredOutput

pytestmark = pytest.mark.timeout(600)

PROMPTS = [
    "Write a short poem about the sea.",
    "List three prime numbers.",
    "What is the capital of France?",
    "Describe a cat in one sentence.",
    "Count from one to ten.",
    "Give me a JSON object describing a book.",
]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from ruvllm.backend import LoadOptions
    from ruvllm.runtime import load_model

    return load_model(str(smollm2_path), backend="jax", options=LoadOptions(quantization="auto"))


def _params(i: int) -> SamplingParams:
    """A different kind of request per index."""
    kinds = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=48, temperature=0.0, stop=["."]),  # a stop string ends it mid-flight
        SamplingParams(max_tokens=25, temperature=0.7, seed=3, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(max_tokens=64, temperature=0.0),  # may end on eos
        SamplingParams(
            max_tokens=60,
            temperature=0.0,
            structured=StructuredOutput.json_schema(
                {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
            ),
        ),
    ]
    return kinds[i % len(kinds)]


def _drive(llm, pipeline: bool, prepare=None) -> tuple[dict, LLMEngine]:
    """Requests 0-2 at the first call, 3-5 at the 6th, request 1 aborted at the 12th; returns each
    request's token ids, text, finish reason and logprobs."""
    engine = LLMEngine(llm, EngineConfig(num_blocks=128, max_num_seqs=8, pipeline_decode=pipeline))
    if prepare is not None:
        engine.executor.model = prepare(engine.executor.model)
    got: dict[str, dict] = {}

    def add(i: int) -> None:
        rid = f"r{i}"
        got[rid] = {"ids": [], "text": "", "finish": None, "logprobs": []}
        engine.add_request(GenerationRequest(llm.tokenizer.encode(PROMPTS[i]), _params(i), request_id=rid))

    def record(out) -> None:
        for d in out.deltas:
            g = got[out.request_id]
            g["ids"] += d.token_ids
            g["text"] += d.text
            g["logprobs"] += [(lp.token_id, round(lp.logprob, 4)) for lp in d.logprobs or []]
            g["finish"] = d.finish_reason or g["finish"]

    for i in range(3):
        add(i)
    calls = 0
    while engine.has_unfinished():
        calls += 1
        if calls == 6:
            for i in range(3, 6):
                add(i)
        if calls == 12:
            final = engine.abort("r1")
            assert final is not None
            record(final)
        for out in engine.step():
            record(out)
        assert not engine.take_failures()
        assert calls < 500
    return got, engine


def test_pipelined_decode_changes_no_output(llm):
    on, engine_on = _drive(llm, True)
    off, engine_off = _drive(llm, False)
    assert engine_on.stats().pipelined_steps > 50, engine_on.stats()
    assert engine_off.stats().pipelined_steps == 0
    assert on == off
    assert on["r1"]["finish"] == "abort" and on["r0"]["finish"] == "length" and on["r2"]["finish"] == "stop"
    assert len(on["r0"]["ids"]) == 40 and on["r1"]["logprobs"]
    for engine in (engine_on, engine_off):  # every block back (the cached ones unreferenced)
        assert engine.stats().blocks_used == 0


class _FailingLaunch:
    """A model whose third launched step fails when its output is asked for."""

    def __init__(self, model) -> None:
        self.model = model
        self.launches = 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def prepare_step(self, batch, cache):
        prepared = self.model.prepare_step(batch, cache)
        if prepared is None:
            return None
        outer = self

        class Prepared:
            def launch(self, tokens):
                wait = prepared.launch(tokens)
                outer.launches += 1
                if outer.launches != 3:
                    return wait

                def failing():
                    wait()
                    raise RuntimeError("device lost the step")

                return failing

        return Prepared()


def test_a_launched_step_that_fails_runs_again(llm):
    wrapped: list[_FailingLaunch] = []

    def wrap(model):
        wrapped.append(_FailingLaunch(model))
        return wrapped[0]

    got, engine = _drive(llm, True, wrap)
    off, _ = _drive(llm, False)
    assert wrapped[0].launches > 3
    assert got == off
    assert engine.stats().blocks_used == 0


def test_backends_without_prepared_steps_run_every_step_as_before(smollm2_path):
    """The NumPy backend has no ``prepare_step``: the engine runs its steps through ``forward``."""
    from ruvllm.backend import PreparesSteps
    from ruvllm.runtime import load_model

    llm = load_model(str(smollm2_path), backend="candle-compat")
    assert not isinstance(llm.model, PreparesSteps)
    engine = LLMEngine(llm, EngineConfig(num_blocks=32))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (outs,) = engine.generate([GenerationRequest(llm.tokenizer.encode(PROMPTS[0]), params)])
    assert sum(len(d.token_ids) for o in outs for d in o.deltas) == 6
    assert engine.stats().pipelined_steps == 0
