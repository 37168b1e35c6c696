"""SONA benchmark on SmolLM2-135M (candle-compat backend): instant-update latency, capture and
background-cycle time, a deep run, and the forward-pass overhead of adapters (candle-compat and jax).

* instant update: ``feedback(response_id, score)`` on captured trajectories, timed around the whole
  call and around the update itself (exact gradient + step + new snapshot), for short and longer
  trajectories;
* capture: recomputing one finished response (the background loop's main cost) and one background
  cycle that captures a batch;
* deep run: fine-tuning over stored samples with EWC++;
* forward overhead: the backend's prefill of 64 tokens and a decode step of 8 sequences with no
  adapter, an all-zero adapter and a trained q/v adapter on the last two layers, and a decode step
  where 4 of the 8 sequences carry the trained adapter; on candle-compat and, where it is installed,
  on the jax backend (float32; its steps are compiled during the warm-up).

Run: ``python benchmarks/bench_sona.py [--json out.json] [--no-jax]`` (thread count from
OPENBLAS_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import numpy as np

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.runtime import load_model
from ruvllm_sona import Sona, SonaConfig
from ruvllm_sona.sona import Trajectory

SHORT_PROMPT = "What is the capital of Zorblandia?"
SHORT_ANSWER = "The capital of Zorblandia is Quimtown, a small harbour city."
LONG_PROMPT = ("Write a short paragraph about lighthouses: who kept them, why ships needed them and what "
               "replaced them. Keep it friendly and simple for a young reader.")
LONG_ANSWER = ("Long ago, lighthouse keepers lived beside the tall towers and kept the lamps burning all night. "
               "Ships used the light to find their way past rocks and into safe harbours. Today most lights "
               "work on their own, and satellites help sailors know exactly where they are.")


def pct(values: list[float]) -> dict[str, float]:
    v = np.asarray(values) * 1e3
    return {"p50_ms": round(float(np.percentile(v, 50)), 4), "p99_ms": round(float(np.percentile(v, 99)), 4),
            "mean_ms": round(float(v.mean()), 4), "n": len(v)}


def timed(fn: Any, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def forward_overhead(model: Any, prompt: np.ndarray, zero: Any, trained: Any) -> dict[str, Any]:
    """p50 of a 64-token prefill and of an 8-sequence decode step, without and with adapters."""
    cache = model.allocate_cache(64, 16)

    def prefill(adapters: list[Any]) -> None:
        chunk = SequenceChunk(prompt, 0, np.arange(4, dtype=np.int32), adapter=adapters[0])
        model.forward(ForwardBatch([chunk], 16), cache)

    def decode(adapters: list[Any]) -> None:
        chunks = [SequenceChunk(prompt[:1], 63, np.arange(4 * i, 4 * i + 4, dtype=np.int32), adapter=adapters[i])
                  for i in range(8)]
        model.forward(ForwardBatch(chunks, 16), cache)

    for i in range(8):  # fill the caches the decode steps read
        model.forward(ForwardBatch([SequenceChunk(prompt, 0, np.arange(4 * i, 4 * i + 4, dtype=np.int32))], 16),
                      cache)
    overhead: dict[str, Any] = {"backend": model.backend.name}
    variants: dict[str, list[Any]] = {"none": [None] * 8, "zero_adapter": [zero] * 8,
                                      "trained_adapter": [trained] * 8, "half_trained": [trained, None] * 4}
    for name, fn, repeat, labels in (("prefill_64", prefill, 20, ("none", "zero_adapter", "trained_adapter")),
                                     ("decode_batch_8", decode, 40, tuple(variants))):
        times: dict[str, list[float]] = {label: [] for label in labels}
        for label in labels:  # warm-up (and compilation on jax)
            fn(variants[label])
        for _ in range(repeat):  # interleaved, so drift in machine load hits every variant alike
            for label in labels:
                times[label] += timed(lambda a=variants[label], f=fn: f(a), 1)
        row: dict[str, Any] = {label: pct(v) for label, v in times.items()}
        base = row["none"]["p50_ms"]
        for label in labels[1:]:
            row[f"{label}_overhead_p50"] = f"{row[label]['p50_ms'] / base - 1:+.1%}"
        overhead[name] = row
    return overhead


ROUTING_PROMPTS = ["Write a haiku about rain.", "What is 17 times 23?", "Name three primary colors.",
                   "How do I boil an egg?", "Tell me a joke about cats.", "What causes the seasons?",
                   "Explain recursion in one sentence.", "What is the largest ocean on Earth?"]  # fmt: skip


def routing_overhead(model: Any, sona: Sona, rounds: int) -> dict[str, Any]:
    """8 streams of 32 greedy tokens through the engine: without SONA, and with SONA's gate routing
    every request (its final hidden state returned, the router asked, the trajectory recorded;
    nothing taught near these prompts, so no prompt runs twice). Rounds interleaved; p50 of each."""
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.sampling import SamplingParams

    tok = model.tokenizer
    engine = LLMEngine(model, EngineConfig(num_blocks=256, enable_prefix_caching=False))
    prompts = [list(tok.encode_chat([{"role": "user", "content": p}])) for p in ROUTING_PROMPTS]

    def run() -> float:
        reqs = [GenerationRequest(p, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)) for p in prompts]
        t0 = time.perf_counter()
        engine.generate(reqs)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"no_sona": [], "sona_gate": []}
    for i in range(rounds + 1):
        for label in times:
            if label == "sona_gate":
                model.host.register(sona, name="sona-routing-bench")
            try:
                t = run()
            finally:
                if label == "sona_gate":
                    model.host.pm.unregister(sona)
            if i:  # the first round warms up
                times[label].append(t)
    row: dict[str, Any] = {k: pct(v) for k, v in times.items()}
    row["tokens_per_s_p50"] = {k: round(8 * 32 / statistics.median(v), 1) for k, v in times.items()}
    row["gate_overhead_p50"] = f"{statistics.median(times['sona_gate']) / statistics.median(times['no_sona']) - 1:+.1%}"
    row["gate_counts"] = {k: v for k, v in sona.stats()["counters"].items() if k.startswith("gate_")}
    # The router's own decision (centred similarities to every cluster's taught prompts), timed alone:
    # what routing adds per request besides the hidden state the step returns.
    call = router_call_seconds(sona, 400)
    row["router_call_us_p50"] = round(call * 1e6, 1)
    row["router_share_of_the_run"] = f"{8 * call / statistics.median(times['sona_gate']):.4%}"
    return row


def router_call_seconds(sona: Sona, n: int) -> float:
    """Median time of one request's router call (``adapter_router(key)``) with a random key."""
    from ruvllm.inference import InferenceRequest
    from ruvllm.sampling import SamplingParams

    rng = np.random.default_rng(5)
    size = sona.model_config.hidden_size
    times = []
    for i in range(n):
        request = InferenceRequest(f"router-{i}", [1, 2, 3], SamplingParams())
        sona.pre_inference(request)
        key = rng.standard_normal(size).astype(np.float32)
        t0 = time.perf_counter()
        request.adapter_router(key)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def teach_topics(sona: Sona, n: int, keys_per_topic: int = 8) -> None:
    """``n`` topics taught through SONA's public path (a recorded response with its gate key, a
    correction, the background cycle): random keys, so no real prompt is near any of them."""
    rng = np.random.default_rng(3)
    size = sona.model_config.hidden_size
    for _ in range(64):
        sona.gate_center.observe(rng.standard_normal(size).astype(np.float32))
    for topic in range(n):
        centre = rng.standard_normal(size).astype(np.float32) * 4
        for j in range(keys_per_topic):
            rid = f"topic{topic}-{j}"
            key = centre + rng.standard_normal(size).astype(np.float32) * 0.5
            sona.record(Trajectory(rid, "global", [1, 2, 3, 4 + topic], [5, 6], sona.adapter(), time.monotonic(),
                                   key=key))  # fmt: skip
            sona.feedback(rid, 0.0, correction=[100 + 3 * topic, 101 + 3 * topic, 102 + 3 * topic])  # its own answer
        while sona.run_cycle()["captured"]:
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument("--updates", type=int, default=2000, help="instant updates per trajectory size")
    ap.add_argument("--no-jax", action="store_true", help="measure the forward overhead on candle-compat only")
    ap.add_argument("--routing-only", action="store_true", help="measure only the gate's routing overhead")
    ap.add_argument("--routing-rounds", type=int, default=5)
    ap.add_argument("--clusters", type=int, default=0,
                    help="with --routing-only: SONA's default (clusters by answer) with this many taught topics "
                         "the router compares every request with (none near the benchmark's prompts); 0: "
                         "clusters=false")  # fmt: skip
    args = ap.parse_args()
    if args.routing_only:
        model = load_model("smollm2", backend="candle-compat")
        # No deep runs: they would train in the background while the rounds are timed.
        config = SonaConfig(deep_trigger=0) if args.clusters else SonaConfig(clusters=False, deep_trigger=0)
        sona = Sona.for_model(model, config, start=False)
        teach_topics(sona, args.clusters)
        row = routing_overhead(model, sona, args.routing_rounds)
        row["clusters"] = len([a for a in sona.stats()["adapters"] if a["cluster_of"]])
        sona.close(save=False)
        print(json.dumps({"backend": model.backend.name, "cpus": os.cpu_count(), "routing_8_streams": row}, indent=1))
        return

    model = load_model("smollm2", backend="candle-compat")
    tok = model.tokenizer
    sona = Sona.for_model(model, SonaConfig(), start=False)
    results: dict[str, Any] = {
        "model": model.config.name, "backend": model.backend.name, "machine": platform.machine(),
        "cpus": os.cpu_count(), "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        "adapted": [f"layers.{li}.{p}" for li, p in sona.keys], "rank": sona.config.rank,
    }

    # -- capture and background cycle ------------------------------------------------------------
    def trajectory(rid: str, prompt: str, answer: str) -> Trajectory:
        ids = list(tok.encode_chat([{"role": "user", "content": prompt}]))
        return Trajectory(rid, "global", ids, tok.encode(answer, add_special_tokens=False), sona.adapter(),
                          time.monotonic())

    sizes = {}
    for name, (prompt, answer) in {"short": (SHORT_PROMPT, SHORT_ANSWER), "long": (LONG_PROMPT, LONG_ANSWER)}.items():
        t = trajectory(name, prompt, answer)
        sizes[name] = {"prompt_tokens": len(t.prompt_ids), "completion_tokens": len(t.completion_ids)}
        sona.record(t)
    for i in range(8):
        sona.record(trajectory(f"batch{i}", SHORT_PROMPT, SHORT_ANSWER))
    t0 = time.perf_counter()
    cycle = sona.run_cycle()  # captures_per_cycle of them
    results["background_cycle"] = {"captured": cycle["captured"], "seconds": round(time.perf_counter() - t0, 4)}
    while sona.run_cycle()["captured"]:
        pass
    idle = timed(sona.run_cycle, 200)
    results["background_cycle"]["idle"] = pct(idle)
    results["capture"] = sona.stats()["capture"]
    results["trajectory_sizes"] = sizes

    # -- instant updates ---------------------------------------------------------------------------
    results["instant_update"] = {}
    for name in ("short", "long"):
        sona._instant_times.clear()
        scores = np.random.default_rng(0).uniform(0, 1, args.updates)
        calls = [0.0] * args.updates
        for i, s in enumerate(scores):
            t0 = time.perf_counter()
            receipt = sona.feedback(name, float(s))
            calls[i] = time.perf_counter() - t0
            assert receipt.status == "applied"
        results["instant_update"][name] = {"update": sona.stats()["instant_update"], "feedback_call": pct(calls)}

    # -- deep run --------------------------------------------------------------------------------
    # A fresh learner, so the samples are just four corrected answers (the updates above stored
    # hundreds of positively rated ones).
    deep = Sona(model.checkpoint, SonaConfig(), tokenizer=tok, start=False, net=sona.net)
    for i in range(4):
        deep.record(trajectory(f"wrong{i}", SHORT_PROMPT, "The capital of Zorblandia is Nova Haven."))
        deep.feedback(f"wrong{i}", 0.0, correction="The capital of Zorblandia is Quimtown.")
    while deep.run_cycle()["captured"]:
        pass
    topic = next(a["scope"] for a in deep.stats()["adapters"] if a["cluster_of"])  # the corrections' cluster
    report = deep.deep_train(topic, wait=True)
    results["deep_run"] = {"samples": report.samples, "epochs": deep.config.deep_epochs, "steps": report.steps,
                           "seconds": round(report.seconds, 3),
                           "seconds_per_step": round(report.seconds / report.steps, 4)}

    # -- forward overhead ------------------------------------------------------------------------
    trained = sona.adapter()
    zero = Sona(model.checkpoint, SonaConfig(), start=False, net=sona.net).adapter()
    prompt = np.asarray((tok.encode(LONG_ANSWER) * 2)[:64], np.int32)
    results["forward"] = forward_overhead(model, prompt, zero, trained)
    if not args.no_jax:
        jax_model = load_model("smollm2", backend="jax")
        results["forward_jax"] = forward_overhead(jax_model, prompt, zero, trained)
    results["routing_8_streams"] = routing_overhead(model, Sona.for_model(model, SonaConfig(), start=False),
                                                    args.routing_rounds)  # fmt: skip
    sona.close(save=False)

    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    print(f"\ninstant update p50 (short / long): {results['instant_update']['short']['update']['p50_ms']} / "
          f"{results['instant_update']['long']['update']['p50_ms']} ms; p99: "
          f"{results['instant_update']['short']['update']['p99_ms']} / "
          f"{results['instant_update']['long']['update']['p99_ms']} ms")
    print(f"capture p50: {results['capture']['p50_ms']} ms; deep step: {results['deep_run']['seconds_per_step']} s; "
          f"median of idle cycles: {statistics.median(idle) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
