"""Prompt sets, by ``dataset.name``: ``toy`` (the toy world's seeded scenes, coolsd.toy.scenes),
``coco2017val`` (MS-COCO 2017 val longest captions, ``coco``) and ``imagenet`` (class labels,
``imagenet``). Every prompt has a ``.caption``; the list's position i is prompt index offset + i."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from coolsd.prompts.coco import coco_longest_captions, load_coco_prompts
from coolsd.prompts.imagenet import imagenet_prompts
from coolsd.toy.scenes import PROMPT_POOL, toy_prompts

DATASETS = ("toy", "coco2017val", "imagenet")
COCO_VAL_IMAGES = 5000  # MS-COCO 2017 val: one (the longest) caption per image


def prompt_pool(name: str) -> Optional[int]:
    """How many prompts data set ``name`` holds (None: no upper bound; ImageNet labels cycle
    through the 1,000 classes)."""
    return {"toy": PROMPT_POOL, "coco2017val": COCO_VAL_IMAGES}.get(name)


def load_prompts(dataset) -> list:
    """The ``n_prompts`` prompts from ``offset`` of the configured data set (``conf/dataset``)."""
    name, n, offset = dataset.get("name"), int(dataset.get("n_prompts")), int(dataset.get("offset", 0))
    if name == "toy":
        return toy_prompts(n, offset)
    if name == "coco2017val":
        return [SimpleNamespace(**p) for p in load_coco_prompts(dataset.get("captions"), n, offset,
                                                                  cache_dir=Path(dataset.get("cache_dir", "outputs/cache")))]
    if name == "imagenet":
        return imagenet_prompts(n, offset)
    raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(DATASETS)}")


__all__ = ["DATASETS", "coco_longest_captions", "load_coco_prompts", "load_prompts", "prompt_pool"]
