"""X-LoRA (peft's ``XLoraConfig``): an X-LoRA directory loads with its experts and classifier; the two
passes give transformers + peft's logits on both backends (top-k on and off, layerwise scalings, a
non-zero scaling pass); the engine's cached two-pass decoding gives peft's uncached greedy tokens; a
batch mixing plain adapters, an X-LoRA request and the base model = each request alone; the shadow
sequence's blocks are freed with the request; the server serves an X-LoRA model by name; bad
X-LoRA directories are refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("peft")

from _tiny_served_fixtures import write_word_tokenizer
from _xlora_fixtures import EXPERTS, EXTRA, VARIANTS, peft_logits, write_base, write_experts, xlora_model

from ruvllm.adapters import AdapterError, XLoraAdapter, load_adapter, load_peft_adapter
from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.errors import RequestError

BACKENDS = ["candle-compat", "jax"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("xlora")
    write_base(root / "base")
    write_word_tokenizer(root / "base", vocab=101)
    write_experts(root / "base", root / "experts")
    write_experts(root / "base", root / "extra", EXTRA)
    return root


@pytest.fixture(scope="module")
def xloras(root) -> dict:
    """variant -> (directory, peft's model)."""
    experts = {n: root / "experts" / n for n in EXPERTS}
    return {v: (root / v, xlora_model(root / "base", experts, v, root / v)) for v in VARIANTS}


@pytest.fixture(scope="module")
def models(root) -> dict:
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    return {b: load_model(str(root / "base"), backend=b, host=load_plugins()) for b in BACKENDS}


def _two_passes(llm, xl: XLoraAdapter, ids: list[int]) -> np.ndarray:
    """Every position's logits of ``ids`` through X-LoRA's two passes, each sequence in blocks of its own."""
    cache = llm.allocate_cache(16, 4)
    tokens = np.asarray(ids, np.int32)
    scaling = SequenceChunk(
        tokens, 0, np.arange(8, dtype=np.int32), hidden_states=True, adapter=xl.scaling_pass(len(ids))
    )
    hidden = llm.forward(ForwardBatch([scaling], 4), cache).hidden_states[0]
    real = SequenceChunk(tokens, 0, np.arange(8, 16, dtype=np.int32), all_logits=True, adapter=xl.mix(hidden))
    return llm.forward(ForwardBatch([real], 4), cache).all_logits[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_and_peft(backend, variant, xloras, models):
    d, peft_model = xloras[variant]
    llm = models[backend]
    xl = load_adapter(d, variant, llm.config)
    assert isinstance(xl, XLoraAdapter) and len(xl.components) == 3
    ids = np.random.default_rng(1).integers(3, 101, size=19).tolist()
    want = peft_logits(peft_model, ids)
    got = _two_passes(llm, xl, ids)
    span = float(want.max() - want.min())
    np.testing.assert_allclose(got, want, atol=1e-4 * span, rtol=0)
    # The classifier's weights are peft's (the scalings it logged for this forward).
    scalings = peft_model.base_model.internal_xlora_scalings[0].numpy()  # [T, modules, experts]
    assert scalings.shape[1] == len(xl.modules) == 12
    # What matters: the mix is not one expert alone, nor the base model.
    base = llm.forward(
        ForwardBatch([SequenceChunk(np.asarray(ids, np.int32), 0, np.arange(8, dtype=np.int32), all_logits=True)], 4),
        llm.allocate_cache(16, 4),
    ).all_logits[0]
    assert np.abs(base - want).max() > 100 * 1e-4 * span


def _tokenizer():
    import tokenizers

    from ruvllm.tokenizer import Tokenizer

    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(101)}, unk_token="t0"))
    return Tokenizer(inner, bos_token_id=None, eos_token_ids=())


def _generate(llm, pairs, *, num_blocks=64, max_tokens=12, budget=5, tokenizer=None):
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    config = EngineConfig(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget)
    engine = LLMEngine(llm, config, tokenizer=tokenizer or _tokenizer())
    outs = engine.generate([GenerationRequest(p, params, adapter=a) for p, a in pairs])
    assert engine.block_manager.num_used_blocks == 0  # the shadows' blocks went back too
    return [[t for o in out for d in o.deltas for t in d.token_ids] for out in outs], engine


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_decoding_gives_peft_uncached_greedy_tokens(backend, xloras, models):
    """peft's X-LoRA generates without a KV cache (each step recomputes both passes over every
    token); the engine keeps both passes' keys/values (the shadow sequence's blocks) and runs the
    prompt in chunks of 5: the same greedy tokens."""
    import torch

    llm = models[backend]
    ids = np.random.default_rng(1).integers(3, 101, size=9).tolist()
    distinct = set()
    for variant, (d, peft_model) in xloras.items():
        with torch.no_grad():
            out = peft_model.generate(
                input_ids=torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
            )
        want = out[0, len(ids) :].tolist()
        (got,), _ = _generate(llm, [(ids, load_adapter(d, variant, llm.config))])
        assert got == want, variant
        distinct.add(tuple(got))
    assert len(distinct) >= 3  # the variants do differ


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_mixing_adapters_xlora_and_the_base_model_equals_each_alone(backend, root, xloras, models):
    llm = models[backend]
    cfg = llm.config
    plain = [load_peft_adapter(root / "experts" / n, n, cfg) for n in EXPERTS]
    plain.append(load_peft_adapter(root / "extra" / "e3", "e3", cfg))
    xl = load_adapter(xloras["topk"][0], "topk", cfg)
    xl_layerwise = load_adapter(xloras["layerwise-top1"][0], "lw", cfg)
    rng = np.random.default_rng(5)
    adapters = [None, *plain, xl, None, xl_layerwise]
    prompts = [rng.integers(3, 101, size=n).tolist() for n in (7, 12, 5, 9, 6, 11, 8, 10)]
    pairs = list(zip(prompts, adapters, strict=True))
    together, _ = _generate(llm, pairs, budget=64)
    alone = [_generate(llm, [pair], budget=64)[0][0] for pair in pairs]
    assert together == alone
    assert len({tuple(t) for t in together}) >= 6


@pytest.mark.slow
def test_xlora_requests_hold_twice_the_blocks_and_survive_preemption(xloras, models):
    """A shadow sequence takes blocks for the same positions; with too few blocks for all three
    requests at once, preemption frees and recomputes both, and the tokens stay those of each alone."""
    llm = models["jax"]
    xl = load_adapter(xloras["dense"][0], "dense", llm.config)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 101, size=n).tolist() for n in (10, 13, 9)]
    pairs = [(p, xl) for p in prompts]
    alone = [_generate(llm, [pair], max_tokens=16)[0][0] for pair in pairs]
    together, engine = _generate(llm, pairs, num_blocks=24, max_tokens=16)
    assert together == alone
    assert engine.scheduler.preemptions > 0
    # n = 2: the choices fork off the prompt with their shadows (shared blocks, then copy-on-write).
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.sampling import SamplingParams

    forking = LLMEngine(llm, EngineConfig(num_blocks=64, block_size=4), tokenizer=_tokenizer())
    two = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, n=2)
    (outs,) = forking.generate([GenerationRequest(prompts[0], two, adapter=xl)])
    for index in (0, 1):
        assert [t for o in outs for d in o.deltas if d.index == index for t in d.token_ids] == alone[0]
    assert forking.block_manager.num_used_blocks == 0
    # Each request alone needs 2 x ceil(29 / 4) = 16 blocks; more than the cache is refused up front.
    small = LLMEngine(llm, EngineConfig(num_blocks=12, block_size=4), tokenizer=_tokenizer())
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    small.add_request(GenerationRequest(prompts[2], params))  # the base model fits in 7
    with pytest.raises(RequestError, match="needs 14 KV blocks but the cache has 12"):
        small.add_request(GenerationRequest(prompts[2], params, adapter=xl))


def test_bad_xlora_directories_are_refused_in_one_line(root, xloras, tmp_path):
    from dataclasses import replace

    from ruvllm.checkpoint import open_checkpoint

    cfg = open_checkpoint(root / "base").config
    src = xloras["dense"][0]

    def broken(edit=None, drop=None, name="b") -> Path:
        d = tmp_path / name
        shutil.copytree(src, d)
        conf = json.loads((d / "adapter_config.json").read_text())
        if edit:
            conf.update(edit)
        (d / "adapter_config.json").write_text(json.dumps(conf))
        if drop:
            p = d / drop
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        return d

    cases = [
        (broken({"hidden_size": 32}, name="h"), "hidden_size 32 does not match the base model's 64"),
        (broken({"xlora_depth": 3}, name="d"), "the classifier has 2 linear layers .* xlora_depth is 3"),
        (broken({"xlora_size": 8}, name="s"), r"classifier layer 0 has weight \(16, 64\) .* expected \(8, 64\)"),
        (broken({"top_k_lora": 4}, name="k"), "top_k_lora 4 must be between 1 and the 3 experts"),
        (broken({"enable_softmax_topk": True}, name="t"), "enable_softmax_topk needs top_k_lora"),
        (broken({"layerwise_scalings": True}, name="l"), r"expected \(36, 16\)"),
        (broken(drop="adapter_model.safetensors", name="c"), r"adapter_model\.safetensors \(the classifier\) is mis"),
        (broken({"adapters": {"0": "expert0", "1": "nowhere"}}, name="e"), "expert '1': adapter 'nowhere' not found"),
        (broken({"adapters": {}}, name="n"), "'adapters' must name at least one LoRA expert"),
    ]  # fmt: skip
    for d, needle in cases:
        with pytest.raises(AdapterError, match=needle) as info:
            load_adapter(d, "x", cfg)
        assert "\n" not in str(info.value)
    # An expert that does not fit the base model is named.
    narrow = replace(cfg, intermediate_size=80)
    with pytest.raises(AdapterError, match=r"adapter 'x/1' .*mlp\.\w+_proj has lora_A"):
        load_adapter(src, "x", narrow)
    with pytest.raises(AdapterError, match="rank 8, above max_lora_rank 4"):
        load_adapter(src, "x", cfg, max_rank=4)


def test_the_server_serves_an_xlora_model_by_name(root, xloras, models):
    import httpx
    from _server_fixtures import live_server

    llm = models["candle-compat"]
    d = xloras["scaling-pass"][0]
    prompt = "w5 w9 w33 w2 w70 w11"
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with live_server(llm, lora_modules=[f"mix={d}"], enable_lora_runtime_updates=True) as srv:
        models_ = httpx.get(srv.url("/v1/models"), timeout=30).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models_] == [("smollm2", None), ("mix", "smollm2")]
        tuned = httpx.post(srv.url("/v1/completions"), json={"model": "mix", **body}, timeout=60).json()
        base = httpx.post(srv.url("/v1/completions"), json={"model": "smollm2", **body}, timeout=60).json()
        loaded = httpx.post(
            srv.url("/v1/load_lora_adapter"), json={"lora_name": "dense", "lora_path": str(xloras["dense"][0])}
        )
        again = httpx.post(srv.url("/v1/completions"), json={"model": "dense", **body}, timeout=60).json()
        bad = httpx.post(srv.url("/v1/load_lora_adapter"), json={"lora_name": "x", "lora_path": str(root / "base")})
    assert loaded.status_code == 200
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    ids = llm.tokenizer.encode(prompt)
    for name, out in (("scaling-pass", tuned), ("dense", again)):
        (want,), _ = _generate(llm, [(ids, load_adapter(xloras[name][0], name, llm.config))], max_tokens=8, budget=256)
        assert out["choices"][0]["text"] == llm.tokenizer.decode(want)
    assert tuned["choices"][0]["text"] != base["choices"][0]["text"]


@pytest.mark.slow
def test_precompiled_steps_cover_xlora_requests(root, xloras):
    """Declared X-LoRA adapters (``AdapterLimits.mixes``) make the precompile cover their passes (the
    scaling pass's hidden states, the real pass's weighted plan): a run mixing an X-LoRA model with
    layerwise scalings, one without, plain adapters and the base model compiles nothing more."""
    from ruvllm.backend import AdapterLimits
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model
    from ruvllm.sampling import SamplingParams
    from ruvllm_server.settings import ServerSettings
    from ruvllm_server.state import lora_limits

    llm = load_model(str(root / "base"), backend="jax", host=load_plugins())
    cfg = llm.config
    loaded = {
        "lw": load_adapter(xloras["layerwise-top1"][0], "lw", cfg),
        "sp": load_adapter(xloras["scaling-pass"][0], "sp", cfg),
        "e3": load_peft_adapter(root / "extra" / "e3", "e3", cfg),
    }
    limits = lora_limits(ServerSettings(model="m"), loaded)
    assert limits == AdapterLimits(
        8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 7, 2
    )
    llm.expect_adapters("test", limits)
    engine = LLMEngine(llm, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=8),
                       tokenizer=_tokenizer())  # fmt: skip
    names = [name for name, _ in engine.precompile()]
    assert any(n.endswith("hidden adapters mixed") for n in names)
    compiled = llm.model.compiled_steps.stats.count
    rng = np.random.default_rng(3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    adapters = [loaded["lw"], loaded["sp"], loaded["e3"], None]
    engine.generate([GenerationRequest(rng.integers(3, 101, size=n).tolist(), params, adapter=a)
                     for n, a in zip((9, 14, 5, 7), adapters, strict=True)])  # fmt: skip
    assert llm.model.compiled_steps.stats.count == compiled


@pytest.mark.slow
def test_smollm2_xlora_matches_peft(smollm2_path, tmp_path):
    """The real model: SmolLM2-135M (its Q4_1 GGUF dequantized, as transformers reads it) with three
    random rank-8 experts and a depth-2 top-2 classifier; every position's logits on both backends
    within 1e-4 of the logit range of transformers + peft, and the engine's greedy tokens = peft's."""
    import torch
    from peft import LoraConfig, XLoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    def base():
        m = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32)
        m.config.use_cache = False
        return m

    targets = [["q_proj", "v_proj"], ["gate_proj", "down_proj"], ["o_proj", "up_proj"]]
    model = base()
    for i, t in enumerate(targets):
        pm = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=t))
        torch.manual_seed(i)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.02)
        pm.save_pretrained(tmp_path / f"expert{i}")
        model = pm.unload()
    adapters = {str(i): str(tmp_path / f"expert{i}") for i in range(3)}
    conf = XLoraConfig(task_type="CAUSAL_LM", hidden_size=576, adapters=adapters, xlora_depth=2, xlora_size=32,
                       top_k_lora=2)  # fmt: skip
    xm = get_peft_model(model, conf)
    torch.manual_seed(5)
    with torch.no_grad():
        for n, p in xm.named_parameters():
            if "internal_xlora_classifier" in n:
                p.normal_(0, 0.3)
    xm.eval()
    saved = conf.to_dict() | {"peft_type": "XLORA", "adapters": {str(i): f"expert{i}" for i in range(3)}}
    (tmp_path / "adapter_config.json").write_text(json.dumps(saved, default=str))
    save_file({k: v.contiguous() for k, v in xm.state_dict().items() if "internal_xlora_classifier" in k},
              str(tmp_path / "adapter_model.safetensors"))  # fmt: skip
    ids = [1, 504, 3575, 282, 4649, 314, 3067, 30, 378, 1326, 314, 253]
    want = peft_logits(xm, ids)
    span = float(want.max() - want.min())
    with torch.no_grad():
        greedy = xm.generate(input_ids=torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    for backend in BACKENDS:
        from ruvllm.backend import LoadOptions

        llm = load_model(
            str(smollm2_path), backend=backend, host=load_plugins(), options=LoadOptions(quantization="none")
        )
        xl = load_adapter(tmp_path, "mix", llm.config)
        np.testing.assert_allclose(_two_passes(llm, xl, ids), want, atol=1e-4 * span, rtol=0)
        (got,), _ = _generate(llm, [(ids, xl)], max_tokens=6, budget=8, tokenizer=llm.tokenizer)
        assert got == greedy[0, len(ids) :].tolist(), backend
