"""Toy-world metrics, named as what they are (NOT COCO FID / CLIP score, not comparable):

* ``toy_fid``: Fréchet distance between Gaussian fits of generated vs reference image features
  in the penultimate layer of ``coolsd.toy.features.ToyFeatureNet`` (a small CNN trained on
  the toy world). Lower is better; 0 for identical feature distributions.
* ``toy_clip``: caption consistency. For each generated image, the fraction of its caption's
  attributes (shape, colour, background, position, size) that the trained classifier predicts
  for the image; the score is the mean over images, in [0, 1]. Higher is better; chance is
  ~0.24 (mean of 1/5, 1/8, 1/4, 1/9, 1/2), and the classifier's own error on clean renders
  (its held-out accuracy) is the practical ceiling.
* ``toy_precision`` / ``toy_recall``: improved precision and recall (Kynkäänniemi et al. 2019,
  k = 3) in the same feature space. Precision is the fraction of generated images whose
  features fall inside the reference manifold (fidelity: a low value means off-distribution
  images); recall is the fraction of reference renders inside the generated manifold
  (diversity: a generator collapsed onto part of the reference scores low recall, not low
  precision). Both in [0, 1], higher is better; NOT the paper's Inception-feature numbers.

Pure functions of features / predicted labels; the feature network lives in ``coolsd.toy``.
"""
from __future__ import annotations

import numpy as np
import torch

from coolsd.metrics.fid import (
    _as_float64,
    bootstrap_fid_ci as fid_bootstrap,
    feature_statistics,
    fid_sample_size_reason,
    frechet_distance_sym,
    sqrt_psd,
)
from coolsd.metrics.registry import declare_metric
from coolsd.toy.scenes import ATTRIBUTES, render_batch
from coolsd.util.stats import FRACTION, NULL_REASON, POSITIVE, mean_ci


def _labels(a, name: str) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    a = np.asarray(a)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D (n,) class ids, got shape {a.shape}")
    return a.astype(np.int64)


def caption_attributes(scenes) -> dict[str, np.ndarray]:
    """attribute -> (n,) class ids of the captions of ``scenes`` (``coolsd.toy.scenes.Scene``)."""

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
    """Fréchet distance between Gaussian fits of generated and reference toy features, through
    ``frechet_distance_sym`` (symmetric eigenvalues: equal to the sqrtm formula to ~1e-9 and
    without its "Matrix is singular" warning on the dead units' zero rows)."""
    return frechet_distance_sym(*feature_statistics(features_gen), *feature_statistics(features_ref))


def toy_fid_ci(
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
                        confidence=confidence, ref_sampler=sampler, sqrtm_point=False)
    return {**out, "n_ref": len(r), "resample_ref": resample_ref}


def paired_fid_difference_ci(
    features_a,
    features_b,
    features_ref,
    n_resamples: int = 200,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict:
    """toy FID(a) - toy FID(b) with a paired bootstrap over prompts (``paired_fid_contrast_ci``
    with weights +1, -1): an interval containing 0 means "within noise".

    Returns {"diff", "lo", "hi", "n", "n_resamples", "seed", "confidence"}.
    """
    return paired_fid_contrast_ci({"a": features_a, "b": features_b}, {"a": 1.0, "b": -1.0}, features_ref,
                                  n_resamples=n_resamples, seed=seed, confidence=confidence)


def paired_fid_contrast_ci(features: dict, weights: dict, features_ref, n_resamples: int = 200, seed: int = 0,
                           confidence: float = 0.95) -> dict:
    """sum_t weights[t] * toy FID(features[t]) with a paired bootstrap over prompts: row i of every
    array belongs to prompt i (each set generated for it, ref rendered from it); each resample
    draws prompt indices with replacement and recomputes every distance on the same rows, so the
    finite-n bias, shared by the sets, cancels in a contrast whose weights sum to 0 (a difference
    a - b; a point against B interpolated between two configurations, ``make claims``). ``lo`` /
    ``hi`` are the bootstrap percentiles of the contrast.

    Returns {"diff", "lo", "hi", "n", "n_resamples", "seed", "confidence"}.
    """
    feats = {t: _as_float64(features[t]) for t in weights}
    r = _as_float64(features_ref)
    if any(len(x) != len(r) for x in feats.values()):
        raise ValueError(f"paired features need equal rows, got {[len(x) for x in feats.values()]} and {len(r)}")
    if n_resamples < 2:
        raise ValueError(f"n_resamples must be >= 2, got {n_resamples}")

    def contrast(idx=None):
        if idx is None:
            return sum(w * toy_fid(feats[t], r) for t, w in weights.items())
        mu_r, sig_r = feature_statistics(r[idx])
        sq = sqrt_psd(sig_r)
        return sum(w * frechet_distance_sym(*feature_statistics(feats[t][idx]), mu_r, sig_r, sqrt_sigma2=sq)
                   for t, w in weights.items())

    point = contrast()
    rng = np.random.default_rng(seed)
    boots = np.array([contrast(rng.integers(0, len(r), len(r))) for _ in range(n_resamples)])
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(boots, [alpha, 1 - alpha])
    return {"diff": float(point), "lo": float(lo), "hi": float(hi), "n": len(r), "n_resamples": n_resamples,
            "seed": seed, "confidence": confidence}


# ---- improved precision and recall ---------------------------------------------------------------
# Implemented here rather than imported: torchmetrics (1.9, installed) has no improved precision /
# recall, the reference implementations (NVlabs, torch-fidelity's "prc", clovaai's prdc) are not
# installed and bring their own feature extractors or scikit-learn, and the metric is a few lines
# of nearest-neighbour radii on top of one distance matrix.
PR_K = 3  # neighbourhood size of Kynkäänniemi et al. 2019


def _distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(a), len(b)) Euclidean distances in float64, summed over coordinates directly: the
    |a|^2 + |b|^2 - 2ab expansion leaves ~1e-7 between identical rows, here they are exactly 0."""
    a, b = torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(np.ascontiguousarray(b))
    return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist").numpy()


def _radii(d_self: np.ndarray, k: int) -> np.ndarray:
    """(n,) distance from each row of a set to its k-th nearest other row, from the set's (n, n)
    distance matrix. A row is excluded from its own neighbours by position only, so an identical
    row elsewhere in the set is a neighbour at distance 0: a feature with >= k exact duplicates
    has radius 0."""
    d = np.where(np.eye(len(d_self), dtype=bool), np.inf, d_self)
    return np.partition(d, k - 1, axis=1)[:, k - 1]


def _memberships(d_gr: np.ndarray, r_gen: np.ndarray, r_ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(in_ref (n_gen,), in_gen (n_ref,)) from the (n_gen, n_ref) cross distances and both sets'
    radii. Balls are closed (distance <= radius, as in the paper), so a radius-0 ball holds
    exactly the features identical to its centre."""
    return (d_gr <= r_ref[None, :]).any(1), (d_gr <= r_gen[:, None]).any(0)


def _pr_features(features, k: int, name: str) -> np.ndarray:
    x = _as_float64(features)
    if k < 1 or len(x) < k + 1:
        raise ValueError(f"{name}: k-th nearest neighbours need k >= 1 and more than k rows, got k={k}, {len(x)} rows")
    return x


def precision_recall_indicators(features_gen, features_ref, k: int = PR_K) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample improved precision / recall (Kynkäänniemi et al. 2019, "Improved Precision and
    Recall Metric for Assessing Generative Models", NeurIPS): a set's manifold is the union of
    closed balls around its features, each with radius = distance to the k-th nearest other
    feature of the same set (Euclidean).

    Returns (in_ref, in_gen): (n_gen,) bool, generated feature j inside the reference manifold
    (its mean is the precision); (n_ref,) bool, reference feature i inside the generated manifold
    (its mean is the recall). The indicators share the manifolds, so they are not independent: a
    t-interval over them misses the manifolds' own sampling noise, which
    ``bootstrap_precision_recall_ci`` includes. Memory and time O(n_gen * n_ref) (three float64
    distance matrices, ~24 MB at n = 1000).
    """
    g, r = _pr_features(features_gen, k, "features_gen"), _pr_features(features_ref, k, "features_ref")
    if g.shape[1] != r.shape[1]:
        raise ValueError(f"feature dims differ: {g.shape[1]} generated vs {r.shape[1]} reference")
    return _memberships(_distances(g, r), _radii(_distances(g, g), k), _radii(_distances(r, r), k))


def precision_recall(features_gen, features_ref, k: int = PR_K) -> tuple[float, float]:
    """(precision, recall) in [0, 1]: fraction of generated features inside the reference
    manifold (fidelity) and of reference features inside the generated manifold (diversity); see
    ``precision_recall_indicators``. Identical sets give (1, 1)."""
    in_ref, in_gen = precision_recall_indicators(features_gen, features_ref, k)
    return float(in_ref.mean()), float(in_gen.mean())


def _pr_bootstrap(features_gen: dict, features_ref, k: int, n_resamples: int, seed: int) -> tuple[dict, dict]:
    """Point (precision, recall) and (n_resamples, 2) bootstrap values for every generated set
    (name -> (n, d), row i generated for prompt i) against the reference (row i rendered from
    prompt i). Each resample draws n prompt indices with replacement from
    ``numpy.random.default_rng(seed)``, rebuilds all manifolds from the distinct drawn prompts
    and weights each drawn prompt's indicators by how often it was drawn. A prompt drawn twice
    is one observation, not its own neighbour at distance 0 (which would shrink its ball and
    bias the resamples low); identical features of different prompts still are neighbours.
    Draws with fewer than k + 1 distinct prompts (only likely for n < ~10) are redrawn. One draw
    serves every set, so per-resample differences between sets are paired, and a set's values
    do not depend on the other sets."""
    r = _pr_features(features_ref, k, "features_ref")
    gens = {name: _pr_features(g, k, f"features_gen[{name!r}]") for name, g in features_gen.items()}
    if any(g.shape != r.shape for g in gens.values()):
        raise ValueError(f"paired features need equal shapes, got {[g.shape for g in gens.values()]} vs {r.shape}")
    if n_resamples < 2:
        raise ValueError(f"n_resamples must be >= 2, got {n_resamples}")
    n = len(r)
    d_rr = _distances(r, r)
    d = {name: (_distances(g, g), _distances(g, r)) for name, g in gens.items()}
    r_ref = _radii(d_rr, k)
    point = {name: np.array([m.mean() for m in _memberships(d_gr, _radii(d_gg, k), r_ref)])
             for name, (d_gg, d_gr) in d.items()}
    boots = {name: np.empty((n_resamples, 2)) for name in gens}
    rng = np.random.default_rng(seed)
    for i in range(n_resamples):
        rows, counts = np.unique(rng.integers(0, n, n), return_counts=True)
        while len(rows) <= k:
            rows, counts = np.unique(rng.integers(0, n, n), return_counts=True)
        sub, w = np.ix_(rows, rows), counts / n  # w sums to 1: the draw's share of each distinct prompt
        r_ref = _radii(d_rr[sub], k)
        for name, (d_gg, d_gr) in d.items():
            in_ref, in_gen = _memberships(d_gr[sub], _radii(d_gg[sub], k), r_ref)
            boots[name][i] = w @ in_ref, w @ in_gen
    return point, boots


def _percentile_cis(point: np.ndarray, boots: np.ndarray, confidence: float, **extra) -> dict:
    """{"precision", "recall"} -> {"mean" (the full-sample value), "ci95": [lo, hi] (bootstrap
    percentiles at ``confidence``), "lo", "hi", "boot_mean", **extra} (``mean``/``ci95`` as
    ``coolsd.util.stats.mean_ci``, so summary tables print them alike)."""
    alpha = (1 - confidence) / 2
    out = {}
    for j, name in enumerate(("precision", "recall")):
        lo, hi = (float(q) for q in np.quantile(boots[:, j], [alpha, 1 - alpha]))
        out[name] = {"mean": float(point[j]), "ci95": [lo, hi], "lo": lo, "hi": hi,
                     "boot_mean": float(boots[:, j].mean()), "confidence": confidence, **extra}
    return out


def bootstrap_precision_recall_ci(features_gen, features_ref, k: int = PR_K, n_resamples: int = 200, seed: int = 0,
                                  confidence: float = 0.95) -> dict:
    """Precision and recall with a bootstrap interval over prompts: row i of both arrays belongs
    to prompt i; each resample redraws prompts with replacement and rebuilds both manifolds from
    the drawn prompts (``_pr_bootstrap``); the interval is the bootstrap percentiles. Resamples
    hold ~0.63 n distinct prompts, so their balls are larger and ``boot_mean`` sits somewhat above
    the point estimate (the interval still held it in every check, n = 10 to 1000): compare
    methods at equal n, or with ``paired_precision_recall_difference_ci``.

    Returns {"precision": ci, "recall": ci}, ci = {"mean", "ci95": [lo, hi], "lo", "hi",
    "boot_mean", "confidence", "n", "k", "n_resamples", "seed"}.
    """
    r = _as_float64(features_ref)
    point, boots = _pr_bootstrap({"gen": features_gen}, r, k, n_resamples, seed)
    return _percentile_cis(point["gen"], boots["gen"], confidence, n=len(r), k=k, n_resamples=n_resamples, seed=seed)


def paired_precision_recall_difference_ci(features_a, features_b, features_ref, k: int = PR_K, n_resamples: int = 200,
                                          seed: int = 0, confidence: float = 0.95) -> dict:
    """Precision(a) - precision(b) and recall(a) - recall(b) with a paired bootstrap over
    prompts: row i of all three arrays belongs to prompt i; each resample draws one set of
    prompt indices for a, b and the reference (``_pr_bootstrap``), so sampling noise shared by
    a and b cancels. The interval is the bootstrap percentiles of the difference: one
    containing 0 means "within noise". With the same ``seed``, the resamples are those of
    ``bootstrap_precision_recall_ci``.

    Returns {"precision": ci, "recall": ci}, ci = {"mean" (the full-sample difference),
    "ci95": [lo, hi], "lo", "hi", "boot_mean", "confidence", "n", "k", "n_resamples", "seed"}.
    """
    r = _as_float64(features_ref)
    point, boots = _pr_bootstrap({"a": features_a, "b": features_b}, r, k, n_resamples, seed)
    return _percentile_cis(point["a"] - point["b"], boots["a"] - boots["b"], confidence, n=len(r), k=k,
                           n_resamples=n_resamples, seed=seed)


def toy_quality(extractor, images: dict, scenes, n_resamples: int = 200) -> dict:
    """Per method tag: toy_clip (its fraction interval over prompts, ``coolsd.util.stats.FRACTION``:
    within [0, 1]), toy_fid (bootstrap CI), toy_precision
    and toy_recall (bootstrap percentile CI over prompts) of its images (``images``: tag ->
    (n, H, W, 3) uint8, prompt-aligned with ``scenes``) against renders of the same scenes, and,
    where ``ar`` is among the tags, the paired differences to it (same prompts, same seeds; for
    precision / recall the same resampled prompts for the method, ``ar`` and the renders). With
    no more prompts than feature dims that vary (``fid_sample_size_reason``) the Gaussian fits are
    rank deficient: toy_fid (and its difference) is None and ``toy_fid_null_reason`` (``coolsd.util.stats.NULL_REASON``) says why;
    with fewer than ``PR_K`` + 1 prompts k-th neighbours do not exist: the precision / recall
    entries are None."""

    ref_feats = extractor(render_batch(scenes))
    attrs = caption_attributes(scenes)
    scored = {tag: extractor.features_and_predictions(imgs) for tag, imgs in images.items()}
    clip = {tag: toy_clip_scores(preds, attrs) for tag, (_, preds) in scored.items()}
    pr_ok = len(scenes) >= PR_K + 1
    if pr_ok:  # one bootstrap for all tags: its resamples are bootstrap_precision_recall_ci's (seed 0)
        pr_point, pr_boots = _pr_bootstrap({tag: f for tag, (f, _) in scored.items()}, ref_feats, PR_K, n_resamples, 0)
    pr_kw = dict(confidence=0.95, n=len(scenes), k=PR_K, n_resamples=n_resamples, seed=0)
    why = fid_sample_size_reason(ref_feats, *(f for f, _ in scored.values()))  # one rule for every tag
    out = {}
    for tag, (feats, _) in scored.items():
        e = {"toy_clip": mean_ci(clip[tag], domain=FRACTION, name="toy_clip"),
             "toy_fid": None if why else toy_fid_ci(feats, ref_feats, n_resamples=n_resamples, seed=0)}
        pr = _percentile_cis(pr_point[tag], pr_boots[tag], **pr_kw) if pr_ok else {}
        e["toy_precision"], e["toy_recall"] = pr.get("precision"), pr.get("recall")
        if "ar" in scored:
            e["toy_clip_minus_ar"] = mean_ci(np.asarray(clip[tag]) - np.asarray(clip["ar"]), name="toy_clip_minus_ar")
            e["toy_fid_minus_ar"] = None if why else paired_fid_difference_ci(feats, scored["ar"][0], ref_feats,
                                                                              n_resamples=n_resamples, seed=0)
            d = (_percentile_cis(pr_point[tag] - pr_point["ar"], pr_boots[tag] - pr_boots["ar"], **pr_kw)
                 if pr_ok else {})
            e["toy_precision_minus_ar"], e["toy_recall_minus_ar"] = d.get("precision"), d.get("recall")
        if why:
            e.update({k + NULL_REASON: why for k in ("toy_fid", "toy_fid_minus_ar") if k in e})
        out[tag] = e
    return out


# the toy metrics' facts (coolsd.metrics.registry): each stands in for the field's metric in a paper's
# table layout and is never that metric
declare_metric("toy_clip", higher_is_better=True, computed_by="world", label="toy_clip", digits=3,
               domain=(FRACTION, 0.0), pareto=True, stands_for="clip_score",
               doc="fraction of a caption's attributes the toy feature network predicts from the image (toy world only)")
declare_metric("toy_fid", higher_is_better=False, computed_by="world", label="toy_fid", digits=1, pareto=True,
               stands_for="fid", domain=(POSITIVE, 0.0),
               doc="Frechet distance of toy-network features to renders of the same scenes (toy world only)")
declare_metric("toy_precision", higher_is_better=True, computed_by="world", label="toy_precision", digits=3,
               domain=(FRACTION, 0.0),
               doc="k-NN precision of toy-network features against the renders (toy world only)")
declare_metric("toy_recall", higher_is_better=True, computed_by="world", label="toy_recall", digits=3,
               domain=(FRACTION, 0.0),
               doc="k-NN recall of toy-network features against the renders (toy world only)")
