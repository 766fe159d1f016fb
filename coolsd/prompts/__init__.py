"""Prompt sets, by ``dataset.name``: ``toy`` (the toy world's seeded scenes, coolsd.toy.scenes),
``coco2017val`` (MS-COCO 2017 val longest captions, ``coco``), ``imagenet`` (class labels,
``imagenet``) and ``prompts`` (a user's prompt file, ``dataset.path``: ``files``). Every prompt has a
``.caption``; the list's position i is prompt index offset + i."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from coolsd.prompts.coco import coco_longest_captions, load_coco_prompts
from coolsd.prompts.files import file_prompts, load_prompt_file
from coolsd.prompts.imagenet import imagenet_prompts
from coolsd.toy.scenes import PROMPT_POOL, toy_prompts

DATASETS = ("toy", "coco2017val", "imagenet", "prompts")
COCO_VAL_IMAGES = 5000  # MS-COCO 2017 val: one (the longest) caption per image


def prompt_pool(name: str) -> Optional[int]:
    """How many prompts data set ``name`` holds (None: no upper bound; ImageNet labels cycle
    through the 1,000 classes; a prompt file's count is its own: ``prompt_file_dataset``)."""
    return {"toy": PROMPT_POOL, "coco2017val": COCO_VAL_IMAGES}.get(name)


def prompt_file_dataset(dataset, fingerprint: dict) -> dict:
    """A prompt file's part of a run's identity: ``n_prompts`` resolved (null: every prompt from
    ``offset``), ``path`` the file's content ``fingerprint`` (never its location), ``column`` if set."""
    offset, n = int(dataset.get("offset", 0)), dataset.get("n_prompts")
    n = len(load_prompt_file(dataset.get("path"), dataset.get("column"))) - offset if n is None else int(n)
    return {"name": "prompts", "n_prompts": n, "offset": offset, "path": fingerprint,
            **({"column": dataset.get("column")} if dataset.get("column") is not None else {})}


def load_prompts(dataset) -> list:
    """The ``n_prompts`` prompts from ``offset`` of the configured data set (``conf/dataset``)."""
    name, n, offset = dataset.get("name"), dataset.get("n_prompts"), int(dataset.get("offset", 0))
    if name == "prompts":
        return file_prompts(dataset.get("path"), None if n is None else int(n), offset, dataset.get("column"))
    n = int(n)
    if name == "toy":
        return toy_prompts(n, offset)
    if name == "coco2017val":
        return [SimpleNamespace(**p) for p in load_coco_prompts(dataset.get("captions"), n, offset,
                                                                  cache_dir=Path(dataset.get("cache_dir", "outputs/cache")))]
    if name == "imagenet":
        return imagenet_prompts(n, offset)
    raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(DATASETS)}")


__all__ = ["DATASETS", "coco_longest_captions", "file_prompts", "load_coco_prompts", "load_prompt_file", "load_prompts",
           "prompt_file_dataset", "prompt_pool"]
