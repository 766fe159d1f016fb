"""Toy weight files: safetensors with a ``format`` tag and a JSON ``config`` in the metadata,
written atomically; every read error names the file and how to rebuild it."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from coolsd.util.loading import BadInputFile, MissingInputFile
from coolsd.util.fingerprint import file_sha256

REBUILD = "run `make toy-assets` to rebuild it"


def check_checksums(folder, manifest: str, files, what: str, rebuild: str) -> dict:
    """The manifest of a folder of toy weights, after checking that every one of ``files`` is
    there with the sha256 the manifest records: a missing, truncated or altered file is one error
    naming it and the rebuild command (``MissingInputFile`` / ``BadInputFile``: one line, exit
    status 2), before anything is loaded (the job's checks call it before any folder is made)."""
    folder = Path(folder)
    path = folder / manifest
    if not path.is_file():
        raise MissingInputFile(f"{what} manifest {path} not found; {rebuild}")
    try:
        recorded = json.loads(path.read_text())
        sums = recorded["sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise BadInputFile(f"{what} manifest {path} is unreadable ({type(e).__name__}); {rebuild}") from e
    for name in files:
        f = folder / name
        if not f.is_file():
            raise MissingInputFile(f"{what} {f} not found; {rebuild}")
        if file_sha256(f) != sums.get(name):  # cached while the file is unchanged: the checks and the load hash once
            raise BadInputFile(f"{what} {f} are corrupted (sha256 differs from {manifest}); {rebuild}")
    return recorded


def save_weights(path, tensors: dict, fmt: str, config_json: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={"format": fmt, "config": config_json})
    tmp.replace(path)


def read_weights(path, fmt: str, what: str = "toy weights", rebuild: str = REBUILD) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict, config JSON) of a file written by ``save_weights`` with this ``fmt``."""
    path = Path(path)
    if not path.is_file():
        raise MissingInputFile(f"{what} {path} not found; {rebuild}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise BadInputFile(f"{what} {path} are unreadable ({' '.join(str(e).split())}); {rebuild}") from e
    if meta.get("format") != fmt or "config" not in meta:
        raise BadInputFile(f"{what} {path} are not a {fmt} file with a config; {rebuild}")
    return sd, meta["config"]
