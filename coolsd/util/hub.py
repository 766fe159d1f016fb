"""Input files named by their Hugging Face hub id: ``hf://org/repo/path/in/repo`` (a file or a
folder of the repo; ``hf://org/repo`` is the whole repo, ``hf://org/repo@revision/path`` pins a
branch, tag or commit), resolved through ``huggingface_hub`` to the local cache in the hub's own
layout (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``).

Invariants: resolving (``local_path``) never touches the network, whatever ``HF_HUB_OFFLINE``
says: a run reads the cache or refuses before anything loads, naming the download command. Only
``fetch`` / ``listing`` (``python -m coolsd.cli.download``) reach the hub, and never while
``HF_HUB_OFFLINE`` is set. The resolved path is a file (or folder) of the cache's snapshot, so a
run's fingerprints (``coolsd.util.fingerprint``) are of the content, as for any local path.
"""
from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import NamedTuple, Optional

PREFIX = "hf://"
FORM = "hf://org/repo[@revision][/path]"


class HubFile(NamedTuple):
    """A file or folder of a hub repo: ``repo`` (org/name), ``revision`` (None: main), ``path``
    inside the repo ('' = the repo's root)."""

    repo: str
    revision: Optional[str]
    path: str

    def __str__(self) -> str:
        at = f"@{self.revision}" if self.revision else ""
        return f"{PREFIX}{self.repo}{at}" + (f"/{self.path}" if self.path else "")


def is_hub(value) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def parse(value) -> Optional[HubFile]:
    """The ``HubFile`` of an ``hf://`` value, None for any other value; a malformed id is a
    ValueError naming the expected form."""
    if not is_hub(value):
        return None
    parts = value[len(PREFIX):].strip("/").split("/")
    if len(parts) < 2 or not all(parts[:2]) or "@" in parts[0]:
        raise ValueError(f"{value} is not a hub id: expected {FORM}")
    name, _, revision = parts[1].partition("@")
    if not name or (_ and not revision):
        raise ValueError(f"{value} is not a hub id: expected {FORM}")
    return HubFile(f"{parts[0]}/{name}", revision or None, "/".join(p for p in parts[2:] if p))


def cache_dir() -> str:
    """The hub cache, read from the environment now (``huggingface_hub.constants`` reads it once,
    at import): ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else the library's default."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return constants.HF_HUB_CACHE


def offline() -> bool:
    """``HF_HUB_OFFLINE`` is set (now, or when ``huggingface_hub`` was imported)."""
    from huggingface_hub import constants

    now = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return now or constants.HF_HUB_OFFLINE


def _cached(ref: HubFile, path: str) -> Optional[Path]:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(ref.repo, path, cache_dir=cache_dir(), revision=ref.revision)
    return Path(found) if isinstance(found, str) else None


def local_path(ref: HubFile, folder: Optional[bool] = None, probe=("config.json",)) -> Optional[Path]:
    """The cached copy of ``ref`` (never the network), or None if the cache lacks it. A file
    (``folder`` False, or None and the path is a cached file) is looked up directly; a folder is
    the folder that holds its first cached ``probe`` file (names it must hold; a tuple entry: any
    one of them), or, without one, the repo's cached snapshot for the revision."""
    if folder is not True and ref.path:
        found = _cached(ref, ref.path)
        if found is not None or folder is False:
            return found
    names = [n for c in probe for n in (c if isinstance(c, tuple) else (c,)) if "*" not in n]
    for name in names:
        found = _cached(ref, f"{ref.path}/{name}" if ref.path else name)
        if found is not None:
            return found.parent
    if names:
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    # nothing to probe: the revision's snapshot folder, if the cache has one (allow_patterns=[]: the caller
    # checks the files it needs, not the library against the repo's full listing)
    try:
        root = Path(snapshot_download(ref.repo, revision=ref.revision, cache_dir=cache_dir(), local_files_only=True,
                                      allow_patterns=[]))
    except (LocalEntryNotFoundError, OSError):
        return None
    p = root / ref.path if ref.path else root
    return p if p.is_dir() else None


def listing(ref: HubFile) -> Optional[dict]:
    """{path in the repo: bytes (None: unknown)} of every file of ``ref``'s repo at its revision,
    as the hub API says; None when offline (``HF_HUB_OFFLINE``) or the hub cannot be reached."""
    if offline():
        return None
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(ref.repo, revision=ref.revision, files_metadata=True)
    except Exception:  # no network, no such repo or a gated one: the caller says what it could not learn
        return None
    return {s.rfilename: s.size for s in info.siblings or ()}


def folder_patterns(ref: HubFile, patterns, files: Optional[dict]) -> list[str]:
    """The glob patterns (in the repo) a folder ``ref`` is fetched with: each of ``patterns``
    under ``ref.path``; a tuple entry is its first alternative that matches a file of ``files``
    (the repo listing; unknown: every alternative)."""
    under = (lambda p: f"{ref.path}/{p}") if ref.path else (lambda p: p)
    out = []
    for entry in patterns:
        alts = [under(p) for p in (entry if isinstance(entry, tuple) else (entry,))]
        if files is not None and len(alts) > 1:
            alts = next(([a] for a in alts if fnmatch.filter(files, a)), alts)
        out += alts
    return out


def is_file(ref: HubFile, folder: Optional[bool], files: Optional[dict]) -> bool:
    """Whether ``ref`` names one file (else a folder): ``folder`` when known, else the repo listing,
    else a path whose last part has a suffix."""
    if folder is not None:
        return not folder and bool(ref.path)
    if files is not None:
        return ref.path in files
    return "." in ref.path.rsplit("/", 1)[-1]


def selected(files: dict, patterns: list[str]) -> dict:
    """The files of a listing that ``patterns`` select (as ``snapshot_download``'s allow_patterns)."""
    from huggingface_hub.utils import filter_repo_objects

    return {f: files[f] for f in filter_repo_objects(list(files), allow_patterns=patterns)}


def fetch(ref: HubFile, file: bool, patterns: list[str]) -> Path:
    """Download ``ref`` into the cache (a file, or a folder's ``patterns``) and return its local path."""
    from huggingface_hub import hf_hub_download, snapshot_download

    if file:
        return Path(hf_hub_download(ref.repo, ref.path, revision=ref.revision, cache_dir=cache_dir()))
    root = Path(snapshot_download(ref.repo, revision=ref.revision, cache_dir=cache_dir(), allow_patterns=patterns))
    return root / ref.path if ref.path else root


def snapshot_repo_name(path) -> Optional[str]:
    """The repo's name (``flan-t5-xl``) when ``path`` is a snapshot root of the hub cache
    (``models--google--flan-t5-xl/snapshots/<commit>``), else None: a cached folder is named by its
    repo, as a downloaded copy would be, not by its commit."""
    p = Path(os.fspath(path))
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name.split("--")[-1]
    return None
