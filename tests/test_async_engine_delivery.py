"""AsyncEngine's hand-off of outputs to event loops: callers that fall behind get every output in
order (several arrive per wakeup), and callers on different event loops, woken one loop at a time,
each get their own. SmolLM2 on candle-compat, greedy; each stream is compared with the same request
run alone on a plain LLMEngine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ruvllm.engine import AsyncEngine, EngineConfig, GenerationRequest, LLMEngine, RequestOutput
from ruvllm.sampling import SamplingParams

PROMPTS = [
    "The sea at night",
    "List three colours:",
    "def add(a, b):",
    "Un phare, une mer,",
    "Once upon a time",
    "1, 2, 3,",
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from ruvllm.runtime import load_model

    return load_model(str(smollm2_path), backend="candle-compat")


def _request(llm, i: int, tag: str) -> GenerationRequest:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return GenerationRequest(llm.tokenizer.encode(PROMPTS[i]), params, request_id=f"{tag}-{i}")


@pytest.fixture(scope="module")
def alone(llm) -> list[tuple[list[int], str]]:
    engine = LLMEngine(llm, EngineConfig(num_blocks=64))
    out = []
    for i in range(len(PROMPTS)):
        (outputs,) = engine.generate([_request(llm, i, "alone")])
        out.append(_tokens_text(outputs))
    return out


def _tokens_text(outputs: list[RequestOutput]) -> tuple[list[int], str]:
    tokens = [t for o in outputs for d in o.deltas for t in d.token_ids]
    return tokens, "".join(d.text for o in outputs for d in o.deltas)


async def _consume(
    engine: AsyncEngine, request: GenerationRequest, gate: asyncio.Event | None = None
) -> list[RequestOutput]:
    """The request's outputs; with ``gate``, it stops reading after the first until the gate opens."""
    outputs = []
    async for out in engine.generate(request):
        outputs.append(out)
        if gate is not None and len(outputs) == 1:
            await gate.wait()  # fallen behind the steps: the rest pile up meanwhile
    return outputs


def test_callers_behind_the_steps_get_every_output_in_order(llm, alone) -> None:
    engine = AsyncEngine(llm, EngineConfig(num_blocks=64))

    async def main() -> list[list[RequestOutput]]:
        # The odd requests' callers read their first output, then nothing until the even ones (as long,
        # in the same steps) have finished.
        gate = asyncio.Event()
        tasks = [
            asyncio.create_task(_consume(engine, _request(llm, i, "behind"), gate if i % 2 else None))
            for i in range(len(PROMPTS))
        ]
        try:
            await asyncio.gather(*tasks[::2])
            gate.set()
            return await asyncio.gather(*tasks)
        finally:
            await engine.shutdown()

    results = asyncio.run(main())
    for i, outputs in enumerate(results):
        assert _tokens_text(outputs) == alone[i]
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]


def test_callers_on_several_event_loops_each_get_their_own(llm, alone) -> None:
    engine = AsyncEngine(llm, EngineConfig(num_blocks=64))
    engine.start()
    results: dict[int, list[RequestOutput]] = {}
    errors: list[BaseException] = []

    def loop_thread(indices: list[int]) -> None:
        async def main() -> None:
            got = await asyncio.gather(*(_consume(engine, _request(llm, i, "loops")) for i in indices))
            results.update(zip(indices, got, strict=True))

        try:
            asyncio.run(main())
        except BaseException as exc:  # re-raised by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=loop_thread, args=(list(range(k, len(PROMPTS), 3)),)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    asyncio.run(engine.shutdown())
    assert not errors, errors
    assert sorted(results) == list(range(len(PROMPTS)))
    for i, outputs in results.items():
        assert _tokens_text(outputs) == alone[i]
        assert outputs[-1].finished
