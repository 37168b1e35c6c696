"""Which file of a Hugging Face repository a quantization names, from the repository's file list
(never a guessed name): ``q4k`` the Q4_K_M GGUF, ``q8`` the Q8_0 GGUF, ``f16`` the F16 GGUF, ``none``
the safetensors model with its config and tokenizer.

A leaf: :mod:`ruvllm.resolve` (what is in the cache) and :mod:`ruvllm.hub` (what to download) both
read it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ruvllm.catalog import HubAlias
from ruvllm.errors import ModelNotFoundError

#: What each file quantization names in a repository.
FILE_QUANTIZATIONS: dict[str, str] = {"q4k": "Q4_K_M", "q8": "Q8_0", "f16": "F16", "none": "safetensors"}
#: The seed CLI's default, and the order a reference with several downloaded variants prefers.
PREFERENCE = ("q4k", "q8", "f16", "none")
#: The load form each file runs with: its own blocks (``auto``, the backend's fastest form keeping
#: the file's weights) or its weights as floats (``none``).
LOAD_FORMS: dict[str, str] = {"q4k": "auto", "q8": "auto", "f16": "none", "none": "none"}

_GGUF_NAMES = {
    "q4k": re.compile(r"(?:^|[-_.])q4_k_m\.gguf$", re.IGNORECASE),
    "q8": re.compile(r"(?:^|[-_.])q8_0\.gguf$", re.IGNORECASE),
    "f16": re.compile(r"(?:^|[-_.])(?:f16|fp16)\.gguf$", re.IGNORECASE),
}
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
#: Besides the weights, what a safetensors (``none``) download takes: config, tokenizer, template.
_HF_SIDE_FILES = re.compile(
    r"^(?:config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|"
    r"tokenizer\.model|chat_template\.jinja|chat_template\.json|model\.safetensors\.index\.json)$"
)


def check_quantization(quantization: str) -> str:
    if quantization not in FILE_QUANTIZATIONS:
        known = ", ".join(f"{k} ({v})" for k, v in FILE_QUANTIZATIONS.items())
        raise ModelNotFoundError(f"unknown file quantization {quantization!r}: choose from {known}")
    return quantization


def pick_files(quantization: str, paths: Iterable[str], where: str) -> list[str]:
    """The files of ``paths`` (repository-relative) that ``quantization`` names: one GGUF, or a
    safetensors model with its config and tokenizer. None there: a one-line error naming ``where``."""
    paths = sorted(paths, key=lambda p: (p.count("/"), len(p), p))  # top level and shortest name first
    if quantization == "none":
        weights = [p for p in paths if "/" not in p and p.endswith(".safetensors")]
        # transformers' model*.safetensors, not a second copy in another layout (Mistral's
        # consolidated.safetensors).
        weights = [p for p in weights if p.startswith("model")] or weights
        if not weights or "config.json" not in paths:
            raise ModelNotFoundError(f"{where} holds no safetensors model (config.json + *.safetensors) for 'none'")
        return weights + [p for p in paths if _HF_SIDE_FILES.match(p)]
    rule = _GGUF_NAMES[check_quantization(quantization)]
    found = [p for p in paths if rule.search(_unsplit(p))]
    whole = [p for p in found if not _SPLIT.search(p)]
    if whole:
        return whole[:1]
    kind = FILE_QUANTIZATIONS[quantization]
    if found:
        raise ModelNotFoundError(
            f"{where} holds {kind} only as a split GGUF ({found[0]}, ...): ruvllm reads single-file GGUFs "
            "(join the parts with llama.cpp's `llama-gguf-split --merge`)"
        )
    have = [q for q, r in _GGUF_NAMES.items() if any(r.search(_unsplit(p)) for p in paths)]
    have += ["none"] if any(p.endswith(".safetensors") for p in paths) else []
    also = f" (it has: {', '.join(have)})" if have else ""
    raise ModelNotFoundError(f"{where} holds no {kind} GGUF file for {quantization!r}{also}")


def _unsplit(path: str) -> str:
    """A file's name without its folder and its split suffix (``-00001-of-00003``)."""
    return _SPLIT.sub(".gguf", path.rsplit("/", 1)[-1])


def available(paths: Iterable[str]) -> list[str]:
    """The file quantizations ``paths`` hold, in preference order."""
    paths = list(paths)
    out = []
    for q in PREFERENCE:
        try:
            pick_files(q, paths, "")
            out.append(q)
        except ModelNotFoundError:
            pass
    return out


def repo_of(alias: HubAlias, quantization: str) -> str:
    """The repository holding an alias's file of ``quantization``: the GGUF repo, or the original."""
    return alias.hub_id if quantization == "none" else alias.gguf_repo


#: ``--quantization`` wherever a model is loaded (generate, chat, serve, benchmark).
QUANTIZATION_CHOICES = ("auto", "q4k", "q8", "f16", "none", "q4", "w8a8", "w4a8", "fp8")
QUANTIZATION_HELP = (
    "For a Hub model (alias or repo id) the seed's names pick which downloaded file runs, in its own form: "
    "q4k = the Q4_K_M GGUF, q8 = the Q8_0 GGUF, f16 = the F16 GGUF, none = the original safetensors "
    "(without the option: the first downloaded of these). For one file: auto (default) = the backend's "
    "fastest form keeping the file's weights; q4k / f16 = the same, checked to be a Q4_K_M / F16 file; "
    "none = float weights; q8 / q4 = int8 / int4 weights rounded at load; w8a8 = int8 weights and "
    "activations; w4a8 = llama.cpp's CPU scheme (4/8-bit weight blocks, int8 activations); fp8 = float8 "
    "e4m3 weights (jax, GPUs from Ada/Hopper; CPUs run it slowly)."
)
