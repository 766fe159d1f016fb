"""HPSv2 (Wu et al., "Human Preference Score v2", 2023), a learned human-preference score of an
image and its caption, as the ``hpsv2`` package computes it, from a local checkpoint (never a
download at run time). The package's open_clip needs torchvision, which does not install beside
this project's torch, so ``hpsv2_worker.py`` scores in whichever interpreter has it (a separate
virtual environment: ``INSTALL``). Everything is checked before any work: the checkpoint exists,
the interpreter exists and imports ``hpsv2``.
"""
from __future__ import annotations

from pathlib import Path

from coolsd.metrics.external import WorkerScorer

HUB_FILE = "hf://xswu/HPSv2/HPS_v2.1_compressed.pt"
SOURCE = "https://huggingface.co/xswu/HPSv2 (HPS_v2.1_compressed.pt; HPS_v2_compressed.pt for v2.0)"
INSTALL = ("create a separate environment for it (python -m venv hps && hps/bin/pip install hpsv2) and pass its "
           "interpreter (python -m coolsd.cli.evaluate --hps-python hps/bin/python, or $HPSV2_PYTHON)")
WORKER = Path(__file__).with_name("hpsv2_worker.py")


class HPSv2Scorer(WorkerScorer):
    """HPSv2 scores of (image file, caption) pairs through ``hpsv2_worker.py``."""

    name, package, install, source, worker = "HPSv2", "hpsv2", INSTALL, SOURCE, WORKER

    def __init__(self, checkpoint, python=None, device: str = "cpu", env: dict | None = None):
        self.checkpoint = Path(checkpoint or "")
        super().__init__({"checkpoint": checkpoint}, ["--checkpoint", self.checkpoint.resolve()], python, device, env)
