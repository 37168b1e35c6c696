"""The KV cache is sized from what a block really costs: bytes per block as the backend stores it
(its dtype), a memory budget (``kv_cache_memory``: sizes with units, default a quarter of the memory
available), and the cache the backend allocates is that big."""

from __future__ import annotations

import pytest

from ruvllm.backend import LoadOptions
from ruvllm.engine import EngineConfig, LLMEngine
from ruvllm.runtime import load_model

#: Tokens per KV block, set explicitly so the expected sizes below do not lean on the engine's default.
BLOCK_SIZE = 16


def _kv_shape_from_gguf(path) -> tuple[int, int, int]:
    """Layers, KV heads and head width as the GGUF file itself states them, read with the ``gguf``
    library (llama.cpp's), not ruvllm's checkpoint reader or model config."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    arch = fields["general.architecture"].contents()

    def value(key: str) -> int:
        return int(fields[f"{arch}.{key}"].contents())

    head_count = value("attention.head_count")
    # llama.cpp's rule: key_length when the file gives one, else the embedding split over the heads.
    key = f"{arch}.attention.key_length"
    head_dim = int(fields[key].contents()) if key in fields else value("embedding_length") // head_count
    return value("block_count"), value("attention.head_count_kv"), head_dim


def test_block_count_follows_the_backends_bytes_per_block(smollm2_path):
    budget = 64 * 2**20
    layers, kv_heads, head_dim = _kv_shape_from_gguf(smollm2_path)
    # One block holds K and V for every layer: 2 * layers * kv_heads * head_dim values per token.
    values_per_block = 2 * layers * kv_heads * head_dim * BLOCK_SIZE
    engines = {}
    for dtype in ("float32", "bfloat16"):
        llm = load_model(str(smollm2_path), backend="jax", options=LoadOptions(dtype=dtype))
        engines[dtype] = LLMEngine(
            llm, EngineConfig(kv_cache_memory_bytes=budget, max_num_seqs=64, block_size=BLOCK_SIZE)
        )
    f32, bf16 = engines["float32"], engines["bfloat16"]
    assert f32.block_bytes == values_per_block * 4  # float32: 4 bytes a value
    assert bf16.block_bytes == values_per_block * 2  # bfloat16: 2 bytes a value
    assert f32.num_blocks == budget // f32.block_bytes and bf16.num_blocks == budget // bf16.block_bytes
    for e in engines.values():
        assert e.cache.nbytes == e.num_blocks * e.block_bytes  # what was allocated is what was counted
    candle = LLMEngine(
        load_model(str(smollm2_path), backend="candle-compat"),
        EngineConfig(kv_cache_memory_bytes=budget, block_size=BLOCK_SIZE),
    )
    assert candle.block_bytes == values_per_block * 4  # NumPy float32


@pytest.mark.parametrize(
    ("text", "value"),
    [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5G", int(1.5 * 2**30)), ("1000", 1000), (42, 42)],
)
def test_kv_cache_memory_sizes(text, value):
    from ruvllm_server.state import parse_bytes

    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "2 parsecs", "-1GiB", "0"])
def test_bad_kv_cache_memory_is_refused(text):
    from ruvllm_server.settings import ServerConfigError
    from ruvllm_server.state import parse_bytes

    with pytest.raises(ServerConfigError, match="kv_cache_memory"):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("available", "budget"),
    [
        (8 * 2**30, 2 * 2**30),  # a quarter
        (2 * 2**30, 512 * 2**20),  # a quarter
        (512 * 2**20, 256 * 2**20),  # a quarter would be 128 MiB: the 256 MiB floor
        (64 * 2**30, 4 * 2**30),  # a quarter would be 16 GiB: the 4 GiB ceiling
    ],
)
def test_default_budget_is_a_quarter_of_available_memory_within_bounds(monkeypatch, available, budget):
    """The documented default (a quarter of the memory available, at least 256 MiB, at most 4 GiB)
    on machines of known memory; the expected budgets are worked out by hand above."""
    import os

    from ruvllm_server.state import kv_cache_budget

    page = 4096
    sysconf = {"SC_AVPHYS_PAGES": available // page, "SC_PAGE_SIZE": page}
    monkeypatch.setattr(os, "sysconf", lambda name: sysconf[name])
    assert kv_cache_budget(None) == budget
    assert kv_cache_budget("1GiB") == 2**30  # a setting wins over the machine's memory
