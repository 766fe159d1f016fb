"""Toy weight files: safetensors with a ``format`` tag and a JSON ``config`` in the metadata,
written atomically; every read error names the file and how to rebuild it."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

REBUILD = "run `make toy-assets` to rebuild it"


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
        raise FileNotFoundError(f"{what} {path} not found; {rebuild}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise ValueError(f"{what} {path} are unreadable ({' '.join(str(e).split())}); {rebuild}") from e
    if meta.get("format") != fmt or "config" not in meta:
        raise ValueError(f"{what} {path} are not a {fmt} file with a config; {rebuild}")
    return sd, meta["config"]
