"""Transparent huge pages behind a CPU model's weights (ruvllm_jax.host_memory.huge_pages): the
buffers' 2 MiB-aligned interiors end up on huge pages (read back from /proc/self/smaps), their values
are untouched, small buffers are left alone, and RUVLLM_JAX_HUGE_PAGES=0 turns it off. Where the
kernel cannot collapse pages (before Linux 6.1, THP off) the tests that need it skip with what the
function said."""

from __future__ import annotations

import re
import sys

import jax
import numpy as np
import pytest

from ruvllm_jax.host_memory import HUGE_PAGE, buffer_ranges, huge_pages, thp_mode

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")


def anon_huge_bytes(start: int, end: int) -> int:
    """AnonHugePages of the mappings over [start, end), from /proc/self/smaps. smaps counts per
    mapping, and advising a range can merge it with a neighbour advised before, so a mapping may
    reach past the range: the count is then of the whole mapping."""
    total, over = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                over = lo < end and start < hi
            elif over and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def collapsed_mb(said: str) -> int:
    m = re.match(r"(\d+) of (\d+) MB collapsed in \d+\.\d\d s", said)
    assert m, said
    return int(m.group(1))


def needs_collapse(said: str) -> None:
    if thp_mode() == "never" or "MADV_COLLAPSE" in said:
        pytest.skip(f"this kernel does not collapse huge pages here: {said}")


def aligned_interior(start: int, end: int) -> tuple[int, int]:
    return (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), end & ~(HUGE_PAGE - 1)


def test_a_large_buffer_lands_on_huge_pages_with_its_values(monkeypatch):
    monkeypatch.delenv("RUVLLM_JAX_HUGE_PAGES", raising=False)
    values = np.random.default_rng(0).standard_normal(6 << 20, dtype=np.float32)  # 24 MiB
    a = jax.device_put(values)
    said = huge_pages([a])
    needs_collapse(said)
    ((start, end),) = buffer_ranges([a])
    lo, hi = aligned_interior(start, end)
    assert hi - lo >= 20 << 20
    assert collapsed_mb(said) == round((hi - lo) / 1e6)
    assert anon_huge_bytes(lo, hi) >= hi - lo  # every aligned 2 MiB of it is one huge page
    np.testing.assert_array_equal(np.asarray(a), values)


def test_buffers_smaller_than_an_aligned_huge_page_are_left_alone(monkeypatch):
    monkeypatch.delenv("RUVLLM_JAX_HUGE_PAGES", raising=False)
    small = [jax.device_put(np.ones(n, np.float32)) for n in (1, 1000, 200_000)]  # at most 0.8 MB
    said = huge_pages(small)
    assert said.startswith("0 of 1 MB collapsed"), said
    assert "advised" not in said


def test_turned_off_by_the_environment():
    """In a fresh process (advice given earlier in this one can spread to later allocations next to it)."""
    import os
    import subprocess

    code = f"""
import jax, numpy as np
from ruvllm_jax.host_memory import huge_pages, buffer_ranges, thp_mode
from {__name__.rpartition(".")[2]} import aligned_interior, anon_huge_bytes
a = jax.device_put(np.ones(6 << 20, np.float32))
print(huge_pages([a]))
print(thp_mode(), anon_huge_bytes(*aligned_interior(*buffer_ranges([a])[0])))
"""
    env = {**os.environ, "RUVLLM_JAX_HUGE_PAGES": "0", "PYTHONPATH": os.path.dirname(__file__)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    said, state = out.stdout.strip().splitlines()[-2:]
    assert said == "off (RUVLLM_JAX_HUGE_PAGES=0)"
    mode, huge = state.split()
    if mode == "madvise":  # (with "always" the kernel may give huge pages to anything)
        assert int(huge) == 0


def test_the_thp_mode_is_read_from_sysfs(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert thp_mode(path) == "madvise"
    path.write_text("[never]\n")
    assert thp_mode(path) == "never"
    assert thp_mode(tmp_path / "missing") is None


def test_smollm2_w4a8_weights_sit_on_huge_pages(smollm2_path):
    """The loaded model says what it did; its largest weight buffer's interior is on huge pages
    (collapsed, or copied there from the weight cache: ruvllm_jax.host_memory.huge_page_copy)."""
    from _jax_fixtures import jax_model_at

    model = jax_model_at(str(smollm2_path), "w4a8")
    ranges = buffer_ranges(jax.tree_util.tree_leaves(model.weights))
    if "copied from the cache file" in model.huge_pages:
        # From the weight cache: copied onto memory advised for huge pages before it was touched.
        if thp_mode() == "never" or "refused" in model.huge_pages:
            pytest.skip(f"no huge pages here: {model.huge_pages}")
    else:
        needs_collapse(model.huge_pages)
        total_mb = sum(e - s for s, e in ranges) / 1e6
        assert collapsed_mb(model.huge_pages) >= 0.5 * total_mb, model.huge_pages
    start, end = max(ranges, key=lambda r: r[1] - r[0])
    lo, hi = aligned_interior(start, end)
    assert anon_huge_bytes(lo, hi) >= 0.9 * (hi - lo)


RELEASE_CHILD = """
import numpy as np, psutil
from ruvllm.memory import release_free_memory
from ruvllm_jax.host_memory import keep_large_buffers
assert keep_large_buffers() == "kept for reuse"
keep = np.ones(4 << 20)            # 32 MiB above the freed block: it is not at the heap's top
big = np.ones(64 << 20)            # 512 MiB on the heap (mmap is off)
keep2 = np.ones(1 << 20)
rss = lambda: psutil.Process().memory_info().rss
held = rss()
del big
kept = rss()
assert release_free_memory()
print(held, kept, rss())
"""


def test_release_free_memory_gives_back_what_the_kept_heap_holds():
    """With the backend's allocator policy (freed large buffers kept), a freed 512 MiB array stays
    resident until ``ruvllm.memory.release_free_memory`` (glibc's malloc_trim) hands it back: what a
    server of several models does after unloading one. In a child process: the policy is global."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", RELEASE_CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    held, kept, released = (int(x) for x in out.stdout.split())
    assert kept > held - (64 << 20)  # freeing alone returned (almost) nothing
    assert released < kept - (400 << 20)  # the trim returned the array's pages
