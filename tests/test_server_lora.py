"""LoRA adapters served by name: ``--lora name=path`` loads a PEFT adapter for SmolLM2, a request with
``model: "<name>"`` runs it (the engine's own result with that adapter), ``/v1/models`` lists it with
its parent, and bad adapters or names are refused."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)

pytest.importorskip("peft")

MODEL = "smollm2"


@pytest.fixture(scope="module")
def smollm2_adapter(smollm2_path, tmp_path_factory) -> Path:
    """A random rank-8 adapter on q/v/down of SmolLM2, written by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.05)
    out = tmp_path_factory.mktemp("smollm2-lora")
    model.save_pretrained(out)
    return out


def test_a_request_picks_an_adapter_by_name(smollm2_model, smollm2_adapter):  # noqa: F811
    from ruvllm.adapters import load_peft_adapter
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.sampling import SamplingParams

    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with live_server(smollm2_model, lora_modules=[f"french={smollm2_adapter}"]) as srv:
        models = httpx.get(srv.url("/v1/models"), timeout=30).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [(MODEL, None), ("french", MODEL)]
        tuned = httpx.post(srv.url("/v1/completions"), json={"model": "french", **body}, timeout=120).json()
        base = httpx.post(srv.url("/v1/completions"), json={"model": MODEL, **body}, timeout=120).json()
        missing = httpx.post(srv.url("/v1/completions"), json={"model": "spanish", **body}, timeout=30)
        from prometheus_client.parser import text_string_to_metric_families

        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url("/metrics")).text)}
        per_adapter = {(s.name, s.labels.get("lora_name")): s.value for f in fams.values() for s in f.samples}
        assert per_adapter[("ruvllm_lora_requests_total", "french")] == 1
        assert per_adapter[("ruvllm_lora_generation_tokens_total", "french")] == 8
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    lora = load_peft_adapter(smollm2_adapter, "french", smollm2_model.config)
    engine = LLMEngine(smollm2_model, EngineConfig(num_blocks=64))
    prompt = smollm2_model.tokenizer.encode(body["prompt"])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (alone,) = engine.generate([GenerationRequest(prompt, params, adapter=lora)])
    want = smollm2_model.tokenizer.decode([t for o in alone for d in o.deltas for t in d.token_ids])
    assert tuned["choices"][0]["text"] == want != base["choices"][0]["text"]


def test_bad_adapters_fail_at_start_in_one_line(smollm2_path, smollm2_adapter, tmp_path):
    import subprocess
    import sys

    def serve(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ruvllm", "serve", str(smollm2_path), "--backend", "candle-compat", *extra],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    for extra, needle in (
        (["--lora", f"french={smollm2_adapter}", "--max-lora-rank", "4"], "above max_lora_rank 4"),
        (["--lora", f"nowhere={tmp_path / 'none'}"], "not found"),
        (["--lora", "no-equals-sign"], "NAME=PATH"),
    ):
        proc = serve(*extra)
        lines = [
            ln for ln in proc.stderr.splitlines() if ln.strip() and '"level"' not in ln and "plugin failed" not in ln
        ]
        assert proc.returncode != 0 and len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]


def test_adapters_load_and_unload_at_run_time(smollm2_model, smollm2_adapter, tmp_path):  # noqa: F811
    """Off unless enabled; behind the API key; an adapter loaded mid-run serves the next request; an
    unload while a stream runs on it lets that stream finish; 20 load/unload cycles keep the
    adapter table (and the device cache, bounded by its LRU) from growing."""
    import threading

    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with live_server(smollm2_model) as srv:  # not enabled: no such route
        r = httpx.post(srv.url("/v1/load_lora_adapter"), json={"lora_name": "x", "lora_path": "y"}, timeout=30)
        assert r.status_code in (404, 405)
    auth = {"Authorization": "Bearer sk-test"}
    with live_server(smollm2_model, enable_lora_runtime_updates=True, api_keys=["sk-test"]) as srv:
        load = {"lora_name": "french", "lora_path": str(smollm2_adapter)}
        assert httpx.post(srv.url("/v1/load_lora_adapter"), json=load, timeout=30).status_code == 401
        r = httpx.post(srv.url("/v1/load_lora_adapter"), json=load, headers=auth, timeout=120)
        assert r.status_code == 200 and r.json() == {"lora_name": "french", "status": "loaded"}
        tuned = httpx.post(
            srv.url("/v1/completions"), json={"model": "french", **body}, headers=auth, timeout=120
        ).json()["choices"][0]["text"]
        # A long stream on the adapter; the adapter is unloaded while it runs.
        streamed: list[str] = []

        def stream() -> None:
            with httpx.stream(
                "POST",
                srv.url("/v1/completions"),
                json={"model": "french", **body, "max_tokens": 40, "stream": True},
                headers=auth,
                timeout=300,
            ) as resp:
                for line in resp.iter_lines():
                    streamed.append(line)

        th = threading.Thread(target=stream)
        th.start()
        while not any(line.startswith("data: {") for line in streamed):
            assert th.is_alive()
        r = httpx.post(srv.url("/v1/unload_lora_adapter"), json={"lora_name": "french"}, headers=auth, timeout=30)
        assert r.status_code == 200
        th.join(timeout=300)
        assert [line for line in streamed if line][-1] == "data: [DONE]"
        assert not any('"error"' in line for line in streamed)
        import json

        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed if line.startswith("data: {"))
        assert text.startswith(tuned)  # the stream ran on the adapter to its end
        gone = httpx.post(srv.url("/v1/completions"), json={"model": "french", **body}, headers=auth, timeout=30)
        assert gone.status_code == 404
        bad = httpx.post(
            srv.url("/v1/load_lora_adapter"), json={"lora_name": "x", "lora_path": str(tmp_path)}, headers=auth
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        for i in range(20):
            assert httpx.post(srv.url("/v1/load_lora_adapter"), json=load, headers=auth, timeout=60).status_code == 200
            again = httpx.post(
                srv.url("/v1/completions"), json={"model": "french", **body}, headers=auth, timeout=120
            ).json()["choices"][0]["text"]
            assert again == tuned, i
            assert (
                httpx.post(
                    srv.url("/v1/unload_lora_adapter"), json={"lora_name": "french"}, headers=auth, timeout=30
                ).status_code
                == 200
            )
        assert srv.state.adapters == {}


def test_the_adapters_requests_can_pick_are_declared_for_the_precompile():
    """What ``--lora`` adapters (and runtime updates) declare to the engine's precompile: the loaded
    adapters' largest rank, the projections they adapt and how many there are; with runtime updates
    every projection, ``max_lora_rank`` (default 16) and ``max_loras`` (default 4) per step."""
    import numpy as np

    from ruvllm.adapters import LoraWeights
    from ruvllm.backend import LORA_PROJECTIONS, AdapterLimits
    from ruvllm_server.settings import ServerSettings
    from ruvllm_server.state import lora_limits

    def weights(name, rank, projs):
        return LoraWeights(name, {(0, p): (np.zeros((rank, 8), np.float32), np.zeros((8, rank), np.float32), 1.0)
                                  for p in projs})  # fmt: skip

    loaded = {"a": weights("a", 8, ["v_proj", "q_proj"]), "b": weights("b", 4, ["down_proj"])}
    assert lora_limits(ServerSettings(model="m"), {}) is None
    assert lora_limits(ServerSettings(model="m"), loaded) == AdapterLimits(8, ("q_proj", "v_proj", "down_proj"), 2)
    runtime = ServerSettings(model="m", enable_lora_runtime_updates=True)
    assert lora_limits(runtime, loaded) == AdapterLimits(16, LORA_PROJECTIONS, 4)
    bounded = ServerSettings(model="m", enable_lora_runtime_updates=True, max_lora_rank=32, max_loras=8)
    assert lora_limits(bounded, {}) == AdapterLimits(32, LORA_PROJECTIONS, 8)
