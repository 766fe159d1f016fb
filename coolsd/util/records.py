"""Per-sample records: a PNG and a JSON line per generated sample; the run folder's lock and
identity.

Invariants: a record line is appended (and fsynced) only after its PNG is on disk, so every
record points to a complete image; readers tolerate a truncated last line (a run killed
mid-write) and ignore it. One process at a time writes a record file: it holds an exclusive
``flock`` on ``<record file>.lock`` (``RunLock``) while it resumes and appends, so two identical
runs (or a requeued SLURM task and its predecessor) never both append; the kernel drops the lock
when its process dies, kill -9 included, so a stale lock cannot block. ``run.json`` binds the
folder to one configuration, its input files' content fingerprints included (``claim_run_dir``).

Test aid (never set in a real run): ``$COOLSD_TEST_HOLD_FILE`` names a file; while it exists, a
writer waits after each record it has made durable (``RecordWriter.append``), so that a test can
kill or requeue a run at a known record count (tests/job/test_slurm.py) instead of racing it.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from PIL import Image

from coolsd.util.errors import ConfigError, InputError, shorten
from coolsd.util.loading import BadInputFile, one_line


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


_UMASK = os.umask(0o022)
os.umask(_UMASK)


def _write_temp(text: str, path: Path) -> Path:
    """``text`` in a new temporary file beside ``path`` (a unique name: concurrent writers never share one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0600 -> what open() would have given
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(tmp)


def write_json_atomic(obj, path: Path) -> None:
    os.replace(_write_temp(json.dumps(obj, indent=2, default=float), path), path)


def write_text_atomic(text: str, path: Path) -> None:
    os.replace(_write_temp(text, path), path)


PROBE_GRACE_S = 1.0  # a probe (RunLock.held_by) holds a free lock for microseconds: never refuse a run for that


class RunFolderLocked(InputError, RuntimeError):
    """Another live process holds the record file this run would write."""


class RunLock:
    """Exclusive lock on one record file of a run folder: ``flock`` on ``<dir>/<name>.lock``,
    whose content names the holder (host, pid, start time, command). ``wait`` seconds: how long
    to wait for a holder to finish (0: refuse at once). The lock dies with its process, so a
    lock file left by a killed run is taken over (its stale holder line is overwritten)."""

    def __init__(self, run_dir: Path, name: str = "samples.jsonl", wait: float = 0.0, config: str | None = None):
        self.path = Path(run_dir) / (name + ".lock")
        self.wait, self._fd = float(wait), None
        self.config = config  # a digest of the holder's configuration: a refusal's advice depends on it

    def _holder_config(self) -> str | None:
        try:
            return json.loads(self.path.read_text()).get("config")
        except (OSError, ValueError, AttributeError):
            return None

    @staticmethod
    def holder(path: Path) -> str:
        try:
            h = json.loads(path.read_text())
            return f"host {h['host']}, pid {h['pid']}, since {h['started']} ({h['command']})"
        except (OSError, ValueError, KeyError, TypeError):
            return "a process that has not written its name yet"

    @classmethod
    def held_by(cls, run_dir: Path, name: str = "samples.jsonl") -> str | None:
        """The holder of this record file's lock, None if it is free; writes nothing."""
        path = Path(run_dir) / (name + ".lock")
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return cls.holder(path)
        finally:
            os.close(fd)  # closing drops a lock this probe took
        return None

    def refuse_if_held(self) -> None:
        """Fail fast (before a run loads its models) if the lock is held and this run would not wait."""
        if self.wait <= 0 and (who := self.held_by(self.path.parent, self.path.name[:-5])) is not None:
            raise self._refusal(who)

    def _refusal(self, who: str) -> RunFolderLocked:
        """Waiting helps only a run of the holder's configuration (it then resumes); a run of another
        configuration can never use this folder, so it is told to choose another."""
        theirs = self._holder_config()
        if self.config is not None and theirs is not None and theirs != self.config:
            return RunFolderLocked(f"{self.path.parent}: {self.path.name[:-5]} is being written by {who}, a run of "
                                   "another configuration: this folder will hold that run only; use another output "
                                   "folder")
        return RunFolderLocked(f"{self.path.parent}: {self.path.name[:-5]} is being written by {who}; two runs never "
                               "write one record file: wait for it to finish (a rerun then resumes) or use another "
                               "output folder (or set $COOLSD_LOCK_WAIT to wait that many seconds)")

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's line stays readable
        deadline = time.monotonic() + max(self.wait, PROBE_GRACE_S)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise self._refusal(self.holder(self.path)) from None
                time.sleep(min(0.5, max(0.01, deadline - time.monotonic())))
        started = datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started,
                                  "command": " ".join(sys.argv)[:300], "config": self.config}).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # released: no holder to name (the file stays; deleting it would race)
            os.close(self._fd)
            self._fd = None


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
        _test_hold()
        return record


TEST_HOLD_ENV = "COOLSD_TEST_HOLD_FILE"  # test aid (module docstring); unset in every real run


def _test_hold() -> None:
    """Test aid: wait while the file named by ``$COOLSD_TEST_HOLD_FILE`` exists (unset: return at
    once). Called after a record is durable, so a run held here has exactly the records on disk
    that a test counted, and a kill while it waits loses none."""
    hold = os.environ.get(TEST_HOLD_ENV)
    while hold and os.path.exists(hold):
        time.sleep(0.05)


def resume_records(run_dir: Path, name: str = "samples.jsonl") -> list[dict]:
    """The complete records of an interrupted run, after dropping a truncated last line from
    the file (so later appends start on a fresh line). Every record's image must exist and
    decode: a folder whose images do not match its records is an error (``BadInputFile``, one line
    listing them), never silently regenerated over."""
    run_dir = Path(run_dir)
    path = run_dir / name
    records = read_records(path)
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            os.replace(_write_temp("".join(json.dumps(r, default=float) + "\n" for r in records), path), path)
    bad = image_problems(run_dir, records)
    if bad:
        raise BadInputFile(f"{path}: {images_mismatch(bad, records)}")
    return records


def image_problems(run_dir: Path, records: list[dict]) -> list[str]:
    """``<image> (method m, prompt p): why`` for every record whose image (``record["image"]``,
    relative to ``run_dir``) is missing or does not decode; records without an image are fine."""
    out = []
    for r in records:
        if "image" not in r:
            continue
        img = Path(run_dir) / r["image"]
        try:
            with Image.open(img) as im:
                im.load()
        except (OSError, ValueError) as e:
            detail = one_line(str(e).replace(repr(str(img)), "").replace(str(img), ""), 80)  # its name is said first
            why = "missing" if not img.exists() else f"unreadable ({detail or type(e).__name__})"
            out.append(f"{r['image']} (method {r.get('method')!r}, prompt {r.get('prompt_index')}): {why}")
    return out


def images_mismatch(problems: list[str], records: list[dict], shown: int = 3) -> str:
    """One line for ``image_problems``: how many, the first ``shown``, and the fix."""
    first = "; ".join(problems[:shown]) + (f"; and {len(problems) - shown} more" if len(problems) > shown else "")
    with_image = sum("image" in r for r in records)
    return (f"{len(problems)} of its {with_image} records point to images that are missing or unreadable ({first}); "
            "the images folder does not match its records: restore the images, or rerun into a new output folder")


def read_records(path: Path) -> list[dict]:
    """All complete records; a truncated last line (a run killed while writing it) is skipped. Any
    other line that is not one JSON object (UTF-8) is a corrupted file: one ``BadInputFile`` naming
    the file and the line and the fix, whoever reads it (a resumed run, merge, evaluate, reports)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    lines = path.read_bytes().splitlines()
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if i == len(lines) - 1:
                break  # the run died while writing its last line
            raise BadInputFile(_corrupted(path, i + 1, len(lines), f"not JSON ({one_line(e, 80)})", raw)) from None
        if not isinstance(record, dict):
            what = f"a JSON {type(record).__name__}, not a record object"
            raise BadInputFile(_corrupted(path, i + 1, len(lines), what, raw))
        out.append(record)
    return out


def _corrupted(path: Path, line: int, lines: int, what: str, raw: bytes) -> str:
    return (f"{path} line {line} of {lines} is {what}: the record file is corrupted there "
            f"({shorten(raw.decode('utf-8', 'replace'), 60)}); delete that line (rerunning the same command "
            "regenerates its sample) or the whole run folder, and rerun")


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


def describe_identity_diff(old: dict, new: dict, limit: int = 8) -> str:
    """What differs between two run identities, for an error message: a changed input file
    (a fingerprint's ``sha256``) is named as the file whose content differs; other keys as
    ``key: old -> new``."""
    a, b = _flatten(old), _flatten(new)
    diff = identity_diff(old, new)
    files = sorted({k.rsplit(".", 1)[0] for k in diff if k.endswith(".sha256")})
    parts = []
    for f in files:
        name = b.get(f + ".name", a.get(f + ".name", f))
        if a.get(f + ".sha256", "<absent>") == "<absent>":
            parts.append(f"{f} ({name}) has no content fingerprint in the old run.json (written before coolsd "
                         "recorded them), so its file cannot be shown to be the same")
        else:
            size = ("same name and size" if (a.get(f + ".name"), a.get(f + ".bytes")) == (b.get(f + ".name"), b.get(f + ".bytes"))
                    else f"{a.get(f + '.bytes')} -> {b.get(f + '.bytes')} bytes")
            parts.append(f"{f} ({name}) has other content than the file this folder was started with "
                         f"(sha256 {str(a.get(f + '.sha256'))[:12]}.. -> {str(b.get(f + '.sha256'))[:12]}.., {size})")
    rest = [k for k in diff if not any(k.startswith(f + ".") for f in files)]
    parts += [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in rest]
    return "; ".join(parts[:limit]) + (f"; and {len(parts) - limit} more" if len(parts) > limit else "")


def claim_run_dir(run_dir: Path, identity: dict, name: str = "run.json") -> bool:
    """Bind a run folder to the configuration that fills it. A new folder gets ``run.json``
    (created exclusively: of processes claiming one folder at once, exactly one writes it); a
    folder that has one must hold the same identity, input file fingerprints included (then the
    run resumes: returns True), otherwise it is an error naming what differs (a changed file by
    its key and name), and nothing in it is touched."""
    path = Path(run_dir) / name
    ident = json.loads(json.dumps(identity, default=float))
    if not path.exists():
        tmp = _write_temp(json.dumps(ident, indent=2), path)
        try:
            os.link(tmp, path)  # fails if another process created run.json meanwhile
            return False
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: last writer wins (identities are compared below)
            os.replace(tmp, path)
            return False
        finally:
            tmp.unlink(missing_ok=True)
    old = json.loads(path.read_text())
    if old != ident:
        raise ConfigError(f"{run_dir} holds a run of another configuration ({describe_identity_diff(old, ident)}); "
                          "use a new output folder (nothing was overwritten)")
    return True
