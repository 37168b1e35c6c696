"""jax with ``mmap_experts``: a mixture of experts' GGUF experts left in the file's memory map and read
as stored by the native ``ruvllm_experts_stored`` kernel (tests/test_moe_mmap_kernel.py), the rest of
the model in ``w4a8`` as usual.

Tolerances, as tests/test_moe_native.py states them against the float model of the file's weights:
the median row's KL below ``1e-3`` nats and the mean below ``1e-2`` (the activations' int8 rounding,
here per block of 256 inputs where the copied form rounds per 32, can tip a token's router between
two experts near a tie); against the copied ``w4a8`` form the same bounds (the gpt-oss file, MXFP4
experts beside float matrices that ``w4a8`` rounds as Q4_1, against the copied form only). A
sequence's prefill and decode logits are the same bits alone and beside others, on every ISA variant
this CPU runs (forced as ``RUVLLM_CPU_ISA`` does); the variants agree within float rounding (the
stored-block kernel's rows are the same bits on all of them, tests/test_moe_mmap_kernel.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from _jax_fixtures import mean_kl
from _moe_checkpoints import mxfp4_representable, write_gpt_oss_gguf, write_moe_checkpoint, write_moe_gguf

from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm.errors import BackendError
from ruvllm.plugins import load_plugins
from ruvllm_jax import native
from ruvllm_jax.experts import StoredExperts

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")

BLOCK = 4
SHAPES = {
    "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=256, norm_topk_prob=True),
    "mixtral": dict(hidden_size=256, intermediate_size=256),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[tuple[str, str], object]:
    from test_moe_native import _requantize  # Q4_K_M (Q4_K, Q6_K ffn_down in layer 0) and Q8_0 experts

    out = {}
    for family, shape in SHAPES.items():
        d = tmp_path_factory.mktemp(family)
        f32 = write_moe_gguf(write_moe_checkpoint(d / "hf", family, **shape), family, d / "f32.gguf")
        for kind in ("q4_k_m", "q8_0") if family == "mixtral" else ("q4_k_m", "q8_0", "q4_0"):
            out[family, kind] = _requantize(f32, d / f"{kind}.gguf", kind)
    d = tmp_path_factory.mktemp("gpt_oss")  # MXFP4 experts, as llama.cpp writes gpt-oss
    hf_dir = write_moe_checkpoint(d / "hf", "gpt_oss", swiglu_limit=7.0)
    mxfp4_representable(hf_dir)
    out["gpt_oss", "mxfp4"] = write_gpt_oss_gguf(hf_dir, d / "mxfp4.gguf", "MXFP4")
    return out


def _load(path, backend: str = "jax", **extra):
    options = LoadOptions(quantization="none" if backend == "candle-compat" else "w4a8", extra=extra)
    return load_plugins().choose_backend(backend).load(open_checkpoint(path), options)


def _logits(model, prompts: list[list[int]]) -> list[np.ndarray]:
    """All-position logits of the prompts as one ragged prefill, then each one decode step."""
    cache = model.kv_cache(4 * len(prompts), BLOCK, {})
    tables = [np.arange(i * 4, i * 4 + 4, dtype=np.int32) for i in range(len(prompts))]
    chunks = [
        SequenceChunk(np.asarray(p, np.int32), 0, t, all_logits=True) for p, t in zip(prompts, tables, strict=True)
    ]
    out = model.forward(ForwardBatch(chunks, BLOCK), cache)
    rows = [np.asarray(out.all_logits[i]) for i in range(len(prompts))]
    step = [SequenceChunk(np.asarray([5], np.int32), len(p), t) for p, t in zip(prompts, tables, strict=True)]
    decode = np.asarray(model.forward(ForwardBatch(step, BLOCK), cache).logits)
    return [np.concatenate([r, decode[i : i + 1]]) for i, r in enumerate(rows)]


PROMPTS = [np.random.default_rng(s).integers(3, 101, size=n).tolist() for s, n in ((1, 11), (2, 6), (3, 9))]


@pytest.mark.parametrize(
    ("family", "kind"), [("qwen3_moe", "q4_k_m"), ("qwen3_moe", "q8_0"), ("mixtral", "q4_k_m"), ("gpt_oss", "mxfp4")]
)
def test_mapped_experts_match_the_float_model_and_the_copied_form(files, family, kind) -> None:
    path = files[family, kind]
    mapped = _load(path, mmap_experts="true")
    assert mapped.options.extra["mmap_experts"] == "true"
    assert isinstance(mapped.weights.layers.expert_down, StoredExperts)
    got = np.concatenate(_logits(mapped, PROMPTS))
    others = [_load(path, mmap_experts="false")]
    if kind != "mxfp4":  # that file's other matrices are float, which w4a8 rounds as Q4_1: not the float model
        others.append(_load(path, "candle-compat", mmap_experts="false"))
    for other in others:
        want = np.concatenate(_logits(other, PROMPTS))
        kl = np.asarray([mean_kl(want[i : i + 1], got[i : i + 1]) for i in range(len(got))])
        assert np.median(kl) < 1e-3 and kl.mean() < 1e-2, (type(other).__name__, np.median(kl), kl.mean())


def test_a_sequence_alone_and_batched_on_every_variant(files) -> None:
    model = _load(files["qwen3_moe", "q4_k_m"], mmap_experts="true")
    runs = []
    for isa in [i for i in native.ISAS if i in native.supported_isas()]:
        with native.use_isa(isa):
            batched = _logits(model, PROMPTS)
            alone = _logits(model, PROMPTS[1:2])
        # Prefill and decode rows the same bits (the router's product and the routing's sums in a fixed
        # order, padding rows routed to no expert; the experts' kernel is batch invariant row for row).
        np.testing.assert_array_equal(batched[1], alone[0])
        runs.append(np.concatenate(batched))
    for other in runs[1:]:  # the attention kernels' variants round differently; the experts' do not
        assert np.abs(other - runs[0]).max() < 1e-5 * np.abs(runs[0]).max()


def test_mmap_experts_refusals_name_what_is_missing(files) -> None:
    with pytest.raises(
        BackendError, match=r"mmap_experts=true needs experts in Q8_0, Q4_K, Q6_K, MXFP4 \(this file's: Q4_0\)"
    ):
        _load(files["qwen3_moe", "q4_0"], mmap_experts="true")
    assert _load(files["qwen3_moe", "q4_0"], mmap_experts="auto").options.extra["mmap_experts"] == "false"
    path = files["qwen3_moe", "q8_0"]
    with pytest.raises(BackendError, match=r"mmap_experts=true needs quantization w4a8 \(got none\)"):
        load_plugins().choose_backend("jax").load(
            open_checkpoint(path), LoadOptions(quantization="none", extra={"mmap_experts": "true"})
        )
    with pytest.raises(BackendError, match="mmap_experts must be one of auto, true, false"):
        _load(path, mmap_experts="sometimes")


def test_auto_maps_the_experts_when_their_w4a8_copy_would_not_fit(files, monkeypatch) -> None:
    from ruvllm import mapped_experts

    path = files["qwen3_moe", "q4_k_m"]
    need = mapped_experts.experts_file_bytes(open_checkpoint(path))  # the w4a8 copy's size, about
    monkeypatch.setattr(mapped_experts, "available_memory", lambda: int(need / mapped_experts.AUTO_SHARE) - 1)
    assert isinstance(_load(path).weights.layers.expert_gate, StoredExperts)
    monkeypatch.setattr(mapped_experts, "available_memory", lambda: 4 * need)
    assert _load(path).options.extra["mmap_experts"] == "false"


def test_engine_steps_with_mapped_experts_are_precompiled_and_a_request_alone_matches_the_batch(files) -> None:
    """Through the engine: every MoE step precompiled with the experts mapped (nothing compiles while
    running), and each request's greedy tokens the same alone as beside the other."""
    import tokenizers

    from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
    from ruvllm.runtime import load_model
    from ruvllm.sampling import SamplingParams
    from ruvllm.tokenizer import Tokenizer

    options = LoadOptions(quantization="w4a8", extra={"mmap_experts": "true"})
    llm = load_model(str(files["qwen3_moe", "q4_k_m"]), backend="jax", host=load_plugins(), options=options)
    assert llm.model.options.extra["mmap_experts"] == "true"
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(101)}, unk_token="t0"))
    engine = LLMEngine(
        llm,
        EngineConfig(block_size=4, max_num_batched_tokens=8, max_num_seqs=2, num_blocks=64),
        tokenizer=Tokenizer(inner, bos_token_id=None, eos_token_ids=()),
    )
    engine.precompile()
    compiled = llm.model.compiled_steps.stats.count
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 101, size=n).tolist() for n in (15, 9)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def tokens(outs) -> list[list[int]]:
        return [[t for o in out for d in o.deltas for t in d.token_ids] for out in outs]

    together = tokens(engine.generate([GenerationRequest(list(p), params) for p in prompts]))
    alone = [tokens(engine.generate([GenerationRequest(list(p), params)]))[0] for p in prompts]
    assert together == alone and all(len(t) == 10 for t in together)
    assert llm.model.compiled_steps.stats.count == compiled
