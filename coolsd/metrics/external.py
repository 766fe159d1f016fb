"""Metric networks that run in another interpreter: a package whose pins clash with this project's
torch (ImageReward's old timm, HPSv2's open_clip, both with torchvision) lives in its own virtual
environment, and a standalone worker script (importing nothing from coolsd) scores there. One JSON
job in ({"items": [{"image": path, "caption": str}, ...]}), one JSON result out, written atomically
({"scores": [float, ...] in item order, "unexpected_keys": [...]}).

``WorkerScorer`` checks everything before any work: the weight files exist (``MissingInputFile``
naming each and where it comes from), the interpreter exists and imports the package (else how to
install it), and after a run that the worker returned one score per image.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from coolsd.util.loading import MissingInputFile


class WorkerScorer:
    """A subclass sets ``name`` (in messages), ``package`` (the module the interpreter must import),
    ``install`` (how to get an interpreter that has it), ``source`` (where the weight files come
    from), ``worker`` (the script) and passes ``files`` {what: path} and the worker's own
    ``arguments``."""

    name = package = install = source = ""
    worker: Path

    def __init__(self, files: dict, arguments: list, python=None, device: str = "cpu", env: dict | None = None):
        self.files = {what: Path(p or "") for what, p in files.items()}
        self.arguments = [str(a) for a in arguments]
        self.python = str(python or sys.executable)
        self.device, self.env = device, env
        for what, p in self.files.items():
            if not str(p) or not p.is_file():
                raise MissingInputFile(f"{self.name} {what} file {str(p) or '(not set)'} not found; it comes from "
                                       f"{self.source}")
        probe = self._run([self.python, "-c", f"import {self.package}"], timeout=600, check=False)
        if probe.returncode != 0:
            why = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode
            raise RuntimeError(f"{self.python} cannot import the {self.package} package (optional extra); "
                               f"{self.install}. Its error: {why}")

    def _run(self, cmd, timeout=None, check=True):
        env = {**os.environ, **(self.env or {})}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except FileNotFoundError:
            raise MissingInputFile(f"{self.name} interpreter {self.python} does not exist; {self.install}") from None
        if check and proc.returncode != 0:
            raise RuntimeError(f"{self.name} worker failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        return proc

    def score(self, image_paths: Sequence[str | os.PathLike], captions: Sequence[str]) -> np.ndarray:
        """One score per (image file, caption) pair, in order."""
        if len(image_paths) != len(captions):
            raise ValueError(f"{len(image_paths)} images but {len(captions)} captions")
        missing = [str(p) for p in image_paths if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"{len(missing)} image(s) to score do not exist, e.g. {missing[0]}")
        with tempfile.TemporaryDirectory(prefix="coolsd_worker_") as tmp:
            job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
            items = [{"image": str(Path(p).resolve()), "caption": c} for p, c in zip(image_paths, captions)]
            job.write_text(json.dumps({"items": items}), encoding="utf-8")
            self._run([self.python, str(self.worker), str(job), str(out), *self.arguments, "--device", self.device])
            result = json.loads(out.read_text(encoding="utf-8"))
        scores = np.asarray(result["scores"], dtype=np.float64)
        if scores.shape != (len(items),):
            raise RuntimeError(f"{self.name} worker returned {scores.shape} scores for {len(items)} images")
        self.unexpected_keys = result.get("unexpected_keys", [])
        return scores
