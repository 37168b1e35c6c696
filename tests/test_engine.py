"""The serving engine on SmolLM2 (candle-compat backend): continuous batching, prefix caching,
preemption, n > 1 with copy-on-write, sampling parameters, hooks, metrics and the async API.

References are computed without the engine: greedy "alone" outputs come from the backend's forward
step driven one sequence at a time, and logits for the sampling checks from one all-logits prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import numpy as np
import pytest
from _forward_wrap import wrapped_forward

from ruvllm import hookimpl
from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.engine import AsyncEngine, EngineConfig, EngineDeadError, GenerationRequest, LLMEngine, RequestOutput
from ruvllm.errors import RequestError
from ruvllm.sampling import SamplingParams, log_softmax

SUBJECTS = [
    "The capital of France",
    "My favourite colour",
    "Water boils at",
    "The quick brown fox",
    "Once upon a time",
    "Python is a programming language",
    "The moon orbits",
    "In 1492 Columbus",
    "The best way to learn",
    "Cats and dogs",
    "A healthy breakfast",
    "The theory of relativity",
    "Mount Everest is",
    "The stock market",
    "Rain falls when",
    "Music makes",
]
ENDINGS = ["", " is", " was said to be", " and, according to many people who studied it for years,"]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from ruvllm.runtime import load_model

    return load_model(str(smollm2_path), backend="candle-compat")


@pytest.fixture(scope="module")
def eos(llm) -> tuple[int, ...]:
    return tuple(set(llm.config.eos_token_ids) | set(llm.tokenizer.eos_token_ids))


class ReferenceRunner:
    """Greedy decoding and logits straight from the backend's forward step, one sequence alone."""

    BLOCK = 16

    def __init__(self, llm, eos: tuple[int, ...]) -> None:
        self.llm, self.eos = llm, eos
        self.cache = llm.allocate_cache(64, self.BLOCK)  # 1024 slots; reads never go past a chunk's end
        self.table = np.arange(64, dtype=np.int32)

    def _forward(self, ids: list[int], start: int, all_logits: bool = False):
        chunk = SequenceChunk(np.asarray(ids, np.int32), start, self.table, all_logits=all_logits)
        return self.llm.forward(ForwardBatch([chunk], self.BLOCK), self.cache)

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        logits = self._forward(prompt, 0).logits[0]
        out: list[int] = []
        while True:
            out.append(int(np.argmax(logits)))
            if out[-1] in self.eos or len(out) == max_tokens:
                return out
            logits = self._forward([out[-1]], len(prompt) + len(out) - 1).logits[0]

    def logits(self, ids: list[int]) -> np.ndarray:
        """float64 logits ``[len(ids), vocab]``: row i predicts token i + 1."""
        return self._forward(ids, 0, all_logits=True).all_logits[0].astype(np.float64)


@pytest.fixture(scope="module")
def ref(llm, eos) -> ReferenceRunner:
    return ReferenceRunner(llm, eos)


class Workload:
    """64 different prompts (5..25 tokens) with max_tokens 8..12, and their greedy outputs alone."""

    def __init__(self, llm, ref: ReferenceRunner) -> None:
        self.ref = ref
        tok = llm.tokenizer
        self.items = [(tok.encode(SUBJECTS[i % 16] + ENDINGS[i // 16]), 8 + i % 5) for i in range(64)]
        assert len({tuple(p) for p, _ in self.items}) == 64
        self._alone: dict[int, list[int]] = {}

    def alone(self, i: int) -> list[int]:
        """Request ``i`` decoded greedily on its own, one forward step per token (memoized)."""
        if i not in self._alone:
            self._alone[i] = self.ref.greedy(*self.items[i])
        return self._alone[i]

    def assert_greedy_alone(self, i: int, tokens: list[int]) -> None:
        """``tokens`` are what request ``i`` gives alone: every token is the argmax of the logits
        one forward pass over the prompt and the tokens before it yields, and generation ended at
        eos or at max_tokens. (Cheaper than a decode loop: one forward step per request.)"""
        prompt, max_tokens = self.items[i]
        rows = self.ref.logits(prompt + tokens[:-1])[len(prompt) - 1 :]
        assert [int(np.argmax(r)) for r in rows] == tokens, f"request {i}"
        assert not any(t in self.ref.eos for t in tokens[:-1])
        assert tokens[-1] in self.ref.eos or len(tokens) == max_tokens


@pytest.fixture(scope="module")
def workload(llm, ref) -> Workload:
    return Workload(llm, ref)


def tokens_of(outputs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for o in outputs for d in o.deltas if d.index == index for t in d.token_ids]


def text_of(outputs: list[RequestOutput], index: int = 0) -> str:
    return "".join(d.text for o in outputs for d in o.deltas if d.index == index)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


class ForwardCounter:
    """Wraps the model's forward: counts the tokens every step carries."""

    def __init__(self) -> None:
        self.tokens = 0
        self.adapters: list[object] = []

    def __call__(self, inner, batch, cache):
        self.tokens += sum(len(c.token_ids) for c in batch.chunks)
        self.adapters.extend(c.adapter for c in batch.chunks)
        return inner(batch, cache)


@pytest.fixture
def counter(llm):
    c = ForwardCounter()
    with wrapped_forward(llm, c):
        yield c


# -- continuous batching ----------------------------------------------------------------------


def test_64_concurrent_requests_match_each_request_run_alone(llm, workload, eos):
    engine = LLMEngine(llm, EngineConfig(num_blocks=256, max_num_seqs=64))
    requests = [GenerationRequest(p, greedy(k)) for p, k in workload.items]
    results = engine.generate(requests)
    for i, outputs in enumerate(results):
        tokens = tokens_of(outputs)
        workload.assert_greedy_alone(i, tokens)
        if i % 4 == 0:  # a quarter also against a literal one-token-per-step decode alone
            assert tokens == workload.alone(i)
        assert outputs[-1].finished and sum(o.finished for o in outputs) == 1
        reason = outputs[-1].deltas[-1].finish_reason
        assert reason == ("stop" if tokens[-1] in eos else "length")
        assert text_of(outputs) == llm.tokenizer.decode(tokens, skip_special_tokens=True)
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0
    assert stats.blocks_used == 0 and engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished()


def test_async_engine_with_a_quarter_cancelled_mid_stream_frees_every_block(llm, workload):
    engine = AsyncEngine(llm, EngineConfig(num_blocks=256, max_num_seqs=64))
    picked = random.Random(0).sample(range(64), 16)
    closed, cancelled = set(picked[:8]), set(picked[8:])  # leave the loop / cancel the task

    async def consume(i: int, started: asyncio.Event) -> list[RequestOutput]:
        prompt, max_tokens = workload.items[i]
        outputs = []
        request = GenerationRequest(prompt, greedy(max_tokens), request_id=f"r{i}")
        async with contextlib.aclosing(engine.generate(request)) as stream:
            async for out in stream:
                outputs.append(out)
                if len(outputs) == 2:
                    started.set()
                    if i in closed:
                        break
        return outputs

    async def main():
        started = [asyncio.Event() for _ in range(64)]
        tasks = [asyncio.create_task(consume(i, started[i])) for i in range(64)]
        for i in cancelled:
            await started[i].wait()
            tasks[i].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        stats = engine.stats()
        await engine.shutdown()
        return results, stats

    results, stats = asyncio.run(main())
    for i, outputs in enumerate(results):
        if i in cancelled:
            assert isinstance(outputs, asyncio.CancelledError)
        elif i in closed:
            assert len(tokens_of(outputs)) == 2 and not outputs[-1].finished
        else:
            workload.assert_greedy_alone(i, tokens_of(outputs))
    assert stats.blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert engine.engine.block_manager.num_used_blocks == 0


def test_async_abort_ends_the_stream_and_frees_blocks_at_once(llm, workload):
    engine = AsyncEngine(llm, EngineConfig(num_blocks=64))
    prompt = workload.items[0][0]

    async def main():
        outputs = []
        gen = engine.generate(GenerationRequest(prompt, greedy(200, ignore_eos=True), request_id="x"))
        outputs.append(await gen.__anext__())
        final = await engine.abort("x")
        used_after_abort = engine.engine.block_manager.num_used_blocks
        outputs.extend([o async for o in gen])
        await engine.shutdown()
        return outputs, final, used_after_abort

    outputs, final, used = asyncio.run(main())
    assert used == 0
    assert final is not None and final.finished
    assert outputs[-1].finished and outputs[-1].deltas[-1].finish_reason == "abort"


def test_async_shutdown_drains_running_requests_then_refuses_new_ones(llm, workload):
    engine = AsyncEngine(llm, EngineConfig(num_blocks=32))

    async def consume(i: int, started: asyncio.Event) -> list[RequestOutput]:
        outputs = []
        async for out in engine.generate(GenerationRequest(workload.items[i][0], greedy(4, ignore_eos=True))):
            outputs.append(out)
            started.set()
        return outputs

    async def main():
        started = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.create_task(consume(i, started[i])) for i in range(2)]
        for ev in started:
            await ev.wait()
        await engine.shutdown(drain=True)
        results = await asyncio.gather(*tasks)
        with pytest.raises(EngineDeadError):
            await engine.generate(GenerationRequest([1, 2], greedy(1))).__anext__()
        return results

    for outputs in asyncio.run(main()):
        assert len(tokens_of(outputs)) == 4 and outputs[-1].deltas[-1].finish_reason == "length"
    assert engine.stats().blocks_used == 0


def test_stream_yields_deltas_and_metrics(llm, workload):
    (prompt, k), expected = workload.items[5], workload.alone(5)
    engine = LLMEngine(llm, EngineConfig(num_blocks=32, max_num_seqs=1))
    outputs = list(engine.stream(GenerationRequest(prompt, greedy(k))))
    assert tokens_of(outputs) == expected
    assert [len(o.deltas[0].token_ids) for o in outputs] == [1] * len(expected)
    m = outputs[-1].metrics
    assert m.prompt_tokens == len(prompt) and m.completion_tokens == len(expected)
    assert 0 <= m.queue_time <= m.ttft <= m.e2e
    assert len(m.inter_token_latencies) == len(expected) - 1 and min(m.inter_token_latencies) > 0
    assert outputs[0].metrics.completion_tokens == 1  # each output carries the figures of its time


def test_closing_a_stream_early_aborts_its_request(llm, workload):
    engine = LLMEngine(llm, EngineConfig(num_blocks=32))
    stream = engine.stream(GenerationRequest(workload.items[0][0], greedy(50, ignore_eos=True)))
    next(stream)
    assert engine.stats().blocks_used > 0
    stream.close()
    assert engine.stats().blocks_used == 0 and not engine.has_unfinished()


# -- prefix caching ---------------------------------------------------------------------------

PREFIX_TOKENS = 512


def test_shared_prefix_is_computed_once(llm, ref, counter):
    tok = llm.tokenizer
    passage = " ".join(f"Item {i}: the {w} costs {i * 3} coins." for i, w in enumerate(["apple", "pear", "plum"] * 60))
    prefix = tok.encode(passage)[:PREFIX_TOKENS]
    assert len(prefix) == PREFIX_TOKENS
    first = prefix + tok.encode(" Question one: what costs 9 coins?", add_special_tokens=False)
    second = prefix + tok.encode(" Question two:", add_special_tokens=False)
    engine = LLMEngine(llm, EngineConfig(num_blocks=128, block_size=16))

    out_first = engine.generate([GenerationRequest(first, greedy(2, ignore_eos=True))])[0]
    assert counter.tokens == len(first) + 1  # the prompt, then one decode step
    counter.tokens = 0
    out_second = engine.generate([GenerationRequest(second, greedy(3, ignore_eos=True))])[0]
    # Only the tokens after the shared 512 (32 full blocks) plus 2 decode steps went through forward.
    assert counter.tokens == (len(second) - PREFIX_TOKENS) + 2
    assert out_second[-1].metrics.cached_tokens == PREFIX_TOKENS
    assert out_first[-1].metrics.cached_tokens == 0
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == PREFIX_TOKENS
    assert stats.prefix_cache_queried_tokens == len(first) + len(second)
    # The reused keys/values give what a cold run alone gives.
    assert tokens_of(out_second) == ref.greedy(second, 3)


def test_prefix_hits_need_identical_full_blocks(llm, counter):
    tok = llm.tokenizer
    base = tok.encode("Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho")
    assert len(base) >= 20
    other = list(base)
    other[3] = (other[3] + 1) % llm.config.vocab_size  # differs inside the first block
    engine = LLMEngine(llm, EngineConfig(num_blocks=32, block_size=16))
    engine.generate([GenerationRequest(base, greedy(1))])
    counter.tokens = 0
    out = engine.generate([GenerationRequest(other, greedy(1))])[0]
    assert counter.tokens == len(other)
    assert out[-1].metrics.cached_tokens == 0


# -- preemption and chunked prefill -------------------------------------------------------------


def test_too_few_blocks_preempt_but_every_request_completes_correctly(llm, workload):
    picked = range(48, 54)  # the longest prompts (15..17 tokens)
    # Block size 4: 14 blocks hold 56 tokens, far less than the ~6 x 30 the requests need together;
    # a 24-token budget also splits prompts into chunks when two are admitted in one step.
    config = EngineConfig(num_blocks=14, block_size=4, max_num_batched_tokens=24)
    engine = LLMEngine(llm, config)
    results = engine.generate([GenerationRequest(p, greedy(k)) for p, k in (workload.items[i] for i in picked)])
    for i, outputs in zip(picked, results, strict=True):
        assert tokens_of(outputs) == workload.alone(i)
    stats = engine.stats()
    assert stats.preemptions > 0
    assert stats.blocks_used == 0


def test_priority_policy_serves_the_important_request_first(llm, workload):
    engine = LLMEngine(llm, EngineConfig(num_blocks=32, max_num_seqs=1, policy="priority"))
    p1, p2 = workload.items[0][0], workload.items[1][0]
    low = GenerationRequest(p1, greedy(3), priority=5, request_id="low")
    high = GenerationRequest(p2, greedy(3), priority=0, request_id="high")
    engine.add_request(low)
    engine.add_request(high)
    order = [o.request_id for o in iter_until_done(engine) if o.finished]
    assert order == ["high", "low"]


def iter_until_done(engine: LLMEngine):
    while engine.has_unfinished():
        yield from engine.step()


# -- n > 1: shared prompt, copy-on-write --------------------------------------------------------


def test_n_choices_share_the_prompt_and_copy_on_write(llm, workload, counter):
    (prompt, k), expected = workload.items[20], workload.alone(20)
    assert len(prompt) % 16 != 0  # the last prompt block is partial, so choices must copy it
    engine = LLMEngine(llm, EngineConfig(num_blocks=32))
    outputs = engine.generate([GenerationRequest(prompt, greedy(k, n=3))])[0]
    for i in range(3):
        assert tokens_of(outputs, i) == expected
    decode_steps = len(expected) - 1
    assert counter.tokens == len(prompt) + 3 * decode_steps  # the prompt went through forward once
    assert engine.stats().blocks_used == 0

    seeded = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=8, n=2, seed=3, ignore_eos=True))])
    a, b = tokens_of(seeded[0], 0), tokens_of(seeded[0], 1)
    assert a != b  # each choice has its own random stream
    again = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=8, n=2, seed=3, ignore_eos=True))])
    assert (tokens_of(again[0], 0), tokens_of(again[0], 1)) == (a, b)


def test_prompt_logprobs_are_exact_chunked_cached_and_forked(llm, workload, counter):
    """Prompt logprobs against one float64 log-softmax of the whole prompt's logits: the prompt run
    in 16-token chunks, then again once its blocks are in the prefix cache (it must be recomputed:
    the counter sees every prompt token twice), and with n=3 (computed once, sent once)."""
    prompt = llm.tokenizer.encode(
        "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid, "
        "and the capital of Portugal is Lisbon. The capital of Greece is Athens."
    )
    assert len(prompt) > 32
    cache = llm.allocate_cache(32, 16)
    table = np.arange(32, dtype=np.int32)
    full = llm.forward(ForwardBatch([SequenceChunk(np.asarray(prompt, np.int32), 0, table, all_logits=True)], 16),
                       cache).all_logits[0].astype(np.float64)  # fmt: skip
    ref = full - full.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    engine = LLMEngine(llm, EngineConfig(num_blocks=64, max_num_batched_tokens=16))
    counter.tokens = 0
    for n in (1, 1, 3):
        outs = engine.generate([GenerationRequest(prompt, greedy(2, n=n, prompt_logprobs=2))])[0]
        sent = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        assert len(sent) == 1
        got = sent[0]
        assert len(got) == len(prompt) and got[0] is None
        for i in range(1, len(prompt)):
            e = got[i]
            assert e.token_id == prompt[i]
            assert abs(e.logprob - ref[i - 1, prompt[i]]) < 1e-4
            assert [t for t, _, _ in e.top] == [int(t) for t in np.argsort(-ref[i - 1], kind="stable")[:2]]
            assert e.rank == 1 + int(np.count_nonzero(ref[i - 1] > ref[i - 1, prompt[i]] + 1e-9))
    assert counter.tokens >= 3 * len(prompt)  # no prefix-cache hits for these requests
    plain = engine.generate([GenerationRequest(prompt, greedy(2))])[0]
    assert all(o.prompt_logprobs is None for o in plain)
    assert plain[-1].metrics.cached_tokens > 0  # the blocks they published are there for others
    with pytest.raises(RequestError, match="prompt_logprobs"):
        engine.add_request(GenerationRequest(prompt, greedy(2, prompt_logprobs=21)))


# -- sampling parameters through the engine ---------------------------------------------------


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    return engine.generate([GenerationRequest(prompt, params)])[0]


@pytest.fixture(scope="module")
def engine(llm) -> LLMEngine:
    return LLMEngine(llm, EngineConfig(num_blocks=64))


def test_top_k_1_equals_greedy_and_sampling_differs_without_it(engine, workload):
    (prompt, k), expected = workload.items[3], workload.alone(3)
    assert tokens_of(run(engine, prompt, SamplingParams(max_tokens=k, temperature=1.0, top_k=1))) == expected
    free = [tokens_of(run(engine, prompt, SamplingParams(max_tokens=k, temperature=1.5, seed=s))) for s in range(3)]
    assert any(f != expected for f in free)


def test_logit_bias_forces_a_token(engine, llm, workload):
    banana = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = run(engine, workload.items[0][0], greedy(4, logit_bias={banana: 100.0}))
    assert tokens_of(out) == [banana] * 4


def test_seed_repeats_and_different_seeds_differ(engine, workload):
    prompt = workload.items[7][0]
    params = {"max_tokens": 10, "temperature": 1.0, "ignore_eos": True}
    a = tokens_of(run(engine, prompt, SamplingParams(seed=11, **params)))
    assert a == tokens_of(run(engine, prompt, SamplingParams(seed=11, **params)))
    assert a != tokens_of(run(engine, prompt, SamplingParams(seed=12, **params)))


def test_stop_string_spanning_two_tokens_is_cut_exactly(engine, llm, workload):
    tok = llm.tokenizer
    prompt = workload.items[0][0]
    reference = tokens_of(run(engine, prompt, greedy(12, ignore_eos=True)))
    pieces = [tok.decode(reference[: i + 1]) for i in range(len(reference))]
    full = pieces[-1]
    # A stop string made of the last character of one token and the first of the next.
    for i in range(2, len(reference) - 1):
        left, right = pieces[i], pieces[i + 1]
        if len(right) > len(left) and len(left) > len(pieces[i - 1]):
            stop = left[-1] + right[len(left)]
            if full.find(stop) == len(left) - 1:
                break
    else:
        pytest.fail("no token boundary with a usable stop string in the reference output")
    outputs = run(engine, prompt, greedy(12, ignore_eos=True, stop=[stop]))
    assert text_of(outputs) == full[: len(left) - 1]
    last = outputs[-1].deltas[-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert tokens_of(outputs) == reference[: i + 2]  # generation ended at the token completing it
    # No delta ever showed text beyond the cut (the first character was held back).
    seen = ""
    for o in outputs:
        seen += o.deltas[0].text
        assert full[: len(left) - 1].startswith(seen)


def test_min_tokens_suppresses_eos(engine, llm, eos):
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Is the sky blue? Answer yes or no."}])
    plain = tokens_of(run(engine, prompt, greedy(16)))
    assert plain[-1] in eos and len(plain) < 8, "precondition: the model answers briefly"
    need = len(plain) + 3
    forced = tokens_of(run(engine, prompt, greedy(16, min_tokens=need)))
    assert len(forced) >= need
    assert not any(t in eos for t in forced[:need])
    assert forced[: len(plain) - 1] == plain[:-1]  # same choices up to where eos was banned
    # ignore_eos: eos is just another token, generation runs to max_tokens.
    through = run(engine, prompt, greedy(len(plain) + 2, ignore_eos=True))
    assert tokens_of(through)[: len(plain)] == plain and len(tokens_of(through)) == len(plain) + 2
    assert through[-1].deltas[-1].finish_reason == "length"
    # Its text leaves special tokens out unless asked to show them.
    eos_text = llm.tokenizer.id_to_token(plain[-1])
    assert eos_text not in text_of(through)
    shown = run(engine, prompt, greedy(len(plain) + 2, ignore_eos=True, skip_special_tokens=False))
    assert eos_text in text_of(shown)


def test_stop_token_ids_end_generation_without_showing_the_token(engine, llm, workload):
    prompt, expected = workload.items[4][0], workload.alone(4)
    stop_token = expected[2]
    assert stop_token not in expected[:2]
    outputs = run(engine, prompt, greedy(12, stop_token_ids=[stop_token]))
    assert tokens_of(outputs) == expected[:3]
    last = outputs[-1].deltas[-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop_token
    assert text_of(outputs) == llm.tokenizer.decode(expected[:2], skip_special_tokens=True)


def _penalized(raw: np.ndarray, prompt: list[int], produced: list[int], p: SamplingParams) -> np.ndarray:
    """The OpenAI / CTRL definitions, written out independently of ruvllm.sampling."""
    x = raw.copy()
    for t in set(prompt) | set(produced):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(produced):
        x[t] -= p.presence_penalty + p.frequency_penalty * produced.count(t)
    return x


@pytest.mark.parametrize(
    "penalty",
    [{"repetition_penalty": 1.8}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}],
    ids=["repetition", "presence", "frequency"],
)
def test_penalties_change_the_choice_as_defined(engine, llm, ref, penalty):
    prompt = llm.tokenizer.encode("Once upon a time")
    params = greedy(12, ignore_eos=True, **penalty)
    out = tokens_of(run(engine, prompt, params))
    logits = ref.logits(prompt + out)[len(prompt) - 1 :]
    changed = 0
    for j, token in enumerate(out):
        adjusted = _penalized(logits[j], prompt, out[:j], params)
        # Chosen token is the argmax of the penalized logits (ties within float32 noise allowed).
        assert adjusted[token] >= adjusted.max() - 1e-3
        changed += int(np.argmax(logits[j])) != token
    assert changed > 0  # the penalty made a difference somewhere


@pytest.mark.parametrize(
    ("filt", "temperature"),
    [({"min_p": 0.2}, 2.0), ({"top_p": 0.5}, 1.5), ({"top_k": 3}, 2.0)],
    ids=["min_p", "top_p", "top_k"],
)
def test_filters_only_ever_pick_allowed_tokens(engine, llm, ref, filt, temperature):
    prompt = llm.tokenizer.encode("My favourite colour")
    for seed in range(2):
        params = SamplingParams(max_tokens=8, temperature=temperature, seed=seed, ignore_eos=True, **filt)
        out = tokens_of(run(engine, prompt, params))
        logits = ref.logits(prompt + out)[len(prompt) - 1 :]
        for j, token in enumerate(out):
            z = logits[j] / temperature
            probs = np.exp(z - z.max())
            probs /= probs.sum()
            order = np.argsort(-probs)
            if "min_p" in filt:
                allowed = set(np.flatnonzero(probs >= filt["min_p"] * probs.max() * (1 - 1e-4)).tolist())
            elif "top_p" in filt:
                k = int(np.searchsorted(np.cumsum(probs[order]), filt["top_p"] * (1 + 1e-4))) + 1
                allowed = set(order[:k].tolist())
            else:
                allowed = set(order[: filt["top_k"]].tolist())
            assert token in allowed, (seed, j)


def test_logprobs_equal_log_softmax_of_the_logits(engine, ref, workload):
    prompt = workload.items[9][0]
    outputs = run(engine, prompt, greedy(4, logprobs=5, ignore_eos=True))
    entries = [lp for o in outputs for d in o.deltas for lp in d.logprobs]
    tokens = tokens_of(outputs)
    assert len(entries) == len(tokens) == 4
    reference = ref.logits(prompt + tokens)[len(prompt) - 1 :]
    for j, entry in enumerate(entries):
        lsm = log_softmax(reference[j])
        assert entry.token_id == tokens[j]
        # float32 logits from differently shaped forward steps: agree to 1e-3.
        assert entry.logprob == pytest.approx(lsm[tokens[j]], abs=1e-3)
        assert [t for t, _, _ in entry.top] == np.argsort(-lsm)[:5].tolist()
        np.testing.assert_allclose([lp for _, _, lp in entry.top], np.sort(lsm)[::-1][:5], atol=1e-3)


# -- requests, hooks -----------------------------------------------------------------------------


def test_oversized_and_invalid_requests_are_refused_at_add_time(engine, llm):
    ctx = engine.max_model_len
    with pytest.raises(RequestError, match="context"):
        engine.add_request(GenerationRequest([1] * ctx, greedy(1)))
    with pytest.raises(RequestError, match="max_tokens"):
        engine.add_request(GenerationRequest([1] * 10, greedy(ctx - 5)))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request(GenerationRequest([], greedy(1)))
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request(GenerationRequest([llm.config.vocab_size], greedy(1)))
    with pytest.raises(RequestError, match="temperature"):
        engine.add_request(GenerationRequest([1, 2], SamplingParams(temperature=-1)))
    small = LLMEngine(llm, EngineConfig(num_blocks=2, block_size=16))
    with pytest.raises(RequestError, match="KV blocks"):
        small.add_request(GenerationRequest([1] * 20, greedy(20)))
    engine.add_request(GenerationRequest([1, 2], greedy(1), request_id="dup"))
    with pytest.raises(RequestError, match="already"):
        engine.add_request(GenerationRequest([1, 2], greedy(1), request_id="dup"))
    engine.abort("dup")
    assert not engine.has_unfinished() and engine.stats().blocks_used == 0


class AdapterPlugin:
    """pre_inference attaches an adapter; post_inference records what finished."""

    class Adapter:
        def __init__(self) -> None:
            self.calls = 0

        def delta(self, layer, proj, x):
            self.calls += 1
            return None  # observe only: the forward pass stays the base model's

    def __init__(self) -> None:
        self.adapter = self.Adapter()
        self.results = []

    @hookimpl
    def pre_inference(self, request):
        if request.user == "with-adapter":
            request.adapter = self.adapter
            request.sampling.max_tokens = 3  # plugins may adjust sampling too

    @hookimpl
    def post_inference(self, request, result):
        self.results.append((request.user, result))


def test_plugin_hooks_set_the_adapter_and_see_the_result(llm, workload, counter):
    plugin = AdapterPlugin()
    prompt, expected = workload.items[2][0], workload.alone(2)
    counter.adapters.clear()
    llm.host.register(plugin)
    try:
        engine = LLMEngine(llm, EngineConfig(num_blocks=32))
        out = engine.generate([GenerationRequest(prompt, greedy(8), user="with-adapter")])[0]
    finally:
        llm.host.pm.unregister(plugin)
    assert tokens_of(out) == expected[:3]
    assert counter.adapters and all(a is plugin.adapter for a in counter.adapters)
    assert plugin.adapter.calls > 0
    ((user, result),) = plugin.results
    assert user == "with-adapter" and result.output_token_ids == expected[:3]
    assert result.text == text_of(out) and result.finish_reason == "length"
    assert result.prompt_tokens == len(prompt) and result.ttft > 0


class ShiftAdapter:
    """Adds twice the attention heads' output (before o_proj) to o_proj's output in every layer: a
    real change of the model's answers."""

    def delta(self, layer, proj, x):
        return 2.0 * x if proj == "o_proj" else None


class RouterPlugin:
    """Sets ``adapter_router`` on every request; the router records the hidden state it is given and
    answers with what ``choose(user)`` says (an adapter, None, or an exception)."""

    def __init__(self, choose) -> None:
        self.choose, self.seen = choose, {}

    @hookimpl
    def pre_inference(self, request):
        def router(hidden, user=request.user):
            self.seen[user] = hidden
            pick = self.choose(user)
            if isinstance(pick, Exception):
                raise pick
            return pick

        request.adapter_router = router


def test_adapter_router_picks_from_the_prompts_hidden_state(llm, workload, counter):
    """The router gets the base model's final-norm hidden state at the last prompt token; an adapter it
    returns reruns the prompt with it (the answer is the adapted model's, exactly as when the adapter
    is set from the start), None or a failing router keeps the base model's answer."""
    prompt, expected = workload.items[3][0], workload.alone(3)
    adapter = ShiftAdapter()
    engine = LLMEngine(llm, EngineConfig(num_blocks=64))
    fixed = engine.generate([GenerationRequest(prompt, greedy(6), adapter=adapter)])[0]
    assert tokens_of(fixed) != expected[:6]  # the adapter changes the answer
    picks = {"on": adapter, "off": None, "broken": RuntimeError("router bug")}
    plugin = RouterPlugin(picks.get)
    llm.host.register(plugin)
    try:
        counter.tokens = 0
        routed = engine.generate([GenerationRequest(prompt, greedy(6), user="on")])[0]
        assert counter.tokens == 2 * len(prompt) + 5  # the prompt twice, then five decode steps
        unrouted = engine.generate([GenerationRequest(prompt, greedy(6), user="off")])[0]
        broken = engine.generate([GenerationRequest(prompt, greedy(6), user="broken")])[0]
    finally:
        llm.host.pm.unregister(plugin)
    assert tokens_of(routed) == tokens_of(fixed)
    assert tokens_of(unrouted) == expected[:6] and tokens_of(broken) == expected[:6]
    cache = llm.allocate_cache(16, 16)
    batch = ForwardBatch([SequenceChunk(np.asarray(prompt, np.int32), 0, np.arange(16, dtype=np.int32),
                                        hidden_states=True)], 16)  # fmt: skip
    want = llm.forward(batch, cache).hidden_states[0][-1]
    for user in ("on", "off"):
        np.testing.assert_allclose(plugin.seen[user], want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert engine.stats().blocks_used == 0


def test_pre_inference_sees_only_valid_requests_and_post_inference_every_choice(llm, workload):
    plugin = AdapterPlugin()
    seen = []

    class Recorder:
        @hookimpl
        def pre_inference(self, request):
            seen.append(request.request_id)

    recorder = Recorder()
    llm.host.register(plugin)
    llm.host.register(recorder)
    try:
        engine = LLMEngine(llm, EngineConfig(num_blocks=64))
        with pytest.raises(RequestError):  # too long for the context: refused before any plugin runs
            engine.add_request(GenerationRequest([1, 2, 3], greedy(10**6), request_id="bad"))
        prompt = workload.items[1][0]
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3)
        out = engine.generate([GenerationRequest(prompt, params, request_id="three")])[0]
    finally:
        llm.host.pm.unregister(plugin)
        llm.host.pm.unregister(recorder)
    assert seen == ["three"]
    ((_, result),) = plugin.results
    assert [c.index for c in result.choices] == [0, 1, 2]
    for c in result.choices:
        assert c.output_token_ids == tokens_of(out, c.index) and c.text == text_of(out, c.index)
    assert result.output_token_ids == result.choices[0].output_token_ids


# -- failures stay local -------------------------------------------------------------------------

MARK = 4242  # a prompt starting with this token is the one the faulty backend picks on


class FaultyForward:
    """Wraps the backend's forward: ``raise_marked`` raises whenever a marked sequence is in the
    batch; ``nan_marked`` returns NaN logits for the marked row; ``raise_once`` fails the next whole
    step once; ``raise_always`` fails every step."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.calls = 0

    def __call__(self, inner, batch, cache):
        self.calls += 1
        marked = [i for i, c in enumerate(batch.chunks) if c.start_pos == 0 and c.token_ids[0] == MARK]
        if self.mode == "raise_marked" and marked:
            raise RuntimeError("the backend refuses this sequence")
        if self.mode == "raise_once":
            self.mode = "ok"
            raise RuntimeError("a transient device error")
        if self.mode == "raise_always":
            raise RuntimeError("the device is gone")
        result = inner(batch, cache)
        if self.mode == "nan_marked" and marked:
            result.logits = np.array(result.logits, copy=True)
            result.logits[marked[0]] = np.nan
        return result


def _run_async(engine, requests):
    async def one(req):
        out = []
        try:
            async for o in engine.generate(req):
                out.append(o)
        except Exception as exc:
            return exc
        return out

    async def main():
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["raise_marked", "nan_marked", "raise_once"])
def test_a_failure_stays_with_its_request(llm, workload, mode):
    from ruvllm.errors import RequestFailedError

    fault = FaultyForward(mode)
    with wrapped_forward(llm, fault):
        engine = AsyncEngine(llm, EngineConfig(num_blocks=128, max_num_seqs=8))
        good = [GenerationRequest(workload.items[i][0], greedy(workload.items[i][1])) for i in range(4)]
        bad = GenerationRequest([MARK, *workload.items[5][0]], greedy(6), request_id="bad")
        results = _run_async(engine, [*good[:2], bad, *good[2:]])
        stats = engine.stats()
        asyncio.run(engine.shutdown())
    bad_result = results[2]
    if mode == "raise_once":  # a transient error is retried: everybody finishes
        assert not isinstance(bad_result, Exception)
    else:
        assert isinstance(bad_result, RequestFailedError) and bad_result.request_id == "bad"
        assert ("non-finite" if mode == "nan_marked" else "refuses") in str(bad_result)
    for i, out in zip(range(4), [*results[:2], *results[3:]], strict=True):
        assert not isinstance(out, Exception), out
        assert tokens_of(out) == workload.alone(i)
    assert stats.blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert engine.broken is None


def test_an_engine_whose_steps_keep_failing_is_broken_and_says_why(llm, workload):
    fault = FaultyForward("raise_always")
    with wrapped_forward(llm, fault):
        engine = AsyncEngine(llm, EngineConfig(num_blocks=64))
        results = _run_async(engine, [GenerationRequest(workload.items[i][0], greedy(4)) for i in range(3)])
        assert all(isinstance(r, Exception) for r in results)
        assert engine.broken and "the device is gone" in engine.broken
        with pytest.raises(EngineDeadError):
            _run_async_raise(engine, GenerationRequest(workload.items[0][0], greedy(2)))
    assert engine.stats().blocks_used == 0


def _run_async_raise(engine, request):
    async def main():
        async for _ in engine.generate(request):
            pass

    asyncio.run(main())
