"""Content fingerprints of the weight and data files a run reads (``run.json``'s ``world`` entry).

A file's fingerprint is its name, its byte count and the sha256 of its whole content; a folder's
(the FLAN-T5 folder, an EAGLE drafter folder, Lumina-mGPT's model folder) is the sha256 over the
sorted (relative path, sha256) pairs of every file in it, hidden files and folders (``.cache``,
``.git``) excepted. Paths are not part of a fingerprint: a run folder resumes on a machine that
keeps the same files elsewhere, and refuses one whose files differ in content, same name and
size included.

Invariant: a cached digest is reused only while the file's resolved path, device, inode, size,
mtime_ns and ctime_ns are all unchanged. Replacing a file (a copy, a rename over it, an edit in
place, ``cp -p`` or ``touch -r`` restoring the old mtime) changes its inode or its ctime, which
no user-space tool can set back, so a stale digest is never used. The cache is one small JSON per
file in ``$COOLSD_CACHE_DIR`` (default ``$XDG_CACHE_HOME/coolsd`` or ``~/.cache/coolsd``), under
``fingerprints/``; where it cannot be written the digest is computed every time (slower, never
wrong).

``code_commit``: the git commit (and whether tracked files differ from it) of the code a
benchmark's results measured.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from coolsd.util.hub import snapshot_repo_name
from coolsd.util.records import sha256_file, write_json_atomic

ANNOUNCE_BYTES = 1 << 30  # hashing a file this large takes seconds: say so


def cache_root() -> Path:
    """Where cached digests live (``$COOLSD_CACHE_DIR``, else the XDG user cache)."""
    if os.environ.get("COOLSD_CACHE_DIR"):
        return Path(os.environ["COOLSD_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "coolsd"


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path), "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def file_sha256(path) -> str:
    """The sha256 of a file's content, from the cache while the file is unchanged (module doc)."""
    path = Path(os.fspath(path)).resolve()
    key = _stat_key(path)
    entry = cache_root() / "fingerprints" / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")
    try:
        cached = json.loads(entry.read_text())
        if {k: cached.get(k) for k in key} == key and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError):
        pass
    if key["size"] >= ANNOUNCE_BYTES:
        print(f"fingerprinting {path} ({key['size'] / 2**30:.1f} GiB; once, cached in {entry.parent})", flush=True)
    digest = sha256_file(path)
    if _stat_key(path) != key:  # changed while being read: do not cache a digest of a moving file
        return digest
    try:
        write_json_atomic({**key, "sha256": digest}, entry)
    except OSError:
        pass  # a read-only cache: computed again next time
    return digest


def _folder_files(folder: Path) -> list[Path]:
    out = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [Path(root) / f for f in sorted(files) if not f.startswith(".")]
    return sorted(out, key=lambda p: p.relative_to(folder).as_posix())


def fingerprint(path) -> dict:
    """``{"name", "bytes", "sha256"}`` of a file, or of a folder (then also ``"files"``, its file
    count); a path that does not exist gets ``bytes`` and ``sha256`` None."""
    p = Path(os.fspath(path))
    if p.is_file():
        return {"name": p.name, "bytes": p.stat().st_size, "sha256": file_sha256(p)}
    if p.is_dir():
        files = _folder_files(p)
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f.relative_to(p).as_posix()}\0{file_sha256(f)}\n".encode())
        return {"name": p.name, "bytes": sum(f.stat().st_size for f in files), "files": len(files),
                "sha256": h.hexdigest()}
    return {"name": p.name, "bytes": None, "sha256": None}


def code_commit(root) -> "str | None":
    """The git commit of the checkout at ``root``, with ``+dirty`` when tracked files differ from
    it (untracked files do not count); None outside a git checkout or without git: what a
    benchmark's results name as the code they measured."""
    import subprocess

    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("+dirty" if dirty else "")) if sha else None


def file_identity(path) -> dict:
    """A loaded file's (or folder's) identity in ``run.json``: name, bytes and content sha256
    (``coolsd.util.fingerprint``: cached while the file is unchanged; never fooled by a same-size
    replacement). A hub cache snapshot folder is named by its repo (``flan-t5-xl``), not its commit."""

    fp = fingerprint(path)
    repo = snapshot_repo_name(path)
    return {**fp, "name": repo} if repo else fp
