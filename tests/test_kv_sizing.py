"""The KV cache is sized from what a block really costs: bytes per block as the backend stores it
(its dtype), a memory budget (``kv_cache_memory``: sizes with units; by default room for four
sequences of the context within half the memory left once the model is loaded), and the cache the
backend allocates is that big."""

from __future__ import annotations

import pytest

from ruvllm.backend import LoadOptions
from ruvllm.engine import EngineConfig, LLMEngine
from ruvllm.engine.config import DEFAULT_KV_MEMORY_SHARE
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


def _smollm2_engine(smollm2_path, monkeypatch, available: int, **kw) -> LLMEngine:
    import ruvllm.engine.kv_plan as kv_plan

    monkeypatch.setattr(kv_plan, "available_memory", lambda: available)
    llm = load_model(str(smollm2_path), backend="candle-compat")
    return LLMEngine(llm, EngineConfig(block_size=BLOCK_SIZE, **kw))


@pytest.mark.parametrize("max_num_seqs", [64, 2])
def test_default_budget_holds_four_contexts_when_memory_allows(smollm2_path, monkeypatch, max_num_seqs):
    """The default rule (DEFAULT_KV_RULE): room for 4 sequences of the served context (fewer with a
    smaller max_num_seqs), worked out here from the file's own shapes, not the engine's numbers."""
    import gguf

    layers, kv_heads, head_dim = _kv_shape_from_gguf(smollm2_path)
    fields = gguf.GGUFReader(str(smollm2_path)).fields
    context = int(fields["llama.context_length"].contents())
    block = 2 * layers * kv_heads * head_dim * BLOCK_SIZE * 4  # float32 K and V of every layer
    engine = _smollm2_engine(smollm2_path, monkeypatch, 64 * 2**30, max_num_seqs=max_num_seqs)
    blocks = min(max_num_seqs, 4) * -(-context // BLOCK_SIZE)
    assert engine.num_blocks == blocks
    assert engine.kv_budget_bytes == blocks * block == engine.kv_cache_bytes
    # SmolLM2-135M (8192 tokens of context, 46 KB a token): 1.5 GB, not the old 4 GiB ceiling.
    assert engine.kv_cache_bytes < 2**31


def test_default_budget_is_half_the_memory_left(smollm2_path, monkeypatch):
    """Where 4 contexts do not fit, half of the memory available once the model is loaded."""
    available = 256 * 2**20
    engine = _smollm2_engine(smollm2_path, monkeypatch, available, max_num_seqs=64)
    assert engine.kv_budget_bytes == available // 2
    assert engine.num_blocks == (available // 2) // engine.block_bytes


def test_a_given_budget_or_block_count_wins(smollm2_path, monkeypatch):
    engine = _smollm2_engine(smollm2_path, monkeypatch, 64 * 2**30, kv_cache_memory_bytes=64 * 2**20)
    assert engine.kv_budget_bytes == 64 * 2**20 and engine.num_blocks == 64 * 2**20 // engine.block_bytes
    engine = _smollm2_engine(smollm2_path, monkeypatch, 64 * 2**30, num_blocks=7)
    assert engine.kv_budget_bytes is None and engine.num_blocks == 7


def test_available_memory_is_limited_by_the_cgroup(tmp_path):
    """A memory limit on the process's cgroup (a container's) is what it may take, not the host's
    MemAvailable: the tightest limit less usage (plus inactive page cache) up the cgroup's path, in
    cgroup v2 and in v1's memory controller."""
    from ruvllm.memory import cgroup_headroom

    gib = 2**30
    root = tmp_path / "cgroup"
    leaf = root / "outer" / "inner"
    leaf.mkdir(parents=True)
    (root / "outer" / "memory.max").write_text(f"{16 * gib}\n")
    (root / "outer" / "memory.current").write_text(f"{10 * gib}\n")
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.current").write_text(f"{9 * gib}\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/outer/inner\n")
    assert cgroup_headroom(root, proc) == 6 * gib
    (leaf / "memory.max").write_text(f"{12 * gib}\n")
    assert cgroup_headroom(root, proc) == 3 * gib  # 12 GiB less 9 in use, tighter than the outer 6
    (leaf / "memory.stat").write_text(f"anon {7 * gib}\ninactive_file {gib}\n")
    assert cgroup_headroom(root, proc) == 4 * gib  # the inactive page cache is reclaimable
    # cgroup v1: the memory controller's own hierarchy; its "no limit" is a huge number.
    v1 = root / "memory" / "job"
    v1.mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{20 * gib}\n")
    (v1 / "memory.limit_in_bytes").write_text(f"{16 * gib}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{5 * gib}\n")
    (v1 / "memory.stat").write_text(f"cache {3 * gib}\ntotal_inactive_file {2 * gib}\n")
    proc.write_text("4:memory:/job\n0::/\n")
    assert cgroup_headroom(root, proc) == 13 * gib
    proc.write_text("1:name=systemd:/x\n")  # no memory controller: no answer
    assert cgroup_headroom(root, proc) is None


def test_a_share_of_the_memory_is_rounded_so_restarts_size_the_cache_alike():
    from ruvllm.engine.config import default_kv_memory

    engine = EngineConfig()
    wanted = 64 * 2**30  # more than the share: the share decides
    # Shares of 4,608 / 5,216 / 5,244 / 5,632 / 6,100 MiB (starts of an 8B server): one size.
    starts = [default_kv_memory(engine, wanted, 2 * mib * 2**20) for mib in (4_608, 5_216, 5_244, 5_632, 6_100)]
    assert set(starts) == {4_096 * 2**20}
    assert default_kv_memory(engine, wanted, 2 * 6_200 * 2**20) == 6_144 * 2**20  # 1.5 x 4 GiB
    for avail in (3 * 2**30 + 12345, 777_777_777, 2**33, 2**34 - 1):
        got, share = default_kv_memory(engine, wanted, avail), int(DEFAULT_KV_MEMORY_SHARE * avail)
        assert share * 2 / 3 <= got <= share
        assert got >> (got.bit_length() - 2) << (got.bit_length() - 2) == got  # 2 leading bits
    assert default_kv_memory(engine, 5 * 2**20 + 3, 2**34) == 5 * 2**20 + 3  # what the contexts need, exactly
