"""Confidence intervals reported with every mean (docs/methods.md#6-evaluation-protocol), one implementation per domain.

Every interval is returned in the same shape, {"mean", "ci95": [lo, hi], "lo", "hi",
"half_width" ((hi - lo) / 2, also for the asymmetric ones), "std", "n", "interval"}, so a
summary, ``coolsd.job.tracking`` and the reports read any of them alike. ``mean_ci(x, domain=...)``
picks the interval that respects where the quantity lives:

* ``REAL`` (any sign: NLL, paired differences ``<metric>_minus_ar``): Student-t on the mean.
* ``POSITIVE`` (bounded below by ``lower``: latency, decode time, forwards, images / s, summed
  TV / KL >= 0, accepted length >= 1): a log-scale interval, ``lower + (m - lower) *
  exp(+-t * s / ((m - lower) sqrt n))`` (the delta method on log(mean - lower), Student-t
  quantile), so ``lo > lower`` always; it tends to the t-interval as n grows.
* ``FRACTION`` (in [0, 1]: toy_clip, off-support, acceptance rate): Wilson's score interval on
  the counts where every value is 0 or 1 (binomial data), else the delta method on the logit of
  the mean (Student-t quantile), mapped back, so 0 <= lo <= hi <= 1.
* ``ratio_ci``: mean(num) / mean(den) of positive numbers (speed-up) by a bootstrap
  (``scipy.stats.bootstrap``, BCa, percentile where BCa is undefined), positive by construction.
* ``t_test_p`` / ``holm_adjusted``: the p-value a t-interval inverts, and Holm's correction of a
  family of p-values, for checks that a family of intervals contains 0 (``make demo``).

Invariants: ``lo <= mean <= hi`` and [lo, hi] lies in the domain; values outside the domain are
an error naming them, except float noise: a value at most ``noise`` outside its bound (the
domain's ``lower``, or 0 and 1 of a fraction) is that bound computed with rounding (an exact 0
computed in float32 can come out as -8e-7) and is set to the bound before anything else
(``clamp_to_domain``, the one place this happens). ``noise`` defaults to ``FLOAT_NOISE``; a
quantity summed from many float32 terms passes its own (``MetricInfo.noise``, ``coolsd.metrics.signal_metrics``).
Degenerate inputs: n = 1 has no interval (no ``ci95`` / ``lo`` / ``hi`` / ``half_width`` /
``std`` keys, ``no_ci: "n=1: no CI"``, printed as such); all-equal values give a zero-width
interval, except 0/1 data, whose Wilson interval is never empty.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

REAL, POSITIVE, FRACTION = "real", "positive", "fraction"
DOMAINS = (REAL, POSITIVE, FRACTION)
NULL_REASON = "_null_reason"  # a summary's "<metric>_null_reason": why <metric> is null (e.g. toy_fid at small n)
# a summary entry's key for the prompts a world's quality metrics left out: {"n", "of", "prompt_indices",
# "why"} (``coolsd.worlds.toy.toy_quality``); the printed summary says it (``coolsd.job.summary.summary_lines``)
UNSCORED = "unscored_prompts"


# how far outside its domain's bound a computed quantity may be and still read as the bound: a few
# float32 roundings of an O(1) quantity (2^-24 ~ 6e-8 each) stay below 1e-6; a quantity computed in
# float64 is far closer. A value further out is a bug, never noise, and stays an error.
FLOAT_NOISE = 1e-6



def _scipy_stats():
    """scipy.stats, imported on first use: it takes ~1 s to import, and a refused run.py config
    (which loads the worlds, and through the toy metrics this module) should stop in well under that."""
    from scipy import stats

    return stats

def clamp_to_domain(x: np.ndarray, domain: str, lower: float, noise: float, name: str) -> np.ndarray:
    """``x`` (float64) with values within ``noise`` outside the domain's bounds set to the bound;
    a value further out is an error naming ``name``, the bound and the value."""
    if domain == POSITIVE:
        if x.min() < lower - noise:
            raise ValueError(f"{name}: a quantity >= {lower:g} has value {x.min():.6g}, more than float noise "
                             f"({noise:g}) below it")
        return np.maximum(x, lower)
    if domain != FRACTION:
        return x
    if x.min() < -noise or x.max() > 1 + noise:
        raise ValueError(f"{name}: a fraction in [0, 1] has values in [{x.min():.6g}, {x.max():.6g}], more than float "
                         f"noise ({noise:g}) outside")
    return np.clip(x, 0.0, 1.0)


def no_ci(m: float, n: int) -> dict:
    """A mean without an interval (too few values): ``no_ci`` says why, printed in tables."""
    return {"mean": m, "n": n, "no_ci": f"n={n}: no CI"}


def _interval(m: float, lo: float, hi: float, sd: float, n: int, kind: str) -> dict:
    lo, hi = min(lo, m), max(hi, m)  # rounding at zero width
    return {"mean": m, "ci95": [lo, hi], "lo": lo, "hi": hi, "half_width": (hi - lo) / 2, "std": sd, "n": n,
            "interval": kind}


def _t(level: float, n: int) -> float:
    return float(_scipy_stats().t.ppf(0.5 + level / 2, n - 1))


def mean_ci(x, level: float = 0.95, domain: str = REAL, lower: float = 0.0, name: str = "values",
            noise: float = FLOAT_NOISE) -> dict:
    """Mean of samples (prompts / images) with the 95% interval of its ``domain`` (module
    docstring); ``lower``: the bound of a ``POSITIVE`` quantity; ``noise``: how far outside the
    domain a value may be from rounding alone (``clamp_to_domain``); ``name`` appears in errors."""
    x = np.asarray(x, dtype=np.float64).ravel()
    n = len(x)
    if n == 0:
        raise ValueError(f"mean_ci needs at least one value ({name})")
    if domain not in DOMAINS:
        raise ValueError(f"mean_ci: unknown domain {domain!r} ({name}); one of {DOMAINS}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: {int((~np.isfinite(x)).sum())} of {n} values are not finite")
    if not noise >= 0:
        raise ValueError(f"mean_ci: noise must be >= 0, got {noise!r} ({name})")
    x = clamp_to_domain(x, domain, lower, noise, name)
    m = float(x.mean())
    if n < 2:
        return no_ci(m, n)
    sd = float(x.std(ddof=1))
    if domain == FRACTION and np.isin(x, (0.0, 1.0)).all():
        lo, hi = wilson_interval(int(x.sum()), n, level)
        return _interval(m, lo, hi, sd, n, "wilson")
    if domain == REAL or sd == 0:
        half = _t(level, n) * sd / math.sqrt(n)
        return _interval(m, m - half, m + half, sd, n, "t")
    se = sd / math.sqrt(n)
    if domain == POSITIVE:  # m > lower: some value is above it (sd > 0)
        f = math.exp(_t(level, n) * se / (m - lower))
        return _interval(m, lower + (m - lower) / f, lower + (m - lower) * f, sd, n, "log")
    # FRACTION, not all 0/1: some value is strictly inside (0, 1), so 0 < m < 1
    c, h = math.log(m / (1 - m)), _t(level, n) * se / (m * (1 - m))
    return _interval(m, 1 / (1 + math.exp(h - c)), 1 / (1 + math.exp(-c - h)), sd, n, "logit")


def wilson_interval(successes: int, trials: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval for a binomial proportion (within [0, 1], never empty, sensible at
    0 and n successes, unlike the Wald interval)."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"wilson_interval needs 0 <= successes <= trials >= 1, got {successes} of {trials}")
    z = float(_scipy_stats().norm.ppf(0.5 + level / 2))
    p, z2 = successes / trials, z * z / trials
    centre = (p + z2 / 2) / (1 + z2)
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials)) / (1 + z2)
    return max(0.0, centre - half), min(1.0, centre + half)


def ratio_ci(num, den, level: float = 0.95, resamples: int = 2000, seed: int = 0, paired: bool = False) -> dict:
    """mean(num) / mean(den) of positive numbers with a bootstrap CI (speed-up = mean AR latency /
    mean method latency; ``scipy.stats.bootstrap``, BCa, percentile where BCa's jackknife is
    degenerate). ``paired``: num[i] and den[i] belong together (the same prompt), so each
    resample draws one set of indices for both; otherwise each is resampled independently.
    Positive by construction; n = 1 (on either side) has no interval."""
    num, den = np.asarray(num, float).ravel(), np.asarray(den, float).ravel()
    if paired and len(num) != len(den):
        raise ValueError(f"paired ratio needs equal lengths, got {len(num)} and {len(den)}")
    if len(num) == 0 or len(den) == 0 or min(num.min(), den.min()) <= 0 or not np.isfinite([*num, *den]).all():
        raise ValueError(f"ratio_ci needs finite positive values on both sides, got {len(num)} and {len(den)}")
    m, n = float(num.mean() / den.mean()), int(min(len(num), len(den)))
    if n < 2:
        return no_ci(m, n)
    if np.ptp(num) == 0 and np.ptp(den) == 0:
        return _interval(m, m, m, 0.0, n, "bootstrap")

    def ratio(a, b, axis=-1):
        return a.mean(axis) / b.mean(axis)

    kw = dict(paired=paired, vectorized=True, confidence_level=level, n_resamples=resamples,
              rng=np.random.default_rng(seed))
    with warnings.catch_warnings(record=True) as caught:  # BCa's jackknife is 0/0 where every ratio is equal
        warnings.simplefilter("always")
        res = _scipy_stats().bootstrap((num, den), ratio, method="BCa", **kw)
    lo, hi = res.confidence_interval
    if caught or not (np.isfinite(lo) and np.isfinite(hi)):
        kw["rng"] = np.random.default_rng(seed)
        res = _scipy_stats().bootstrap((num, den), ratio, method="percentile", **kw)
        lo, hi = res.confidence_interval
    return _interval(m, float(lo), float(hi), float(res.standard_error), n, "bootstrap")


def t_test_p(ci: dict, null: float = 0.0) -> float:
    """The two-sided p-value of "the mean is ``null``" behind a Student-t interval of ``mean_ci``
    (``interval: "t"``: ``mean``, ``std``, ``n``): below 1 - level exactly when that level's
    interval excludes ``null`` (the one-sample t-test the interval inverts). All values equal
    (``std`` 0): 1 where the mean is ``null``, else 0."""
    if ci.get("interval") != "t" or "std" not in ci:
        raise ValueError(f"t_test_p needs a Student-t interval of mean_ci with n >= 2, got {ci!r}")
    n, sd, m = int(ci["n"]), float(ci["std"]), float(ci["mean"])
    if sd == 0:
        return 1.0 if m == null else 0.0
    return float(2 * _scipy_stats().t.sf(abs(m - null) / (sd / math.sqrt(n)), n - 1))


def holm_adjusted(pvalues) -> np.ndarray:
    """Holm's step-down adjusted p-values (Holm 1979), as ``statsmodels.stats.multitest.
    multipletests(p, method="holm")[1]`` computes them (statsmodels is not a dependency; scipy's
    ``false_discovery_control`` has only the FDR methods): the i-th smallest of m p-values
    (0-based) times m - i, made non-decreasing in that order by a running maximum, capped at 1.
    Rejecting every hypothesis whose adjusted p is below ``alpha`` keeps the family-wise error
    rate (the chance of one or more false rejections among the m) at most ``alpha``, whatever
    the dependence between the tests. Returned in the input's order."""
    p = np.asarray(pvalues, dtype=np.float64).ravel()
    if p.size and not ((p >= 0) & (p <= 1)).all():
        raise ValueError(f"holm_adjusted needs p-values in [0, 1], got {p.tolist()}")
    order = np.argsort(p, kind="stable")
    stepped = np.maximum.accumulate((len(p) - np.arange(len(p))) * p[order])
    out = np.empty_like(p)
    out[order] = np.minimum(stepped, 1.0)
    return out
