"""Feedback and adapter swaps while requests stream never corrupt a request in flight.

SONA's background thread runs (captures, queued feedback), a feeder thread sends score feedback
(an instant update and a new snapshot each time) and a deep run trains and swaps the adapter, all
while the engine steps long-running requests on SmolLM2. Afterwards every request's streamed tokens
are replayed, teacher-forced, through the backend with the snapshot it started with: each token
must be the greedy choice there. The swapped-in adapter would have chosen differently, so a request
that had picked it up mid-flight would be caught.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from _sona_fixtures import chat_ids, sona_net, sona_smollm2

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.hookspecs import hookimpl
from ruvllm.sampling import SamplingParams
from ruvllm_sona import Sona, SonaConfig
from ruvllm_sona.sona import ADAPTER_METADATA_KEY

ANSWER = "The capital of Zorblandia is Quimtown."
QUESTIONS = ["What is the capital of Zorblandia?", "Which city is the capital of Zorblandia?"]
#: Logit gap under which two tokens count as tied (batched and single-sequence float32 sums differ).
TIE = 1e-3


class Recorder:
    """Keeps what each finished (or aborted) request ran with and produced."""

    def __init__(self) -> None:
        self.runs: dict[str, tuple[object, list[int], list[int]]] = {}

    @hookimpl
    def post_inference(self, request, result) -> None:
        self.runs[request.request_id] = (request.metadata.get(ADAPTER_METADATA_KEY), list(request.prompt_token_ids),
                                         list(result.output_token_ids))


def _teacher_forced_margins(model, prompt, output, adapter) -> np.ndarray:
    """For each streamed token: max logit minus the logit of that token (0 when it was the argmax)."""
    ids = prompt + output[:-1]
    blocks = -(-len(ids) // 16)
    cache = model.allocate_cache(blocks, 16)
    out = model.forward(ForwardBatch([SequenceChunk(np.asarray(ids, np.int32), 0, np.arange(blocks, dtype=np.int32),
                                                    all_logits=True, adapter=adapter)], 16), cache)
    logits = out.all_logits[0][len(prompt) - 1:]
    return logits.max(axis=1) - logits[np.arange(len(output)), output]


def _wait(condition, timeout=300.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("SONA's background work did not finish in time")
        time.sleep(0.05)


def test_in_flight_requests_keep_their_snapshot(smollm2_path):
    model = sona_smollm2(str(smollm2_path))
    tok = model.tokenizer
    sona = Sona(model.checkpoint, SonaConfig(background_interval=0.05, deep_trigger=0.0, deep_epochs=12),
                tokenizer=tok, net=sona_net(str(smollm2_path)))
    recorder = Recorder()
    model.host.register(sona, name="sona-concurrency")
    model.host.register(recorder, name="sona-recorder")
    try:
        engine = LLMEngine(model, EngineConfig(num_blocks=128))
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        warm = [GenerationRequest(chat_ids(tok, q), greedy, request_id=f"warm{i}") for i, q in enumerate(QUESTIONS)]
        engine.generate(warm)
        _wait(lambda: sona.stats()["trajectories"]["captured"] >= len(warm))
        for r in warm:
            sona.feedback(r.request_id, 0.0, ANSWER)
        # The corrections teach one cluster (SONA's default); the gate applies it to these prompts
        # once its first instant update is in.
        topics = [a["scope"] for a in sona.stats()["adapters"] if a["cluster_of"] == "global"]
        assert len(topics) == 1, topics
        topic = topics[0]
        _wait(lambda: sona.stats()["trajectories"]["feedback_waiting"] == 0)
        assert not sona.adapter(topic).is_zero

        long_params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        long = [GenerationRequest(chat_ids(tok, q), long_params, request_id=f"long{i}")
                for i, q in enumerate(QUESTIONS)]
        for r in long:
            engine.add_request(r)
        for _ in range(3):
            engine.step()

        updates = []
        stop = threading.Event()

        def feeder() -> None:  # instant updates from score feedback, concurrently with the steps
            i = 0
            while not stop.is_set():
                # Low scores: negative advantages, so no new deep-loop samples pull the other way.
                updates.append(sona.feedback(warm[i % len(warm)].request_id, 0.0).status)
                i += 1
                time.sleep(0.02)

        reports = []
        deep = threading.Thread(target=lambda: reports.append(sona.deep_train(topic, wait=True)))
        feeding = threading.Thread(target=feeder)
        deep.start()
        feeding.start()
        while deep.is_alive():
            engine.step()
        stop.set()
        feeding.join()
        in_flight_at_swap = [r.request_id for r in long if r.request_id in engine._requests]
        for _ in range(4):
            engine.step()

        after = [GenerationRequest(chat_ids(tok, q), greedy, request_id=f"after{i}") for i, q in enumerate(QUESTIONS)]
        for r in after:
            engine.add_request(r)
        while any(r.request_id in engine._requests for r in after):
            engine.step()
        for r in long:
            engine.abort(r.request_id)
    finally:
        model.host.pm.unregister(sona)
        model.host.pm.unregister(recorder)
        sona.close(save=False)

    assert reports and reports[0].steps > 0
    assert updates and all(s == "applied" for s in updates)
    assert in_flight_at_swap, "the long requests finished before the swap; nothing was tested"
    final = sona.adapter(topic)
    for rid in [r.request_id for r in long + after]:
        snapshot, prompt, output = recorder.runs[rid]
        assert len(output) >= 4, rid
        adapter = None if snapshot.is_zero else snapshot
        margins = _teacher_forced_margins(model, prompt, output, adapter)
        assert margins.max() <= TIE, (rid, snapshot, margins.max())
    for rid in in_flight_at_swap:
        snapshot, prompt, output = recorder.runs[rid]
        assert snapshot.scope == topic and snapshot.version < final.version
        # Under the adapter swapped in while it ran, this request would have continued differently.
        assert _teacher_forced_margins(model, prompt, output, final).max() > 10 * TIE, rid
    for r in after:
        assert recorder.runs[r.request_id][0].version >= reports[0].adapter_version
