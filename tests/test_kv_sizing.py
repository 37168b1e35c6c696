"""The KV cache is sized from what a block really costs: bytes per block as the backend stores it
(its dtype), a memory budget (``kv_cache_memory``: sizes with units, default a quarter of the memory
available), and the cache the backend allocates is that big."""

from __future__ import annotations

import pytest

from ruvllm.backend import LoadOptions
from ruvllm.engine import EngineConfig, LLMEngine
from ruvllm.runtime import load_model


def test_block_count_follows_the_backends_bytes_per_block(smollm2_path):
    budget = 64 * 2**20
    engines = {}
    for dtype in ("float32", "bfloat16"):
        llm = load_model(str(smollm2_path), backend="jax", options=LoadOptions(dtype=dtype))
        engines[dtype] = LLMEngine(llm, EngineConfig(kv_cache_memory_bytes=budget, max_num_seqs=64))
    c = engines["float32"].model.config
    f32, bf16 = engines["float32"], engines["bfloat16"]
    assert f32.block_bytes == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 16 * 4
    assert bf16.block_bytes * 2 == f32.block_bytes
    assert f32.num_blocks == budget // f32.block_bytes and bf16.num_blocks == budget // bf16.block_bytes
    for e in engines.values():
        assert e.cache.nbytes == e.num_blocks * e.block_bytes  # what was allocated is what was counted
    candle = LLMEngine(
        load_model(str(smollm2_path), backend="candle-compat"), EngineConfig(kv_cache_memory_bytes=budget)
    )
    assert candle.block_bytes == f32.block_bytes


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


def test_default_budget_is_a_quarter_of_available_memory_within_bounds():
    import os

    from ruvllm_server.state import kv_cache_budget

    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert abs(kv_cache_budget(None) - min(4 * 2**30, max(256 * 2**20, available // 4))) < available // 20
    assert kv_cache_budget("1GiB") == 2**30
