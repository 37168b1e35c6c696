"""lm-evaluation-harness (``lm-eval[api]``) scores a small multiple-choice task, written here, through
``local-completions`` against a live ``ruvllm serve`` on SmolLM2, offline: the harness finds the
server's tokenizer through ``GET /tokenizer_info`` (no Hugging Face tokenizer by name), sends token-id
prompts with echo and logprobs, and reports an accuracy. Each loglikelihood it computed equals the
engine's own sum of prompt logprobs over the same tokens (candle-compat, float32: the same numbers,
in the same order)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)

pytest.importorskip("lm_eval")

TASK = "ruvllm_capitals"
DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
    {"question": "What is the capital of Italy?", "choices": ["Madrid", "Rome", "Vienna"], "answer": 1},
    {"question": "What is the capital of Germany?", "choices": ["Berlin", "Lisbon", "Oslo"], "answer": 0},
    {"question": "What is the capital of Spain?", "choices": ["Athens", "Dublin", "Madrid"], "answer": 2},
]


def _write_task(where: Path) -> None:
    docs = where / "docs.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (where / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )


def test_a_multiple_choice_task_through_local_completions(smollm2_model, tmp_path, monkeypatch):  # noqa: F811
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    import lm_eval.utils
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    _write_task(tmp_path)
    detected: list[bool] = []
    check = lm_eval.utils.check_remote_tokenizer_support

    def remote_tokenizer(*args, **kw):
        detected.append(check(*args, **kw))
        return detected[-1]

    monkeypatch.setattr(lm_eval.utils, "check_remote_tokenizer_support", remote_tokenizer)
    scored: list[tuple[list[int], int, float]] = []
    parse = LocalCompletionsAPI.parse_logprobs

    def recorded(outputs, tokens=None, ctxlens=None, **kw):
        answers = parse(outputs, tokens=tokens, ctxlens=ctxlens, **kw)
        scored.extend((list(t), c, a[0]) for t, c, a in zip(tokens, ctxlens, answers, strict=True))
        return answers

    monkeypatch.setattr(LocalCompletionsAPI, "parse_logprobs", staticmethod(recorded))
    with live_server(smollm2_model) as server:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "base_url": server.url("/v1/completions"),
                "model": "smollm2",
                "tokenized_requests": True,
                "num_concurrent": 1,
                "max_retries": 1,
            },
            tasks=[TASK],
            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
            batch_size=1,
        )
    assert detected == [True]  # the server's tokenizer, found through /tokenizer_info and /tokenize
    acc = results["results"][TASK]["acc,none"]
    assert 0.0 <= acc <= 1.0, results["results"]
    assert len(scored) == sum(len(d["choices"]) for d in DOCS)

    # The engine's own loglikelihood of each continuation, one request at a time, as the server ran them.
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.sampling import SamplingParams

    engine = LLMEngine(smollm2_model, EngineConfig(num_blocks=256, max_num_seqs=4))
    for tokens, ctxlen, loglikelihood in scored:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        (outs,) = engine.generate([GenerationRequest(tokens, params)])
        prompt = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
        assert sum(p.logprob for p in prompt[ctxlen:]) == loglikelihood, (tokens, ctxlen)
