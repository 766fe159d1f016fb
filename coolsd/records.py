"""Per-sample records: a PNG and a JSON line per generated sample.

Invariant: a record line is appended (and fsynced) only after its PNG is on disk, so every
record points to a complete image; readers tolerate a truncated last line (a run killed
mid-write) and ignore it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from PIL import Image


def save_png_atomic(image: np.ndarray, path: Path) -> None:
    """(H, W, 3) uint8 -> PNG, written to a temporary name then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    Image.fromarray(image).save(tmp, format="PNG")
    os.replace(tmp, path)


def write_json_atomic(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=float))
    os.replace(tmp, path)


class RecordWriter:
    def __init__(self, run_dir: Path, name: str = "samples.jsonl"):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / name

    def append(self, record: dict, image: np.ndarray | None = None, image_name: str | None = None) -> dict:
        if image is not None:
            rel = Path("images") / image_name
            save_png_atomic(image, self.dir / rel)
            record = {**record, "image": str(rel)}
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return record


def read_records(path: Path) -> list[dict]:
    """All complete records; a truncated last line is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # the run died while writing its last line
            raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
    return out
