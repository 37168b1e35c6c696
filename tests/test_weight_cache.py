"""The jax backend's weight cache (ruvllm_jax.weight_cache): a GGUF's w4a8 weights repacked once into
a cache file, memory-mapped by every later load and used in place.

Checked on a tiny Q4_K_M-like file (Q4_K, Q5_K and Q6_K layers mixed, so the layers' common form is
in play): the logits of a load that writes the entry and of one that maps it equal, bit for bit, those
of today's load without the cache, under every kernel variant the CPU runs; the mapped load's weight
buffers lie inside the cache file's mapping (no copy); and bad input never gives wrong weights: a
truncated or foreign entry is rebuilt, a changed GGUF gets a new entry, a cache directory that cannot
be written loads without one, and a corrupt GGUF is a one-line error that leaves no entry behind.
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from _gguf_files import write_tiny_llama_gguf
from _jax_fixtures import load_jax
from _kquant_files import requantize_gguf
from structlog.testing import capture_logs

from ruvllm.backend import ForwardBatch, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm.errors import ModelFormatError
from ruvllm_jax import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")

PROMPT = np.array([5, 77, 200, 13, 9, 31, 250, 4, 120, 66, 18], np.int32)


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    d = tmp_path_factory.mktemp("weight-cache")
    return requantize_gguf(write_tiny_llama_gguf(d / "f32.gguf", hidden=256, layers=2), d / "q4_k_m.gguf")


def _load(path):
    with capture_logs() as logs:
        model = load_jax(open_checkpoint(path), quantization="w4a8")
    said = next(e for e in logs if e["event"] == "weights loaded")["weight_cache"]
    return model, said


def _logits(model) -> np.ndarray:
    chunk = SequenceChunk(PROMPT, 0, np.arange(2, dtype=np.int32), all_logits=True)
    return np.asarray(model.forward(ForwardBatch([chunk], 16), model.allocate_cache(4, 16)).all_logits[0])


def _mapped_range(path) -> tuple[int, int]:
    """The address range of this process's mapping of ``path`` (its first to last mapped byte)."""
    starts, ends = [], []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                starts.append(lo)
                ends.append(hi)
    assert starts, f"{path} is not mapped"
    return min(starts), max(ends)


def test_mapped_weights_equal_todays_load_on_every_variant(tiny_q4_k_m, tmp_path, monkeypatch):
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", "off")
    today, said = _load(tiny_q4_k_m)
    assert said == "off"
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", str(tmp_path / "cache"))
    written, said_w = _load(tiny_q4_k_m)
    copied, said_c = _load(tiny_q4_k_m)  # onto anonymous huge pages (the default where THP is on)
    monkeypatch.setenv("RUVLLM_JAX_HUGE_PAGES", "0")  # left in the mapping
    mapped, said_m = _load(tiny_q4_k_m)
    assert said_w.startswith("written: ") and said_m.startswith("hit: ") and said_c.startswith("hit: ")
    entries = list((tmp_path / "cache").glob("*.bin"))
    assert len(entries) == 1 and said_m.endswith(str(entries[0]))
    for isa in native.supported_isas():
        with native.use_isa(isa):
            want = _logits(today)
            np.testing.assert_array_equal(_logits(written), want, err_msg=f"{isa}: the load that wrote the entry")
            np.testing.assert_array_equal(_logits(mapped), want, err_msg=f"{isa}: the mapped load")
            np.testing.assert_array_equal(_logits(copied), want, err_msg=f"{isa}: the load copied to huge pages")
    # In place: every weight buffer of the mapped load lies in the cache file's mapping.
    lo, hi = _mapped_range(entries[0])
    leaves = [x for x in jax.tree_util.tree_leaves(mapped.weights) if x.size]
    inside = [lo <= x.unsafe_buffer_pointer() and x.unsafe_buffer_pointer() + x.nbytes <= hi for x in leaves]
    assert leaves and all(inside)
    assert mapped.weight_bytes == today.weight_bytes


def test_a_damaged_or_foreign_entry_is_rebuilt(tiny_q4_k_m, tmp_path, monkeypatch):
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", "off")
    want = _logits(_load(tiny_q4_k_m)[0])
    cache = tmp_path / "cache"
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", str(cache))
    _load(tiny_q4_k_m)
    (data,) = cache.glob("*.bin")
    manifest = data.with_suffix(".manifest")
    good_manifest = manifest.read_bytes()
    # Truncated data.
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    model, said = _load(tiny_q4_k_m)
    assert said.startswith("written: ")
    np.testing.assert_array_equal(_logits(model), want)
    # Garbage in the manifest.
    manifest.write_bytes(b"not a manifest")
    model, said = _load(tiny_q4_k_m)
    assert said.startswith("written: ")
    np.testing.assert_array_equal(_logits(model), want)
    # Another entry's manifest (another file, or another ruvllm) under this entry's name.
    other = tmp_path / "other.gguf"
    shutil.copy(tiny_q4_k_m, other)
    _load(other)
    (other_manifest,) = (m for m in cache.glob("*.manifest") if m != manifest)
    manifest.write_bytes(other_manifest.read_bytes())
    model, said = _load(tiny_q4_k_m)
    assert said.startswith("written: ")
    np.testing.assert_array_equal(_logits(model), want)
    assert manifest.read_bytes() == good_manifest


def test_a_changed_file_gets_a_new_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "files"
    d.mkdir()
    path = requantize_gguf(write_tiny_llama_gguf(d / "a.gguf", hidden=256, layers=2, seed=1), d / "m.gguf")
    first = _logits(_load(path)[0])
    requantize_gguf(write_tiny_llama_gguf(d / "b.gguf", hidden=256, layers=2, seed=2), path)
    model, said = _load(path)
    assert said.startswith("written: ")
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 2
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", "off")
    want = _logits(_load(path)[0])
    np.testing.assert_array_equal(_logits(model), want)
    assert not np.array_equal(want, first)


def test_an_unwritable_cache_directory_loads_without_it(tiny_q4_k_m, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", str(blocker / "cache"))
    model, said = _load(tiny_q4_k_m)
    assert said.startswith("off (") and "directory" in said.lower()
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", "off")
    np.testing.assert_array_equal(_logits(model), _logits(_load(tiny_q4_k_m)[0]))


def test_a_corrupt_gguf_is_an_error_and_leaves_no_entry(tiny_q4_k_m, tmp_path, monkeypatch):
    import gguf

    cache = tmp_path / "cache"
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", str(cache))
    bad = tmp_path / "corrupt.gguf"
    raw = bytearray(tiny_q4_k_m.read_bytes())
    t = next(t for t in gguf.GGUFReader(tiny_q4_k_m).tensors if t.name == "blk.0.ffn_down.weight")
    raw[t.data_offset : t.data_offset + 2] = np.array([np.inf], np.float16).tobytes()  # Q5_K: its first block's d
    bad.write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError) as exc:
        load_jax(open_checkpoint(bad), quantization="w4a8")
    assert "\n" not in str(exc.value) and "non-finite" in str(exc.value)
    assert not [p for p in cache.glob("*") if p.is_file()]


def test_dropping_a_tensors_file_pages_keeps_its_values_and_touches_nothing_else(tiny_q4_k_m):
    """The loader drops a converted tensor's pages from the process (ruvllm_jax.host_memory.
    drop_file_pages): the values read back the same from the page cache, and memory outside the
    checkpoint's read-only mapping (where MADV_DONTNEED would zero it) is refused."""
    from ruvllm_jax.host_memory import drop_file_pages

    ckpt = open_checkpoint(tiny_q4_k_m)
    raw = ckpt.raw_tensor("model.embed_tokens.weight").data
    before = np.array(raw)
    assert drop_file_pages(raw, ckpt.mapping()) == (raw.nbytes >= 2 * 4096)
    np.testing.assert_array_equal(raw, before)
    anon = np.arange(1 << 16, dtype=np.uint8)
    assert not drop_file_pages(anon, ckpt.mapping())
    assert not drop_file_pages(anon, anon)  # writable: never a file mapping of ours
    np.testing.assert_array_equal(anon, np.arange(1 << 16, dtype=np.uint8))
