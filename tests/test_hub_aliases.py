"""The seed CLI's model aliases and quantization names (issue 20): ``ruvllm download NAME
--quantization q4k|q8|f16|none`` picks that file from the repository's file list, resumes an
interrupted download, and ``--quantization`` on generate/chat/serve picks among downloaded files.

No network here: offline resolution runs on a huggingface_hub cache laid out by the test as the
library lays it out (``blobs/<sha256>``, ``snapshots/<commit>/<file>`` links, ``refs/main``), and
downloads run against a local server speaking the Hub's file-list and file endpoints
(``tests/_fake_hub.py``, ``HF_ENDPOINT`` pointed at it)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _fake_hub import FakeHub
from _gguf_files import write_tiny_llama_gguf

from ruvllm.errors import ModelNotFoundError
from ruvllm.hub import FILE_QUANTIZATIONS, LOAD_FORMS, PREFERENCE, available, pick_files, repo_of
from ruvllm.resolve import (
    ALIASES,
    HUB_ALIASES,
    file_form,
    hub_cache_dir,
    list_models,
    resolve,
    select,
    user_cache_dir,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"

#: File names as GGUF repositories name them, with decoys each rule must pass over.
GGUF_FILES = {
    "q4k": "{m}-Q4_K_M.gguf",
    "q8": "{m}-Q8_0.gguf",
    "f16": "{m}-f16.gguf",
}
DECOYS = (
    "{m}-Q4_K_S.gguf",
    "{m}-Q5_K_M.gguf",
    "{m}-IQ4_XS.gguf",
    "{m}-Q8_0_L.gguf",
    "{m}-f32/{m}-f32-00001-of-00002.gguf",
)


def _put(cache: Path, repo_id: str, filename: str, data: bytes) -> Path:
    """One file in huggingface_hub's cache layout: the blob named by its sha256, a relative link from
    the snapshot, ``refs/main`` naming the commit."""
    repo = hub_cache_dir(cache) / ("models--" + repo_id.replace("/", "--"))
    blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    link = repo / "snapshots" / COMMIT / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    return link


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf").read_bytes()


def test_the_seed_aliases_name_the_seed_models():
    seed = {
        "qwen": "Qwen/Qwen2.5-7B-Instruct",
        "mistral": "mistralai/Mistral-7B-Instruct-v0.3",
        "phi": "microsoft/Phi-3-medium-4k-instruct",
        "llama": "meta-llama/Meta-Llama-3.1-8B-Instruct",
    }
    for name, hub_id in seed.items():
        assert HUB_ALIASES[name].hub_id == hub_id
    assert {"smollm2", "gemma3"} <= set(ALIASES) and not set(HUB_ALIASES) & set(ALIASES)
    for a in [*HUB_ALIASES.values(), *ALIASES.values()]:
        org, name = (a.hub_id or "").split("/")
        assert org and name
    for a in HUB_ALIASES.values():
        assert repo_of(a, "none") == a.hub_id and repo_of(a, "q4k") == a.gguf_repo.rstrip("/")
    assert PREFERENCE[0] == "q4k" and set(PREFERENCE) == set(FILE_QUANTIZATIONS)


def test_each_rule_picks_its_file_from_a_repository_listing():
    m = "Model-7B-Instruct"
    listing = [f.format(m=m) for f in [*GGUF_FILES.values(), *DECOYS]] + ["README.md", ".gitattributes"]
    for q, name in GGUF_FILES.items():
        assert pick_files(q, listing, "repo") == [name.format(m=m)]
    assert available(listing) == ["q4k", "q8", "f16"]
    with pytest.raises(ModelNotFoundError, match="no safetensors model"):
        pick_files("none", listing, "repo")
    hf = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
          "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "README.md",
          "original/consolidated.00.pth", "original/params.json", "consolidated.safetensors"]  # fmt: skip
    got = pick_files("none", hf, "repo")
    assert set(got) == set(hf) - {"README.md", "original/consolidated.00.pth", "original/params.json",
                                  "consolidated.safetensors"}  # fmt: skip
    # Only split files of a kind: refused by name, not half-downloaded.
    with pytest.raises(ModelNotFoundError, match="split GGUF"):
        pick_files("f16", [f"{m}-f16/{m}-f16-00001-of-00002.gguf", f"{m}-f16/{m}-f16-00002-of-00002.gguf"], "r")
    with pytest.raises(ModelNotFoundError, match=r"no Q8_0 GGUF file for 'q8' \(it has: q4k\)"):
        pick_files("q8", [f"{m}-Q4_K_M.gguf"], "r")


@pytest.mark.parametrize("name", sorted(HUB_ALIASES))
def test_every_alias_and_quantization_resolves_offline(name, tmp_path, tiny_gguf):
    alias = HUB_ALIASES[name]
    # Nothing cached: one line naming the command that fetches it, for the default and each kind.
    with pytest.raises(ModelNotFoundError, match=rf"not downloaded .* run `ruvllm download {name}` while online"):
        resolve(name, cache=tmp_path)
    for q in PREFERENCE:
        with pytest.raises(ModelNotFoundError, match=rf"run `ruvllm download {name} --quantization {q}`") as e:
            resolve(name, cache=tmp_path, quantization=q)
        assert "\n" not in str(e.value) and repo_of(alias, q) in str(e.value)

    m = alias.gguf_repo.split("/")[1].removesuffix("-GGUF")
    expected: dict[str, Path] = {}
    for q, pattern in GGUF_FILES.items():
        expected[q] = _put(tmp_path, alias.gguf_repo, pattern.format(m=m), tiny_gguf + q.encode())
    for decoy in DECOYS:
        _put(tmp_path, alias.gguf_repo, decoy.format(m=m), b"decoy " + decoy.encode())
    for f in ("model.safetensors", "tokenizer.json"):
        _put(tmp_path, alias.hub_id, f, f.encode())
    expected["none"] = _put(tmp_path, alias.hub_id, "config.json", b"{}").parent

    for q in PREFERENCE:
        assert resolve(name, cache=tmp_path, quantization=q) == expected[q]
        path, form = select(name, q, tmp_path)
        assert path == expected[q] and form == LOAD_FORMS[q]
    assert resolve(name, cache=tmp_path) == expected["q4k"]  # the seed's default first
    assert select(name, "w8a8", tmp_path) == (expected["q4k"], "w8a8")  # a load form: on the preferred file
    listed = {x.name: x for x in list_models(tmp_path)}[name]
    assert listed.downloaded and listed.quantizations == PREFERENCE and listed.hub_id == alias.hub_id
    assert listed.size_bytes == sum(
        p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.iterdir()) for p in expected.values()
    )


def test_a_cached_repo_id_picks_by_quantization_too(tmp_path, tiny_gguf):
    repo = "someorg/Some-Model-GGUF"
    with pytest.raises(ModelNotFoundError, match=rf"run `ruvllm download {repo} --quantization q8`"):
        resolve(repo, cache=tmp_path, quantization="q8")
    q8 = _put(tmp_path, repo, "Some-Model-Q8_0.gguf", tiny_gguf)
    assert resolve(repo, cache=tmp_path) == q8
    with pytest.raises(ModelNotFoundError, match=rf"no Q4_K_M GGUF .*run `ruvllm download {repo} --quantization q4k`"):
        resolve(repo, cache=tmp_path, quantization="q4k")
    q4k = _put(tmp_path, repo, "Some-Model-Q4_K_M.gguf", tiny_gguf + b"x")
    assert resolve(repo, cache=tmp_path) == q4k
    assert select(repo, "q8", tmp_path) == (q8, "auto")
    listed = {x.name: x for x in list_models(tmp_path)}[repo]
    assert listed.quantizations == ("q4k", "q8")


def test_a_quantization_picks_the_file_that_loads(tmp_path):
    """``--quantization q8`` on an alias loads its Q8_0 file (here: a tiny model whose other files are
    of another shape) in the file's own form."""
    from ruvllm.runtime import load_model

    alias = HUB_ALIASES["qwen-0.5b"]
    for q, layers in (("q4k", 1), ("q8", 2)):
        gguf = write_tiny_llama_gguf(tmp_path / f"{q}.gguf", layers=layers)
        _put(tmp_path, alias.gguf_repo, f"Qwen2.5-0.5B-Instruct-{FILE_QUANTIZATIONS[q]}.gguf", gguf.read_bytes())
    # candle-compat loads "none" and "auto" only: q8 reached it as "auto" (the file's own form), which it
    # resolves to float weights; a load form "q8" would have been refused.
    llm = load_model("qwen-0.5b", backend="candle-compat", cache_dir=str(tmp_path), quantization="q8")
    assert llm.config.num_layers == 2 and llm.options.quantization == "none"
    llm = load_model("qwen-0.5b", backend="candle-compat", cache_dir=str(tmp_path))
    assert llm.config.num_layers == 1  # none given: the seed's default, q4k
    with pytest.raises(ModelNotFoundError, match=r"run `ruvllm download qwen-0\.5b --quantization f16`"):
        load_model("qwen-0.5b", backend="candle-compat", cache_dir=str(tmp_path), quantization="f16")


def test_picking_a_file_of_one_file_is_refused(tmp_path):
    gguf = write_tiny_llama_gguf(tmp_path / "one.gguf")
    for ref in (str(gguf), "smollm2"):
        with pytest.raises(ModelNotFoundError, match="is one model file: quantization 'q8' picks among the files"):
            resolve(ref, cache=tmp_path, quantization="q8")
    assert select(str(gguf), "q8", tmp_path) == (gguf, "q8")  # as a load form it applies


def test_the_seeds_names_on_one_file_are_checked_against_it(tmp_path):
    from ruvllm.checkpoint import open_checkpoint

    q4k = open_checkpoint(write_tiny_llama_gguf(tmp_path / "k.gguf", weight_type="Q4_K"))
    f16 = open_checkpoint(write_tiny_llama_gguf(tmp_path / "h.gguf", weight_type="F16"))
    f32 = open_checkpoint(write_tiny_llama_gguf(tmp_path / "f.gguf"))
    assert file_form(q4k, "q4k") == "auto" and file_form(f16, "f16") == "none"
    assert file_form(f32, "w8a8") == "w8a8" and file_form(f32, "q8") == "q8"  # load forms pass
    with pytest.raises(ModelNotFoundError, match=r"--quantization q4k picks a Q4_K_M file, and .* holds F32"):
        file_form(f32, "q4k")
    with pytest.raises(ModelNotFoundError, match=r"--quantization f16 picks an F16 file, and .* holds Q4_K"):
        file_form(q4k, "f16")


def test_the_cache_directory_is_the_seeds_on_each_platform(monkeypatch, tmp_path):
    import platformdirs.macos
    import platformdirs.unix
    import platformdirs.windows

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir(platformdirs.unix.Unix) == tmp_path / "xdg" / "ruvllm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert user_cache_dir(platformdirs.unix.Unix) == Path("~/.cache/ruvllm").expanduser()
    assert user_cache_dir(platformdirs.macos.MacOS) == Path("~/Library/Caches/ruvllm").expanduser()
    monkeypatch.setattr(platformdirs.windows, "get_win_folder", lambda csidl: "/LocalAppData")
    assert user_cache_dir(platformdirs.windows.Windows) == Path("/LocalAppData/ruvllm")


def test_nothing_cached_is_one_line_from_the_cli(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RUVLLM_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "ruvllm", "generate", "mistral", "hi", "--quantization", "f16"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "run `ruvllm download mistral --quantization f16`" in line
    proc = subprocess.run(
        [sys.executable, "-m", "ruvllm", "download", "qwen3", "--quantization", "q8"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert HUB_ALIASES["qwen3"].gguf_repo in proc.stderr and "offline" in proc.stderr


# -- downloads, against a local Hub ---------------------------------------------------------------------


@pytest.fixture
def fake_hub(tmp_path, tiny_gguf):
    alias = HUB_ALIASES["qwen-0.5b"]
    big = write_tiny_llama_gguf(tmp_path / "big.gguf", hidden=512, layers=2).read_bytes()
    assert len(big) > 12 * 2**20  # above huggingface_hub's 10 MiB write chunk, so a stall leaves bytes behind
    gguf_repo = {
        "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf": tiny_gguf,
        "Qwen2.5-0.5B-Instruct-Q8_0.gguf": big,
        "Qwen2.5-0.5B-Instruct-f16.gguf": tiny_gguf + b"f16",
        "Qwen2.5-0.5B-Instruct-Q5_K_M.gguf": b"not this one",
        "README.md": b"# readme",
    }
    hf_repo = {"config.json": b"{}", "model.safetensors": b"weights", "tokenizer.json": b"{}", "README.md": b"#"}
    hub = FakeHub({alias.gguf_repo: gguf_repo, alias.hub_id: hf_repo}).start()
    yield hub
    hub.stop()


def _env(hub: FakeHub, cache: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_ENDPOINT": hub.url, "RUVLLM_CACHE_DIR": str(cache), "HF_HUB_DISABLE_XET": "1", **more}


_DOWNLOAD = "import sys; from ruvllm.hub import download; print(download(sys.argv[1], quantization=sys.argv[2]))"


def test_download_fetches_the_file_of_each_quantization(fake_hub, tmp_path):
    cache = tmp_path / "cache"
    repos = fake_hub.repos
    alias = HUB_ALIASES["qwen-0.5b"]
    for q in PREFERENCE:
        proc = subprocess.run(
            [sys.executable, "-c", _DOWNLOAD, "qwen-0.5b", q], capture_output=True, text=True,
            env=_env(fake_hub, cache), timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        got = Path(proc.stdout.strip())
        if q == "none":
            assert {p.name for p in got.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json"}
            assert (got / "model.safetensors").read_bytes() == repos[alias.hub_id]["model.safetensors"]
        else:
            assert got.read_bytes() == repos[alias.gguf_repo][got.name] and FILE_QUANTIZATIONS[q] in got.name.upper()
    snap = next((hub_cache_dir(cache) / ("models--" + alias.gguf_repo.replace("/", "--")) / "snapshots").iterdir())
    assert sorted(p.name for p in snap.iterdir()) == sorted(
        ["Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", "Qwen2.5-0.5B-Instruct-Q8_0.gguf", "Qwen2.5-0.5B-Instruct-f16.gguf"]
    )  # nothing else of the repository
    # Offline now: every kind resolves from the cache, and the CLI lists them.
    for q in PREFERENCE:
        assert resolve("qwen-0.5b", cache=cache, quantization=q).exists()
    proc = subprocess.run(
        [sys.executable, "-m", "ruvllm", "list", "--downloaded"], capture_output=True, text=True,
        env=_env(fake_hub, cache, HF_HUB_OFFLINE="1"), timeout=120,
    )  # fmt: skip
    row = next(line for line in proc.stdout.splitlines() if " qwen-0.5b " in line)
    assert "q4k, q8, f16, none" in row and alias.hub_id in row and "MiB" in row


def test_an_interrupted_download_resumes(fake_hub, tmp_path):
    alias = HUB_ALIASES["qwen-0.5b"]
    name = "Qwen2.5-0.5B-Instruct-Q8_0.gguf"
    data = fake_hub.repos[alias.gguf_repo][name]
    cache = tmp_path / "cache"
    fake_hub.stall_after[name] = 12 * 2**20
    proc = subprocess.Popen(
        [sys.executable, "-m", "ruvllm", "download", "qwen-0.5b", "--quantization", "q8"],
        env=_env(fake_hub, cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    blobs = hub_cache_dir(cache) / ("models--" + alias.gguf_repo.replace("/", "--")) / "blobs"
    deadline = time.monotonic() + 120
    part = None
    while time.monotonic() < deadline and proc.poll() is None:
        parts = list(blobs.glob("*.ruvllm-part")) if blobs.is_dir() else []
        if parts and parts[0].stat().st_size >= 10 * 2**20:
            part = parts[0]
            break
        time.sleep(0.1)
    assert part is not None, "the download never wrote its first 10 MiB"
    proc.send_signal(signal.SIGKILL)  # as a killed terminal or a lost machine leaves it
    proc.wait(30)
    fake_hub.release()
    fake_hub.stall_after[name] = None
    kept = part.stat().st_size
    assert 0 < kept < len(data)

    fake_hub.requests.clear()
    proc2 = subprocess.run(
        [sys.executable, "-m", "ruvllm", "download", "qwen-0.5b", "--quantization", "q8"],
        env=_env(fake_hub, cache), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc2.returncode == 0, proc2.stderr
    gets = [r for r in fake_hub.requests if r[0] == "GET" and r[1].endswith(name)]
    assert [r[2] for r in gets] == [f"bytes={kept}-"]  # only the rest was asked for
    path = Path(proc2.stdout.strip().splitlines()[-1])
    assert path.read_bytes() == data and not part.exists()
    assert resolve("qwen-0.5b", cache=cache, quantization="q8") == path


def test_a_corrupt_transfer_is_refused_and_removed(fake_hub, tmp_path):
    """A partial file that is not a prefix of the real one (the Hub's sha256 disagrees): refused in one
    line, removed, and the next download is whole."""
    alias = HUB_ALIASES["qwen-0.5b"]
    name = "Qwen2.5-0.5B-Instruct-f16.gguf"
    data = fake_hub.repos[alias.gguf_repo][name]
    cache = tmp_path / "cache"
    blobs = hub_cache_dir(cache) / ("models--" + alias.gguf_repo.replace("/", "--")) / "blobs"
    blobs.mkdir(parents=True)
    bad = blobs / (hashlib.sha256(data).hexdigest() + ".ruvllm-part")
    bad.write_bytes(b"\0" * (len(data) // 2))
    proc = subprocess.run(
        [sys.executable, "-c", _DOWNLOAD, "qwen-0.5b", "f16"], capture_output=True, text=True,
        env=_env(fake_hub, cache), timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "sha256" in proc.stderr and not bad.exists()
    proc = subprocess.run(
        [sys.executable, "-c", _DOWNLOAD, "qwen-0.5b", "f16"], capture_output=True, text=True,
        env=_env(fake_hub, cache), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).read_bytes() == data


def test_info_before_download_reads_the_hubs_file_list(fake_hub, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ruvllm", "info", "qwen-0.5b"], capture_output=True, text=True,
        env=_env(fake_hub, tmp_path), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "downloaded                 no:" in out
    assert "Qwen2.5-0.5B-Instruct-Q8_0.gguf" in out and "Qwen/Qwen2.5-0.5B-Instruct/model.safetensors" in out
    proc = subprocess.run(
        [sys.executable, "-m", "ruvllm", "info", "qwen-0.5b"], capture_output=True, text=True,
        env=_env(fake_hub, tmp_path, HF_HUB_OFFLINE="1"), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "not downloaded" in proc.stdout and "offline mode" in proc.stdout


def test_a_repo_that_is_no_model_downloads_its_files(tmp_path):
    """A PEFT adapter's repository (no GGUF, no config.json): its JSON and safetensors come down, as
    ``--lora org/name`` then finds them."""
    repo = "someorg/some-lora"
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"w", "README.md": b"#", "x/y.bin": b"0"}
    hub = FakeHub({repo: files}).start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ruvllm", "download", repo], capture_output=True, text=True,
            env=_env(hub, tmp_path), timeout=120,
        )  # fmt: skip
    finally:
        hub.stop()
    assert proc.returncode == 0, proc.stderr
    snap = Path(proc.stdout.strip().splitlines()[-1])
    assert sorted(p.name for p in snap.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert resolve(repo, cache=tmp_path) == snap
