"""Mixtures of experts (Qwen3-MoE, Mixtral, gpt-oss) compute what Hugging Face transformers computes, on both
backends: logits at every position of ragged, chunked, prefix-shared and decode steps (within 2e-5,
float32), from HF directories and from GGUF files written the way llama.cpp writes them; the router's
choice is transformers' (ties included); what ruvllm does not implement is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _family_checkpoints import hf_all_logits, hf_model
from _moe_checkpoints import (
    GGUF_FAMILIES,
    MOE_FAMILIES,
    moe_config,
    mxfp4_representable,
    write_gpt_oss_gguf,
    write_moe_checkpoint,
    write_moe_gguf,
)

from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm.errors import BackendError, ModelFormatError
from ruvllm.plugins import load_plugins

pytest.importorskip("transformers")

ATOL = 2e-5
BLOCK = 4
BACKENDS = ("candle-compat", "jax")
#: The jax backend with its layers unrolled, as it runs on CUDA (``unroll_layers``, auto there).
STEP_BACKENDS = (*BACKENDS, "jax-unrolled")


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def family_dir(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, write_moe_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def _load(path: Path, backend: str, **options):
    ckpt = open_checkpoint(path)
    if backend == "jax-unrolled":
        options["extra"] = {"unroll_layers": True}
    model = load_plugins().choose_backend(backend.removesuffix("-unrolled")).load(ckpt, LoadOptions(**options))
    return ckpt, model, model.kv_cache(48, BLOCK, {})


@pytest.mark.parametrize("backend", STEP_BACKENDS)
def test_ragged_chunked_prefix_cached_steps_match_transformers(family_dir, backend) -> None:
    family, path = family_dir
    ckpt, model, cache = _load(path, backend)
    cfg = ckpt.config
    assert (cfg.architecture, cfg.num_experts, cfg.experts_per_token) == (
        {"qwen3_moe": ("qwen3_moe", 8, 3), "mixtral": ("mixtral", 4, 2), "gpt_oss": ("gpt_oss", 4, 2)}[family]
    )
    assert cfg.norm_topk_prob == (family == "mixtral")
    if family == "gpt_oss":
        assert cfg.layer_windows == (5, 0) and cfg.rope.kind == "yarn" and not cfg.rope.truncate
        assert cfg.attention_sinks and cfg.o_proj_bias and cfg.expert_bias and cfg.router_bias
    rng = np.random.default_rng(3)
    a = rng.integers(3, cfg.vocab_size, size=30).tolist()
    b = a[:12] + rng.integers(3, cfg.vocab_size, size=9).tolist()  # shares a's first 12 tokens (3 blocks)
    c = rng.integers(3, cfg.vocab_size, size=23).tolist()
    perm = rng.permutation(48).astype(np.int32)
    table_a, table_c = perm[0:9], perm[9:16]
    table_b = np.concatenate([table_a[:3], perm[16:22]])
    ref = {"a": hf_all_logits(path, a), "b": hf_all_logits(path, b), "c": hf_all_logits(path, c)}
    seqs = {"a": (a, table_a), "b": (b, table_b), "c": (c, table_c)}

    def run(step: list[tuple[str, int, int]]) -> None:
        chunks = [
            SequenceChunk(np.asarray(seqs[k][0][lo:hi], np.int32), lo, seqs[k][1], all_logits=True)
            for k, lo, hi in step
        ]
        out = model.forward(ForwardBatch(chunks, BLOCK), cache)
        for row, (k, lo, hi) in enumerate(step):
            np.testing.assert_allclose(
                out.all_logits[row], ref[k][lo:hi], atol=ATOL, rtol=0,
                err_msg=f"{family} on {backend}: sequence {k} positions {lo}..{hi - 1}",
            )  # fmt: skip

    run([("a", 0, 12), ("c", 0, 5)])
    run([("a", 12, 21), ("b", 12, 13), ("c", 5, 19)])  # b reuses a's 3 cached blocks
    for pos in range(21, 30):  # decode a past mixtral's window, with b and c alongside
        step = [("a", pos, pos + 1)]
        if 13 <= pos - 8 < len(b):
            step.append(("b", pos - 8, pos - 7))
        if 19 <= pos - 2 < len(c):
            step.append(("c", pos - 2, pos - 1))
        run(step)
    if backend.startswith("jax"):  # the steps ran as asked: scanned layers, or unrolled
        assert {plan.unroll_layers for plan in model.compiled_steps.stats.plans} == {backend == "jax-unrolled"}


def _hf_router(
    family: str, cfg, weight: np.ndarray, bias: np.ndarray, hidden: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    kind = {"qwen3_moe": Qwen3MoeTopKRouter, "mixtral": MixtralTopKRouter, "gpt_oss": GptOssTopKRouter}[family]
    router = kind(moe_config(family, **cfg))
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(weight))
        if family == "gpt_oss":
            router.bias.copy_(torch.from_numpy(bias))
        _, scores, idx = router(torch.from_numpy(hidden))
    return scores.numpy(), idx.numpy()


@pytest.mark.parametrize(
    ("family", "norm"), [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True), ("gpt_oss", False)]
)
def test_routing_matches_the_transformers_router_ties_included(family, norm) -> None:
    """ruvllm.modeling.route (NumPy and JAX, the same lines) chooses transformers' experts with its
    weights. Experts 1 and 5 (and 2, 6) have equal router rows, so their logits tie exactly: where a
    tie straddles the k-th place, torch's pick among equals is its own, ruvllm's the lower index (a
    stable sort, every backend alike), and the weights are the same numbers either way. gpt_oss picks
    by logits (its router's bias included, equal for the tied pairs) and takes a softmax of the k."""
    import jax.numpy as jnp

    from ruvllm.model_config import ModelConfig
    from ruvllm.modeling import route

    n, k = (8, 3) if family == "qwen3_moe" else (8, 2)
    rng = np.random.default_rng(11)
    weight = rng.normal(size=(n, 64)).astype(np.float32) / 8
    weight[5], weight[6] = weight[1], weight[2]
    bias = np.zeros(n, np.float32)
    if family == "gpt_oss":  # its router's bias; on the rows of zeros four experts tie at the top
        bias = rng.normal(size=n).astype(np.float32) / 4
        bias[[1, 2, 5, 6]] = bias.max() + 1
    hidden = rng.normal(size=(200, 64)).astype(np.float32)
    hidden[:20] = 0.0  # every logit equal (gpt_oss: the bias's), experts tie
    edit = {"num_experts" if family == "qwen3_moe" else "num_local_experts": n, "num_experts_per_tok": k}
    if family == "qwen3_moe":
        edit["norm_topk_prob"] = norm
    want_w, want_e = _hf_router(family, edit, weight, bias, hidden)
    routing = "topk_softmax" if family == "gpt_oss" else "softmax_topk"
    shape = ModelConfig("x", 101, 64, 32, 1, 4, 2, 16, 64, num_experts=n, experts_per_token=k,
                        expert_intermediate_size=32, norm_topk_prob=norm, routing=routing)  # fmt: skip
    logits = hidden @ weight.T + bias
    got_w, got_e = route(logits, shape)
    jax_w, jax_e = route(jnp.asarray(logits), shape)
    np.testing.assert_array_equal(np.asarray(jax_e), got_e)
    np.testing.assert_allclose(np.asarray(jax_w), got_w, rtol=0, atol=1e-6)  # XLA's exp: an ulp apart
    np.testing.assert_allclose(got_w, want_w, rtol=0, atol=1e-6)  # by place: weights fall alike
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True) if family != "gpt_oss" else logits
    kth, next_ = np.sort(probs, -1)[:, ::-1][:, k - 1], np.sort(probs, -1)[:, ::-1][:, k]
    straddles = kth == next_
    assert straddles[:20].all() and 0 < straddles[20:].sum() < 180  # ties of both kinds occur
    clear = ~straddles
    np.testing.assert_array_equal(np.sort(got_e[clear], -1), np.sort(want_e[clear], -1))
    for t in np.flatnonzero(straddles):  # ruvllm: among equal weights, the lower indices first
        for j in range(k - 1):
            if got_w[t, j] == got_w[t, j + 1]:
                assert got_e[t, j] < got_e[t, j + 1]
    first = sorted(np.argsort(-logits[0], kind="stable")[:k].tolist())  # 0, 1, ... (gpt_oss: 1, 2)
    assert np.sort(got_e[:20], -1).tolist() == [first] * 20


@pytest.mark.parametrize("family", GGUF_FAMILIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gguf_files_match_transformers(family, backend, tmp_path) -> None:
    """The same weights as GGUF (experts stacked in ``ffn_*_exps``, the router ``ffn_gate_inp``;
    Mixtral a ``llama`` file with permuted Q/K) compute transformers' logits. llama.cpp always
    renormalises the top-k weights, so the qwen3_moe model has norm_topk_prob on (as Qwen3-30B-A3B)."""
    edit = {"norm_topk_prob": True} if family == "qwen3_moe" else {}
    hf_dir = write_moe_checkpoint(tmp_path / "hf", family, **edit)
    path = write_moe_gguf(hf_dir, family, tmp_path / "model.gguf")
    ckpt, model, cache = _load(path, backend)
    assert ckpt.config.num_experts == (8 if family == "qwen3_moe" else 4)
    ids = np.random.default_rng(7).integers(3, 101, size=26).tolist()
    table = np.random.default_rng(8).permutation(48)[:7].astype(np.int32)
    chunk = SequenceChunk(np.asarray(ids, np.int32), 0, table, all_logits=True)
    out = model.forward(ForwardBatch([chunk], BLOCK), cache)
    np.testing.assert_allclose(out.all_logits[0], hf_all_logits(hf_dir, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_oss_gguf_with_mxfp4_experts_matches_transformers(backend, tmp_path) -> None:
    """gpt-oss as llama.cpp's converter writes it, its experts in MXFP4 (the HF checkpoint's experts
    rounded to MXFP4 values first, so both hold the same weights): transformers' logits. (llama.cpp
    fixes the SwiGLU limit at 7 and writes none, so the checkpoint has that one.)"""
    hf_dir = write_moe_checkpoint(tmp_path / "hf", "gpt_oss", swiglu_limit=7.0)
    mxfp4_representable(hf_dir)
    path = write_gpt_oss_gguf(hf_dir, tmp_path / "model.gguf", "MXFP4")
    ckpt, model, cache = _load(path, backend)
    cfg = ckpt.config
    assert (cfg.architecture, cfg.layer_windows, cfg.routing) == ("gpt_oss", (5, 0), "topk_softmax")
    assert ckpt.raw_tensor("model.layers.1.mlp.experts.3.up_proj.weight").ggml_type == "MXFP4"
    ids = np.random.default_rng(7).integers(3, 101, size=26).tolist()
    table = np.random.default_rng(8).permutation(48)[:7].astype(np.int32)
    chunk = SequenceChunk(np.asarray(ids, np.int32), 0, table, all_logits=True)
    out = model.forward(ForwardBatch([chunk], BLOCK), cache)
    np.testing.assert_allclose(out.all_logits[0], hf_all_logits(hf_dir, ids), atol=ATOL, rtol=0)


def test_an_mxfp4_block_with_a_bad_scale_is_a_load_error_naming_it(tmp_path) -> None:
    import gguf

    hf_dir = write_moe_checkpoint(tmp_path / "hf", "gpt_oss")
    path = write_gpt_oss_gguf(hf_dir, tmp_path / "model.gguf", "MXFP4")
    reader = gguf.GGUFReader(str(path), "r+")
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    down.data.reshape(-1, 17)[5, 0] = 0xFF  # expert 0's sixth block: an E8M0 scale that is NaN
    del reader, down
    with pytest.raises(ModelFormatError, match=r"blk\.1\.ffn_down_exps\.weight \(expert 0\).*0xFF") as info:
        _load(path, "candle-compat")
    assert "\n" not in str(info.value)


def test_quantized_gguf_experts_keep_their_blocks(tmp_path) -> None:
    """A Q8_0 file's experts are read per expert from the stacked blocks, as the file holds them (the
    block bytes of expert 5 are gguf's quantization of its float weights), and the model runs on them."""
    import gguf

    hf_dir = write_moe_checkpoint(tmp_path / "hf", "qwen3_moe", norm_topk_prob=True)
    q8 = open_checkpoint(write_moe_gguf(hf_dir, "qwen3_moe", tmp_path / "q8.gguf", "Q8_0"))
    f32 = open_checkpoint(write_moe_gguf(hf_dir, "qwen3_moe", tmp_path / "f32.gguf"))
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    raw = q8.raw_tensor(name)
    assert raw.ggml_type == "Q8_0" and raw.shape == (64, 32)
    q = gguf.quants.quantize(f32.tensor(name), gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(raw.data, q)
    assert q8.matrix_types()["Q8_0"] == 2 * (4 + 3 * 8)  # per layer: q, k, v, o and 8 experts' three
    ids = np.random.default_rng(2).integers(3, 101, size=9).tolist()
    outs = []
    for ckpt in (q8, f32):
        model = load_plugins().choose_backend("candle-compat").load(ckpt, LoadOptions())
        chunk = SequenceChunk(np.asarray(ids, np.int32), 0, np.arange(3, dtype=np.int32), all_logits=True)
        outs.append(model.forward(ForwardBatch([chunk], BLOCK), model.kv_cache(4, BLOCK, {})).all_logits[0])
    assert 1e-4 < np.abs(outs[0] - outs[1]).max() < 0.1  # Q8_0's rounding, read exactly


def _edited(tmp_path: Path, family: str, edit: dict) -> Path:
    path = write_moe_checkpoint(tmp_path, family)
    config = json.loads((path / "config.json").read_text())
    config.update(edit)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("family", "edit", "field"),
    [
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("qwen3_moe", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ("qwen3_moe", {"num_local_experts": 0}, "num_local_experts"),
        ("mixtral", {"num_local_experts": None}, "num_local_experts"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
        ("qwen3_moe", {"moe_intermediate_size": 0}, "moe_intermediate_size"),
        ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
        ("gpt_oss", {"attention_bias": False}, "attention_bias"),
        ("gpt_oss", {"swiglu_limit": None}, "swiglu_limit"),
        ("gpt_oss", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_or_unimplemented_expert_fields_are_refused_by_name(family, edit, field, tmp_path) -> None:
    with pytest.raises(ModelFormatError, match=field) as info:
        _ = open_checkpoint(_edited(tmp_path, family, edit)).config
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_missing_router_is_a_load_error_naming_it(backend, tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    path = write_moe_checkpoint(tmp_path, "mixtral")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.gate.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=r"model\.layers\.1\.mlp\.gate\.weight") as info:
        _load(path, backend)
    assert "\n" not in str(info.value)


def test_gguf_expert_counts_out_of_range_are_refused_by_name(tmp_path) -> None:
    import gguf

    hf_dir = write_moe_checkpoint(tmp_path / "hf", "qwen3_moe", norm_topk_prob=True)
    path = write_moe_gguf(hf_dir, "qwen3_moe", tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(path), "r+")
    reader.fields["qwen3moe.expert_used_count"].parts[-1][0] = 12  # more than the 8 experts
    del reader
    with pytest.raises(ModelFormatError, match="expert_used_count") as info:
        _ = open_checkpoint(path).config
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("quantization", ["q8", "q4"])  # w4a8, w8a8: tests/test_moe_native.py
def test_jax_refuses_quantized_experts_by_name(family_dir, quantization) -> None:
    _family, path = family_dir
    with pytest.raises(BackendError, match=rf"mlp\.experts.*quantization {quantization}") as info:
        _load(path, "jax", quantization=quantization)
    assert "\n" not in str(info.value)


def test_sona_refuses_a_mixture_of_experts_by_name(tmp_path) -> None:
    from ruvllm_sona.errors import SonaError
    from ruvllm_sona.model import LoraLlama

    with pytest.raises(SonaError, match="num_experts"):
        LoraLlama.from_checkpoint(open_checkpoint(write_moe_checkpoint(tmp_path, "mixtral")))


def _peft_adapter(base: Path, out: Path, targets: list[str]):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=targets),
    )
    torch.manual_seed(4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.3)
    model.save_pretrained(out)
    return model.eval()


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_adapters_on_a_mixture_of_experts_match_peft(family_dir, backend, tmp_path) -> None:
    """A PEFT LoRA on the attention projections of an MoE model computes peft's logits."""
    import torch

    pytest.importorskip("peft")
    from ruvllm.adapters import load_peft_adapter

    _family, path = family_dir
    peft_model = _peft_adapter(path, tmp_path / "lora", ["q_proj", "k_proj", "v_proj", "o_proj"])
    ckpt, model, cache = _load(path, backend)
    lora = load_peft_adapter(tmp_path / "lora", "attn", ckpt.config)
    ids = np.random.default_rng(1).integers(3, 101, size=15).tolist()
    with torch.no_grad():
        want = peft_model(torch.tensor([ids])).logits[0].numpy()
    chunk = SequenceChunk(np.asarray(ids, np.int32), 0, np.arange(4, dtype=np.int32), all_logits=True, adapter=lora)
    got = model.forward(ForwardBatch([chunk], BLOCK), cache).all_logits[0]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(got - hf_all_logits(path, ids)).max() > 1e-2  # the adapter matters


def test_adapters_on_experts_or_the_router_are_refused_by_name(tmp_path) -> None:
    from safetensors.numpy import save_file

    from ruvllm.adapters import AdapterError, load_peft_adapter

    cfg = open_checkpoint(write_moe_checkpoint(tmp_path / "base", "qwen3_moe")).config
    rng = np.random.default_rng(0)
    for module in ("mlp.experts.3.gate_proj", "mlp.gate", "mlp.down_proj"):
        d = tmp_path / module
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
        prefix = f"base_model.model.model.layers.0.{module}"
        save_file(
            {f"{prefix}.lora_A.weight": rng.normal(size=(2, 64)).astype(np.float32),
             f"{prefix}.lora_B.weight": rng.normal(size=(32, 2)).astype(np.float32)},
            str(d / "adapter_model.safetensors"),
        )  # fmt: skip
        with pytest.raises(AdapterError, match=f"{module}.*mixture of experts") as info:
            load_peft_adapter(d, "x", cfg)
        assert "\n" not in str(info.value)


def _hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf_model(str(path)).generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(("family", "backend"), [("gpt_oss", "jax"), ("mixtral", "jax"), ("gpt_oss", "candle-compat")])
def test_engine_greedy_tokens_match_transformers_with_moe_steps_precompiled(family, backend, tmp_path) -> None:
    """Through the engine (chunked prefill, a shared prefix, decode past the window; gpt_oss on the
    hybrid cache of its alternating layers): transformers' greedy tokens, and on jax every MoE step
    in the precompiled set (nothing compiles while running)."""
    import tokenizers

    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.runtime import load_model
    from ruvllm.sampling import SamplingParams
    from ruvllm.tokenizer import Tokenizer

    path = write_moe_checkpoint(tmp_path, family)
    llm = load_model(str(path), backend=backend, host=load_plugins())
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(101)}, unk_token="t0"))
    engine = LLMEngine(
        llm,
        EngineConfig(block_size=4, max_num_batched_tokens=8, max_num_seqs=2, num_blocks=64),
        tokenizer=Tokenizer(inner, bos_token_id=None, eos_token_ids=()),
    )
    assert engine.hybrid == (family == "gpt_oss")
    if backend == "jax":
        engine.precompile()
        compiled = llm.model.compiled_steps.stats.count
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 101, size=15).tolist()
    other = prompt[:12] + rng.integers(3, 101, size=5).tolist()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = engine.generate([GenerationRequest(list(p), params) for p in (prompt, other)])
    got = [[t for o in out for d in o.deltas for t in d.token_ids] for out in outs]
    assert got == [_hf_greedy(path, p, 12) for p in (prompt, other)]
    assert engine.scheduler.prefix_cache_hit_tokens >= 8  # whole blocks of the shared 12 tokens
    if backend == "jax":
        assert llm.model.compiled_steps.stats.count == compiled


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_stored_tensor_is_read(family, tmp_path) -> None:
    """No tensor of the files is left unread (a bias or norm the schema missed would be dropped
    silently): the HF directory's canonical names are exactly the schema's, and every tensor of the
    GGUF form maps to one; ModelConfig.num_parameters counts them all."""
    import gguf

    from ruvllm.checkpoint import gguf_to_hf_name
    from ruvllm.modeling import LAYER_TENSORS, global_tensors

    hf_dir = write_moe_checkpoint(tmp_path / "hf", family)
    files = [hf_dir]
    if family == "gpt_oss":
        files.append(write_gpt_oss_gguf(hf_dir, tmp_path / "m.gguf"))
    else:
        files.append(write_moe_gguf(hf_dir, family, tmp_path / "m.gguf"))
    for path in files:
        ckpt = open_checkpoint(path)
        cfg = ckpt.config
        want = set(global_tensors(cfg))
        for layer in range(cfg.num_layers):
            want |= {n for t in LAYER_TENSORS if t.present(cfg) for n in t.names(layer, cfg)}
        assert set(ckpt.tensor_names()) == want, path.name
        assert sum(ckpt.tensor(n).size for n in want) == cfg.num_parameters  # the count `ruvllm info` shows
    stored = [t.name for t in gguf.GGUFReader(str(files[1])).tensors]
    unread = [n for n in stored if gguf_to_hf_name(n, ckpt.family) is None and "_exps." not in n]
    assert unread == []


def test_jax_refuses_pallas_attention_for_attention_sinks_at_load(tmp_path) -> None:
    path = write_moe_checkpoint(tmp_path, "gpt_oss")
    with pytest.raises(BackendError, match=r"attention='pallas_interpret' has no attention sinks \(gpt_oss\)"):
        _load(path, "jax", extra={"attention": "pallas_interpret"})
