"""Backend conformance kit: what every backend must do, checked against a float64 NumPy reference.

A backend package runs it from its own tests::

    from ruvllm.testing import run_backend_conformance

    def test_my_backend_conforms(tmp_path):
        run_backend_conformance("my-backend", tmp_path)

It writes a tiny random-weight Llama checkpoint (Hugging Face layout: ``config.json`` +
``model.safetensors``; GQA, untied head, block size 4), loads it with the backend object
(:class:`ruvllm.backend.Backend`), and checks, each time against :func:`reference_logits` (float64,
written from the definition):

* ``ragged``: one step carrying a whole prompt, a chunk of another prompt and decodes, then more
  chunks and decodes, over scattered block tables that cross block boundaries; every position's
  logits (``all_logits``);
* ``block_copies``: a sequence continued in blocks the step first copies from another's (what the
  engine does when ``n > 1`` choices stop sharing a block);
* ``isolation``: blocks that held another sequence's keys and values are reused for a new one, which
  must see only its own positions;
* ``capabilities``: the model declares :class:`ruvllm.backend.Capabilities` and has every
  :class:`ruvllm.backend.BackendModel` method;
* ``hidden_states``: final-norm hidden states of every new token, finite, ``[n, hidden]`` (a model
  that declares no ``hidden_states`` must refuse the request with ``BackendError``);
* ``adapters``: a LoRA adapter on some projections changes the logits exactly as
  ``x W^T + scale (x A^T) B^T`` says where the model declares ``adapters``, and is refused with
  ``BackendError`` where it does not;
* ``batch_invariance``: a sequence's logits do not depend on what else is in the step;
* ``quantized_batch_invariance``: the same, bit for bit, with each of the quantized forms ``w8a8``
  and ``w4a8`` the backend offers (a checkpoint of :data:`QUANTIZABLE_TINY`'s sizes, multiples of
  32): its integer products are exact, so only a float order that changes with the batch can differ;
* ``threads``: two threads calling ``forward`` at once, each on its own cache, get what they get
  alone.

Each check raises ``AssertionError`` naming what differed. Tolerance ``atol`` (default 1e-4) on
float32 logits of O(1-10).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ruvllm.adapters import LoraWeights
from ruvllm.backend import BACKEND_MODEL_METHODS, Capabilities, ForwardBatch, LoadOptions, SequenceChunk
from ruvllm.errors import BackendError

TINY = dict(vocab=97, hidden=48, layers=2, heads=4, kv_heads=2, ffn=80, theta=10000.0, eps=1e-5)
#: TINY with every product's input a multiple of 32 (the group size of the w4a8 / w8a8 forms).
QUANTIZABLE_TINY = TINY | dict(hidden=64, ffn=96)
BLOCK = 4


def write_tiny_checkpoint(path: str | Path, seed: int = 0, sizes: Mapping[str, Any] | None = None) -> Path:
    """A random-weight Llama checkpoint in Hugging Face layout (weights scaled so attention is sharp
    and every parameter matters), of :data:`TINY`'s sizes or ``sizes``. Returns the directory."""
    from safetensors.numpy import save_file

    t = TINY if sizes is None else sizes
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = t["hidden"] // t["heads"]

    def mat(out: int, inp: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((out, inp)) * gain / np.sqrt(inp)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((t["vocab"], t["hidden"])).astype(np.float32),
        "model.norm.weight": norm(t["hidden"]),
        "lm_head.weight": mat(t["vocab"], t["hidden"], 3.0),
    }
    for i in range(t["layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(t["hidden"]),
            p + "post_attention_layernorm.weight": norm(t["hidden"]),
            p + "self_attn.q_proj.weight": mat(t["heads"] * hd, t["hidden"], 2.0),
            p + "self_attn.k_proj.weight": mat(t["kv_heads"] * hd, t["hidden"], 2.0),
            p + "self_attn.v_proj.weight": mat(t["kv_heads"] * hd, t["hidden"]),
            p + "self_attn.o_proj.weight": mat(t["hidden"], t["heads"] * hd),
            p + "mlp.gate_proj.weight": mat(t["ffn"], t["hidden"]),
            p + "mlp.up_proj.weight": mat(t["ffn"], t["hidden"]),
            p + "mlp.down_proj.weight": mat(t["hidden"], t["ffn"]),
        }
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": t["vocab"],
        "hidden_size": t["hidden"],
        "intermediate_size": t["ffn"],
        "num_hidden_layers": t["layers"],
        "num_attention_heads": t["heads"],
        "num_key_value_heads": t["kv_heads"],
        "max_position_embeddings": 256,
        "rms_norm_eps": t["eps"],
        "rope_theta": t["theta"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def reference_logits(
    weights: Mapping[str, np.ndarray],
    ids: list[int],
    lora: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray, float]] | None = None,
    hidden: bool = False,
) -> np.ndarray:
    """float64 logits ``[len(ids), vocab]`` (or final-norm hidden states) of the tiny Llama at every
    position, straight from the definition, with an optional LoRA ``(layer, proj) -> (A, B, scale)``."""
    t = TINY
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    nh, nkv = t["heads"], t["kv_heads"]
    hd = t["hidden"] // nh
    n = len(ids)

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + t["eps"]) * g

    def proj(x: np.ndarray, layer: int, name: str, full: str) -> np.ndarray:
        y = x @ w[full].T
        if lora and (layer, name) in lora:
            a, b, scale = lora[(layer, name)]
            y = y + scale * (x @ np.asarray(a, np.float64).T) @ np.asarray(b, np.float64).T
        return y

    inv = 1.0 / t["theta"] ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(n)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x: np.ndarray) -> np.ndarray:
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    x = w["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((n, n), bool))
    for i in range(t["layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rope(proj(h, i, "q_proj", p + "self_attn.q_proj.weight").reshape(n, nh, hd))
        k = rope(proj(h, i, "k_proj", p + "self_attn.k_proj.weight").reshape(n, nkv, hd))
        v = proj(h, i, "v_proj", p + "self_attn.v_proj.weight").reshape(n, nkv, hd)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        s = np.where(causal[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        a = np.einsum("hqk,khd->qhd", pr, v).reshape(n, nh * hd)
        x = x + proj(a, i, "o_proj", p + "self_attn.o_proj.weight")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g = proj(h, i, "gate_proj", p + "mlp.gate_proj.weight")
        u = proj(h, i, "up_proj", p + "mlp.up_proj.weight")
        act = g / (1.0 + np.exp(-g)) * u
        x = x + proj(act, i, "down_proj", p + "mlp.down_proj.weight")
    x = rms(x, w["model.norm.weight"])
    return x if hidden else x @ w["lm_head.weight"].T


def _random_lora(seed: int = 3) -> LoraWeights:
    """A LoRA adapter on q and v of layer 0 and down of layer 1 (both adapter protocol methods)."""
    rng = np.random.default_rng(seed)
    t = TINY
    hd = t["hidden"] // t["heads"]
    shapes = {
        (0, "q_proj"): (t["hidden"], t["heads"] * hd),
        (0, "v_proj"): (t["hidden"], t["kv_heads"] * hd),
        (1, "down_proj"): (t["ffn"], t["hidden"]),
    }
    params = {
        key: (
            (rng.standard_normal((4, inp)) / np.sqrt(inp)).astype(np.float32),
            (rng.standard_normal((out, 4)) * 0.5).astype(np.float32),
            0.75,
        )
        for key, (inp, out) in shapes.items()
    }
    return LoraWeights("conformance", params)


class _Runner:
    def __init__(self, backend: str, path: Path, atol: float) -> None:
        from ruvllm.plugins import load_plugins
        from ruvllm.runtime import load_model

        self.backend, self.path = backend, path
        self.model = load_model(str(path), backend=backend, host=load_plugins(), options=LoadOptions())
        self.weights = {n: self.model.checkpoint.tensor(n) for n in self.model.checkpoint.tensor_names()}
        self.atol = atol

    def cache(self, blocks: int = 48) -> Any:
        return self.model.allocate_cache(blocks, BLOCK)

    def step(self, cache: Any, chunks: list[SequenceChunk], copies: list[tuple[int, int]] | None = None):
        return self.model.forward(ForwardBatch(chunks, BLOCK, block_copies=list(copies or [])), cache)

    def close(self, got: np.ndarray, want: np.ndarray, what: str) -> None:
        got = np.asarray(got, np.float64)
        if got.shape != want.shape:
            raise AssertionError(f"{what}: shape {got.shape}, expected {want.shape}")
        err = float(np.max(np.abs(got - want))) if got.size else 0.0
        if not err <= self.atol:
            raise AssertionError(f"{what}: max |difference| {err:.3g} from the float64 reference (atol {self.atol})")


def _chunk(ids: list[int], start: int, table: list[int], **kw: Any) -> SequenceChunk:
    return SequenceChunk(np.asarray(ids, np.int32), start, np.asarray(table, np.int32), **kw)


def _ragged(r: _Runner) -> None:
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(3, TINY["vocab"], size=n).tolist() for n in (13, 22, 9))
    ta, tb, tc = [7, 2, 30, 11, 5, 19, 40], [3, 17, 9, 26, 1, 33, 12, 21], [8, 44, 15, 6]
    cache = r.cache()
    want = {name: reference_logits(r.weights, ids) for name, ids in (("a", a), ("b", b), ("c", c))}
    out = r.step(cache, [_chunk(a[:10], 0, ta, all_logits=True), _chunk(b[:6], 0, tb, all_logits=True)])
    r.close(out.all_logits[0], want["a"][:10], "ragged: whole prompt a")
    r.close(out.all_logits[1], want["b"][:6], "ragged: first chunk of b")
    out = r.step(
        cache,
        [
            _chunk(a[10:11], 10, ta),
            _chunk(b[6:15], 6, tb, all_logits=True),
            _chunk(c, 0, tc, all_logits=True),
        ],
    )
    r.close(out.logits[0], want["a"][10], "ragged: decode of a")
    r.close(out.all_logits[1], want["b"][6:15], "ragged: chunk of b continuing its cache")
    r.close(out.all_logits[2], want["c"], "ragged: prompt c beside them")
    for pos in range(11, 13):
        out = r.step(cache, [_chunk(a[pos : pos + 1], pos, ta), _chunk(b[pos + 4 : pos + 5], pos + 4, tb)])
        r.close(out.logits[0], want["a"][pos], f"ragged: decode of a at {pos}")
        r.close(out.logits[1], want["b"][pos + 4], f"ragged: decode of b at {pos + 4}")


def _block_copies(r: _Runner) -> None:
    rng = np.random.default_rng(2)
    ids = rng.integers(3, TINY["vocab"], size=11).tolist()
    cache = r.cache()
    r.step(cache, [_chunk(ids[:10], 0, [4, 9, 13])])
    # The fork continues in its own copy of the partly filled last block (13 -> 20).
    out = r.step(cache, [_chunk(ids[10:11], 10, [4, 9, 20], all_logits=True)], copies=[(13, 20)])
    r.close(out.all_logits[0], reference_logits(r.weights, ids)[10:11], "block_copies: continued in a copied block")


def _isolation(r: _Runner) -> None:
    rng = np.random.default_rng(4)
    old, new = rng.integers(3, TINY["vocab"], size=16).tolist(), rng.integers(3, TINY["vocab"], size=6).tolist()
    cache = r.cache()
    r.step(cache, [_chunk(old, 0, [5, 6, 7, 8])])  # poison blocks 5..8
    out = r.step(cache, [_chunk(new, 0, [8, 7], all_logits=True)])  # reuse two of them
    r.close(out.all_logits[0], reference_logits(r.weights, new), "isolation: reused blocks leaked old keys")


def _refused(r: _Runner, what: str, chunk: SequenceChunk) -> None:
    try:
        r.step(r.cache(), [chunk])
    except BackendError:
        return
    raise AssertionError(f"{what}: the model declares it cannot, yet ran the step instead of raising BackendError")


def _capabilities(r: _Runner) -> None:
    caps = getattr(r.model.model, "capabilities", None)
    if not isinstance(caps, Capabilities):
        name = type(r.model.model).__name__
        raise AssertionError(f"capabilities: {name} declares none (a ruvllm.backend.Capabilities)")
    missing = [m for m in BACKEND_MODEL_METHODS if not callable(getattr(r.model.model, m, None))]
    if missing:
        raise AssertionError(f"capabilities: the model has no {', '.join(missing)}")
    if "float32" not in caps.dtypes or not {"none", "auto"} <= set(caps.quantizations):
        raise AssertionError("capabilities: every backend runs float32 with quantization none and auto")
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    auto = load_model(str(r.path), backend=r.backend, host=load_plugins(), options=LoadOptions(dtype="auto"))
    if auto.options.dtype not in caps.dtypes:  # (load_model refuses it too)
        raise AssertionError(f"capabilities: dtype 'auto' resolved to {auto.options.dtype!r}, not one it runs")


def _hidden(r: _Runner) -> None:
    ids = np.random.default_rng(5).integers(3, TINY["vocab"], size=7).tolist()
    chunk = _chunk(ids, 0, [1, 2], hidden_states=True)
    if not r.model.capabilities.hidden_states:
        return _refused(r, "hidden_states", chunk)
    out = r.step(r.cache(), [chunk])
    got = np.asarray(out.hidden_states[0], np.float64)
    if not np.isfinite(got).all():
        raise AssertionError("hidden_states: not finite")
    r.close(got, reference_logits(r.weights, ids, hidden=True), "hidden_states")


def _adapters(r: _Runner) -> None:
    ids = np.random.default_rng(6).integers(3, TINY["vocab"], size=9).tolist()
    lora = _random_lora()
    chunk = _chunk(ids, 0, [3, 4, 5], all_logits=True, adapter=lora)
    if not r.model.capabilities.adapters:
        return _refused(r, "adapters", chunk)
    out = r.step(r.cache(), [chunk])
    r.close(out.all_logits[0], reference_logits(r.weights, ids, lora.params), "adapters: LoRA update")


def _batch_invariance(r: _Runner) -> None:
    rng = np.random.default_rng(7)
    ids = rng.integers(3, TINY["vocab"], size=8).tolist()
    alone = r.step(r.cache(), [_chunk(ids, 0, [1, 2], all_logits=True)]).all_logits[0]
    others = [_chunk(rng.integers(3, TINY["vocab"], size=n).tolist(), 0, [10 + 3 * k, 11 + 3 * k, 12 + 3 * k])
              for k, n in enumerate((3, 11, 1))]  # fmt: skip
    crowd = r.step(r.cache(), [others[0], _chunk(ids, 0, [1, 2], all_logits=True), *others[1:]]).all_logits[1]
    r.close(crowd, np.asarray(alone, np.float64), "batch_invariance: a sequence's logits changed with the batch")


def _quantized_batch_invariance(r: _Runner) -> None:
    """A sequence's logits (and hidden states, where the backend returns them: a difference the
    quantization of the next product would round away shows there) bit for bit the same alone and
    beside other sequences, prompt and decode, in each quantized form the backend claims."""
    from ruvllm.plugins import load_plugins
    from ruvllm.runtime import load_model

    forms = [q for q in ("w8a8", "w4a8") if q in r.model.capabilities.quantizations]
    if not forms:
        return
    path = write_tiny_checkpoint(r.path.parent / "tiny-llama-quantizable", seed=3, sizes=QUANTIZABLE_TINY)
    vocab = QUANTIZABLE_TINY["vocab"]
    rng = np.random.default_rng(9)
    ids = rng.integers(3, vocab, size=8).tolist()
    others = [rng.integers(3, vocab, size=n).tolist() for n in (3, 11, 1, 6, 2)]
    hidden = bool(r.model.capabilities.hidden_states)

    def same(form: str, what: str, got: Any, want: Any) -> None:
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape or not np.array_equal(got, want):
            err = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("nan")
            raise AssertionError(f"quantized_batch_invariance: {form}: {what} changed with the batch "
                                 f"(max |difference| {err:.3g})")  # fmt: skip

    for form in forms:
        model = load_model(str(path), backend=r.backend, host=load_plugins(), options=LoadOptions(quantization=form))

        def step(chunks: list[SequenceChunk], model: Any = model) -> Any:
            return model.forward(ForwardBatch(chunks, BLOCK), model.allocate_cache(48, BLOCK))

        alone = step([_chunk(ids, 0, [1, 2], all_logits=True, hidden_states=hidden)])
        beside = [_chunk(o, 0, [10 + 3 * k, 11 + 3 * k, 12 + 3 * k]) for k, o in enumerate(others)]
        crowd = step([beside[0], _chunk(ids, 0, [1, 2], all_logits=True, hidden_states=hidden), *beside[1:]])
        same(form, "a prompt's logits", crowd.all_logits[1], alone.all_logits[0])
        if hidden:
            same(form, "a prompt's hidden states", crowd.hidden_states[1], alone.hidden_states[0])
        # Decodes: the sequence's next token alone, then beside the others' next tokens.
        nxt = int(np.argmax(np.asarray(alone.all_logits[0])[-1]))
        cache = model.allocate_cache(48, BLOCK)
        seqs = [ids, *others]
        tables = [[1, 2, 3, 4]] + [[10 + 4 * k, 11 + 4 * k, 12 + 4 * k, 13 + 4 * k] for k in range(len(others))]
        model.forward(ForwardBatch([_chunk(s, 0, t) for s, t in zip(seqs, tables, strict=True)], BLOCK), cache)
        one = model.forward(ForwardBatch([_chunk([nxt], len(ids), tables[0], hidden_states=hidden)], BLOCK), cache)
        many = model.forward(ForwardBatch([_chunk([nxt if k == 0 else 5], len(s), t, hidden_states=hidden)
                                           for k, (s, t) in enumerate(zip(seqs, tables, strict=True))], BLOCK),
                             cache)  # fmt: skip
        same(form, "a decode's logits", many.logits[0], one.logits[0])
        if hidden:
            same(form, "a decode's hidden states", many.hidden_states[0], one.hidden_states[0])


def _threads(r: _Runner) -> None:
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, TINY["vocab"], size=n).tolist() for n in (12, 7)]
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            cache = r.cache()
            for _ in range(3):
                results[k] = r.step(cache, [_chunk(prompts[k], 0, [0, 1, 2], all_logits=True)]).all_logits[0]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise AssertionError(f"threads: forward from two threads raised {errors[0]!r}")
    for k, ids in enumerate(prompts):
        r.close(results[k], reference_logits(r.weights, ids), f"threads: thread {k}")


CHECKS = {
    "capabilities": _capabilities,
    "ragged": _ragged,
    "block_copies": _block_copies,
    "isolation": _isolation,
    "hidden_states": _hidden,
    "adapters": _adapters,
    "batch_invariance": _batch_invariance,
    "quantized_batch_invariance": _quantized_batch_invariance,
    "threads": _threads,
}


def run_backend_conformance(
    backend: str, workdir: str | Path, *, atol: float = 1e-4, checks: list[str] | None = None
) -> list[str]:
    """Run the kit against ``backend`` (an installed backend's name); returns the checks that passed
    and raises ``AssertionError`` at the first that fails."""
    runner = _Runner(backend, write_tiny_checkpoint(Path(workdir) / "tiny-llama"), atol)
    passed = []
    for name in checks or list(CHECKS):
        CHECKS[name](runner)
        passed.append(name)
    return passed
