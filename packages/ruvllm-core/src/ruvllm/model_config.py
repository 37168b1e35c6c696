"""Architecture hyper-parameters shared by every backend, read from GGUF metadata or config.json."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Architectures the built-in backends implement (Llama family: GQA, RoPE, RMSNorm, SwiGLU).
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "smollm", "smollm2"})


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""

    @property
    def num_parameters(self) -> int:
        """Parameter count implied by the shapes (embeddings counted once when tied)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        emb = self.vocab_size * h
        return emb * (1 if self.tie_word_embeddings else 2) + L * per_layer + h
