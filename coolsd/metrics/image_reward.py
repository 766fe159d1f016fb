"""ImageReward v1.0 (docs/methods.md#6-evaluation-protocol: mean over images, from a local checkpoint), an optional extra.

The ``image-reward`` package pins timm 0.6.13 and needs torchvision, which do not install beside
this project's torch; so the scores are computed by ``image_reward_worker.py`` in whichever
interpreter has the package (``python``: a separate virtual environment, or this one after
``pip install coolsd[imagereward]`` where that resolves). Everything is checked before any work:
the checkpoint and ``med_config.json`` exist, the interpreter exists and imports ``ImageReward``.
"""
from __future__ import annotations

from pathlib import Path

from coolsd.metrics.external import WorkerScorer

SOURCE = "https://huggingface.co/THUDM/ImageReward (files ImageReward.pt and med_config.json)"
INSTALL = ("create a separate environment for it (python -m venv ir && ir/bin/pip install image-reward) and "
           "pass its interpreter (python -m coolsd.cli.evaluate --ir-python ir/bin/python, or $IMAGEREWARD_PYTHON)")
WORKER = Path(__file__).with_name("image_reward_worker.py")


class ImageRewardScorer(WorkerScorer):
    """ImageReward v1.0 scores of (image file, caption) pairs through ``image_reward_worker.py``."""

    name, package, install, source, worker = "ImageReward", "ImageReward", INSTALL, SOURCE, WORKER

    def __init__(self, checkpoint, med_config, python=None, device: str = "cpu", env: dict | None = None):
        self.checkpoint, self.med_config = Path(checkpoint or ""), Path(med_config or "")
        super().__init__({"checkpoint": checkpoint, "med_config": med_config},
                         ["--checkpoint", self.checkpoint.resolve(), "--med-config", self.med_config.resolve()],
                         python, device, env)
