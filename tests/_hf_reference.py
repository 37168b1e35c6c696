"""Hugging Face transformers as the independent reference for backends: it reads the same GGUF file
(its own dequantizers and Q/K un-permutation) into its own Llama implementation, float32 on CPU.

Loading dequantizes the whole model and builds a tokenizer from the GGUF vocabulary (tens of seconds
here), so each is cached per path for the test session; every test module shares them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def _require_hf() -> None:
    for mod in ("torch", "transformers", "accelerate"):  # transformers needs accelerate to read GGUF
        pytest.importorskip(mod, reason=f"the HF reference needs {mod} (pip install torch transformers accelerate)")


@functools.cache
def _model(path: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    p = Path(path)
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
    return model.eval()


@functools.cache
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    p = Path(path)
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Run torch single-threaded: a small model gains little from a second thread, and on a busy
    2-core machine torch's spinning thread pool was measured 10x slower (105 s vs 9 s for 32 tokens)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def hf_model(gguf_path: str | Path) -> Any:
    """The transformers model of ``gguf_path`` (float32, eval mode), loaded once per session."""
    _require_hf()
    return _model(str(gguf_path))


def hf_encode(gguf_path: str | Path, text: str) -> list[int]:
    """Token ids of ``text`` by the transformers tokenizer of ``gguf_path`` (no special tokens added)."""
    _require_hf()
    return list(_tokenizer(str(gguf_path))(text, add_special_tokens=False)["input_ids"])


def hf_logits(gguf_path: str | Path, token_ids: list[int]) -> np.ndarray:
    """float32 ``[len(token_ids), vocab]``: the reference logits at every position of one sequence."""
    import torch

    model = hf_model(gguf_path)
    with torch.no_grad(), _one_torch_thread():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def hf_greedy(gguf_path: str | Path, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """``generate(do_sample=False)`` continuation of exactly ``max_new_tokens`` tokens (EOS does not stop it)."""
    import torch

    model = hf_model(gguf_path)
    ids = torch.tensor([token_ids])
    with torch.no_grad(), _one_torch_thread():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(token_ids) :].tolist()
