"""Toy-world metrics, named as what they are (NOT COCO FID / CLIP score, not comparable):

* ``toy_fid``: Fréchet distance between Gaussian fits of generated vs reference image features
  in the penultimate layer of ``coolsd.toy.features.ToyFeatureNet`` (a small CNN trained on
  the toy world). Lower is better; 0 for identical feature distributions.
* ``toy_clip``: caption consistency. For each generated image, the fraction of its caption's
  attributes (shape, colour, background, position, size) that the trained classifier predicts
  for the image; the score is the mean over images, in [0, 1]. Higher is better; chance is
  ~0.24 (mean of 1/5, 1/8, 1/4, 1/9, 1/2), and the classifier's own error on clean renders
  (its held-out accuracy) is the practical ceiling.

Pure functions of features / predicted labels; the feature network lives in ``coolsd.toy``.
"""
from __future__ import annotations

import numpy as np

from coolsd.stats import mean_ci
from coolsd.metrics.fid import _as_float64, feature_statistics, fid_from_features, frechet_distance_sym, sqrt_psd
from coolsd.metrics.fid import bootstrap_fid_ci as fid_bootstrap


def _labels(a, name: str) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    a = np.asarray(a)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D (n,) class ids, got shape {a.shape}")
    return a.astype(np.int64)


def caption_attributes(scenes) -> dict[str, np.ndarray]:
    """attribute -> (n,) class ids of the captions of ``scenes`` (``coolsd.toy.scenes.Scene``)."""
    from coolsd.toy.scenes import ATTRIBUTES

    return {k: np.array([s.labels()[k] for s in scenes], dtype=np.int64) for k in ATTRIBUTES}


def toy_clip_scores(pred_attrs: dict, caption_attrs: dict) -> np.ndarray:
    """(n,) per-image fraction of the caption's attributes the classifier predicts.

    ``caption_attrs``: attribute -> (n,) class ids from the captions (every attribute in it is
    scored); ``pred_attrs``: attribute -> (n,) predicted ids, must cover those attributes.
    """
    if not caption_attrs:
        raise ValueError("caption_attrs is empty: nothing to score")
    missing = [k for k in caption_attrs if k not in pred_attrs]
    if missing:
        raise KeyError(f"predictions lack attribute(s) {missing}; have {sorted(pred_attrs)}")
    n = None
    hits = None
    for k, cap in caption_attrs.items():
        c, p = _labels(cap, f"caption_attrs[{k!r}]"), _labels(pred_attrs[k], f"pred_attrs[{k!r}]")
        if n is None:
            n, hits = len(c), np.zeros(len(c))
        if len(c) != n or len(p) != n:
            raise ValueError(f"attribute {k!r}: {len(p)} predictions / {len(c)} captions, expected {n}")
        hits += c == p
    return hits / len(caption_attrs)


def toy_clip(pred_attrs: dict, caption_attrs: dict) -> float:
    """Mean over images of ``toy_clip_scores``."""
    return float(toy_clip_scores(pred_attrs, caption_attrs).mean())


def toy_fid(features_gen, features_ref) -> float:
    """Fréchet distance between Gaussian fits of generated and reference toy features."""
    return fid_from_features(features_gen, features_ref)


def bootstrap_fid_ci(
    features_gen,
    features_ref,
    n_resamples: int = 200,
    seed: int = 0,
    confidence: float = 0.95,
    resample_ref: bool = False,
) -> dict:
    """toy FID with a bootstrap interval over images (``coolsd.metrics.fid.bootstrap_fid_ci``,
    whose docstring says how ``lo``/``hi`` are placed); ``resample_ref`` also redraws the
    reference images, n of n, after each generated draw.

    Returns {"fid", "lo", "hi", "boot_mean", "boot_std", "boot_lo", "boot_hi", "n_resamples",
    "seed", "confidence", "n_gen", "n_ref", "resample_ref"}.
    """
    r = _as_float64(features_ref)
    sampler = (lambda rng: feature_statistics(r[rng.integers(0, len(r), len(r))])) if resample_ref else None
    out = fid_bootstrap(features_gen, *feature_statistics(r), n_resamples=n_resamples, seed=seed,
                        confidence=confidence, ref_sampler=sampler)
    return {**out, "n_ref": len(r), "resample_ref": resample_ref}


def paired_fid_difference_ci(
    features_a,
    features_b,
    features_ref,
    n_resamples: int = 200,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict:
    """toy FID(a) - toy FID(b) with a paired bootstrap over prompts: row i of all three arrays
    belongs to prompt i (a and b generated for it, ref rendered from it); each resample draws
    prompt indices with replacement and recomputes both distances on the same rows, so the
    finite-n bias, which is the same for a and b, cancels in the difference. ``lo``/``hi`` are
    the bootstrap percentiles of the difference: an interval containing 0 means "within noise".

    Returns {"diff", "lo", "hi", "n", "n_resamples", "seed", "confidence"}.
    """
    a, b, r = _as_float64(features_a), _as_float64(features_b), _as_float64(features_ref)
    if not len(a) == len(b) == len(r):
        raise ValueError(f"paired features need equal rows, got {len(a)}, {len(b)}, {len(r)}")
    if n_resamples < 2:
        raise ValueError(f"n_resamples must be >= 2, got {n_resamples}")
    point = fid_from_features(a, r) - fid_from_features(b, r)
    rng = np.random.default_rng(seed)
    diffs = np.empty(n_resamples)
    for i in range(n_resamples):
        idx = rng.integers(0, len(a), len(a))
        mu_r, sig_r = feature_statistics(r[idx])
        sq = sqrt_psd(sig_r)
        da = frechet_distance_sym(*feature_statistics(a[idx]), mu_r, sig_r, sqrt_sigma2=sq)
        db = frechet_distance_sym(*feature_statistics(b[idx]), mu_r, sig_r, sqrt_sigma2=sq)
        diffs[i] = da - db
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(diffs, [alpha, 1 - alpha])
    return {"diff": float(point), "lo": float(lo), "hi": float(hi), "n": len(a), "n_resamples": n_resamples,
            "seed": seed, "confidence": confidence}


def toy_quality(extractor, images: dict, scenes, n_resamples: int = 200) -> dict:
    """Per method tag: toy_clip (95% t-CI over prompts) and toy_fid (bootstrap CI) of its
    images (``images``: tag -> (n, H, W, 3) uint8, prompt-aligned with ``scenes``) against
    renders of the same scenes, and, where ``ar`` is among the tags, the paired differences to
    it (same prompts, same seeds). With fewer than 2 prompts a covariance does not exist:
    toy_fid and its difference are None."""
    from coolsd.toy.scenes import render_batch

    fid_ok = len(scenes) >= 2
    ref_feats = extractor(render_batch(scenes))
    attrs = caption_attributes(scenes)
    scored = {tag: extractor.features_and_predictions(imgs) for tag, imgs in images.items()}
    clip = {tag: toy_clip_scores(preds, attrs) for tag, (_, preds) in scored.items()}
    out = {}
    for tag, (feats, _) in scored.items():
        e = {"toy_clip": mean_ci(clip[tag]),
             "toy_fid": bootstrap_fid_ci(feats, ref_feats, n_resamples=n_resamples, seed=0) if fid_ok else None}
        if "ar" in scored:
            e["toy_clip_minus_ar"] = mean_ci(np.asarray(clip[tag]) - np.asarray(clip["ar"]))
            e["toy_fid_minus_ar"] = (paired_fid_difference_ci(feats, scored["ar"][0], ref_feats, n_resamples=n_resamples,
                                                              seed=0) if fid_ok else None)
        out[tag] = e
    return out
