"""What every real world does with the local files a user provides: name the missing ones
(with where each comes from) before any work, and identify the ones a run used."""
from __future__ import annotations

import os
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def missing_paths(files: dict, sources: dict, prefix: str = "target.files") -> list[str]:
    """'name: not set / path does not exist -- source' for each entry of ``files`` that is unusable."""
    out = []
    for name, path in files.items():
        if path in (None, "", "null"):
            out.append(f"{name}: not set (set {prefix}.{name} or its environment variable) -- {sources.get(name, '')}")
        elif not Path(os.fspath(path)).exists():
            out.append(f"{name}: {path} does not exist -- {sources.get(name, '')}")
    return out


def file_identity(path) -> dict:
    p = Path(os.fspath(path))
    return {"name": p.name, "bytes": p.stat().st_size if p.is_file() else None}


def require_files(target: str, missing: list[str]) -> None:
    """Stop before any work when files are missing, listing every one of them."""
    if missing:
        raise FileNotFoundError(f"target {target!r} cannot run: missing files\n  " + "\n  ".join(missing))
