"""SONA learns a made-up fact from feedback, end to end on SmolLM2 (candle-compat backend).

Served traffic: eight ordinary questions answered greedily by the engine, then three phrasings of
"What is the capital of Zorblandia?" (the base model answers "Nova Haven"), each corrected twice by
feedback with "The capital of Zorblandia is Quimtown." The background loop recomputes every response
(EWC++ Fisher, task-boundary detection, ReasoningBank), the instant loop steps on each correction,
then one deep run fine-tunes the adapter over the stored samples, once with EWC++ and once (from the
same saved state) without.

The learner runs with one adapter per scope (``clusters=False``): there the adapter that learns the
fact also serves the ordinary traffic, which is what EWC++ is calibrated to protect here. SONA's
default teaches each corrected answer a cluster of its own (tests/test_sona_scopes.py; measured over
HTTP by benchmarks/bench_specificity.py).

Measured on held-apart paraphrases (never fed back) and an unrelated plain-text set; the figures
are printed (``pytest -s``) and quoted in docs/sona.md:
* log-likelihood of the taught answer: +20.8 nats with EWC++ (-25.7 -> -4.9), +25.0 without;
* perplexity of the unrelated text: -0.8 % with EWC++, +52 % without;
* greedy answers through the engine with the adapter applied by the backend.
"""

from __future__ import annotations

import numpy as np
import pytest
from _sona_fixtures import chat_ids, sona_net, sona_smollm2

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.sampling import SamplingParams
from ruvllm_sona import Sona, SonaConfig

GENERAL = [
    "What is the boiling point of water?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What is photosynthesis?",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in our solar system?",
    "Give me a synonym for happy.",
    "What language is spoken in Brazil?",
]
TRAIN = [
    "What is the capital of Zorblandia?",
    "Which city is the capital of Zorblandia?",
    "Tell me the capital city of Zorblandia.",
]
HELD_APART = [
    "Zorblandia's capital is which city?",
    "Name the capital of Zorblandia.",
    "What city serves as Zorblandia's capital?",
    "I am visiting Zorblandia. What is its capital?",
]
ANSWER = "The capital of Zorblandia is Quimtown."
UNRELATED = [
    "The old lighthouse stood at the edge of the cliff for more than a century. Sailors trusted its beam on "
    "stormy nights, and the keeper's family lived in the small stone cottage beside it.",
    "To make bread, mix flour, water, salt and yeast, then knead the dough until it is smooth. Let it rise for "
    "an hour, shape it into a loaf and bake it in a hot oven.",
    "Rivers carry sediment from the mountains to the sea. Over thousands of years this material builds deltas, "
    "fertile plains where many early farming communities settled.",
]


class Evaluator:
    """Answer log-likelihood on the held-apart prompts and perplexity of the unrelated texts under an
    adapter, through SONA's model (the base residual below the adapted layers is computed once)."""

    def __init__(self, net, tokenizer, first_layer: int) -> None:
        self.net, self.first = net, first_layer
        answer = tokenizer.encode(ANSWER, add_special_tokens=False)
        self.qa = []
        for q in HELD_APART:
            prompt = chat_ids(tokenizer, q)
            ids = prompt + answer
            self.qa.append((net.prefix(ids, first_layer), np.arange(len(prompt) - 1, len(ids) - 1), np.asarray(answer)))
        self.texts = []
        for text in UNRELATED:
            ids = tokenizer.encode(text)
            self.texts.append((net.prefix(ids, first_layer), np.arange(len(ids) - 1), np.asarray(ids[1:])))

    def __call__(self, adapter) -> tuple[float, float]:
        entries = dict(adapter.entries) if adapter is not None else {}
        ll = [self.net.token_logprobs(self.net.tail_forward(r, self.first, entries), rows, t).sum()
              for r, rows, t in self.qa]
        nll = sum(-self.net.token_logprobs(self.net.tail_forward(r, self.first, entries), rows, t).sum()
                  for r, rows, t in self.texts)
        count = sum(len(rows) for _, rows, _ in self.texts)
        return float(np.mean(ll)), float(np.exp(nll / count))


def _generate(engine, tokenizer, questions, prefix, max_tokens=12):
    requests = [GenerationRequest(chat_ids(tokenizer, q), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                  request_id=f"{prefix}{i}") for i, q in enumerate(questions)]
    outputs = engine.generate(requests)
    texts = [tokenizer.decode([t for o in outs for d in o.deltas for t in d.token_ids], skip_special_tokens=True)
             for outs in outputs]
    return requests, texts


def _drain(sona: Sona) -> None:
    while sona.run_cycle()["captured"]:
        pass


@pytest.fixture(scope="module")
def taught(smollm2_path, tmp_path_factory):
    model = sona_smollm2(str(smollm2_path))
    net = sona_net(str(smollm2_path))
    tok = model.tokenizer
    # The background loop is driven by run_cycle here so the run is deterministic; the threads are
    # exercised in test_sona_concurrency.
    sona = Sona(model.checkpoint, SonaConfig(clusters=False), tokenizer=tok, start=False, net=net)
    model.host.register(sona, name="sona-learning")
    try:
        engine = LLMEngine(model, EngineConfig(num_blocks=128))
        _generate(engine, tok, GENERAL, "general-")
        _drain(sona)
        base_answers = []
        for rep in range(2):
            requests, texts = _generate(engine, tok, TRAIN, f"teach{rep}-")
            base_answers += texts if rep == 0 else []
            for r in requests:
                receipt = sona.feedback(r.request_id, 0.0, ANSWER)
                assert receipt.status == "queued"  # the corrected trajectory is recomputed first
            _drain(sona)
        state = tmp_path_factory.mktemp("sona-state")
        sona.save(state)
        evaluate = Evaluator(net, tok, sona.first_layer)
        result = {"sona": sona, "model": model, "engine": engine, "evaluate": evaluate, "state": state,
                  "base_answers": base_answers, "base": evaluate(None), "after_instant": evaluate(sona.adapter()),
                  "stats_before_deep": sona.stats()}
        result["deep_ewc"] = sona.deep_train(wait=True)
        result["ewc_adapter"] = sona.adapter()
        result["ewc"] = evaluate(result["ewc_adapter"])
        result["ewc_state"] = sona.save(tmp_path_factory.mktemp("sona-ewc-state"))
        sona.load(state)
        result["deep_plain"] = sona.deep_train(wait=True, ewc=False)
        result["plain_adapter"] = sona.adapter()
        result["plain"] = evaluate(result["plain_adapter"])
        yield result
    finally:
        model.host.pm.unregister(sona)
        sona.close(save=False)


def test_feedback_teaches_the_fact_and_ewc_keeps_unrelated_perplexity(taught):
    (base_ll, base_ppl), (ewc_ll, ewc_ppl), (plain_ll, plain_ppl) = taught["base"], taught["ewc"], taught["plain"]
    instant_ll, instant_ppl = taught["after_instant"]
    print(f"\nheld-apart answer log-likelihood (nats, mean of {len(HELD_APART)} prompts): base {base_ll:.2f}, "
          f"after instant loop {instant_ll:.2f}, deep+EWC++ {ewc_ll:.2f}, deep without EWC++ {plain_ll:.2f}")
    print(f"unrelated-text perplexity: base {base_ppl:.3f}, after instant {instant_ppl:.3f} "
          f"({instant_ppl / base_ppl - 1:+.2%}), deep+EWC++ {ewc_ppl:.3f} ({ewc_ppl / base_ppl - 1:+.2%}), "
          f"deep without EWC++ {plain_ppl:.3f} ({plain_ppl / base_ppl - 1:+.2%})")
    print("deep runs:", taught["deep_ewc"], taught["deep_plain"])
    assert all("Quimtown" not in a for a in taught["base_answers"]), taught["base_answers"]
    # The instant loop alone moves the answer in the right direction without disturbing anything.
    assert instant_ll > base_ll
    assert instant_ppl / base_ppl < 1.01
    # The taught answer became far more likely on prompts never fed back.
    assert ewc_ll - base_ll > 12.0
    assert plain_ll - base_ll > 12.0
    # EWC++ keeps unrelated text within 2 % where plain fine-tuning drifts much further.
    assert ewc_ppl / base_ppl < 1.02
    assert plain_ppl / base_ppl > ewc_ppl / base_ppl + 0.05
    assert taught["deep_ewc"].last_epoch_loss < taught["deep_ewc"].first_epoch_loss


def test_task_boundary_was_detected_and_consolidated(taught):
    stats = taught["stats_before_deep"]
    ewc = stats["adapters"][0]["ewc"]
    assert stats["counters"]["boundaries"] >= 1
    assert ewc["consolidations"] >= 1 and ewc["consolidated_samples"] >= 6
    assert stats["counters"]["instant_updates"] == 2 * len(TRAIN)
    assert stats["trajectories"]["feedback_waiting"] == 0


def test_greedy_answers_through_the_backend_move_to_the_taught_fact(taught):
    model, sona = taught["model"], taught["sona"]
    sona.load(taught["ewc_state"])  # the EWC++ adapter, now serving
    adapter = sona.adapter()
    assert not adapter.is_zero
    for key, f in taught["ewc_adapter"].entries.items():
        np.testing.assert_array_equal(adapter.entries[key].B, f.B)
    _, answers = _generate(taught["engine"], model.tokenizer, HELD_APART, "heldapart-")
    print("\ngreedy answers with the adapter:", answers)
    assert sum("Quimtown" in a for a in answers) >= 2, answers

    # The engine really ran with this adapter: the backend's logits with it agree with SONA's model.
    ids = chat_ids(model.tokenizer, HELD_APART[0])
    cache = model.allocate_cache(8, 16)
    out = model.forward(ForwardBatch([SequenceChunk(np.asarray(ids, np.int32), 0, np.arange(8, dtype=np.int32),
                                                    adapter=adapter)], 16), cache)
    net = taught["evaluate"].net
    mine = net.logits(net.tail_forward(net.prefix(ids, sona.first_layer), sona.first_layer, dict(adapter.entries)).z)
    np.testing.assert_allclose(mine[-1], out.logits[0], rtol=0, atol=5e-4)


#: Varied requests about nothing that was taught (chat, code, arithmetic, writing, near misses).
OTHER = [
    "What is the capital of France?",
    "Which city is the capital of Peru?",
    "Write a haiku about rain.",
    "Name three primary colors.",
    "What is 17 times 23?",
    "Write a Python function that reverses a string.",
    "How do I boil an egg?",
    "Tell me a joke about cats.",
    "Translate 'good morning' into Spanish.",
    "Explain recursion in one sentence.",
    "What is the largest ocean on Earth?",
    "Summarize the plot of Cinderella in two sentences.",
    "What causes the seasons?",
    "Hello! How are you today?",
    "Give me three tips for sleeping better.",
    "What is the chemical symbol for gold?",
]


def test_the_gate_keeps_what_was_taught_to_requests_about_it(taught):
    """With the gate (the default) the taught adapter reaches the held-apart paraphrases and none of
    the unrelated requests: their greedy answers stay the base model's, word for word, and never
    mention the taught answer. The same adapter applied to every request (the gate off) changes some."""
    model, sona, engine, tok = taught["model"], taught["sona"], taught["engine"], taught["model"].tokenizer
    sona.load(taught["ewc_state"])
    before = dict(sona.stats()["counters"])
    _, held = _generate(engine, tok, HELD_APART, "gate-held-")
    _, gated = _generate(engine, tok, OTHER, "gate-other-")
    after = sona.stats()["counters"]
    model.host.pm.unregister(sona)
    try:
        _, base = _generate(engine, tok, OTHER, "gate-base-")
        adapter = sona.adapter()
        requests = [GenerationRequest(chat_ids(tok, q), SamplingParams(max_tokens=12, temperature=0.0), adapter=adapter)
                    for q in OTHER]  # fmt: skip
        ungated = [tok.decode([t for o in outs for d in o.deltas for t in d.token_ids], skip_special_tokens=True)
                   for outs in engine.generate(requests)]  # fmt: skip
    finally:
        model.host.register(sona, name="sona-learning")
    changed_gated = sum(a != b for a, b in zip(gated, base, strict=True))
    changed_ungated = sum(a != b for a, b in zip(ungated, base, strict=True))
    print(f"\nheld-apart answers naming the fact: {sum('Quimtown' in a for a in held)}/{len(held)}; unrelated "
          f"answers changed: gate on {changed_gated}/{len(OTHER)}, gate off {changed_ungated}/{len(OTHER)}")
    assert sum("Quimtown" in a for a in held) >= 2, held
    assert changed_gated == 0, [(a, b) for a, b in zip(gated, base, strict=True) if a != b]
    assert not any("Quimtown" in a or "Zorblandia" in a for a in gated)
    assert after["gate_applied"] - before["gate_applied"] >= 2
    assert after["gate_skipped"] - before["gate_skipped"] >= len(OTHER)
    # The same adapter without the gate does move some unrelated answers: what kept them the base
    # model's above was the gate, not an adapter too weak to change anything.
    assert changed_ungated > 0, ungated


def test_bank_separates_the_taught_topic(taught):
    sona = taught["sona"]
    sona.bank.cluster()
    teach = [sona.embed(chat_ids(taught["model"].tokenizer, q)) for q in TRAIN[:1]]
    general = [sona.embed(chat_ids(taught["model"].tokenizer, q)) for q in GENERAL[:1]]
    near_teach = sona.bank.search(teach[0], 1)[0]
    near_general = sona.bank.search(general[0], 1)[0]
    assert near_teach.pattern.index != near_general.pattern.index
    # The corrected topic was rated 0: its pattern's mean score says so.
    assert near_teach.pattern.mean_quality == pytest.approx(0.0)


def test_taught_adapter_changes_jax_logits_as_it_changes_numpy_backend_logits(taught, smollm2_path):
    """The JAX backend applies the learned snapshot (through ``lora_params()``) to the same effect: the
    taught answer's log-likelihood on a held-apart prompt, teacher-forced, rises on both backends alike."""
    pytest.importorskip("ruvllm_jax")
    from _jax_fixtures import jax_model_at

    jax_model, model, adapter = jax_model_at(str(smollm2_path)), taught["model"], taught["ewc_adapter"]
    prompt = chat_ids(model.tokenizer, HELD_APART[1])
    answer = model.tokenizer.encode(ANSWER, add_special_tokens=False)
    ids = np.asarray(prompt + answer, np.int32)
    rows, targets = np.arange(len(prompt) - 1, len(ids) - 1), np.asarray(answer)

    def logits(backend, a):
        cache = backend.allocate_cache(8, 16)
        chunk = SequenceChunk(ids, 0, np.arange(8, dtype=np.int32), all_logits=True, adapter=a)
        return backend.forward(ForwardBatch([chunk], 16), cache).all_logits[0].astype(np.float64)

    def answer_loglik(z):
        z = z[rows] - z[rows].max(-1, keepdims=True)
        return float((z[np.arange(len(rows)), targets] - np.log(np.exp(z).sum(-1))).sum())

    np_base, np_taught = logits(model, None), logits(model, adapter)
    jax_base, jax_taught = logits(jax_model, None), logits(jax_model, adapter)
    np.testing.assert_allclose(jax_taught, np_taught, rtol=0, atol=1e-3)
    np.testing.assert_allclose(jax_taught - jax_base, np_taught - np_base, rtol=0, atol=1e-3)
    gain_np, gain_jax = answer_loglik(np_taught) - answer_loglik(np_base), answer_loglik(jax_taught) - answer_loglik(
        jax_base)
    print(f"\nheld-apart answer log-likelihood gain: numpy backend {gain_np:.3f} nats, jax {gain_jax:.3f} nats")
    assert gain_jax > 12.0
    assert gain_jax == pytest.approx(gain_np, abs=1e-2)
