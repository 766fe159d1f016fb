"""Goodness-of-fit helpers for comparing sampled and exact distributions."""
from __future__ import annotations

import numpy as np


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson chi-square test of ``counts`` against ``probs``; cells with expected count below
    ``min_expected`` are pooled into one cell. Observations in cells of probability 0 give
    p-value 0 (they cannot happen under the hypothesis)."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = counts.sum()
    if np.any(counts[probs <= 0] > 0):
        return 0.0
    expected = n * probs / probs.sum()
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    if len(obs) < 2:
        return 1.0
    from scipy import stats  # deferred: scipy.stats takes ~1 s to import, and run.py's refusals import the lab

    return float(stats.chisquare(obs, exp).pvalue)


def total_variation(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(np.asarray(a) - np.asarray(b)).sum())
