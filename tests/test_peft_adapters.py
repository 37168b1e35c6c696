"""PEFT LoRA adapters users bring: logits = transformers + peft on the same tiny random checkpoint
(several ranks, MLP targets, rslora, rank/alpha patterns) on both backends, a batch mixing adapters
and the base model = each request alone, and one-line errors for adapters that do not fit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("peft")

from ruvllm.adapters import AdapterError, load_peft_adapter
from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.checkpoint import open_checkpoint

CONFIG = dict(
    vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
ADAPTERS = {
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8-rslora": dict(
        r=8, lora_alpha=16, use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp-patterns": dict(
        r=2, lora_alpha=4, target_modules=["gate_proj", "down_proj", "o_proj"],
        rank_pattern={"down_proj": 6}, alpha_pattern={"o_proj": 3},
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("base")
    model.save_pretrained(path)
    return path


def _adapter(base_dir: Path, out: Path, kind: str, seed: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir), LoraConfig(**ADAPTERS[kind]))
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.3)
    model.save_pretrained(out)
    return model.eval()


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    """name -> (directory, the peft model)."""
    out = {}
    for i, kind in enumerate(ADAPTERS):
        d = tmp_path_factory.mktemp(kind)
        out[kind] = (d, _adapter(base_dir, d, kind, seed=10 + i))
    return out


def _peft_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _ours(backend: str, base_dir: Path, ids: list[int], adapter) -> np.ndarray:
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    llm = load_model(str(base_dir), backend=backend, host=load_plugins())
    cache = llm.allocate_cache(16, 4)
    chunk = SequenceChunk(np.asarray(ids, np.int32), 0, np.arange(8, dtype=np.int32)[::-1].copy(), all_logits=True,
                          adapter=adapter)  # fmt: skip
    return llm.forward(ForwardBatch([chunk], 4), cache).all_logits[0]


@pytest.mark.parametrize("backend", ["candle-compat", "jax"])
@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_logits_match_transformers_and_peft(backend, kind, base_dir, adapters):
    d, peft_model = adapters[kind]
    cfg = open_checkpoint(base_dir).config
    lora = load_peft_adapter(d, kind, cfg)
    ids = np.random.default_rng(1).integers(3, 101, size=19).tolist()
    want = _peft_logits(peft_model, ids)
    got = _ours(backend, base_dir, ids, lora)
    span = float(want.max() - want.min())
    np.testing.assert_allclose(got, want, atol=1e-4 * span, rtol=0)
    base = _ours(backend, base_dir, ids, None)
    assert np.abs(base - want).max() > 100 * 1e-4 * span  # the adapter matters


def test_a_batch_mixing_adapters_and_the_base_model_equals_each_alone(base_dir, adapters):
    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model
    from ruvllm.sampling import SamplingParams
    from ruvllm.tokenizer import Tokenizer

    llm = load_model(str(base_dir), backend="jax", host=load_plugins())
    cfg = llm.config
    loras = [None, *(load_peft_adapter(d, k, cfg) for k, (d, _) in adapters.items())]
    import tokenizers

    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(101)}, unk_token="t0"))
    tok = Tokenizer(inner, bos_token_id=None, eos_token_ids=())
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 101, size=n).tolist() for n in (7, 12, 5, 9)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def run(pairs):
        engine = LLMEngine(llm, EngineConfig(num_blocks=64, block_size=4), tokenizer=tok)
        outs = engine.generate([GenerationRequest(p, params, adapter=a) for p, a in pairs])
        return [[t for o in out for d in o.deltas for t in d.token_ids] for out in outs]

    together = run(list(zip(prompts, loras, strict=True)))
    alone = [run([(p, a)])[0] for p, a in zip(prompts, loras, strict=True)]
    assert together == alone
    assert len({tuple(t) for t in together}) == 4


def test_adapters_that_do_not_fit_are_refused_in_one_line(base_dir, adapters, tmp_path):
    cfg = open_checkpoint(base_dir).config
    d, _ = adapters["all-r8-rslora"]
    with pytest.raises(AdapterError, match="max_lora_rank 4"):
        load_peft_adapter(d, "x", cfg, max_rank=4)
    import dataclasses

    narrow = dataclasses.replace(cfg, intermediate_size=80)
    needs = r"model\.layers\.0\.mlp\.\w+_proj has lora_A .* the base model needs"
    with pytest.raises(AdapterError, match=needs) as info:
        load_peft_adapter(d, "x", narrow)
    assert "\n" not in str(info.value)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora"):
        load_peft_adapter(broken, "x", cfg)
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors is missing"):
        load_peft_adapter(broken, "x", cfg)
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(AdapterError, match="peft_type 'IA3'"):
        load_peft_adapter(broken, "x", cfg)


def test_reloading_adapters_does_not_grow_device_memory(base_dir, adapters):
    """A reload makes a new adapter object each time (what hot-loading does): the jax backend's device
    copies stay bounded by its LRU, measured as the bytes of live device arrays."""
    import jax

    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model
    from ruvllm_jax.lora import ADAPTER_CACHE_SIZE

    llm = load_model(str(base_dir), backend="jax", host=load_plugins())
    d, _ = adapters["all-r8-rslora"]
    cache = llm.allocate_cache(16, 4)
    ids = np.arange(3, 10, dtype=np.int32)

    def cycle() -> None:
        lora = load_peft_adapter(d, "x", llm.config)  # a fresh object, as after unload + load
        llm.forward(ForwardBatch([SequenceChunk(ids, 0, np.arange(2, dtype=np.int32), adapter=lora)], 4), cache)

    def live_bytes() -> int:
        return sum(a.nbytes for a in jax.live_arrays())

    for _ in range(ADAPTER_CACHE_SIZE + 4):
        cycle()
    before = live_bytes()
    for _ in range(20):
        cycle()
    assert live_bytes() <= before
    assert len(llm.model.adapters._entries) <= ADAPTER_CACHE_SIZE


def test_max_adapters_bounds_device_residency_and_results_stay_exact(base_dir, adapters):
    """With room for two adapters on the device, a step cycling through three keeps at most two
    resident (the least recently used is dropped and uploaded again) and computes the same logits."""
    from ruvllm.backend import LoadOptions
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    llm = load_model(str(base_dir), backend="jax", host=load_plugins(), options=LoadOptions(max_adapters=2))
    loras = [load_peft_adapter(d, k, llm.config) for k, (d, _) in adapters.items()]
    ids = np.random.default_rng(9).integers(3, 101, size=6).astype(np.int32)
    cache = llm.allocate_cache(16, 4)

    def logits(lora):
        chunk = SequenceChunk(ids, 0, np.arange(2, dtype=np.int32), all_logits=True, adapter=lora)
        return llm.forward(ForwardBatch([chunk], 4), cache).all_logits[0]

    first = [logits(a) for a in loras]
    again = [logits(a) for a in loras]
    cache_ = llm.model.adapters
    assert len(cache_._entries) <= 2 and cache_.uploads >= 5
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(Exception, match="max_adapters"):
        load_model(str(base_dir), backend="jax", host=load_plugins(), options=LoadOptions(max_adapters=0))


def test_the_native_lora_kernel_equals_the_dense_form_in_a_mixed_batch(base_dir, adapters):
    """With quantized weights on CPU the step applies adapters through the native kernel (each token
    times its own adapter's factors); the same step with the kernels off uses XLA's dense form. Four
    sequences, three adapters and the base model, chunks of 1 and 5 tokens: logits agree within float
    rounding, and each adapter changes its rows."""
    from ruvllm.backend import LoadOptions
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model
    from ruvllm_jax import native

    if not native.available():
        pytest.skip("native kernels not built")
    host = load_plugins()
    on = load_model(str(base_dir), backend="jax", host=host, options=LoadOptions(quantization="w4a8"))
    off = load_model(
        str(base_dir), backend="jax", host=host, options=LoadOptions(quantization="w4a8", extra={"native": False})
    )
    loras = [None, *(load_peft_adapter(d, k, on.config) for k, (d, _) in adapters.items())]
    rng = np.random.default_rng(9)
    for n in (1, 5):
        chunks = [
            SequenceChunk(rng.integers(3, 101, size=n).astype(np.int32), 0, np.arange(2 * i, 2 * i + 2, dtype=np.int32),
                          all_logits=True, adapter=a)
            for i, a in enumerate(loras)
        ]  # fmt: skip
        got = on.forward(ForwardBatch(chunks, 4), on.allocate_cache(16, 4)).all_logits
        want = off.forward(ForwardBatch(chunks, 4), off.allocate_cache(16, 4)).all_logits
        base = [dataclasses.replace(c, adapter=None) for c in chunks]
        plain = on.forward(ForwardBatch(base, 4), on.allocate_cache(16, 4)).all_logits
        for i in range(len(chunks)):
            span = float(want[i].max() - want[i].min())
            np.testing.assert_allclose(got[i], want[i], atol=1e-4 * span, rtol=0)
            if i:
                assert np.abs(got[i] - plain[i]).max() > 100 * 1e-4 * span  # the adapter was applied
