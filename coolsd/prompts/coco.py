"""MS-COCO 2017 val prompts as LANTERN / COOL-SD evaluate (docs/methods.md#6-evaluation-protocol): the longest caption
of each of the 5,000 val images, from a user-supplied ``captions_val2017.json``.

Derivation (LANTERN ``data/prompts/preprocess.py``), kept exactly, quirks included:
annotations are read in file order; an image's first caption is kept and replaced only by a
strictly longer one (raw ``len``, no strip, so ties keep the first seen); captions stay raw
(trailing spaces, newlines); the order is each image's first appearance among annotations.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from coolsd.util.loading import read_json, reading
from coolsd.util.records import sha256_file

SOURCE = ("annotations_trainval2017.zip from https://cocodataset.org/#download "
          "(http://images.cocodataset.org/annotations/annotations_trainval2017.zip), "
          "file annotations/captions_val2017.json")
WHAT = "a COCO captions file (captions_val2017.json: a JSON object with 'annotations')"


def coco_longest_captions(path) -> list[dict]:
    """[{"image_id", "caption"}] in LANTERN's order, from a COCO captions file."""
    data = read_json(path, WHAT, SOURCE)
    best: dict[int, str] = {}  # insertion order = first appearance
    with reading(path, WHAT, SOURCE):
        for i, a in enumerate(data["annotations"]):
            if not isinstance(a, dict) or "image_id" not in a or "caption" not in a:
                raise ValueError(f"annotation {i} lacks image_id/caption")
            image_id, caption = a["image_id"], a["caption"]
            if image_id not in best or len(best[image_id]) < len(caption):
                best[image_id] = caption
    return [{"image_id": k, "caption": v} for k, v in best.items()]


def load_coco_prompts(path, n: int, offset: int = 0, cache_dir: Optional[Path] = None) -> list[dict]:
    """Prompts [offset, offset + n) of the longest-caption list, each {"index", "image_id",
    "caption"}. The derived list is cached in ``cache_dir`` keyed by the source file's sha256."""
    path = Path(path) if path else None
    prompts = None
    if cache_dir is not None and path is not None and path.is_file():
        cache = Path(cache_dir) / f"coco2017val_longest_{sha256_file(path)[:16]}.json"
        if cache.is_file():
            prompts = json.loads(cache.read_text(encoding="utf-8"))
        else:
            prompts = coco_longest_captions(path)
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(cache.name + ".partial")
            tmp.write_text(json.dumps(prompts, ensure_ascii=False), encoding="utf-8")
            tmp.replace(cache)
    if prompts is None:
        prompts = coco_longest_captions(path)
    if n < 1 or offset < 0 or offset + n > len(prompts):
        raise ValueError(f"COCO prompts [{offset}, {offset + n}) exceed the {len(prompts)} captions of {path}")
    return [{"index": offset + i, **p} for i, p in enumerate(prompts[offset : offset + n])]
