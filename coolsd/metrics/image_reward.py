"""ImageReward v1.0 (docs/methods.md#6-evaluation-protocol: mean over images, from a local checkpoint), an optional extra.

The ``image-reward`` package pins timm 0.6.13 and needs torchvision, which do not install beside
this project's torch; so the scores are computed by ``image_reward_worker.py`` in whichever
interpreter has the package (``python``: a separate virtual environment, or this one after
``pip install coolsd[imagereward]`` where that resolves). Everything is checked before any work:
the checkpoint and ``med_config.json`` exist, the interpreter exists and imports ``ImageReward``.
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

SOURCE = "https://huggingface.co/THUDM/ImageReward (files ImageReward.pt and med_config.json)"
INSTALL = ("create a separate environment for it (python -m venv ir && ir/bin/pip install image-reward) and "
           "pass its interpreter (python -m coolsd.cli.evaluate --ir-python ir/bin/python, or $IMAGEREWARD_PYTHON)")
WORKER = Path(__file__).with_name("image_reward_worker.py")


class ImageRewardScorer:
    def __init__(self, checkpoint, med_config, python: str | os.PathLike | None = None, device: str = "cpu",
                 env: dict | None = None):
        self.checkpoint, self.med_config = Path(checkpoint or ""), Path(med_config or "")
        self.python = str(python or sys.executable)
        self.device, self.env = device, env

        for what, p in (("checkpoint", self.checkpoint), ("med_config", self.med_config)):
            if not str(p) or not p.is_file():
                raise MissingInputFile(f"ImageReward {what} file {str(p) or '(not set)'} not found; it comes from "
                                       f"{SOURCE}")
        probe = self._run([self.python, "-c", "import ImageReward"], timeout=600, check=False)
        if probe.returncode != 0:
            raise RuntimeError(f"{self.python} cannot import the ImageReward package (optional extra); {INSTALL}. "
                               f"Its error: {probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode}")

    def _run(self, cmd, timeout=None, check=True):
        env = {**os.environ, **(self.env or {})}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except FileNotFoundError:
            raise MissingInputFile(f"ImageReward interpreter {self.python} does not exist; {INSTALL}") from None
        if check and proc.returncode != 0:
            raise RuntimeError(f"ImageReward worker failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        return proc

    def score(self, image_paths: Sequence[str | os.PathLike], captions: Sequence[str]) -> np.ndarray:
        """One ImageReward score per (image file, caption) pair, in order."""
        if len(image_paths) != len(captions):
            raise ValueError(f"{len(image_paths)} images but {len(captions)} captions")
        missing = [str(p) for p in image_paths if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"{len(missing)} image(s) to score do not exist, e.g. {missing[0]}")
        with tempfile.TemporaryDirectory(prefix="coolsd_ir_") as tmp:
            job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
            items = [{"image": str(Path(p).resolve()), "caption": c} for p, c in zip(image_paths, captions)]
            job.write_text(json.dumps({"items": items}), encoding="utf-8")
            self._run([self.python, str(WORKER), str(job), str(out), "--checkpoint", str(self.checkpoint.resolve()),
                       "--med-config", str(self.med_config.resolve()), "--device", self.device])
            result = json.loads(out.read_text(encoding="utf-8"))
        scores = np.asarray(result["scores"], dtype=np.float64)
        if scores.shape != (len(items),):
            raise RuntimeError(f"ImageReward worker returned {scores.shape} scores for {len(items)} images")
        self.unexpected_keys = result.get("unexpected_keys", [])
        return scores
