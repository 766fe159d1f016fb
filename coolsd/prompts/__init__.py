"""Prompt sets, by ``dataset.name``: ``toy`` (the toy world's seeded scenes, coolsd.toy.scenes),
``coco2017val`` (MS-COCO 2017 val longest captions, ``coco``) and ``imagenet`` (class labels,
``imagenet``). Every prompt has a ``.caption``; the list's position i is prompt index offset + i."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from coolsd.prompts.coco import coco_longest_captions, load_coco_prompts

DATASETS = ("toy", "coco2017val", "imagenet")


def load_prompts(dataset) -> list:
    """The ``n_prompts`` prompts from ``offset`` of the configured data set (``conf/dataset``)."""
    name, n, offset = dataset.get("name"), int(dataset.get("n_prompts")), int(dataset.get("offset", 0))
    if name == "toy":
        from coolsd.toy.scenes import toy_prompts

        return toy_prompts(n, offset)
    if name == "coco2017val":
        return [SimpleNamespace(**p) for p in load_coco_prompts(dataset.get("captions"), n, offset,
                                                                  cache_dir=Path(dataset.get("cache_dir", "outputs/cache")))]
    if name == "imagenet":
        from coolsd.prompts.imagenet import imagenet_prompts

        return imagenet_prompts(n, offset)
    raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(DATASETS)}")


__all__ = ["DATASETS", "coco_longest_captions", "load_coco_prompts", "load_prompts"]
