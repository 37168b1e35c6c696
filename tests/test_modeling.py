"""ruvllm.modeling, the one model definition: its layer schema names exactly the tensors each family's
checkpoint holds (written by transformers), with transformers' shapes; its activations, norm and RoPE
agree with PyTorch's; the same function runs on NumPy and JAX arrays."""

from __future__ import annotations

import numpy as np
import pytest
from _family_checkpoints import write_family_checkpoint

from ruvllm import modeling
from ruvllm.checkpoint import open_checkpoint

FAMILIES = ["llama3", "mistral", "qwen2-yarn", "qwen3", "gemma3", "phi3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_schema_names_every_layer_tensor_of_the_checkpoint(tmp_path, family):
    ckpt = open_checkpoint(write_family_checkpoint(tmp_path, family))
    cfg = ckpt.config
    names = set(ckpt.tensor_names())
    for layer in range(cfg.num_layers):
        want = {t.name(layer): t.shape(cfg) for t in modeling.layer_tensors(cfg)}
        held = {n for n in names if n.startswith(f"model.layers.{layer}.")}
        assert held == set(want), f"{family} layer {layer}: schema and checkpoint differ by {held ^ set(want)}"
        for name, shape in want.items():
            assert tuple(ckpt.tensor(name).shape) == shape, name
    assert {n for n in names if not n.startswith("model.layers.")} == set(modeling.global_tensors(cfg))


@pytest.mark.parametrize("family", ["llama3", "qwen2-yarn"])
def test_projection_shapes_are_transformers_weight_shapes(tmp_path, family):
    from _family_checkpoints import hf_model

    path = write_family_checkpoint(tmp_path, family)
    cfg = open_checkpoint(path).config
    layer = hf_model(str(path)).model.layers[1]
    for proj in modeling.PROJECTIONS:
        module = getattr(getattr(layer, modeling.projection_module(proj)), proj)
        assert tuple(module.weight.shape) == modeling.projection_shape(cfg, proj)
        assert modeling.projection_tensor(1, proj) == f"model.layers.1.{modeling.projection_module(proj)}.{proj}.weight"


def test_activations_norm_and_rope_match_pytorch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    g = (rng.standard_normal((5, 32)) * 6).astype(np.float32)
    g[0, :3] = (-200.0, 0.0, 200.0)  # far tails: the tanh form neither overflows nor loses the sign
    tg = torch.from_numpy(g.astype(np.float64))
    np.testing.assert_allclose(modeling.silu(g), torch.nn.functional.silu(tg).numpy(), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(
        modeling.gelu_tanh(g), torch.nn.functional.gelu(tg, approximate="tanh").numpy(), rtol=2e-6, atol=2e-6
    )
    w = rng.standard_normal(32).astype(np.float32)
    ref = tg * torch.rsqrt(tg.pow(2).mean(-1, keepdim=True) + 1e-5) * torch.from_numpy(w.astype(np.float64))
    np.testing.assert_allclose(modeling.rms_norm(g, w, 1e-5), ref.numpy(), rtol=2e-6, atol=2e-6)

    # Rotate-half RoPE as transformers writes it (cos/sin over the whole head: both halves alike).
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)
    ang = np.arange(5)[:, None] * (10000.0 ** (-np.arange(4) / 4))[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    tx = torch.from_numpy(x.astype(np.float64))
    c = torch.from_numpy(np.concatenate([cos, cos], -1).astype(np.float64))[:, None, :]
    s = torch.from_numpy(np.concatenate([sin, sin], -1).astype(np.float64))[:, None, :]
    rotate_half = torch.cat([-tx[..., 4:], tx[..., :4]], dim=-1)
    np.testing.assert_allclose(modeling.apply_rope(x, cos, sin), (tx * c + rotate_half * s).numpy(), atol=2e-6)
    # The transpose undoes the rotation.
    np.testing.assert_allclose(modeling.apply_rope_transpose(modeling.apply_rope(x, cos, sin), cos, sin), x, atol=2e-6)


def test_the_same_functions_run_on_jax_arrays_in_their_dtype():
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 2, 8)).astype(np.float32)
    w = rng.standard_normal(8).astype(np.float32)
    cos, sin = np.cos(rng.standard_normal((4, 4))).astype(np.float32), np.sin(rng.standard_normal((4, 4)))
    sin = sin.astype(np.float32)
    for fn, args in (
        (modeling.rms_norm, (x, w, 1e-6)),
        (modeling.silu, (x,)),
        (modeling.gelu_tanh, (x,)),
        (modeling.apply_rope, (x, cos, sin)),
        (lambda a: modeling.softcap(a, 3.0), (x,)),
    ):
        on_jax = fn(*(jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in args))
        assert not isinstance(on_jax, np.ndarray)  # computed by jax, not converted to NumPy on the way
        np.testing.assert_allclose(np.asarray(on_jax), fn(*args), rtol=1e-6, atol=1e-6)
    bf16 = modeling.rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), 1e-6)
    assert bf16.dtype == jnp.bfloat16  # float32 arithmetic, the input's dtype out


def test_attention_mask_is_causal_and_windowed():
    # Queries at positions 3, 4, 5 over keys 0..5 with a window of 2: key j is seen when q - 2 < j <= q.
    masked = modeling.attention_mask(3, 6, 3, window=2)
    seen = ~masked
    assert seen.tolist() == [
        [False, False, True, True, False, False],
        [False, False, False, True, True, False],
        [False, False, False, False, True, True],
    ]
    assert modeling.attention_mask(1, 6, 5) is None  # a lone last query sees every key


def test_unknown_projection_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown projection 'x_proj'"):
        modeling.projection_module("x_proj")
