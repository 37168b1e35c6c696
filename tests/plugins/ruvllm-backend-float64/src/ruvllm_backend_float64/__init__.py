"""``float64``: a small third-party backend written from docs/writing-a-backend.md alone. Llama-style
models (RMSNorm, SiLU gate, GQA, any RoPE ruvllm describes, optional tied head) in float64 NumPy over
a paged KV cache; LoRA adapters through ``delta``. Everything else is refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np

from ruvllm import hookimpl
from ruvllm.backend import Backend, Capabilities, ForwardOutput
from ruvllm.errors import BackendError

NAME = "float64"


class Float64Model:
    capabilities = Capabilities(
        dtypes=("float32",), quantizations=("none", "auto"), adapters=True, hidden_states=True, all_logits=True
    )

    def __init__(self, checkpoint, options) -> None:
        cfg = checkpoint.config
        unsupported = {
            "qk_norm": cfg.qk_norm,
            "output_norms": cfg.output_norms,
            "attention_bias": cfg.attention_bias,
            "final_logit_softcap": cfg.final_logit_softcap is not None,
            "sliding window": any(cfg.layer_window(i) for i in range(cfg.num_layers)),
            "embedding_scale": cfg.embedding_scale != 1.0,
            "activation": cfg.activation != "silu",
        }
        for field, present in unsupported.items():
            if present:
                raise BackendError(f"float64 backend: {field} is not supported")
        if options.quantization not in ("none", "auto") or options.dtype not in ("float32", "auto") or options.extra:
            raise BackendError("float64 backend: no quantization, dtype or extra options are supported")
        self.cfg = cfg
        self.options = dataclasses.replace(options, quantization="none", dtype="float32")

        def t(name: str) -> np.ndarray:
            return np.asarray(checkpoint.tensor(name), np.float64)

        self.embed = t("model.embed_tokens.weight")
        self.norm = t("model.norm.weight")
        self.head = self.embed if cfg.tie_word_embeddings else t("lm_head.weight")
        names = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
        self.layers = [{n: t(f"model.layers.{i}.{n}.weight") for n in names} for i in range(cfg.num_layers)]

    def kv_cache(self, num_blocks, block_size, options):
        if options:
            raise BackendError(f"float64 backend: unknown KV cache option(s) {', '.join(sorted(options))}")
        return Float64Cache(self, num_blocks, block_size)

    def kv_block_bytes(self, block_size, options) -> int:
        c = self.cfg
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * block_size * 8

    def precompile(self, cache, limits, progress):
        return []

    def rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.cfg.rms_norm_eps) * w

    def forward(self, batch, cache) -> ForwardOutput:
        c = self.cfg
        for src, dst in batch.block_copies:  # copy-on-write, before anything else
            cache.k[:, dst] = cache.k[:, src]
            cache.v[:, dst] = cache.v[:, src]
        out = ForwardOutput(np.zeros((len(batch.chunks), c.vocab_size), np.float32))
        for ci, chunk in enumerate(batch.chunks):
            hidden = self.sequence(chunk, cache, batch.block_size)
            logits = hidden @ self.head.T
            out.logits[ci] = logits[-1]
            if chunk.all_logits:
                out.all_logits[ci] = logits.astype(np.float32)
            if chunk.hidden_states:
                out.hidden_states[ci] = hidden.astype(np.float32)
        return out

    def sequence(self, chunk, cache, bs: int) -> np.ndarray:
        c = self.cfg
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        ids = np.asarray(chunk.token_ids)
        n, start = len(ids), chunk.start_pos
        pos = start + np.arange(n)
        table = np.asarray(chunk.block_table)
        blocks, offs = table[pos // bs], pos % bs
        seen = np.arange(start + n)
        sblocks, soffs = table[seen // bs], seen % bs
        adapter = chunk.adapter

        def proj(layer: int, name: str, x: np.ndarray, w: np.ndarray) -> np.ndarray:
            y = x @ w.T
            if adapter is not None:
                d = adapter.delta(layer, name.split(".")[-1], x.astype(np.float32))
                if d is not None:
                    y = y + np.asarray(d, np.float64)
            return y

        x = self.embed[ids]
        for li, w in enumerate(self.layers):
            cos, sin = (np.asarray(a, np.float64)[:, None, :] for a in c.layer_rope(li).cos_sin(pos, hd))

            def rope(v: np.ndarray, cos: np.ndarray = cos, sin: np.ndarray = sin) -> np.ndarray:
                a, b = v[..., : hd // 2], v[..., hd // 2 :]
                return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

            h = self.rms(x, w["input_layernorm"])
            q = rope(proj(li, "q_proj", h, w["self_attn.q_proj"]).reshape(n, nh, hd))
            k = rope(proj(li, "k_proj", h, w["self_attn.k_proj"]).reshape(n, nkv, hd))
            v = proj(li, "v_proj", h, w["self_attn.v_proj"]).reshape(n, nkv, hd)
            cache.k[li, blocks, offs] = k
            cache.v[li, blocks, offs] = v
            keys = np.repeat(cache.k[li, sblocks, soffs], nh // nkv, axis=1)
            vals = np.repeat(cache.v[li, sblocks, soffs], nh // nkv, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, keys) * c.attention_scale
            scores = np.where(seen[None, None, :] <= pos[None, :, None], scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            a = np.einsum("hqk,khd->qhd", p, vals).reshape(n, nh * hd)
            x = x + proj(li, "o_proj", a, w["self_attn.o_proj"])
            h = self.rms(x, w["post_attention_layernorm"])
            g = proj(li, "gate_proj", h, w["mlp.gate_proj"])
            u = proj(li, "up_proj", h, w["mlp.up_proj"])
            x = x + proj(li, "down_proj", g / (1.0 + np.exp(-g)) * u, w["mlp.down_proj"])
        return self.rms(x, self.norm)


class Float64Cache:
    def __init__(self, model: Float64Model, num_blocks: int, block_size: int) -> None:
        c = model.cfg
        shape = (c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.k, self.v = np.zeros(shape), np.zeros(shape)


class Float64Backend(Backend):
    name = NAME
    description = "float64 NumPy Llama (third-party test backend)"
    priority = -10

    def load(self, checkpoint, options):
        return Float64Model(checkpoint, options)


@hookimpl
def register_backends(register):
    register(Float64Backend())
