"""Image metrics, torch-fidelity style: a feature extractor maps images to (n, d) float64
features; each metric is a pure function of features (-> statistics -> a number).

The toy metrics (``coolsd.metrics.toy``) use the toy world's own feature network
(``coolsd.toy.features``); they are named ``toy_fid`` / ``toy_clip`` / ``toy_precision`` /
``toy_recall`` because they are NOT COCO FID (Inception-v3 pool3 on COCO), CLIP score or the
Inception-feature precision / recall of Kynkäänniemi et al. and are not comparable to them.
"""
from __future__ import annotations

import numpy as np
import torch

from coolsd.metrics.fid import (
    StreamingStats,
    feature_statistics,
    fid_from_features,
    frechet_distance,
    frechet_distance_sym,
    sqrt_psd,
)
from coolsd.metrics.numerics import ieee_fp32, metric_numerics
from coolsd.metrics.toy import (
    PR_K,
    bootstrap_precision_recall_ci,
    caption_attributes,
    mean_ci,
    paired_fid_difference_ci,
    paired_precision_recall_difference_ci,
    precision_recall,
    precision_recall_indicators,
    toy_clip,
    toy_clip_scores,
    toy_fid,
    toy_fid_ci,
)

__all__ = [
    "FeatureExtractor", "to_float_images",
    "StreamingStats", "feature_statistics", "frechet_distance", "frechet_distance_sym", "sqrt_psd",
    "fid_from_features",
    "toy_fid", "toy_clip", "toy_clip_scores", "caption_attributes", "mean_ci", "toy_fid_ci",
    "paired_fid_difference_ci",
    "PR_K", "precision_recall", "precision_recall_indicators", "bootstrap_precision_recall_ci",
    "paired_precision_recall_difference_ci",
]


def to_float_images(images) -> torch.Tensor:
    """(n, 3, H, W) float32 in [0, 1] from uint8 (n, H, W, 3) (numpy or torch; /255) or float
    (n, 3, H, W) already in [0, 1]. Anything else (float NHWC, values in [-1, 1], ...) raises."""
    x = images if isinstance(images, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(images))
    if x.ndim != 4:
        raise ValueError(f"images must be 4-D (n, H, W, 3) uint8 or (n, 3, H, W) float, got shape {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        if x.shape[-1] != 3:
            raise ValueError(f"uint8 images must be (n, H, W, 3), got shape {tuple(x.shape)}")
        return x.permute(0, 3, 1, 2).float().div_(255.0)
    if not x.is_floating_point():
        raise ValueError(f"images must be uint8 or floating point, got {x.dtype}")
    if x.shape[1] != 3:
        raise ValueError(f"float images must be (n, 3, H, W) in [0, 1], got shape {tuple(x.shape)}")
    x = x.float()
    if x.numel() and (x.min() < -1e-4 or x.max() > 1 + 1e-4):
        raise ValueError(f"float images must lie in [0, 1], got range [{x.min():.3g}, {x.max():.3g}]")
    return x.clamp(0, 1)


class FeatureExtractor:
    """Images -> (n, feature_dim) float64 features.

    Subclasses set ``name`` and ``feature_dim`` and implement ``_forward(x)`` on a float32
    (block, 3, H, W) batch in [0, 1]. The network always runs on blocks of exactly ``block``
    images (the last one zero-padded), so each image's features are bit-identical whatever
    ``batch_size`` is and wherever the image sits in the input: float kernels otherwise pick
    batch-shape-dependent reduction orders (~1e-8 differences). ``batch_size`` (rounded up to
    a multiple of ``block``) only sets how many images are converted and moved at once.
    """

    name: str = "features"
    feature_dim: int = 0
    block: int = 32
    _empty_hw: tuple[int, int] = (32, 32)  # image size used to shape outputs for empty input

    def __init__(self, batch_size: int = 256, device: str | torch.device = "cpu"):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.device = torch.device(device)

    @property
    def numerics(self) -> str:
        """Device type and precision the network runs at (``numerics.metric_numerics``)."""
        return metric_numerics(self.device)

    def _forward(self, x: torch.Tensor):  # (block, 3, H, W) float32 -> (block, d) or a tuple of (block, ...)
        raise NotImplementedError

    def _run(self, images, batch_size: int | None = None, fn=None) -> list[torch.Tensor]:
        """Outputs of ``fn`` (default ``_forward``; a tensor or a tuple of tensors per block)
        over all images, concatenated per output, on the CPU."""
        fn = self._forward if fn is None else fn
        n = len(images)
        bs = self.batch_size if batch_size is None else batch_size
        bs = -(-max(bs, 1) // self.block) * self.block
        parts: list[list[torch.Tensor]] = []
        with torch.inference_mode(), ieee_fp32():
            for s in range(0, n, bs):
                x = to_float_images(images[s:s + bs]).to(self.device)
                for b in range(0, len(x), self.block):
                    chunk = x[b:b + self.block]
                    m = len(chunk)
                    if m < self.block:
                        chunk = torch.cat([chunk, chunk.new_zeros((self.block - m, *chunk.shape[1:]))])
                    out = fn(chunk)
                    out = out if isinstance(out, tuple) else (out,)
                    if not parts:
                        parts = [[] for _ in out]
                    for p, o in zip(parts, out):
                        p.append(o[:m].cpu())
            if not parts:  # no images: shapes from one all-zero block
                out = fn(torch.zeros(self.block, 3, 1, 1, device=self.device).expand(-1, -1, *self._empty_hw))
                parts = [[o[:0].cpu()] for o in (out if isinstance(out, tuple) else (out,))]
        return [torch.cat(p) for p in parts]

    def __call__(self, images, batch_size: int | None = None) -> np.ndarray:
        feats = self._run(images, batch_size)[0]
        return feats.double().numpy().reshape(len(images), self.feature_dim)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, feature_dim={self.feature_dim}, batch_size={self.batch_size}, device={self.device})"
