"""Per-sample records: a PNG and a JSON line per generated sample.

Invariant: a record line is appended (and fsynced) only after its PNG is on disk, so every
record points to a complete image; readers tolerate a truncated last line (a run killed
mid-write) and ignore it.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import numpy as np
from PIL import Image


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
        """Write the PNG (atomically), then append the record's line: a record never points to a
        missing image. A full disk is an error saying so (the run resumes once there is space)."""
        try:
            if image is not None:
                rel = Path("images") / image_name
                save_png_atomic(image, self.dir / rel)
                record = {**record, "image": str(rel)}
            with open(self.path, "a") as f:
                f.write(json.dumps(record, default=float) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(e.errno, f"out of disk space writing to {self.dir} ({e.strerror}); free space or "
                                       "move the run folder, then run the same command again: it resumes") from e
            raise
        return record


def resume_records(run_dir: Path, name: str = "samples.jsonl") -> list[dict]:
    """The complete records of an interrupted run, after dropping a truncated last line from
    the file (so later appends start on a fresh line). Every record's image must exist and
    decode: a folder whose images do not match its records is an error, never silently
    regenerated over."""
    run_dir = Path(run_dir)
    path = run_dir / name
    records = read_records(path)
    if path.exists():
        text = path.read_text()
        if text and not text.endswith("\n"):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r, default=float) + "\n" for r in records))
            os.replace(tmp, path)
    for r in records:
        if "image" not in r:
            continue
        img = run_dir / r["image"]
        try:
            with Image.open(img) as im:
                im.load()
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{path}: record (method {r.get('method')!r}, prompt {r.get('prompt_index')}) points to "
                f"{img}, which is missing or unreadable ({e}); the images folder does not match its records. "
                "Use a new output folder or restore the images.") from None
    return records


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


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def identity_diff(a: dict, b: dict) -> list[str]:
    """The flattened keys whose values differ between two run identities, sorted."""
    fa, fb = _flatten(a), _flatten(b)
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k, "<absent>") != fb.get(k, "<absent>"))


def claim_run_dir(run_dir: Path, identity: dict, name: str = "run.json") -> bool:
    """Bind a run folder to the configuration that fills it. A new folder gets ``run.json``;
    a folder that has one must hold the same identity (then the run resumes: returns True),
    otherwise it is an error naming the keys that differ, and nothing in it is touched."""
    path = Path(run_dir) / name
    ident = json.loads(json.dumps(identity, default=float))
    if path.exists():
        old = json.loads(path.read_text())
        if old != ident:
            a, b = _flatten(old), _flatten(ident)
            diff = identity_diff(old, ident)
            shown = ", ".join(f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in diff[:8])
            raise ValueError(
                f"{run_dir} holds a run of another configuration ({shown}); "
                "use a new output folder (nothing was overwritten)")
        return True
    write_json_atomic(ident, path)
    return False
