"""PEFT LoRA adapters and X-LoRA mixes on the mlx backend give transformers + peft's logits (the
fixtures and checks of tests/test_peft_adapters.py and tests/test_xlora.py, run on mlx), and a
batch mixing adapters, an X-LoRA request and the base model through the engine equals each alone."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("peft")
pytest.importorskip("mlx.core")

from test_peft_adapters import ADAPTERS, _ours, _peft_logits, adapters, base_dir  # noqa: F401 (fixtures)
from test_xlora import _generate, _two_passes, root, xloras  # noqa: F401 (fixtures)

from ruvllm.adapters import load_adapter, load_peft_adapter
from ruvllm.checkpoint import open_checkpoint


@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_lora_logits_match_transformers_and_peft(kind, base_dir, adapters):  # noqa: F811
    d, peft_model = adapters[kind]
    lora = load_peft_adapter(d, kind, open_checkpoint(base_dir).config)
    ids = np.random.default_rng(1).integers(3, 101, size=19).tolist()
    want = _peft_logits(peft_model, ids)
    span = float(want.max() - want.min())
    np.testing.assert_allclose(_ours("mlx", base_dir, ids, lora), want, atol=1e-4 * span, rtol=0)


@pytest.fixture(scope="module")
def mlx_base(root):  # noqa: F811
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    return load_model(str(root / "base"), backend="mlx", host=load_plugins())


@pytest.mark.parametrize("variant", ["topk", "layerwise-top1"])
def test_xlora_logits_match_transformers_and_peft(variant, xloras, mlx_base):  # noqa: F811
    from _xlora_fixtures import peft_logits

    d, peft_model = xloras[variant]
    xl = load_adapter(d, variant, mlx_base.config)
    ids = np.random.default_rng(1).integers(3, 101, size=19).tolist()
    want = peft_logits(peft_model, ids)
    span = float(want.max() - want.min())
    np.testing.assert_allclose(_two_passes(mlx_base, xl, ids), want, atol=1e-4 * span, rtol=0)


def test_a_batch_mixing_adapters_xlora_and_the_base_model_equals_each_alone(root, xloras, mlx_base):  # noqa: F811
    from _xlora_fixtures import EXPERTS

    cfg = mlx_base.config
    plain = [load_peft_adapter(root / "experts" / n, n, cfg) for n in EXPERTS]
    xl = load_adapter(xloras["topk"][0], "topk", cfg)
    rng = np.random.default_rng(5)
    pairs = list(
        zip([rng.integers(3, 101, size=n).tolist() for n in (7, 12, 5, 9, 6)], [None, *plain, xl], strict=True)
    )
    together, _ = _generate(mlx_base, pairs, budget=64, max_tokens=6)
    assert together == [_generate(mlx_base, [pair], budget=64, max_tokens=6)[0][0] for pair in pairs]


def test_factors_are_uploaded_once_and_a_delta_only_adapter_runs_on_the_host(base_dir, adapters):  # noqa: F811
    from ruvllm.backend import ForwardBatch, SequenceChunk
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    d, _ = adapters["all-r8-rslora"]
    lora = load_peft_adapter(d, "all-r8-rslora", open_checkpoint(base_dir).config)

    class DeltaOnly:  # what a plugin may attach: no lora_params, only delta
        def delta(self, layer, proj, x):
            return lora.delta(layer, proj, x)

    llm = load_model(str(base_dir), backend="mlx", host=load_plugins())
    ids = np.arange(3, 22, dtype=np.int32)

    def run(adapter):
        chunk = SequenceChunk(ids, 0, np.arange(5, dtype=np.int32), all_logits=True, adapter=adapter)
        return llm.forward(ForwardBatch([chunk], 4), llm.allocate_cache(8, 4)).all_logits[0]

    on_device = [run(lora) for _ in range(2)]
    assert llm.model.adapter_factors.uploads == 1
    np.testing.assert_array_equal(on_device[0], on_device[1])
    np.testing.assert_allclose(run(DeltaOnly()), on_device[0], atol=1e-4, rtol=0)
