"""FID reference statistics of the real images (docs/methods.md#6-evaluation-protocol: the 5,000 COCO val2017 images,
clean-fid protocol), computed once per (image set, feature extractor) and cached as .npz.

The cache key hashes the extractor's name and protocol, the id of its weights, the device type
and float32 precision its network runs at (``extractor_numerics``, ``coolsd.metrics.numerics``),
and every image's file name and size, in order: a different image set, preprocessing, weight
file, device type or precision gives a different cache entry, never statistics computed
otherwise than the generated images' features they are compared with.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from coolsd.metrics.fid import StreamingStats
from coolsd.metrics.image_prep import load_rgb
from coolsd.metrics.numerics import metric_numerics
from coolsd.util.loading import MissingInputFile

COCO_IMAGES_SOURCE = ("val2017.zip from https://cocodataset.org/#download "
                      "(http://images.cocodataset.org/zips/val2017.zip)")


def coco_image_files(images_dir, image_ids: Sequence[int] | None = None) -> list[Path]:
    """The val2017 JPEGs (``%012d.jpg``) of ``image_ids`` in that order, or every ``*.jpg`` of the
    folder sorted by name. A missing folder or image is an error naming it and its source."""

    d = Path(images_dir) if images_dir else None
    if d is None or not d.is_dir():
        raise MissingInputFile(f"COCO val2017 image folder {d or '(not set)'} not found; it comes from "
                               f"{COCO_IMAGES_SOURCE}")
    if image_ids is None:
        files = sorted(d.glob("*.jpg"))
        if not files:
            raise MissingInputFile(f"{d} holds no .jpg images; expected the COCO val2017 folder ({COCO_IMAGES_SOURCE})")
        return files
    files = [d / f"{int(i):012d}.jpg" for i in image_ids]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise MissingInputFile(f"{len(missing)} of {len(files)} COCO images are missing from {d} (e.g. "
                                f"{', '.join(missing[:3])}); expected the full val2017 folder ({COCO_IMAGES_SOURCE})")
    return files


def extractor_numerics(extractor) -> str:
    """The extractor's ``numerics`` (``FeatureExtractor.numerics``: device type and precision); an
    extractor without one runs on its ``device`` (default the CPU) under the metric precision."""

    numerics = getattr(extractor, "numerics", None)
    return numerics if numerics is not None else metric_numerics(getattr(extractor, "device", "cpu"))


def reference_key(files: Sequence[Path], extractor, weights_id: str) -> str:
    h = hashlib.sha256()
    h.update(f"{extractor.name}|{getattr(extractor, 'protocol', '')}|{weights_id}|"
             f"{extractor_numerics(extractor)}\n".encode())
    for f in files:
        h.update(f"{Path(f).name}|{Path(f).stat().st_size}\n".encode())
    return h.hexdigest()[:20]


def image_statistics(files: Sequence[Path], extractor, batch: int = 64, desc: str = "features") -> StreamingStats:
    """Streaming mean / covariance of the extractor's features over image files."""
    stats = StreamingStats(extractor.feature_dim)
    for s in tqdm(range(0, len(files), batch), desc=desc, unit="batch", leave=False):
        stats.update(extractor([load_rgb(f) for f in files[s:s + batch]]))
    return stats


def reference_statistics(files: Sequence[Path], extractor, cache_dir, weights_id: str,
                         batch: int = 64) -> tuple[np.ndarray, np.ndarray, int]:
    """(mu, sigma, n) of the reference images' features, from ``cache_dir`` when present (an entry
    per ``reference_key``; its file name also shows the device type, and the file holds the
    ``numerics`` string it was made under)."""
    numerics = extractor_numerics(extractor)
    key = reference_key(files, extractor, weights_id)
    cache = Path(cache_dir) / f"fid_ref_{extractor.name}_{numerics.split('|', 1)[0]}_{len(files)}_{key}.npz"
    if cache.is_file():
        z = np.load(cache)
        return z["mu"], z["sigma"], int(z["n"])
    mu, sigma = image_statistics(files, extractor, batch, desc="FID reference").compute()
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.stem + ".partial.npz")
    np.savez(tmp, mu=mu, sigma=sigma, n=len(files), numerics=numerics)
    tmp.replace(cache)
    return mu, sigma, len(files)
