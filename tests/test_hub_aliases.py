"""The seed CLI's Hub aliases (llama, qwen, qwen3, mistral, phi): one GGUF file of a Hugging Face
repository each, fetched by ``ruvllm download NAME`` and resolved offline from ruvllm's cache.

No network here: the cache is laid out by the test as huggingface_hub lays it out (``refs/main`` ->
``snapshots/<commit>/<file>``), holding a tiny random-weight GGUF under the alias's file name."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _gguf_files import write_tiny_llama_gguf

from ruvllm.errors import ModelNotFoundError
from ruvllm.resolve import ALIASES, HUB_ALIASES, download, hub_cache_dir, list_models, resolve


def _cache_file(cache: Path, repo_id: str, filename: str) -> Path:
    repo = hub_cache_dir(cache) / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    return write_tiny_llama_gguf(snap / filename)


def test_every_hub_alias_names_a_repo_and_a_gguf_pattern():
    assert set(HUB_ALIASES) == {"llama", "qwen", "qwen3", "mistral", "phi"}
    assert not set(HUB_ALIASES) & set(ALIASES)
    for a in HUB_ALIASES.values():
        org, name = a.repo_id.split("/")
        assert org and name and a.pattern.endswith(".gguf")


def test_a_hub_alias_resolves_from_the_cache_and_loads(tmp_path):
    alias = HUB_ALIASES["qwen"]
    with pytest.raises(ModelNotFoundError, match="run `ruvllm download qwen`"):
        resolve("qwen", cache=tmp_path)
    listed = {m.name: m for m in list_models(tmp_path)}
    assert not listed["qwen"].downloaded and "ruvllm download qwen" in listed["qwen"].description

    filename = "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf"
    assert fnmatch.fnmatch(filename, alias.pattern)
    path = _cache_file(tmp_path, alias.repo_id, filename)
    assert resolve("qwen", cache=tmp_path) == path
    assert {m.name: m for m in list_models(tmp_path)}["qwen"].path == path

    from ruvllm.runtime import load_model

    llm = load_model("qwen", backend="candle-compat", cache_dir=str(tmp_path))
    assert llm.config.num_layers == 1


def test_downloading_an_alias_offline_names_its_repository(tmp_path):
    """Offline, ``ruvllm download qwen3`` fails in one line that names the repository it would fetch."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RUVLLM_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "ruvllm", "download", "qwen3"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode != 0
    assert HUB_ALIASES["qwen3"].repo_id in proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(ModelNotFoundError, match="not a Hugging Face repo id"):
        download("no-such-alias", cache=tmp_path)
