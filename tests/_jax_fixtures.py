"""Helpers shared by the JAX backend tests: tiny random Hugging Face checkpoints, a Hugging Face
reference, and a minimal greedy decoder that drives the backend's forward hook directly (no engine,
so batching is exactly what the test says it is)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk

#: Small shapes that still exercise GQA (4 query heads over 2 kv heads), several layers and biases.
TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def write_tiny_hf_model(directory: Path, arch: str, *, seed: int = 0, tied: bool = False) -> Path:
    """Save a randomly initialised transformers model of ``arch`` (llama, mistral, qwen2) as a
    safetensors checkpoint directory."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    torch.manual_seed(seed)
    config = config_cls(**TINY, tie_word_embeddings=tied)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def hf_logits(model, ids: list[int]) -> np.ndarray:
    """Float32 logits ``[len(ids), vocab]`` of a transformers model."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from transformers (no eos stop, plain argmax)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def load_jax(checkpoint, **options):
    from ruvllm_jax.runner import JaxModel

    return JaxModel.load(checkpoint, LoadOptions(**options))


@functools.cache
def jax_model_at(path: str, quantization: str = "none"):
    """The JAX backend's model of a checkpoint, loaded once per test session and quantization."""
    from ruvllm.checkpoint import open_checkpoint

    return load_jax(open_checkpoint(path), quantization=quantization)


#: Prompts for SmolLM2 tests: prose, code, a list, chat-like; different lengths on purpose.
SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
]


class GreedyDecoder:
    """Greedy decoding of several sequences through one backend's forward, all sequences in every
    step. Blocks are handed out interleaved across sequences so no sequence's cache is contiguous."""

    def __init__(self, model, *, block_size: int = 16, num_blocks: int = 256) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks

    def run(self, prompts: list[list[int]], max_new: int, *, prefill_chunk: int | None = None) -> list[list[int]]:
        n = len(prompts)
        bs = self.block_size
        per_seq = -(-max(len(p) + max_new for p in prompts) // bs)
        if per_seq * n > self.num_blocks:
            raise ValueError("not enough blocks for this test")
        tables = [np.arange(per_seq, dtype=np.int32) * n + i for i in range(n)]
        cache = self.model.allocate_cache(self.num_blocks, bs)
        done = [0] * n
        outs: list[list[int]] = [[] for _ in range(n)]
        # Prefill, possibly in chunks (each step takes the next chunk of every unfinished prompt).
        while any(done[i] < len(p) for i, p in enumerate(prompts)):
            chunks, who = [], []
            for i, p in enumerate(prompts):
                if done[i] < len(p):
                    end = len(p) if prefill_chunk is None else min(len(p), done[i] + prefill_chunk)
                    chunks.append(SequenceChunk(np.asarray(p[done[i] : end], np.int32), done[i], tables[i]))
                    who.append((i, end))
            out = self.model.forward(ForwardBatch(chunks, bs), cache)
            for row, (i, end) in enumerate(who):
                done[i] = end
                if end == len(prompts[i]):
                    outs[i].append(int(np.argmax(out.logits[row])))
        for _ in range(max_new - 1):
            chunks = [
                SequenceChunk(np.asarray([outs[i][-1]], np.int32), len(prompts[i]) + len(outs[i]) - 1, tables[i])
                for i in range(n)
            ]
            out = self.model.forward(ForwardBatch(chunks, bs), cache)
            for i in range(n):
                outs[i].append(int(np.argmax(out.logits[i])))
        return outs


def prompt_logits(model, ids: list[int], *, block_size: int = 16) -> np.ndarray:
    """All-position logits of one prompt in a single prefill step."""
    cache = model.allocate_cache(-(-len(ids) // block_size) + 1, block_size)
    table = np.arange(-(-len(ids) // block_size), dtype=np.int32)[::-1].copy()
    chunk = SequenceChunk(np.asarray(ids, np.int32), 0, table, all_logits=True)
    return model.forward(ForwardBatch([chunk], block_size), cache).all_logits[0]


def mean_kl(want: np.ndarray, got: np.ndarray) -> float:
    """Mean over rows of KL(softmax(want) || softmax(got)) in float64 (nats)."""

    def logsoftmax(z: np.ndarray) -> np.ndarray:
        z = z.astype(np.float64) - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lp, lq = logsoftmax(want), logsoftmax(got)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """Perplexity of ``ids[1:]`` under ``logits[:-1]`` (float64 log-softmax)."""
    x = logits[:-1].astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    nll = -logp[np.arange(len(ids) - 1), ids[1:]]
    return float(np.exp(nll.mean()))
