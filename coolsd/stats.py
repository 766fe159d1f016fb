"""Confidence intervals reported with every mean (METHODS.md 6)."""
from __future__ import annotations

import math

import numpy as np
from scipy import stats


def mean_ci(x, level: float = 0.95) -> dict:
    """Mean with a Student-t interval over samples (prompts / images).

    Returns {"mean", "ci95": [lo, hi], "lo", "hi", "half_width", "std", "n"}; with n = 1 the
    interval collapses to the mean (half_width nan).
    """
    x = np.asarray(x, dtype=np.float64).ravel()
    n = len(x)
    if n == 0:
        raise ValueError("mean_ci needs at least one value")
    m = float(x.mean())
    if n < 2:
        return {"mean": m, "ci95": [m, m], "lo": m, "hi": m, "half_width": float("nan"), "std": float("nan"), "n": 1}
    sd = float(x.std(ddof=1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n))
    return {"mean": m, "ci95": [m - half, m + half], "lo": m - half, "hi": m + half, "half_width": half, "std": sd, "n": n}


def ratio_ci(num, den, level: float = 0.95, resamples: int = 2000, seed: int = 0, paired: bool = False) -> dict:
    """mean(num) / mean(den) with a bootstrap CI (speed-up = mean AR latency / mean method
    latency). ``paired``: num[i] and den[i] belong together (the same prompt), so each resample
    draws one set of indices for both; otherwise each is resampled independently."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    if paired and len(num) != len(den):
        raise ValueError(f"paired ratio needs equal lengths, got {len(num)} and {len(den)}")
    r = np.random.default_rng(seed)
    boots = []
    for _ in range(resamples):
        i = r.integers(0, len(num), len(num))
        j = i if paired else r.integers(0, len(den), len(den))
        boots.append(num[i].mean() / den[j].mean())
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return {"mean": float(num.mean() / den.mean()), "ci95": [float(lo), float(hi)], "n": int(min(len(num), len(den)))}
