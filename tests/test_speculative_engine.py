"""Speculative decoding in the engine on SmolLM2 (jax and candle-compat): greedy output equals the
non-speculative output token for token, alone and 16 at a time; stop strings, max_tokens, n > 1,
logprobs and prefix caching keep working; the KV cache holds afterwards what it would without
speculation; bad settings are refused at start in one line."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ruvllm.backend import LoadOptions
from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.engine.config import EngineConfigError
from ruvllm.sampling import SamplingParams

CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
PROMPTS = [
    f"Here is a Python file:\n\n{CODE}\nRewrite the file with type hints:\n\n",
    "Invoice 2231 from Acme Corp, dated 3 March 2024, total 1,250.00 EUR, due 2 April 2024.\n"
    "Extract the fields as JSON with keys number, vendor, date, total, due:\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "Once upon a time",
]


@pytest.fixture(scope="module", params=["candle-compat", "jax"])
def llm(request, smollm2_path):
    from ruvllm.runtime import load_model

    options = LoadOptions(quantization="auto") if request.param == "jax" else None
    return load_model(str(smollm2_path), backend=request.param, options=options)


def _engine(llm, speculative: str | None, **kw) -> LLMEngine:
    cfg = dict(max_num_seqs=16, num_blocks=512, max_model_len=512, speculative_step_tokens=128)
    cfg.update(kw)
    return LLMEngine(llm, EngineConfig(speculative=speculative, **cfg))


def _run(engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams) -> list[list[list[int]]]:
    """Each request's choices' tokens."""
    reqs = [GenerationRequest(p, SamplingParams(**vars(sampling)), request_id=str(i)) for i, p in enumerate(prompts)]
    outs = engine.generate(reqs)
    got = []
    for out in outs:
        choices: dict[int, list[int]] = {}
        for o in out:
            for d in o.deltas:
                choices.setdefault(d.index, []).extend(d.token_ids)
        got.append([choices[i] for i in sorted(choices)])
    return got


def _prompts(llm, n: int) -> list[list[int]]:
    return [llm.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)]


@pytest.mark.parametrize("concurrent", [1, 16])
def test_greedy_output_is_unchanged(llm, concurrent):
    prompts = _prompts(llm, concurrent)
    sampling = SamplingParams(max_tokens=48 if concurrent == 1 else 24, temperature=0.0)
    plain = _run(_engine(llm, None), prompts, sampling)
    engine = _engine(llm, "ngram")
    assert _run(engine, prompts, sampling) == plain
    stats = engine.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0
    assert stats.blocks_used == 0  # every block went back, drafts' too


def test_the_cache_holds_what_it_would_without_speculation(llm):
    """A request after a speculative one reuses its cached blocks: their keys/values and hashes are
    the non-speculative ones, so its greedy output is the same whichever engine ran the first."""
    prompts = _prompts(llm, 1)
    sampling = SamplingParams(max_tokens=40, temperature=0.0)
    engine = _engine(llm, "ngram")
    first = _run(engine, prompts, sampling)[0][0]
    follow = [prompts[0] + first[:-1]]  # the prompt and what it produced, as a new prompt
    again = _run(engine, follow, SamplingParams(max_tokens=8, temperature=0.0))
    assert engine.stats().prefix_cache_hit_tokens >= 32
    assert again == _run(_engine(llm, None), follow, SamplingParams(max_tokens=8, temperature=0.0))


def test_stop_strings_max_tokens_n_and_logprobs_keep_working(llm):
    prompts = _prompts(llm, 3)[2:]  # the repetitive prompt: drafts are kept
    for sampling in (
        SamplingParams(max_tokens=13, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.0, stop=[" lazy"]),
        SamplingParams(max_tokens=20, temperature=0.0, n=2),
    ):
        plain_engine, spec_engine = _engine(llm, None), _engine(llm, "ngram")
        reqs = [GenerationRequest(prompts[0], sampling, request_id="r")]
        plain = plain_engine.generate(reqs)[0]
        spec = spec_engine.generate([GenerationRequest(prompts[0], sampling, request_id="r")])[0]
        assert spec_engine.stats().spec_accepted_tokens > 0

        def flat(outs, what, index=0):
            got = [getattr(d, what) for o in outs for d in o.deltas if d.index == index]
            if what in ("text", "finish_reason"):
                return "".join(x or "" for x in got)
            return [x for xs in got for x in xs or []]

        for i in range(sampling.n):
            assert flat(spec, "token_ids", i) == flat(plain, "token_ids", i)
            assert flat(spec, "text", i) == flat(plain, "text", i)
            assert flat(spec, "finish_reason", i) == flat(plain, "finish_reason", i)
        if sampling.logprobs:
            a, b = flat(spec, "logprobs"), flat(plain, "logprobs")
            assert [x.token_id for x in a] == [x.token_id for x in b]
            np.testing.assert_allclose([x.logprob for x in a], [x.logprob for x in b], atol=1e-4)


def test_sampled_requests_and_the_opt_out(llm):
    prompts = _prompts(llm, 3)[2:]
    engine = _engine(llm, "ngram")
    sampling = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=7, ignore_eos=True)
    out = _run(engine, prompts, sampling)[0][0]
    assert len(out) == 32 and engine.stats().spec_draft_tokens > 0
    opted_out = _engine(llm, "ngram")
    req = GenerationRequest(prompts[0], SamplingParams(max_tokens=16, temperature=0.0), speculative=False)
    opted_out.generate([req])
    assert opted_out.stats().spec_draft_tokens == 0


def test_bad_settings_are_refused_at_start(llm):
    with pytest.raises(EngineConfigError, match=r"num_speculative_tokens must be in 1\.\.16, got 0"):
        _engine(llm, "ngram", num_speculative_tokens=0)
    with pytest.raises(EngineConfigError, match="speculative must be one of ngram"):
        _engine(llm, "eagle")
    two_tier = {"quantize_old": "int8"} if llm.backend.name == "candle-compat" else {"quantization": "int8"}
    jax_attention = getattr(llm.model, "attention", "reference")
    if llm.backend.name == "jax" and jax_attention != "reference":
        pytest.skip("the jax int8 KV cache needs reference attention")
    with pytest.raises(EngineConfigError, match=f"backend '{llm.backend.name}' cannot drop KV positions"):
        _engine(llm, "ngram", kv_cache_options=two_tier)


def test_structured_output_keeps_its_grammar(llm):
    """A draft is cut where the grammar refuses its first token and verified under the grammar's
    mask: the output matches the regex and equals the non-speculative greedy output."""
    import re

    from ruvllm.structured import StructuredOutput

    regex = r"(The quick brown fox jumps over the lazy dog\. ){2}[a-z ]{0,12}"
    prompt = _prompts(llm, 3)[2]
    sampling = SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutput("regex", regex))
    plain = _run(_engine(llm, None), [prompt], sampling)[0][0]
    engine = _engine(llm, "ngram")
    got = _run(engine, [prompt], sampling)[0][0]
    assert got == plain and engine.stats().spec_accepted_tokens > 0
    assert re.fullmatch(regex, llm.tokenizer.decode(got))


def _fifty_prompts(llm) -> list[list[int]]:
    """The benchmark's 30 prompts (chat template), these tests' 4, and 16 plain continuations."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "benchmarks" / "prompts"
    chats = [
        json.loads(x)["messages"] for f in sorted(root.glob("speculative_*.jsonl")) for x in f.read_text().splitlines()
    ]
    texts = [llm.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in chats] + PROMPTS
    texts += [
        f"Item {i}: the {w} is on the table. Item {i + 1}: the" for i, w in enumerate(["cup", "pen", "book", "key"] * 4)
    ]
    return [llm.tokenizer.encode(t) for t in texts[:50]]


@functools.cache
def _loaded(backend: str, path: str):
    from ruvllm.runtime import load_model

    return load_model(path, backend=backend, options=LoadOptions(quantization="auto") if backend == "jax" else None)


_FIFTY_SAMPLING = SamplingParams(max_tokens=128, temperature=0.0)


@functools.cache
def _plain_fifty(backend: str, path: str) -> list[list[list[int]]]:
    """The non-speculative output of the 50 prompts (shared by both proposers' runs)."""
    llm = _loaded(backend, path)
    prompts = _fifty_prompts(llm)
    assert len(prompts) == 50
    return _run(_engine(llm, None, max_model_len=2048, num_blocks=2048), prompts, _FIFTY_SAMPLING)


@pytest.mark.slow  # 50 x 128 tokens: a plain run per backend (shared), two per proposer; 1.5 to 5 min each
@pytest.mark.timeout(1200)
# On jax the target drafts with its own weights (draft_model="same"). On candle-compat the NumPy model
# drafting for itself outlasts the limit, so its drafts come from the same checkpoint on jax (w4a8): a
# draft loaded by another backend, as the issue allows, and cheap; the verification is candle-compat's.
@pytest.mark.parametrize(
    "backend, proposer", [("jax", "ngram"), ("jax", "draft"), ("candle-compat", "ngram"), ("candle-compat", "draft")]
)
def test_greedy_equality_fifty_prompts(smollm2_path, backend, proposer):
    """The issue's check: 50 prompts x 128 tokens, alone and 16 at a time, identical to the
    non-speculative output (itself the same alone and batched: tests/test_batch_invariance_default)."""
    llm = _loaded(backend, str(smollm2_path))
    prompts = _fifty_prompts(llm)
    want = _plain_fifty(backend, str(smollm2_path))
    draft = None
    if proposer == "draft":
        draft = llm if backend == "jax" else _loaded("jax", str(smollm2_path))
    for concurrent in (1, 16):
        engine = LLMEngine(
            llm,
            EngineConfig(
                max_num_seqs=concurrent,
                max_model_len=2048,
                num_blocks=2048,
                speculative=proposer,
                speculative_step_tokens=128,
                draft_model="same" if proposer == "draft" else None,
            ),
            draft_model=draft,
        )
        assert _run(engine, prompts, _FIFTY_SAMPLING) == want, (proposer, concurrent)
        assert engine.stats().spec_accepted_tokens > 0


class _ScaledOutput:
    """A LoRA-like adapter (candle-compat takes any ``delta``): o_proj's output moved by a tenth of
    its input, position by position, so the adapted model answers differently from the base one."""

    def delta(self, layer, proj, x):
        return 0.1 * x if proj == "o_proj" else None


def test_lora_requests_keep_their_adapter(smollm2_path):
    llm = _loaded("candle-compat", str(smollm2_path))  # (jax takes PEFT factors, not a delta callback)
    prompt = _prompts(llm, 3)[2]
    sampling = SamplingParams(max_tokens=24, temperature=0.0)

    def run(speculative):
        engine = _engine(llm, speculative)
        out = engine.generate([GenerationRequest(prompt, sampling, adapter=_ScaledOutput())])[0]
        return [t for o in out for d in o.deltas for t in d.token_ids], engine.stats()

    plain, _ = run(None)
    spec, stats = run("ngram")
    assert spec == plain and stats.spec_draft_tokens > 0
    assert plain != _run(_engine(llm, None), [prompt], sampling)[0][0]  # the adapter changed the answer
