"""The JAX backend applies per-sequence LoRA adapters (``SequenceChunk.adapter``, through
``lora_params()``) inside its compiled step, as the NumPy backend does through ``delta()``.

On a tiny random Llama (untied, GQA 4/2, 2 layers): logits with a rank-2 adapter on q/v/down equal
transformers in float64 with the same update hooked onto its projections, and the NumPy backend
with the same adapter object; a batch mixing two adapters (different ranks and projections) and
no adapter equals each sequence run alone; an adapter that adapts nothing is the base step bit for
bit and compiles nothing; uploads happen once per adapter snapshot; bad adapters raise
``BackendError``; quantized bfloat16 weights and two-device tensor parallelism apply the same update.

Tolerance: logits are O(1); float32 against float64 over two layers differs by ~1e-6, so 1e-4 of
the logit range (relative) is tight, while the adapters move logits by whole units.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _jax_fixtures import load_jax, write_tiny_hf_model

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm.errors import BackendError

pytest.importorskip("transformers")
sona_lora = pytest.importorskip("ruvllm_sona.lora")

RTOL = 1e-4
BLOCK = 4
MODULE_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
#: Teacher-forced decode tokens, so every comparison feeds the same inputs.
DECODE = [5, 17, 42]


def make_adapter(spec: Any, keys: list[tuple[int, str]], rank: int = 2, scale: float = 2.0, seed: int = 0,
                 size: float = 0.3, version: int = 1) -> Any:
    """A SONA snapshot (the real plugin object, serving both ``delta`` and ``lora_params``)."""
    from ruvllm_sona.model import LoraFactors

    rng = np.random.default_rng(seed)
    entries = {}
    for layer, proj in keys:
        out, inp = spec.projection_shape(proj)
        entries[(layer, proj)] = LoraFactors((rng.standard_normal((rank, inp)) * size).astype(np.float32),
                                             (rng.standard_normal((out, rank)) * size).astype(np.float32), scale)
    return sona_lora.SonaAdapter(f"test{seed}", version, entries)


class Params:
    """An adapter that only has ``lora_params()`` (what a device backend needs)."""

    def __init__(self, params: Any, version: int = 0) -> None:
        self.params, self.version = params, version

    def lora_params(self) -> Any:
        return self.params


def run(model: Any, seqs: list[tuple[list[int], Any]]) -> list[np.ndarray]:
    """All sequences prefilled in one step, then one step per :data:`DECODE` token for all of them;
    returns each sequence's logits ``[len(prompt) + len(DECODE), vocab]``. Blocks interleave."""
    n = len(seqs)
    per_seq = -(-max(len(p) + len(DECODE) for p, _ in seqs) // BLOCK)
    tables = [np.arange(per_seq, dtype=np.int32) * n + i for i in range(n)]
    cache = model.allocate_cache(per_seq * n, BLOCK)
    chunks = [SequenceChunk(np.asarray(p, np.int32), 0, tables[i], all_logits=True, adapter=a)
              for i, (p, a) in enumerate(seqs)]
    out = model.forward(ForwardBatch(chunks, BLOCK), cache)
    rows = [[out.all_logits[i]] for i in range(n)]
    for step, token in enumerate(DECODE):
        chunks = [SequenceChunk(np.asarray([token], np.int32), len(p) + step, tables[i], adapter=a)
                  for i, (p, a) in enumerate(seqs)]
        out = model.forward(ForwardBatch(chunks, BLOCK), cache)
        for i in range(n):
            rows[i].append(out.logits[i][None])
    return [np.concatenate(r) for r in rows]


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float = RTOL) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * np.abs(want).max())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("lora"), "llama")


@pytest.fixture(scope="module")
def jax_model(tiny):
    return load_jax(open_checkpoint(tiny))


@pytest.fixture(scope="module")
def numpy_model(tiny):
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    return load_model(str(tiny), backend="candle-compat", host=load_plugins("candle-compat"))


@pytest.fixture(scope="module")
def adapters(jax_model):
    spec = jax_model.spec
    qv_down = make_adapter(spec, [(0, "q_proj"), (1, "q_proj"), (0, "v_proj"), (1, "v_proj"), (1, "down_proj")])
    # Rank 3 (padded to 4 on device) on other projections: the mixed step pads qv_down to rank 4.
    attn_mlp = make_adapter(spec, [(0, "o_proj"), (1, "k_proj"), (0, "gate_proj"), (1, "up_proj")], rank=3,
                            scale=1.5, seed=1)
    return qv_down, attn_mlp


PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [2, 71, 82, 81, 82, 84, 59], [1, 41, 42, 13, 56, 62, 37, 30, 9]]


def hf_float64_logits(path: Path, ids: list[int], adapter: Any) -> np.ndarray:
    """Transformers in float64 with ``scale * (x @ A.T) @ B.T`` hooked onto each adapted projection."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).to(torch.float64).eval()
    for (layer, proj), (a, b, scale) in adapter.lora_params().items():
        module = getattr(getattr(model.model.layers[layer], MODULE_OF[proj]), proj)
        a64, b64 = torch.from_numpy(a.astype(np.float64)), torch.from_numpy(b.astype(np.float64))
        module.register_forward_hook(lambda _m, inp, out, a=a64, b=b64, s=scale: out + s * (inp[0] @ a.T) @ b.T)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_adapted_logits_match_float64_reference_and_numpy_backend(tiny, jax_model, numpy_model, adapters):
    adapter = adapters[0]
    ids = PROMPTS[0]
    base = run(jax_model, [(ids, None)])[0]
    got = run(jax_model, [(ids, adapter)])[0]
    # The adapter moves logits by whole units: a backend that skipped or misplaced it would fail.
    assert np.abs(got - base).max() > 0.5
    assert_close(got[: len(ids)], hf_float64_logits(tiny, ids, adapter)[: len(ids)])
    assert_close(got, run(numpy_model, [(ids, adapter)])[0])
    plan = next(p for p in jax_model.compiled_steps.stats.plans if p.lora is not None)
    assert plan.lora.rank == 2 and plan.lora.projections == ("q_proj", "v_proj", "down_proj")


def test_mixed_batch_equals_each_sequence_alone(jax_model, numpy_model, adapters):
    qv_down, attn_mlp = adapters
    seqs = list(zip(PROMPTS, [qv_down, None, attn_mlp], strict=True))
    together = run(jax_model, seqs)
    for (ids, adapter), mixed in zip(seqs, together, strict=True):
        alone = run(jax_model, [(ids, adapter)])[0]
        np.testing.assert_allclose(mixed, alone, rtol=0, atol=1e-5 * np.abs(alone).max())
    plans = jax_model.compiled_steps.stats.plans
    assert any(p.lora is not None and p.lora.slots == 2 and p.lora.rank == 4 for p in plans)
    # and the mixed step is the NumPy backend's mixed step
    for got, want in zip(together, run(numpy_model, seqs), strict=True):
        assert_close(got, want)


def test_adapter_that_adapts_nothing_is_the_base_step_bit_for_bit(jax_model, adapters):
    from ruvllm_sona.model import LoraFactors

    spec = jax_model.spec
    out, inp = spec.projection_shape("v_proj")
    zero_b = sona_lora.SonaAdapter("zero", 0, {(1, "v_proj"): LoraFactors(np.ones((2, inp), np.float32),
                                                                          np.zeros((out, 2), np.float32), 2.0)})
    assert zero_b.lora_params() == {}
    seqs = [(PROMPTS[1], None)]
    base = run(jax_model, seqs)[0]
    buckets = jax_model.compiled_buckets
    for empty in (zero_b, Params({})):
        assert np.array_equal(run(jax_model, [(PROMPTS[1], empty)])[0], base)
    assert jax_model.compiled_buckets == buckets  # the very steps compiled for no adapter
    # Steps with adapters compile their own shapes; the no-adapter steps stay as they were.
    run(jax_model, [(PROMPTS[1], adapters[0])])
    with_adapter = jax_model.compiled_buckets
    assert np.array_equal(run(jax_model, seqs)[0], base)
    assert jax_model.compiled_buckets == with_adapter


def test_each_snapshot_is_uploaded_once_and_the_cache_is_bounded(jax_model, adapters):
    adapter = adapters[0]
    cache = jax_model.adapters
    run(jax_model, [(PROMPTS[0], adapter)])
    uploads = cache.uploads
    run(jax_model, [(PROMPTS[0], adapter)])
    assert cache.uploads == uploads  # prefill and three decode steps, no new upload
    newer = make_adapter(jax_model.spec, [(0, "q_proj")], version=2)
    assert cache.get(newer) is cache.get(newer) and cache.uploads == uploads + 1
    many = [Params({(0, "q_proj"): (np.ones((1, 64), np.float32), np.ones((64, 1), np.float32), 1.0)})
            for _ in range(cache.capacity + 3)]
    for a in many:
        cache.get(a)
    cache.trim()
    assert len(cache) == cache.capacity


def _factors(spec: Any, proj: str = "q_proj", rank: int = 2, a_in: int | None = None, b_out: int | None = None):
    out, inp = spec.projection_shape(proj)
    return (np.ones((rank, a_in or inp), np.float32), np.ones((b_out or out, rank), np.float32), 1.0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda s: object(), "applies adapters through lora_params"),
        (lambda s: Params([1, 2]), "not a mapping"),
        (lambda s: Params({(2, "q_proj"): _factors(s)}), r"layer 2 is outside the model's layers 0\.\.1"),
        (lambda s: Params({(0, "x_proj"): _factors(s)}), "unknown projection 'x_proj'"),
        (lambda s: Params({(0, "q_proj"): _factors(s, a_in=65)}), r"expected A \(r, 64\) and B \(64, r\)"),
        (lambda s: Params({(0, "k_proj"): _factors(s, b_out=64)}), r"expected A \(r, 64\) and B \(32, r\)"),
        (lambda s: Params({(0, "q_proj"): (np.ones((2, 64)), np.ones((64, 3)), 1.0)}), "has A"),
        (lambda s: Params({(0, "q_proj"): (np.full((1, 64), np.nan), np.ones((64, 1)), 1.0)}), "non-finite"),
        (lambda s: Params({(0, "q_proj"): (np.ones((1, 64)), np.ones((64, 1)), "2")}), "not a finite number"),
        (lambda s: Params({(0, "q_proj"): (np.ones((1, 64)), np.ones((64, 1)))}), r"not \(A, B, scale\)"),
    ],
)
def test_bad_adapters_raise_backend_error(jax_model, make, message):
    cache = jax_model.allocate_cache(8, BLOCK)
    chunk = SequenceChunk(np.asarray([1, 2, 3], np.int32), 0, np.arange(2, dtype=np.int32),
                          adapter=make(jax_model.spec))
    with pytest.raises(BackendError, match=message):
        jax_model.forward(ForwardBatch([chunk], BLOCK), cache)


def test_quantized_bfloat16_weights_apply_the_same_update(tiny, jax_model, adapters):
    adapter = adapters[0]
    q8 = load_jax(open_checkpoint(tiny), quantization="q8", dtype="bfloat16")
    ids = PROMPTS[0]
    f32_base, f32 = run(jax_model, [(ids, None)])[0], run(jax_model, [(ids, adapter)])[0]
    got = run(q8, [(ids, adapter)])[0]
    effect = np.abs(f32 - f32_base).max()
    # bfloat16 with int8 weights: a few percent of the logit range, far below the adapter's effect.
    assert np.abs(got - f32).max() <= 0.05 * np.abs(f32).max() < 0.2 * effect


TP_SCRIPT = r"""
import json, sys
import jax
import numpy as np
sys.path.insert(0, sys.argv[1])
from _jax_fixtures import load_jax
from test_jax_adapters import PROMPTS, make_adapter, run
from ruvllm.checkpoint import open_checkpoint

assert len(jax.devices()) == 2, jax.devices()
ckpt = open_checkpoint(sys.argv[2])
one, two = load_jax(ckpt), load_jax(ckpt, extra={"tensor_parallel": 2})
adapter = make_adapter(one.spec, [(0, "q_proj"), (1, "v_proj"), (0, "o_proj"), (1, "down_proj")])
seqs = [(PROMPTS[0], adapter), (PROMPTS[1], None)]
a, b = run(one, seqs), run(two, seqs)
shards = [list(s.data.shape) for s in two.weights.layers.o_proj.addressable_shards]
diff = max(float(np.abs(x - y).max()) for x, y in zip(a, b))
print("RESULT" + json.dumps({"diff": diff, "scale": float(np.abs(a[0]).max()), "o_proj_shards": shards}))
"""


def test_tensor_parallel_applies_adapters_like_one_device(tiny):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "RUVLLM_LOG": "ERROR"}
    proc = subprocess.run([sys.executable, "-c", TP_SCRIPT, str(Path(__file__).parent), str(tiny)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT"):])
    assert res["o_proj_shards"] == [[2, 64, 32]] * 2  # o_proj's input (the heads) really is split
    assert res["diff"] <= RTOL * res["scale"]
